"""The simulated backend: CUDA-graph semantics on the CPU, for tests and CI.

NOTE [ Simulated static buffers ]
Capture runs the body once and keeps the tensors it returned: they are the static buffers.
Replay runs the same body again - on the same static input tensors, because the body closes
over them - and copies every result *in place* into the tensors the capture returned. So a
caller that holds a static buffer sees it overwritten by the next replay, exactly as with a
real CUDA graph. Host-synchronising calls are refused during capture, as a capturing CUDA
stream refuses them (CUDA error 900), and so are ops whose output shape depends on tensor values
(NOTE [ Shapes from tensor values ] in value_shapes.py); a replay whose outputs change shape
raises ReplayShapeError instead of copying into the captured buffers.

Unlike a GPU graph, replay re-runs the body's Python: Python values it reads (globals,
attributes, a branch on them) are read afresh on every replay, where a GPU graph repeats what
capture saw. Reads of host tensors (``host_marks.mark_host``) are frozen as on a GPU: replay hands
back the values read at capture, and host results keep their capture-time values.
"""

import contextlib

import paddle

from ..errors import CaptureError
from ..core.paddle_patches import Patches
from .base import NOT_CAPTURED, Backend, Graph, capturing
from .host_marks import is_marked_host
from .value_shapes import check_replay_shapes, refuse_value_shapes

__all__ = ["SimulatedBackend", "refuse_host_sync"]

# (owner, attribute) pairs whose calls synchronise the host with the device.
_HOST_SYNC = (
    (paddle.Tensor, "numpy"),
    (paddle.Tensor, "item"),
    (paddle.Tensor, "tolist"),
    (paddle.Tensor, "__float__"),
    (paddle.Tensor, "__int__"),
    (paddle.Tensor, "__bool__"),
    (paddle.Tensor, "__index__"),
    (paddle.device, "synchronize"),
)


class _HostReads:
    """Values the body read from host tensors (mark_host) at capture, handed back in the same
    order on replay: a GPU graph does not re-run host code (NOTE [ Host tensors ] in io/host_tensors.py)."""

    def __init__(self):
        self.values = []
        self._next = None
        self._inside = False

    def replaying(self):
        self._next = 0
        return self

    def read(self, original, args, kwargs):
        if self._inside:  # a read made by another read (int() calls numpy()): not a read of its own
            return original(*args, **kwargs)
        if self._next is not None and self._next < len(self.values):
            value = self.values[self._next]
            self._next += 1
            return value
        self._inside = True
        try:
            value = original(*args, **kwargs)
        finally:
            self._inside = False
        if self._next is None:  # capture: remember; a replay reading more than capture did reads live
            self.values.append(value)
        return value


def _refusing(owner, name, original, host_reads):
    where = f"paddle.device.{name}()" if owner is paddle.device else f"Tensor.{name}()"

    def refuse(*args, **kwargs):
        if host_reads is not None and owner is paddle.Tensor and args and is_marked_host(args[0]):
            return host_reads.read(original, args, kwargs)
        raise CaptureError(
            f"autocudagraph: {where} was called during capture. It waits for the device, which a "
            "capturing CUDA stream refuses (CUDA error 900). Keep host reads out of the graphed "
            "function, or move them after the call."
        )

    return refuse


@contextlib.contextmanager
def refuse_host_sync(host_reads=None):
    """Makes host-synchronising calls raise CaptureError until the block exits; reads of
    host tensors (mark_host) go to ``host_reads`` when given."""
    patches = Patches()  # NOTE [ Paddle patches ] in core/paddle_patches.py
    try:
        for owner, name in _HOST_SYNC:
            if hasattr(owner, name):
                original = getattr(owner, name)
                patches.set(owner, name, _refusing(owner, name, original, host_reads))
        cuda_mod = getattr(paddle.device, "cuda", None)
        if cuda_mod is not None and hasattr(cuda_mod, "synchronize"):
            patches.set(cuda_mod, "synchronize", _refusing(paddle.device, "cuda.synchronize", None, None))
        yield
    finally:
        patches.restore()


def _flat_tensors(result):
    if isinstance(result, paddle.Tensor):
        return [result]
    return [t for t in result if t is not None]


class _SimulatedGraph(Graph):
    def __init__(self):
        self._body = None
        self._hooks = ()
        self._static = None
        self._host_reads = None

    def capture(self, body, hooks=()):
        host_reads = _HostReads()
        # NOTE [ Shapes from tensor values ] in value_shapes.py
        with capturing(hooks), refuse_host_sync(host_reads), refuse_value_shapes(is_marked_host):
            result = body()
        self._body = body
        self._hooks = tuple(hooks)
        self._static = _flat_tensors(result)
        self._host_reads = host_reads if host_reads.values else None
        return result

    def replay(self):
        if self._body is None:
            raise CaptureError(NOT_CAPTURED)
        # A CUDA graph replays the kernels of the capture-time branch of any Python code, so
        # the body re-runs in the capture context (is_capturing() True, hooks entered), and
        # reads of host tensors return what they returned at capture.
        with capturing(self._hooks):
            if self._host_reads is None:
                fresh = _flat_tensors(self._body())
            else:
                with refuse_host_sync(self._host_reads.replaying()):
                    fresh = _flat_tensors(self._body())
        check_replay_shapes(self._static, fresh)  # before any copy: the static buffers stay as they were
        with paddle.no_grad():
            for static, value in zip(self._static, fresh):
                # Host results keep their capture-time values, as on a GPU.
                if static is not value and not is_marked_host(static):
                    # copy_ leaves the inplace version alone, as a GPU replay does: autograd's
                    # saved-tensor check does not see a replay's writes on either backend.
                    static.copy_(value, False)

    def reset(self):
        self._body = None
        self._static = None


class SimulatedBackend(Backend):
    """CPU stand-in for CUDA graphs with the same static-buffer semantics."""

    name = "simulate"
    shares_pools = True
    capture_executes = True

    def new_pool(self):
        return None

    def new_graph(self, pool):
        return _SimulatedGraph()

    def describe(self):
        return "simulate (CPU, static-buffer semantics, host syncs refused during capture)"
