"""Backends behind one small interface (see base.py), and the choice between them."""

import os

import paddle

from ..errors import CudaGraphError
from .base import _state as _THREAD  # read by plain_call() on every call of a pass-through wrapper
from .base import (Backend, Graph, capture_open, capturing, function_errors, in_own_grad, in_rerun_replay, in_whole_step,
                   is_capturing, is_own_error, own_error, own_grad, whole_step)
from .cuda import CudaBackend, cuda_available, pool_sharing_supported
from .simulated import SimulatedBackend

__all__ = [
    "BACKEND_NAMES",
    "ENV_BACKEND",
    "Backend",
    "Graph",
    "backend_env_set",
    "capture_open",
    "capturing",
    "function_errors",
    "is_own_error",
    "own_error",
    "is_capturing",
    "in_own_grad",
    "in_whole_step",
    "in_rerun_replay",
    "plain_call",
    "plain_thread",
    "own_grad",
    "whole_step",
    "resolve_backend",
    "cuda_available",
    "pool_sharing_supported",
    "thread_nesting",
    "environment_reads",
]

#: Names accepted by ``backend=`` and by the environment override.
BACKEND_NAMES = ("cuda", "simulate", "eager")
#: Environment variable that overrides the backend of every wrapper.
ENV_BACKEND = "PADDLEFLEET_CUDAGRAPH_BACKEND"

_SIMULATED = SimulatedBackend()

_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)
_ENV_KEY = _ENVIRON.encodekey(ENV_BACKEND) if isinstance(_ENV_DATA, dict) and hasattr(_ENVIRON, "encodekey") else None


def plain_thread():
    """True when this thread is inside no capture, whole step or re-running replay (what a call of a key that
    runs eagerly asks of the backends: NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py)."""
    return not _THREAD.nested


def thread_nesting():
    """The per-thread object whose ``nested`` plain_thread() reads (a compiled check reads it too: NOTE [ The
    front door ] in core/front.py)."""
    return _THREAD


def plain_call():
    """True when this thread is inside no capture, whole step or re-running replay and the environment
    names no backend: what a pass-through wrapper's call asks of the backends (NOTE [ Pass-through
    wrappers ] in core/lifecycle.py), in one call."""
    if _THREAD.nested:
        return False
    if _ENV_KEY is not None and os.environ is _ENVIRON:
        return not _ENV_DATA.get(_ENV_KEY)
    return not os.environ.get(ENV_BACKEND)


def environment_reads():
    """``(os module, os.environ, its mapping, the encoded variable name)``: what plain_call() reads of the
    environment, for a compiled check that reads it the same way while ``os.environ`` is still that object (NOTE
    [ The front door ] in core/front.py); None where plain_call() reads through ``os.environ.get``."""
    return None if _ENV_KEY is None else (os, _ENVIRON, _ENV_DATA, _ENV_KEY)


def backend_env_set():
    """True when PADDLEFLEET_CUDAGRAPH_BACKEND is set and not empty (resolve_backend then reads it).

    Read on every call of a pass-through wrapper (NOTE [ Pass-through wrappers ] in core/lifecycle.py):
    from ``os.environ``'s own mapping, which every write through ``os.environ`` updates, without the
    key's encoding ``os.environ.get`` pays (about 0.5 us a read against 0.02); through ``os.environ.get``
    where ``os.environ`` is no longer the process's own mapping (a test replaced it)."""
    if _ENV_KEY is not None and os.environ is _ENVIRON:
        return bool(_ENV_DATA.get(_ENV_KEY))
    return bool(os.environ.get(ENV_BACKEND))


def _gpu_place(tensors):
    for t in tensors:
        place = t.place
        if place.is_gpu_place():
            return paddle.CUDAPlace(place.gpu_device_id())
    return None


def resolve_backend(option, tensors):
    """Returns ``(backend or None, reason)``; None means run eagerly, untouched.

    The environment variable PADDLEFLEET_CUDAGRAPH_BACKEND overrides ``option``.
    """
    from_env = os.environ.get(ENV_BACKEND)
    name = from_env or option
    if name is not None and name not in BACKEND_NAMES:
        raise CudaGraphError(
            f"autocudagraph: {ENV_BACKEND}={name!r} is not a backend. An unknown name would silently run "
            f"eagerly. Set it to one of {BACKEND_NAMES}, or unset it."
        )
    if name == "simulate":
        return _SIMULATED, "simulate"
    if name == "eager":
        if from_env:
            return None, f"backend is eager: the environment sets {ENV_BACKEND}=eager"
        return None, "backend is eager (backend='eager')"
    place = _gpu_place(tensors)
    if name == "cuda":
        if not cuda_available():
            raise CudaGraphError(
                "autocudagraph: backend 'cuda' was asked for but this Paddle build has no CUDA graphs "
                f"(paddle {paddle.__version__}). Install paddlepaddle-gpu, or use backend='simulate' "
                "to test on the CPU."
            )
        if place is None and tensors:
            raise CudaGraphError(
                "autocudagraph: backend 'cuda' needs the call's tensors on a GPU, but they are on "
                f"{tensors[0].place}. Move them with .cuda() or paddle.set_device('gpu')."
            )
        return CudaBackend(place), "cuda"
    if cuda_available() and place is not None:
        return CudaBackend(place), "cuda"
    return None, "no GPU tensors or no CUDA build (backend=None runs eagerly)"
