"""Automatic CUDA graphs for PaddlePaddle training: ``autocudagraph`` (blocks) and
``autocudagraph_step`` (the whole training step)."""

from . import grad_consumers
from .api import autocudagraph
from .backends import is_capturing
from .grad_scaler import GraphGradScaler
from .errors import CaptureError, CudaGraphError, InputMismatchError, PendingBackwardError, StaleOutputError
from .options import GraphOptions
from .step import autocudagraph_step

# NOTE [ Grad consumers ] in grad_consumers.py: hooks registered from now on are recorded.
grad_consumers.install()

__all__ = [
    "autocudagraph",
    "autocudagraph_step",
    "GraphGradScaler",
    "is_capturing",
    "GraphOptions",
    "CudaGraphError",
    "CaptureError",
    "InputMismatchError",
    "PendingBackwardError",
    "StaleOutputError",
]
