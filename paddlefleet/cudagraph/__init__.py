"""Automatic CUDA graphs for PaddlePaddle training: ``autocudagraph``."""

from . import grad_consumers
from .api import autocudagraph
from .backends import is_capturing
from .errors import CaptureError, CudaGraphError, InputMismatchError, PendingBackwardError, StaleOutputError
from .options import GraphOptions

# NOTE [ Grad consumers ] in grad_consumers.py: hooks registered from now on are recorded.
grad_consumers.install()

__all__ = [
    "autocudagraph",
    "is_capturing",
    "GraphOptions",
    "CudaGraphError",
    "CaptureError",
    "InputMismatchError",
    "PendingBackwardError",
    "StaleOutputError",
]
