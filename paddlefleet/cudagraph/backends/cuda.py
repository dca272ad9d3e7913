"""The real backend: Paddle's CUDA graphs.

This is the only module that imports ``paddle.device.cuda.graphs``. It detects what the
installed Paddle can do instead of comparing version strings:

* ``core.CUDAGraph.begin_capture_with_pool_id`` (Paddle >= 3.1): the forward and backward
  graphs of one key are captured into one memory pool.
* without it (Paddle 2.6): every capture gets a private pool.
"""

import gc

import paddle

from ..errors import CaptureError
from .base import NOT_CAPTURED, Backend, Graph, capturing

__all__ = ["CudaBackend", "cuda_available", "pool_sharing_supported"]


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


class _CudaGraph(Graph):
    def __init__(self, place, pool):
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
            with capturing(hooks):
                return self._capture(body)
        finally:
            if was_enabled:
                gc.enable()

    def _capture(self, body):
        graphs, _ = _core_graph_class()
        if self._pool is not None:
            graph = graphs.CUDAGraph(place=self._place, mode="thread_local", pool_id=self._pool)
        else:
            graph = graphs.CUDAGraph(place=self._place, mode="thread_local")
        graph.capture_begin()
        ended = False
        try:
            result = body()
            graph.capture_end()
            ended = True
        finally:
            if not ended:
                # NOTE [ Ending a failed capture ]: a capture left open makes the next
                # operation on the stream fail with CUDA error 900 and aborts the process.
                # End it before anything else touches the stream, then drop the graph.
                try:
                    graph.capture_end()
                    graph.reset()
                except Exception:  # the original error is the one worth reporting
                    pass
        self._graph = graph
        return result

    def replay(self):
        if self._graph is None:
            raise CaptureError(NOT_CAPTURED)
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


class CudaBackend(Backend):
    """Captures with ``paddle.device.cuda.graphs.CUDAGraph``."""

    name = "cuda"
    capture_executes = False

    def __init__(self, place=None):
        self._place = place
        self.shares_pools = pool_sharing_supported()

    def new_pool(self):
        if not self.shares_pools:
            return None
        _, core_graph = _core_graph_class()
        return core_graph.gen_new_memory_pool_id()

    def new_graph(self, pool):
        place = self._place
        if place is None:
            place = paddle.CUDAPlace(paddle.distributed.ParallelEnv().device_id)
        return _CudaGraph(place, pool)

    def describe(self):
        sharing = "forward and backward share one pool" if self.shares_pools else (
            "private pool per graph (no begin_capture_with_pool_id)"
        )
        return f"cuda ({sharing})"
