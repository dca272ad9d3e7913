"""The messages of host_guard's refusals (NOTE [ Host access during capture ] in host_guard.py):
what was called, why a capturing CUDA stream refuses it, and the fix."""

from .refusals import DEVICE_SYNC, GRAD_ASSIGNED, HOST_READ, HOST_TO_DEVICE, STREAM_WAIT

__all__ = ["D2H_FIX", "H2D_FIX", "read_error", "print_error", "copy_error", "sync_error", "sync_object_error",
           "grad_assignment_error", "what_value"]

D2H_FIX = "Keep host reads out of the graphed function, or move them after the call."
H2D_FIX = ("Create the tensor outside the graphed function and pass it in as an argument (its values are "
           "then copied in before every replay), or build it with device ops (paddle.full, paddle.zeros).")


def read_error(what, refusal=HOST_READ):
    """The refusal of a host read (or, with ``refusal=RAW_TENSOR_READ``, of a raw tensor's)."""
    return refusal.error(
        f"autocudagraph: {what} was called during capture. It reads a device tensor on the host, which waits "
        "for the device; a capturing CUDA stream refuses that (CUDA error 900/906) and the capture breaks. "
        + D2H_FIX
    )


def print_error(what):
    """``print(t)``, ``str(t)``, an f-string of ``t``: named as the user wrote it, not as the numpy() it calls."""
    return HOST_READ.error(
        f"autocudagraph: {what} of a device tensor was called during capture. Printing or formatting a tensor "
        "reads its values on the host, which waits for the device; a capturing CUDA stream refuses that (CUDA "
        "error 900/906) and the capture breaks, and a replay would not print anyway (it runs no Python). Print "
        "the call's output after the call, or print shapes and dtypes (t.shape) instead of values."
    )


def copy_error(what):
    return HOST_TO_DEVICE.error(
        f"autocudagraph: {what} was called during capture. It copies host data to the device; a capturing "
        "CUDA stream refuses that copy (CUDA error 906), and a graph could never replay it with new values. "
        + H2D_FIX
    )


def sync_error(what):
    return DEVICE_SYNC.error(
        f"autocudagraph: {what} was called during capture. It waits for the device, which a capturing "
        "CUDA stream refuses (CUDA error 900). " + D2H_FIX
    )


def grad_assignment_error(why):
    """NOTE [ Assigning a grad during capture ]
    ``p.grad = t`` copies ``t`` into the storage of ``p``'s grad (Paddle's grad setter, measured on
    Paddle 2.6.2 and 3.3.1: the grad keeps its address, and ``t`` is not aliased), on the legacy
    stream, which a capturing stream refuses: inside a captured whole step it failed with CUDA error
    906 on H200s with Paddle 2.6.2 (tools/dist_gpu_check.py's probe). Where ``p`` has a grad of
    ``t``'s shape and dtype, the assignment is done as that same copy on the capturing stream
    (``Tensor.copy_``): eager's result bit for bit, the grad keeps its address, and Paddle 2.6's
    ``paddle.nn.utils.clip_grad_norm_`` (which assigns ``p.grad``) is captured. Any other assignment
    (no grad yet, another shape or dtype, a host tensor) would need new storage or a host copy: it
    is refused in Python, on both backends, so the capture fails cleanly."""
    return GRAD_ASSIGNED.error(
        f"autocudagraph: a parameter's .grad was assigned (p.grad = tensor) during capture, {why}. Paddle "
        "would copy it on the legacy CUDA stream (or allocate new grad storage), which a capturing stream "
        "refuses (CUDA error 906), so the capture breaks. Let backward() write the grads, or change them in "
        "place (p.grad.copy_(t, False)); or assign outside the graphed function."
    )


def sync_object_error(what):
    return STREAM_WAIT.error(
        f"autocudagraph: {what} was called during capture. It waits for the device or asks how far it got, "
        "which a capturing CUDA stream refuses (CUDA error 900), and a replay would not repeat it (the "
        "answer would stay the capture's). " + D2H_FIX
    )


def what_value(value):
    """``a numpy array``, ``a list``, ``a Python float``: what a host value is, for messages."""
    if type(value).__module__ == "numpy":
        return "a numpy array" if type(value).__name__ == "ndarray" else f"a numpy {type(value).__name__}"
    if isinstance(value, (bool, int, float, complex)):
        return f"a Python {type(value).__name__}"
    return f"a {type(value).__name__}"
