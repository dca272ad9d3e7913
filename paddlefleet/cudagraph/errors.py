"""Errors raised by autocudagraph.

Messages follow one form: what happened (with the values), why it matters, what to do.
"""

__all__ = [
    "CudaGraphError",
    "CaptureError",
    "InputMismatchError",
    "StaleOutputError",
    "PendingBackwardError",
    "ReplayShapeError",
    "ReplayTraceError",
]


class CudaGraphError(RuntimeError):
    """Base class of every error autocudagraph raises at call time."""


class CaptureError(CudaGraphError):
    """A capture could not be completed (host sync, uncapturable op, error in the function).

    Attributes:
        refusal: the row of the refusal table it was raised from (guards/refusals.py ``ROW.error``), or None.
    """

    refusal = None


class InputMismatchError(CudaGraphError):
    """A call's tensors do not fit the static buffers of the graph its key selected."""


class StaleOutputError(CudaGraphError):
    """An output static buffer was read after a later replay overwrote it."""


class PendingBackwardError(CudaGraphError):
    """A backward replay was asked for a forward replay whose saved state was overwritten."""


class ReplayShapeError(CaptureError):
    """A simulated replay computed outputs of other shapes than its capture: a GPU graph could not
    have given them (the key falls back to eager)."""

    eager_reason = "a replay changed an output's shape"


class ReplayTraceError(ReplayShapeError):
    """A simulated replay ran other ops, or read other tensors or Python values, than its capture:
    a GPU graph would have replayed the capture's (the call runs eagerly; the key falls back)."""

    eager_reason = "a replay read other values than its capture"

