"""The simulated backend: CUDA-graph semantics on the CPU, for tests and CI.

NOTE [ Simulated static buffers ]
Capture runs the body once and keeps the tensors it returned: they are the static buffers.
Replay runs the same body again - on the same static input tensors, because the body closes
over them - and copies every result *in place* into the tensors the capture returned. So a
caller that holds a static buffer sees it overwritten by the next replay, exactly as with a
real CUDA graph. Host-synchronising calls are refused during capture, as a capturing CUDA
stream refuses them (CUDA error 900).
"""

import contextlib

import paddle

from ..errors import CaptureError
from .base import Backend, Graph, capturing

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


def _refusing(owner, name):
    where = f"paddle.device.{name}()" if owner is paddle.device else f"Tensor.{name}()"

    def refuse(*args, **kwargs):
        raise CaptureError(
            f"autocudagraph: {where} was called during capture. It waits for the device, which a "
            "capturing CUDA stream refuses (CUDA error 900). Keep host reads out of the graphed "
            "function, or move them after the call."
        )

    return refuse


@contextlib.contextmanager
def refuse_host_sync():
    """Makes host-synchronising calls raise CaptureError until the block exits."""
    saved = []
    try:
        for owner, name in _HOST_SYNC:
            if hasattr(owner, name):
                saved.append((owner, name, owner.__dict__.get(name, None), getattr(owner, name)))
                setattr(owner, name, _refusing(owner, name))
        cuda_mod = getattr(paddle.device, "cuda", None)
        if cuda_mod is not None and hasattr(cuda_mod, "synchronize"):
            saved.append((cuda_mod, "synchronize", cuda_mod.__dict__.get("synchronize"), cuda_mod.synchronize))
            cuda_mod.synchronize = _refusing(paddle.device, "cuda.synchronize")
        yield
    finally:
        for owner, name, own, original in reversed(saved):
            setattr(owner, name, own if own is not None else original)


def _flat_tensors(result):
    if isinstance(result, paddle.Tensor):
        return [result]
    return [t for t in result if t is not None]


class _SimulatedGraph(Graph):
    def __init__(self):
        self._body = None
        self._hooks = ()
        self._static = None

    def capture(self, body, hooks=()):
        with capturing(hooks), refuse_host_sync():
            result = body()
        self._body = body
        self._hooks = tuple(hooks)
        self._static = _flat_tensors(result)
        return result

    def replay(self):
        if self._body is None:
            raise CaptureError("autocudagraph: replay of a graph that was never captured or was reset.")
        # A CUDA graph replays the kernels of the capture-time branch of any Python code, so
        # the body re-runs in the capture context (is_capturing() True, hooks entered).
        with capturing(self._hooks):
            fresh = _flat_tensors(self._body())
        with paddle.no_grad():
            for static, value in zip(self._static, fresh):
                if static is not value:
                    paddle.assign(value, output=static)

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
