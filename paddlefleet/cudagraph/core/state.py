"""Global state saved and restored around warmup and capture, and the parts of it that key a
call: AMP autocast, RNG (default generator and Fleet's model-parallel tracker), Layer buffers.

Everything here flips global state only inside try/finally (context managers).
"""

import contextlib

import paddle

from ..guards.rng import _tracker


__all__ = ["amp_state", "rng_snapshot", "restore_rng", "preserved_rng", "written_in_place", "BufferSnapshot"]


_dygraph_tracer = paddle.base.framework._dygraph_tracer  # read on every call's key: looked up once


def amp_state():
    """The autocast state that changes what a call computes: ``(level, dtype)``, or None when
    Paddle exposes no tracer state. On a CPU build auto_cast is a no-op and this stays O0."""
    tracer = _dygraph_tracer()
    # Raw (hashable) values: str() of the level enum costs ~15 us per call; the enum itself hashes
    # and compares slowly (NOTE [ Cheap key parts ] in core/keys.py), so the level is its int. Read
    # directly (read on every call's key); a tracer without them, or a level that is no int, below.
    try:
        return (int(tracer._amp_level), tracer._amp_dtype)
    except (AttributeError, TypeError, ValueError):
        return _amp_state_read(tracer)


def _amp_state_read(tracer):
    """amp_state() of ``tracer`` (None: no tracer), each part read where it exists."""
    if tracer is None:
        return None
    return (_enum_int(getattr(tracer, "_amp_level", None)), getattr(tracer, "_amp_dtype", None))


def _enum_int(value):
    """A pybind enum value as its int (injective within its enum), anything else as itself."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return value




def rng_snapshot():
    """Snapshot of the default generator and of every state in Fleet's RNG tracker."""
    tracker = _tracker()
    tracked = None
    if tracker is not None and getattr(tracker, "states_", None):
        tracked = tracker.get_states_tracker()
    return paddle.get_rng_state(), tracked


def restore_rng(snapshot):
    """Puts back a snapshot taken by rng_snapshot(); the snapshot stays valid, so it can be
    restored again (NOTE [ Restoring the tracker ])."""
    default, tracked = snapshot
    paddle.set_rng_state(default)
    if tracked is not None:
        # NOTE [ Restoring the tracker ]
        # Paddle 2.6's RNGStatesTracker keeps GeneratorState values in a dict, and
        # set_states_tracker(states) makes ``states`` that dict: every later rng_state(name)
        # block writes its advanced state into it. Handing it our snapshot's dict would let
        # the next tracker use overwrite the snapshot, and a second restore (verify_replays
        # restores the state before a call twice on a mismatch) would put back the advanced
        # states: silently different dropout masks than eager. Paddle 3.x keeps states by
        # index and copies them out of the dict. A fresh dict each time is right for both.
        # The GeneratorState objects themselves are values: get_state() returns a copy and
        # set_state() copies in (phi::Generator, both versions), so sharing them is safe.
        _tracker().set_states_tracker(dict(tracked))


@contextlib.contextmanager
def preserved_rng():
    """Runs the block and then restores every RNG state it consumed."""
    snapshot = rng_snapshot()
    try:
        yield
    finally:
        restore_rng(snapshot)


def written_in_place(layer):
    """``[(name, tensor)]`` of what a forward may write in place: the initialised buffers and the
    non-trainable parameters (BatchNorm keeps its running statistics in stop_gradient parameters,
    not in buffers) of ``layer`` and its sublayers."""
    frozen = [(n, p) for n, p in layer.named_parameters() if p.stop_gradient]
    return [(n, t) for n, t in list(layer.named_buffers()) + frozen if t._is_initialized()]


class BufferSnapshot:
    """Copies of what a forward may write in place - the buffers and the non-trainable
    parameters of some Layers (BatchNorm keeps its running statistics in parameters with
    stop_gradient=True, not in buffers) - put back by restore(), so that capture runs leave no
    trace.

    Args:
        enabled: False makes add() and restore() no-ops. A backend whose capture only records
            kernels (cuda) changes nothing during capture, and a copy taken inside the capture
            would be recorded, not made: restore() would then write garbage.
    """

    def __init__(self, enabled=True):
        self._saved = {}
        self._enabled = enabled

    def add(self, layer):
        if not self._enabled:
            return
        with paddle.no_grad():
            for _, buf in written_in_place(layer):
                if id(buf) not in self._saved:
                    self._saved[id(buf)] = (buf, buf.clone())

    def restore(self):
        # copy_ keeps the inplace version: a paddle.assign(output=) bump made the caller's
        # backward through the same BatchNorm (used before, or twice) fail with "modified by an
        # inplace operation".
        with paddle.no_grad():
            for buf, copy in self._saved.values():
                buf.copy_(copy, False)
        self._saved = {}

