"""The real backend: Paddle's CUDA graphs.

This is the only module that imports ``paddle.device.cuda.graphs``. It detects what the
installed Paddle can do instead of comparing version strings:

* ``core.CUDAGraph.begin_capture_with_pool_id`` (Paddle >= 3.1): graphs can be captured into one
  memory pool; the forwards of keys share one per device (NOTE [ Keys sharing a forward pool ] in
  shared_pool.py), and a key's forward and backward share one where that is safe (NOTE [ One pool
  per key ]).
* without it (Paddle 2.6): every capture gets a private pool.

NOTE [ One pool per key ]
torch's and TransformerEngine's graphed callables put every graph of a model into one pool: they
capture all graphs up front, the forwards in call order and the backwards in reverse, and are
then replayed in that same order, so memory one graph freed at the end of its capture (its
temporaries) can hold data of a graph captured later, because by the next replay of the first
graph that data is dead (NOTE [ Sharing a pool safely ] in shared_pool.py states the rule).
Graphs here are captured lazily, one key at a time, when a key's first call after warmup comes,
between eager calls of the other keys, and are replayed in whatever order calls come: keys of
other shapes, re-captures after an eviction or a moved parameter, slots of forwards in flight
(NOTE [ Slots ] in block/slots.py), a second grad buffer set captured at a later replay. A graph
captured later into a shared pool may place what must survive until a later replay (its saved
activations between forward and backward, its static outputs and grad buffers, handed out as
aliases: NOTE [ Grad hand-out ] in grads/hand_out_plan.py) in memory an earlier graph uses as
temporary space, and the earlier graph's next replay then overwrites it: silently wrong grads, for
example when two micro-batches of different keys are in flight or a key of another shape replays
between a forward and its backward. Within one key the same holds: its backward is captured after
its forward, so a forward replay may overwrite the backward's static grads, which ``p.grad``
aliases across micro-batches (grads accumulated over them). So no two keys share a pool for all
their graphs, and a key's forward and backward share one only where the backward's buffers are dead after every
backward (grads handed out as copies, clone_param_grads=True, or accumulated in the graph);
otherwise, and for a second grad buffer set, every graph gets its own (block/capture.py). Across
keys only forward graphs share, under a check before every forward replay that keeps the rule in
whatever order calls come (NOTE [ Keys sharing a forward pool ] in shared_pool.py); backward graphs
never do. What graphs hold is measured (NOTE [ Graph pool bytes ] in core/entry.py).
"""

import gc
import logging
import traceback

import paddle

from ..errors import CaptureError, CudaGraphError
from . import cuda_driver
from .base import NOT_CAPTURED, Backend, Graph, capture_guard, capturing
from ..guards.host_guard import gpu_is_host
from .pool_memory import CaptureMeter, reserved
from .shared_pool import PoolConflictError, SharedPool, forward_pool

__all__ = ["CudaBackend", "cuda_available", "pool_sharing_supported"]

logger = logging.getLogger(__name__)


def _core_graph_class():
    try:
        from paddle.device.cuda import graphs
    except ImportError:  # pragma: no cover - very old Paddle
        return None, None
    return graphs, getattr(graphs, "CoreCUDAGraph", None)


def cuda_available():
    """True when this Paddle build has CUDA and CUDA graphs."""
    if not paddle.is_compiled_with_cuda():
        return False
    graphs, core_graph = _core_graph_class()
    return core_graph is not None and graphs.is_cuda_graph_supported()


def pool_sharing_supported():
    """True when captures can name a shared memory pool (Paddle >= 3.1)."""
    _, core_graph = _core_graph_class()
    return core_graph is not None and hasattr(core_graph, "begin_capture_with_pool_id") and hasattr(
        core_graph, "gen_new_memory_pool_id"
    )


def _indexed_generator(place):
    """The default CUDA generator of ``place`` where generators keep states by index (Paddle
    3.x: ``get_state_index``), else None (Paddle 2.6: one state per generator)."""
    try:
        from paddle.base import core

        generator = core.default_cuda_generator(place.get_device_id())
    except Exception:  # no CUDA generator here (CPU build, or a Paddle without paddle.base)
        return None
    return generator if hasattr(generator, "get_state_index") else None


def _current_stream_api():
    """``paddle.device.current_stream`` (Paddle 2.6 and 3.x); ``paddle.device.cuda.current_stream``, deprecated
    since Paddle 2.5 (it warns on every call), only where the former is missing."""
    current = getattr(paddle.device, "current_stream", None)
    return current if current is not None else paddle.device.cuda.current_stream


def _stream_handle(place):
    """The raw handle (an int) of the stream Paddle captures on, or None when unknown."""
    try:
        stream = _current_stream_api()(place)
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            handle = getattr(getattr(stream, "stream_base", None), "cuda_stream", None)
        return int(handle) if handle else None
    except Exception:  # no CUDA stream API here: the driver checks are skipped
        return None


def _paddle_capturing():
    try:
        from paddle.base import core
    except ImportError:  # pragma: no cover - Paddle without paddle.base
        return False
    probe = getattr(core, "is_cuda_graph_capturing", None)
    return bool(probe()) if probe is not None else False


#: Words of the errors Paddle raises when a capture, not the function, failed.
_CAPTURE_WORDS = ("captur", "cuda graph", "cudagraph", "cuda error", "cudaerror", "externalerror")


def _about_capture(err):
    text = f"{type(err).__name__} {err}".lower()
    return any(word in text for word in _CAPTURE_WORDS)


def _device_failure(err, broken):
    why = f" ({broken})" if broken else ""
    return (
        f"autocudagraph: the CUDA capture failed{why}: {type(err).__name__}: {str(err).strip()[:300]}. "
        "The capture was ended and dropped, and this call ran eagerly. Something in the function cannot be "
        "captured (a host read or copy, a sync, an op that allocates outside the graph's pool); move it out "
        "of the graphed function, or return None from dispatch_key_fn for such calls."
    )


def _end_failed_capture(graph, stream, ended=False):
    """Ends a capture whose body (or end) failed, leaving Paddle and the stream as before it began.
    Returns None when the capture was still valid and ended cleanly, else what broke it.

    NOTE [ Ending a broken capture ]
    A CUDA error inside a capture (a sync, a copy on the legacy stream: error 900/906) invalidates
    it. Paddle's end_capture then fails in cudaStreamEndCapture and keeps its capturing graph
    (CUDAGraph::EndCapture moves it out only after a successful end, in 2.6 and 3.x): Paddle
    believes a capture is open, its allocator for the capture is gone ("Required
    cuda_graph_allocator_ shall not be nullptr" on the next allocation) and the process aborts at
    exit in CUDAGraph::Reset. host_guard refuses the known causes before they reach CUDA; for any
    other, the stream gets a fresh, empty capture (driver calls, cuda_driver.py) that Paddle's
    end_capture can end: an empty graph is dropped without instantiation, the capturing graph is
    handed back and reset, which releases its pool. The runtime's last error is cleared.
    """
    why = None
    status = cuda_driver.capture_status(stream)
    if not ended and status != cuda_driver.INVALIDATED:  # Paddle's own end first, unless it must fail
        try:
            graph.capture_end()
            graph.reset()
            return None
        except Exception as err:  # the capture was broken: recovered below
            why = f"{type(err).__name__}: {str(err).strip()[:200]}"
    elif status == cuda_driver.INVALIDATED:
        why = "the capture was invalidated on the device"
    if _paddle_capturing() and stream:
        if cuda_driver.capture_status(stream) != cuda_driver.NONE:
            cuda_driver.end_stream_capture(stream)
        if cuda_driver.begin_stream_capture(stream):
            try:
                _, core_graph = _core_graph_class()
                core_graph.end_capture().reset()
            except Exception:  # reported below: Paddle still capturing
                logger.debug("ending the restarted capture failed", exc_info=True)
                cuda_driver.end_stream_capture(stream)  # leave no capture of ours open on the stream
    cuda_driver.clear_last_error()
    if _paddle_capturing():
        logger.error("autocudagraph: a failed CUDA capture could not be ended; Paddle still reports a capture "
                     "in progress and later CUDA work in this process may fail (%s)", why)
    return why or "the capture was ended by the device"


class _CudaGraph(Graph):
    def __init__(self, place, pool, guard=None):
        self._guard = guard or (lambda: capture_guard(gpu_is_host))  # Backend.guard
        self._place = place
        self._pool = pool
        self._graph = None
        self._generator = _indexed_generator(place)

    def capture(self, body, hooks=()):
        # NOTE [ Garbage collection around capture ]: freeing a tensor of another graph's pool
        # while a capture is open aborts the process on Paddle 2.6 (CUDA error 900, measured on
        # an H100). Only the cyclic collector frees such tensors at a moment we do not choose,
        # so it is kept off until the capture ends: garbage in cycles then waits for the next
        # collection after the capture, which is safe. No full gc.collect() before: what it
        # would free, the paused collector leaves alone until the capture ended, so it bought
        # no safety; it cost 60-70 ms of CPU per graph in a process holding Paddle (measured
        # on a CPU host), two per key: seconds of start-up for a model graphed layer by layer.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            # NOTE [ Allocator cache before a capture ] in pool_memory.py: released, then the pool measured.
            with capturing(hooks), CaptureMeter(self, lambda: reserved(self._place)):
                return self._capture(body)
        finally:
            if was_enabled:
                gc.enable()

    def _capture(self, body):
        graphs, _ = _core_graph_class()
        pool = self._pool
        if pool is not None:
            pool_id = pool.handle if isinstance(pool, SharedPool) else pool
            graph = graphs.CUDAGraph(place=self._place, mode="thread_local", pool_id=pool_id)
        else:
            graph = graphs.CUDAGraph(place=self._place, mode="thread_local")
        stream = _stream_handle(self._place)
        graph.capture_begin()
        try:
            # NOTE [ Host access during capture ] in host_guard.py; NOTE [ Shapes from tensor values ].
            with self._guard():
                result = body()
        except BaseException as err:
            broken = _end_failed_capture(graph, stream)
            if isinstance(err, CudaGraphError) or (broken is None and not _about_capture(err)):
                raise  # our refusal, or the function's own exception (backends.own_error)
            raise CaptureError(_device_failure(err, broken)) from err
        try:
            graph.capture_end()
        except Exception as err:
            broken = _end_failed_capture(graph, stream, ended=True)
            raise CaptureError(_device_failure(err, broken)) from err
        self._graph = graph
        if isinstance(pool, SharedPool):
            pool.join(self)
        return result

    def replay(self):
        if self._graph is None:
            raise CaptureError(NOT_CAPTURED)
        pool = self._pool
        if isinstance(pool, SharedPool):
            # NOTE [ Keys sharing a forward pool ] in shared_pool.py: the dispatcher captured such a key
            # again into its own pool; a replay that gets here anyway would corrupt another key's data.
            conflict = pool.blocked(self)
            if conflict is not None:
                raise PoolConflictError(f"autocudagraph: {conflict}. This replay is refused.")
            pool.replayed(self)
        if self._generator is None:
            self._graph.replay()
            return
        # NOTE [ Generator state index after replay ]
        # On a Paddle whose generators keep states by index (3.x; Fleet's tracker registers one
        # per rng_state name), the hook that re-seeds a captured dropout before a replay first
        # switches the CUDA generator to the state index current at capture
        # (Generator::SetStateIndex in the kernel's parameter setter) and never switches back.
        # A graph with dropout under a tracker block would leave the caller on the tracker's
        # state: the caller's next eager draws would come from the wrong stream. The hooks run
        # on the host inside replay(), so putting the caller's index back afterwards is enough.
        index = self._generator.get_state_index()
        try:
            self._graph.replay()
        finally:
            self._generator.set_state_index(index)

    def reset(self):
        if self._graph is not None:
            self._graph.reset()
            self._graph = None
            if isinstance(self._pool, SharedPool):
                self._pool.leave(self)


class CudaBackend(Backend):
    """Captures with ``paddle.device.cuda.graphs.CUDAGraph``."""

    name = "cuda"
    capture_executes = False
    cpu_is_host = True

    def __init__(self, place=None):
        self._place = place
        self.shares_pools = pool_sharing_supported()

    def new_pool(self):
        if not self.shares_pools:
            return None
        _, core_graph = _core_graph_class()
        return core_graph.gen_new_memory_pool_id()

    def forward_pool(self):
        if not self.shares_pools:
            return None
        return forward_pool(str(self._resolved_place()), self.new_pool)

    def _resolved_place(self):
        place = self._place
        if place is None:
            place = paddle.CUDAPlace(paddle.distributed.ParallelEnv().device_id)
        return place

    def new_graph(self, pool):
        return _CudaGraph(self._resolved_place(), pool, self.guard)

    def is_host(self, tensor):
        return gpu_is_host(tensor)

    def release_error(self, err):
        # Its frames' locals hold tensors of the dropped capture's pool, and freeing one while a later
        # capture is open aborts (NOTE [ Garbage collection around capture ]).
        traceback.clear_frames(err.__traceback__)

    def reserved_bytes(self):
        return int(paddle.device.cuda.memory_reserved(self._place))

    def describe(self):
        sharing = ("the forwards of keys share one pool; a key's forward and backward share one where its grads "
                   "are copies") if self.shares_pools else (
            "private pool per graph (no begin_capture_with_pool_id)"
        )
        return f"cuda ({sharing})"
