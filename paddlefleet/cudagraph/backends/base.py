"""The small interface every backend implements, and the process-wide capture flag.

A backend makes pools and graphs. A graph captures a *body* (a Python callable that runs
Paddle ops) once and replays it later; the tensors the body allocates during capture are the
graph's static buffers, and every replay writes its results into those same tensors.
"""

import contextlib
import threading

__all__ = ["Backend", "Graph", "NOT_CAPTURED", "is_capturing", "capturing", "in_whole_step", "whole_step"]

#: Raised by Graph.replay() on a graph without a capture.
NOT_CAPTURED = (
    "autocudagraph: replay of a graph that was never captured or was reset. Its static buffers were "
    "released (reset(), eviction or a failed capture); call the wrapper, which captures again, instead "
    "of replaying the graph directly."
)

_state = threading.local()


def is_capturing():
    """True while autocudagraph is capturing a graph in this thread.

    Communication code can read it to take its graph-safe path (see ``capture_hooks``).
    """
    return getattr(_state, "depth", 0) > 0


#: Context-manager factories entered around every capture and whole step: replacements of Paddle
#: functions that decide on the host (core/cross_entropy.py registers one when the package is
#: imported; backends/ import nothing above them, so the replacement comes to them).
_device_decision_factories = []


def register_device_decisions(factory):
    """Has ``factory()`` entered around every capture and every whole step from now on."""
    if factory not in _device_decision_factories:
        _device_decision_factories.append(factory)


@contextlib.contextmanager
def _device_decisions():
    with contextlib.ExitStack() as stack:
        for factory in _device_decision_factories:
            stack.enter_context(factory())
        yield


@contextlib.contextmanager
def capturing(hooks=()):
    """Marks the current thread as capturing and enters the capture hooks; undone on exit.
    Paddle functions that decide on the host are replaced meanwhile (NOTE [ Cross entropy
    decides on the host ] in core/cross_entropy.py)."""
    with contextlib.ExitStack() as stack:
        for factory in hooks:
            stack.enter_context(factory())
        stack.enter_context(_device_decisions())
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1


def in_whole_step():
    """True while a whole training step (autocudagraph_step) runs in this thread."""
    return getattr(_state, "steps", 0) > 0


@contextlib.contextmanager
def whole_step():
    """Marks the current thread as running a whole training step: graphed callables it calls run
    eagerly, since the step's own graph captures them (in every phase of the step alike). Paddle
    functions that decide on the host are replaced meanwhile, so that warmup, capture and replays
    run the same ops (NOTE [ Cross entropy decides on the host ] in core/cross_entropy.py)."""
    _state.steps = getattr(_state, "steps", 0) + 1
    try:
        with _device_decisions():
            yield
    finally:
        _state.steps -= 1


class Graph:
    """One captured graph. Subclasses implement ``capture``, ``replay`` and ``reset``."""

    def capture(self, body, hooks=()):
        """Captures ``body()`` and returns what it returned (the static results).

        ``hooks`` are context-manager factories entered around the capture (outside
        begin/end on a real device). The capture is always ended, also when ``body`` raises;
        the error is re-raised.
        """
        raise NotImplementedError

    def replay(self):
        """Re-executes the captured work, writing into the same static tensors."""
        raise NotImplementedError

    def reset(self):
        """Frees the graph; it cannot be replayed afterwards."""
        raise NotImplementedError


class Backend:
    """Makes pools and graphs for one kind of device.

    Attributes:
        name: "cuda" or "simulate".
        shares_pools: whether graphs made with one pool share memory.
        capture_executes: whether capture runs the body's kernels (simulate) or only records
            them (cuda). See NOTE [ RNG across capture ] in block/capture.py.
    """

    name = "base"
    shares_pools = False
    capture_executes = False

    def new_pool(self):
        """Returns a pool handle to share between the graphs of one key (or None)."""
        raise NotImplementedError

    def new_graph(self, pool):
        """Returns an empty Graph that will allocate from ``pool``."""
        raise NotImplementedError

    def describe(self):
        """One line naming the backend and its capabilities."""
        return self.name
