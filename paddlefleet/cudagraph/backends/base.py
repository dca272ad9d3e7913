"""The small interface every backend implements, and the process-wide capture flag.

A backend makes pools and graphs. A graph captures a *body* (a Python callable that runs
Paddle ops) once and replays it later; the tensors the body allocates during capture are the
graph's static buffers, and every replay writes its results into those same tensors.
"""

import contextlib
import threading

from ..errors import CudaGraphError
from ..guards.host_guard import host_guard
from ..guards.host_marks import is_marked_host
from ..guards.value_shapes import refuse_value_shapes
from ..guards.double_backward import in_own_grad, own_grad  # re-exported: the package marks its own paddle.grad

__all__ = ["Backend", "Graph", "NOT_CAPTURED", "is_capturing", "capturing", "in_own_grad", "in_whole_step", "own_grad",
           "whole_step", "function_errors", "capture_guard", "capture_open", "own_error", "is_own_error", "in_rerun_replay",
           "rerun_replay"]

#: Raised by Graph.replay() on a graph without a capture.
NOT_CAPTURED = (
    "autocudagraph: replay of a graph that was never captured or was reset. Its static buffers were "
    "released (reset(), eviction or a failed capture); call the wrapper, which captures again, instead "
    "of replaying the graph directly."
)

class _PerThread(threading.local):
    """This thread's nesting (captures, whole steps, re-running replays, the package's own grads),
    read on every graphed call: each field has a class default, so that a thread that never set one
    reads it without the AttributeError ``getattr(local, name, default)`` raises and catches (about
    0.3 us a read against 0.04)."""

    depth = 0
    steps = 0
    rerun_replays = 0
    nested = 0  # depth + steps + rerun_replays: the one read of a call that asks whether it runs inside any
    own_grads = 0
    asked = False


_state = _PerThread()


def is_capturing():
    """True while autocudagraph is capturing a graph in this thread.

    Communication code can read it to take its graph-safe path (see ``capture_hooks``).
    """
    capturing_now = getattr(_state, "depth", 0) > 0
    if capturing_now:
        _state.asked = True  # NOTE [ The function's own exceptions ] in core/runner.py
    return capturing_now


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
def _counted(name):
    """One more level of the nesting ``name`` (a _PerThread field: depth, rerun_replays, steps) for
    this thread while the block runs."""
    fields = vars(_state)  # this thread's own fields (the class gives the defaults)
    fields[name] = getattr(_state, name) + 1
    fields["nested"] = _state.nested + 1
    try:
        yield
    finally:
        fields[name] -= 1
        fields["nested"] -= 1


@contextlib.contextmanager
def capturing(hooks=()):
    """Marks the current thread as capturing and enters the capture hooks; undone on exit.
    Paddle functions that decide on the host are replaced meanwhile (NOTE [ Cross entropy
    decides on the host ] in core/cross_entropy.py)."""
    with contextlib.ExitStack() as stack:
        for factory in hooks:
            stack.enter_context(factory())
        stack.enter_context(_device_decisions())
        stack.enter_context(_counted("depth"))
        yield


def capture_open():
    """is_capturing() for the library's own checks: the same answer, not recorded as the function
    asking (NOTE [ The function's own exceptions ] in core/runner.py)."""
    return _state.depth > 0


#: The mark of an exception the graphed function raised itself during a capture.
_OWN = "_autocudagraph_function_error"


def own_error(err):
    """Marks ``err`` as raised by the graphed function itself and returns it (NOTE [ The function's
    own exceptions ] in core/runner.py)."""
    try:
        err._autocudagraph_function_error = True
    except AttributeError:  # an exception without attributes stays a capture failure (contained)
        pass
    return err


def is_own_error(err):
    """Was ``err`` raised by the graphed function itself during a capture (own_error)?"""
    return getattr(err, _OWN, False)


@contextlib.contextmanager
def function_errors():
    """Around the graphed function's own call during a capture: an exception it raises (other
    than our refusals) is marked with own_error, so that the backend and the phase machine can
    tell it from a failure of the capture (NOTE [ The function's own exceptions ] in
    core/runner.py). It leaves unchanged."""
    asked, _state.asked = getattr(_state, "asked", False), False
    try:
        yield
    except CudaGraphError:
        raise
    except Exception as err:
        if not _state.asked:  # code that asked is_capturing() and then raised refuses the capture itself
            own_error(err)
        raise
    finally:
        _state.asked = asked




def in_rerun_replay():
    """True while a replay that re-runs the captured Python (the simulated backend's) runs in this
    thread. A GPU replay runs no Python: a graphed callable called there is not a call at all."""
    return _state.rerun_replays > 0


def rerun_replay():
    """Marks a replay that re-runs the captured body in this thread (see in_rerun_replay)."""
    return _counted("rerun_replays")


def in_whole_step():
    """True while a whole training step (autocudagraph_step) runs in this thread."""
    return _state.steps > 0


@contextlib.contextmanager
def whole_step():
    """Marks the current thread as running a whole training step: graphed callables it calls run
    eagerly, since the step's own graph captures them (in every phase of the step alike). Paddle
    functions that decide on the host are replaced meanwhile, so that warmup, capture and replays
    run the same ops (NOTE [ Cross entropy decides on the host ] in core/cross_entropy.py)."""
    with _counted("steps"), _device_decisions():
        yield


@contextlib.contextmanager
def capture_guard(is_host, host_reads=None):
    """Backend.guard for a backend whose host memory is what ``is_host`` says."""
    with host_guard(is_host, host_reads), refuse_value_shapes(is_host):
        yield


class Graph:
    """One captured graph. Subclasses implement ``capture``, ``replay`` and ``reset``.

    Attributes:
        pool_bytes: device bytes its capture made the process reserve (its pool), or None where the
            backend measures none (backends/pool_memory.py; NOTE [ What a key holds ] in core/memory.py).
        cache_released: cached allocator bytes given back right before its capture (NOTE [ Allocator
            cache before a capture ] in backends/pool_memory.py).
        live: () -> whether it holds data a later step still reads, set by its owner, or None: never;
            what: words naming it (NOTE [ Sharing a pool safely ] in backends/shared_pool.py).
    """

    pool_bytes = None
    cache_released = 0
    live = None
    what = ""

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
    """Makes pools and graphs for one kind of device. The rooms above ask it what differs between
    backends (``replays_python``, ``cpu_is_host``, ``guard``, ``release_error``), never its name.

    Attributes:
        name: "cuda" or "simulate", for messages.
        shares_pools: whether graphs made with one pool share memory.
        capture_executes: whether capture runs the body's kernels (simulate) or only records
            them (cuda). See NOTE [ RNG across capture ] in block/capture.py.
        cpu_is_host: whether a CPU tensor is host memory to this backend's graphs (a GPU's: NOTE
            [ Host tensors ] in io/host_tensors.py); elsewhere only tensors marked host are.
    """

    name = "base"
    shares_pools = False
    capture_executes = False
    cpu_is_host = False

    @property
    def replays_python(self):
        """Whether a capture runs the function and every replay runs it again (the simulated
        backend), where a recording capture (cuda) runs no Python after it. Such a capture takes
        back what it changed (RNG, Layer buffers, in-place writes: NOTE [ RNG across capture ] in
        block/capture.py) and traces its ops (NOTE [ Values a simulated replay reads ] in
        block/replay_fallback.py)."""
        return self.capture_executes

    def is_host(self, tensor):
        """Is ``tensor`` host memory to this backend's graphs (a capture may read it)?"""
        return is_marked_host(tensor)

    def guard(self, host_reads=None):
        """What this backend's graphs refuse inside a capture: host reads, host-to-device copies and
        syncs (NOTE [ Host access during capture ] in guards/host_guard.py), raw tensors, and ops whose
        shapes come from tensor values (NOTE [ Shapes from tensor values ] in guards/value_shapes.py).
        ``host_reads`` records reads of host memory to hand back on a replay that re-runs them."""
        return capture_guard(self.is_host, host_reads)

    def release_error(self, err):
        """Called with an exception the function raised during a failed capture, before it is raised
        on as eager raises it (a backend whose pool its frames' tensors hold drops them)."""

    def new_pool(self):
        """Returns a pool handle to share between the graphs of one key (or None)."""
        raise NotImplementedError

    def forward_pool(self):
        """The pool the forward graphs of keys share (NOTE [ Keys sharing a forward pool ] in
        backends/shared_pool.py): a SharedPool, or None where each key keeps its own."""
        return None

    def new_graph(self, pool):
        """Returns an empty Graph that will allocate from ``pool``."""
        raise NotImplementedError

    def reserved_bytes(self):
        """Device memory reserved by this process now (a capture's pool bytes are what it grows by), or
        None where there is no device memory to measure (NOTE [ Graph pool bytes ] in core/entry.py)."""
        return None


    def describe(self):
        """One line naming the backend and its capabilities."""
        return self.name
