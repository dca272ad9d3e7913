"""Automatic CUDA graphs for PaddlePaddle training: ``autocudagraph``."""

from .api import autocudagraph
from .backends import is_capturing
from .errors import CaptureError, CudaGraphError, InputMismatchError, PendingBackwardError, StaleOutputError
from .options import GraphOptions

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
