"""The simulated backend: CUDA-graph semantics on the CPU, for tests and CI.

NOTE [ Simulated static buffers ]
Capture runs the body once and keeps the tensors it returned: they are the static buffers.
Replay runs the same body again - on the same static input tensors, because the body closes
over them - and copies every result *in place* into the tensors the capture returned. So a
caller that holds a static buffer sees it overwritten by the next replay, exactly as with a
real CUDA graph. Host reads, host-to-device copies and syncs are refused during capture, as a
capturing CUDA stream refuses them (NOTE [ Host access during capture ] in host_guard.py), and
so are ops whose output shape depends on tensor values (NOTE [ Shapes from tensor values ] in
value_shapes.py); a replay whose outputs change shape
raises ReplayShapeError instead of copying into the captured buffers.

Unlike a GPU graph, replay re-runs the body's Python: Python values it reads (globals,
attributes, a branch on them) are read afresh on every replay, where a GPU graph repeats what
capture saw. Reads of host tensors (``host_marks.mark_host``) are frozen as on a GPU: replay hands
back the values read at capture, and host results keep their capture-time values.

NOTE [ Shapes are host tensors ]
On a GPU ``paddle.shape(x)`` returns a CPU tensor (its kernel's output lives on the host), and
ops on CPU tensors give CPU tensors: ``int(paddle.shape(x)[0])`` inside a graphed function is a
host read of host memory, which a capture allows and bakes in (a key fixes every shape, so the
value is right on every replay). The simulated backend marks what ``paddle.shape`` returns as a
host tensor (``mark_host``), and what indexing makes of a marked tensor, while it captures and
replays, so it allows the same reads (``int(paddle.shape(x)[0])``, ``x[: paddle.shape(x)[0] - 1]``).
Paddle functions applied to them (``paddle.cast``) are not followed: take the int first.
"""

import contextlib

import paddle

from ..guards.paddle_patches import Patches
from ..errors import CaptureError
from .base import NOT_CAPTURED, Backend, Graph, capture_guard, capturing, rerun_replay
from ..guards.host_guard import host_guard
from ..guards.host_marks import is_marked_host, mark_host
from ..guards.python_output import python_output
from .pool_memory import results_bytes
from .shared_pool import PoolConflictError, SharedPool, forward_pool
from ..guards.value_shapes import check_replay_shapes

__all__ = ["SimulatedBackend", "refuse_host_sync"]

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


def refuse_host_sync(host_reads=None):
    """host_guard() with no tensor counted as host memory: every host read, copy and sync raises
    CaptureError until the block exits (code that probes what Paddle itself reads uses it)."""
    return host_guard(lambda t: False, host_reads)


#: Tensor methods whose result is a host tensor where every tensor operand is one (NOTE [ Shapes
#: are host tensors ]). A replaced native operator keeps the native one as ``__native__``, so that a
#: whole step's op trace (guards/host_reads.py) still records it.
_HOST_PRESERVING = ("__getitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                    "__floordiv__", "__truediv__", "__mod__", "__neg__")


def _marking(original, marks_result):
    def call(*args, **kwargs):
        out = original(*args, **kwargs)
        if isinstance(out, paddle.Tensor) and marks_result(args, kwargs):
            mark_host(out)
        return out

    call.__native__ = getattr(original, "__native__", original)
    return call


def _all_marked(args, kwargs):
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, paddle.Tensor)]
    return bool(tensors) and all(map(is_marked_host, tensors))


@contextlib.contextmanager
def _host_shapes():
    """NOTE [ Shapes are host tensors ]: ``paddle.shape`` results, and what indexing or Python
    arithmetic makes of them, are marked as host tensors until the block exits."""
    with Patches() as patches:  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        shape = paddle.shape
        for module in (paddle, paddle.tensor, getattr(paddle.tensor, "attribute", None)):
            if module is not None and getattr(module, "shape", None) is shape:
                patches.set(module, "shape", _marking(shape, lambda args, kwargs: True))
        for name in _HOST_PRESERVING:
            original = getattr(paddle.Tensor, name, None)
            if original is not None:
                patches.set(paddle.Tensor, name, _marking(original, _all_marked))
        yield


def _flat_tensors(result):
    if isinstance(result, paddle.Tensor):
        return [result]
    return [t for t in result if t is not None]


class _SimulatedGraph(Graph):
    def __init__(self, pool_model=False, pool=None, guard=None):
        self._pool_model = pool_model
        self._pool = pool if isinstance(pool, SharedPool) else None
        # Backend.guard: host memory is what host marks mark.
        self._guard = guard or (lambda host_reads: capture_guard(is_marked_host, host_reads))
        self._body = None
        self._hooks = ()
        self._static = None
        self._host_reads = None

    def capture(self, body, hooks=()):
        host_reads = _HostReads()
        # NOTE [ Shapes from tensor values ] in value_shapes.py
        # NOTE [ Host access during capture ] in host_guard.py
        # NOTE [ Python output on replay ] in guards/python_output.py: warns after the capture.
        with python_output(), capturing(hooks), _host_shapes(), self._guard(host_reads):
            result = body()
        self._body = body
        self._hooks = tuple(hooks)
        self._static = _flat_tensors(result)
        self._host_reads = host_reads if host_reads.values else None
        if self._pool_model:  # SimulatedBackend.pool_model
            self.pool_bytes = results_bytes(self._static)
        if self._pool is not None:
            self._pool.join(self)
        return result

    def replay(self):
        if self._body is None:
            raise CaptureError(NOT_CAPTURED)
        pool = self._pool
        if pool is not None:  # NOTE [ Sharing a pool safely ] in shared_pool.py: every later graph asked
            conflict = pool.conflict(self)
            if conflict is not None:
                raise PoolConflictError(f"autocudagraph: {conflict}. This sharing is refused.")
            pool.replayed(self)
        # A CUDA graph replays the kernels of the capture-time branch of any Python code, so
        # the body re-runs in the capture context (is_capturing() True, hooks entered), and
        # reads of host tensors return what they returned at capture.
        with capturing(self._hooks), _host_shapes(), rerun_replay():
            if self._host_reads is None:
                fresh = _flat_tensors(self._body())
            else:
                with host_guard(is_marked_host, self._host_reads.replaying()):
                    fresh = _flat_tensors(self._body())
        check_replay_shapes(self._static, fresh)  # before any copy: the static buffers stay as they were
        with paddle.no_grad():
            for static, value in zip(self._static, fresh):
                # Host results keep their capture-time values, as on a GPU; a static output that
                # shares memory with the fresh result (a view of an input or of a tensor from
                # outside) already holds it: a copy would write into that tensor.
                if static is not value and not is_marked_host(static) and not static._is_shared_buffer_with(value):
                    # copy_ leaves the inplace version alone, as a GPU replay does: autograd's
                    # saved-tensor check does not see a replay's writes on either backend.
                    static.copy_(value, False)

    def reset(self):
        self._body = None
        self._static = None
        if self._pool is not None:
            self._pool.leave(self)


class SimulatedBackend(Backend):
    """CPU stand-in for CUDA graphs with the same static-buffer semantics."""

    name = "simulate"
    shares_pools = True
    capture_executes = True
    #: Model pools: every graph's pool bytes are the static results its capture made, where a GPU
    #: pool holds them (backends/pool_memory.results_bytes), and graphs made with one pool share it
    #: under the liveness rule (NOTE [ Sharing a pool safely ] in shared_pool.py). Off: pools are
    #: neither measured nor modelled.
    pool_model = False

    def new_pool(self):
        return SharedPool() if self.pool_model else None

    def forward_pool(self):
        return forward_pool("simulate") if self.pool_model else None

    def new_graph(self, pool):
        return _SimulatedGraph(self.pool_model, pool, self.guard)

    def describe(self):
        return "simulate (CPU, static-buffer semantics, host syncs refused during capture)"
