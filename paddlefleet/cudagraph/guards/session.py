"""One capture session: the guards a capture of a block or of a whole step opens, opened the same
way for both, and the record the function's runs leave.

NOTE [ One capture session ]
What a capture touched is one concept: the Layers it called (``LayerRecorder``) and the slots they
must not rebind (``SlotWatch``), the random numbers it drew (``DrawGuard``), a double backward
(``refuse_create_graph``), the tensors it wrote in place (``InPlaceWrites``) and the ops it ran with
their host values (``OpTrace``), the Layer attributes it wrote (``AttrWrites``). A block's forward
capture and a whole step's capture open them through one ``CaptureSession``; what differs is asked for, not composed anew: a step draws in its
own backward (``backward=True``) and refuses what only a step can do (``guards``: Paddle's
GradScaler, optimizers outside ``optimizers=``), a block refuses a double backward. Host reads,
raw tensors and value-dependent shapes are refused by the graph itself, inside the capture (on a
GPU between begin and end of the stream capture): ``Backend.guard`` gives each backend's guard.
What a backend's capture does differently is the backend's (``Backend.replays_python``): a
capture that runs the function copies its in-place writes and traces its ops, a recording one
does neither. The checks run once, after the graph's capture: a rebound slot, a changed Layer
attribute, then a draw; a capture that fails puts the attributes it wrote back. Python's cyclic
collector is paused from the guards' install to their removal (``collector_paused``).

The record (``CaptureRecord``) is built once per capture, by the function's runs inside it:
``outputs`` and ``spec`` of the latest run (a simulated backward differentiates the latest
replay's outputs), the capture run's ``trace`` and the latest replay's (``replayed``, taken by
the replay's check: NOTE [ Values a simulated replay reads ] in block/replay_fallback.py).
"""

import contextlib
import gc

from .attr_writes import AttrWrites
from .double_backward import refuse_create_graph
from .host_reads import OpTrace
from .in_place_writes import VersionlessWrites
from .layer_attrs import LayerRecorder, layers_with_sublayers
from .rng import DrawGuard

__all__ = ["CaptureRecord", "CaptureSession", "collector_paused"]


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block, back on after it if it was on.

    Around a capture session's guards and the capture they watch: a GPU capture keeps the collector off
    anyway (NOTE [ Garbage collection around capture ] in backends/cuda.py), and the guards replace some
    2,000 of Paddle's op entry points with wrappers made for this capture and freed at its end. Made with
    the collector on, those allocations set off collections of the process's young objects (and, each
    tenth, older ones): about 8 ms a guard against 2-3 with it paused, measured on the CPU. Made and freed
    while it is paused, they leave its counts where they were. The simulated backend's capture runs the
    function with the collector off, as a GPU's does."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CaptureRecord(dict):
    """What the function's runs inside one capture left (NOTE [ One capture session ]).

    Keys: ``outputs`` (the latest run's output tensors), ``spec`` (``(out_spec, out_consts)`` of the
    latest run), ``trace`` (the capture run's OpTrace, None when untraced), ``replayed`` (the latest
    replay's OpTrace, taken by ``take_replayed``), and what a body adds to it (the backward body's
    ``grad_groups``, a step's ``record`` and ``stepped``).
    """

    @property
    def captured(self):
        """Has the capture run of the function returned?"""
        return "spec" in self

    def take_replayed(self):
        """The latest replay's OpTrace (None when untraced or taken), forgotten."""
        return self.pop("replayed", None)


class CaptureSession:
    """The guards of one capture (NOTE [ One capture session ]).

    Args:
        backend: the key's backend; it says whether the capture runs the function.
        snapshot, watch: objects with ``add(layer)`` given each Layer the capture calls, before it
            runs (what the capture writes in the Layers is put back; the slots it must not rebind);
            ``watch.check()`` runs after the capture. None: the Layers called are not recorded.
        backward: the capture runs a backward (a step's): DrawGuard(backward=True).
        double_backward: refuse ``paddle.grad(create_graph=True)`` (a block's forward).
        writes: an InPlaceWrites entered around the capture run of the function (a block's, made
            where the backend's capture runs the function: written back after the capture, so the
            capture call's replay applies them once, as on a GPU), or None.
        trace: OpTrace's keyword arguments for every run of the function, or None: traced where the
            backend's replays run the function, or always with ``always=True`` in it (a step's).
        guards: a body's own context managers, entered around the graph's capture.
    """

    def __init__(self, backend, snapshot=None, watch=None, backward=False, double_backward=False, writes=None,
                 trace=None, guards=()):
        self.record = CaptureRecord()
        self.recorder = LayerRecorder(snapshot, watch) if snapshot is not None else None
        self._watch = watch
        self._draws = DrawGuard(backward=backward)
        self._double_backward = double_backward
        self._guards = tuple(guards)
        self.writes = writes
        self.versionless = VersionlessWrites()  # NOTE [ Writes without a version bump ] in guards/in_place_writes.py
        trace = dict(trace) if trace is not None else None
        if trace is not None and not trace.pop("always", False) and not backend.replays_python:
            trace = None
        self._trace = trace

    @property
    def layers(self):
        """The Layers the capture called, in call order."""
        return self.recorder.layers if self.recorder is not None else []

    def capture(self, graph, body, hooks):
        """``graph.capture(body, hooks)`` under the session's guards, then the checks; returns what
        the capture returned (raises CaptureError from the first guard that refuses)."""
        writes = AttrWrites()  # NOTE [ Attributes a capture writes ] in guards/attr_writes.py
        try:
            with collector_paused(), contextlib.ExitStack() as stack:
                if self.recorder is not None:
                    stack.enter_context(self.recorder)
                stack.enter_context(self._draws)
                if self._double_backward:  # NOTE [ Double backward inside a graphed function ]
                    stack.enter_context(refuse_create_graph())
                for guard in self._guards:
                    stack.enter_context(guard)
                stack.enter_context(writes)
                outputs = graph.capture(body, hooks)
            if self._watch is not None:
                self._watch.check()
            writes.check(layers=layers_with_sublayers(self.layers))
            self._draws.check()  # NOTE [ Random draws seen from generator state ] in guards/rng.py
        except BaseException as err:
            writes.failed(err)
            raise
        return outputs

    @contextlib.contextmanager
    def function_run(self):
        """Around each run of the function inside the graph (the capture run and a simulated
        replay): the capture run's in-place writes copied (outside the trace, so the copies are no
        ops of it) and the targets of ``copy_``/``set_value`` noted, the ops traced. Yields the run's
        OpTrace (None when untraced); the capture run's goes into the record as ``trace`` when the run
        returns, a replay's as ``replayed``. ``keep_writes`` in the trace's arguments: a replay's trace
        keeps what the run wrote in place, so that a replay found to differ can undo it."""
        first = "trace" not in self.record
        writes = self.writes if first and self.writes is not None else contextlib.nullcontext()
        versionless = self.versionless if first else contextlib.nullcontext()  # copy_/set_value targets noted
        trace = None
        if self._trace is not None:
            kwargs = dict(self._trace)
            keep = kwargs.pop("keep_writes", False) and not first
            trace = OpTrace(**{"where": first, **kwargs, **({"keep_writes": True} if keep else {})})
        with writes, versionless, trace if trace is not None else contextlib.nullcontext():
            yield trace
        self.record["trace" if first else "replayed"] = trace
