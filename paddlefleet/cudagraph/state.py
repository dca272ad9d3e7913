"""Global state saved and restored around warmup and capture, and the parts of it that key a
call: AMP autocast, RNG (default generator and Fleet's model-parallel tracker), Layer buffers.

Everything here flips global state only inside try/finally (context managers).
"""

import contextlib

import paddle

__all__ = ["amp_state", "rng_snapshot", "restore_rng", "preserved_rng", "BufferSnapshot"]


def amp_state():
    """The autocast state that changes what a call computes: ``(level, dtype)``, or None when
    Paddle exposes no tracer state. On a CPU build auto_cast is a no-op and this stays O0."""
    tracer = paddle.base.framework._dygraph_tracer()
    if tracer is None:
        return None
    # Raw (hashable) values: str() of the level enum costs ~15 us per call.
    return (getattr(tracer, "_amp_level", None), getattr(tracer, "_amp_dtype", None))


def _tracker():
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
    except ImportError:  # pragma: no cover - Paddle without fleet
        return None
    try:
        return get_rng_state_tracker()
    except Exception:  # pragma: no cover - tracker not initialised in this process
        return None


def rng_snapshot():
    """Snapshot of the default generator and of every state in Fleet's RNG tracker."""
    tracker = _tracker()
    tracked = None
    if tracker is not None and getattr(tracker, "states_", None):
        tracked = tracker.get_states_tracker()
    return paddle.get_rng_state(), tracked


def restore_rng(snapshot):
    """Puts back a snapshot taken by rng_snapshot()."""
    default, tracked = snapshot
    paddle.set_rng_state(default)
    if tracked is not None:
        _tracker().set_states_tracker(tracked)


@contextlib.contextmanager
def preserved_rng():
    """Runs the block and then restores every RNG state it consumed."""
    snapshot = rng_snapshot()
    try:
        yield
    finally:
        restore_rng(snapshot)


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
            frozen = [p for p in layer.parameters() if p.stop_gradient]
            for buf in list(layer.buffers()) + frozen:
                if id(buf) not in self._saved and buf._is_initialized():
                    self._saved[id(buf)] = (buf, buf.clone())

    def restore(self):
        with paddle.no_grad():
            for buf, copy in self._saved.values():
                paddle.assign(copy, output=buf)
        self._saved = {}
