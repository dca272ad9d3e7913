"""Host reads and host-to-device copies, refused in Python while a graph is captured.

NOTE [ Host access during capture ]
A CUDA graph records device work. Reading a device tensor on the host (``.numpy()``, ``.item()``,
``float(t)``, ``if t:``, ``print(t)``, ``.cpu()``) waits for the device, and copying host data to
the device (``paddle.to_tensor(array)``, ``paddle.assign(list)``, ``cpu_tensor.cuda()``,
``t.set_value(array)``) is a copy from pageable host memory on the legacy stream. A capturing
stream refuses both: CUDA error 900 or 906 (measured on an H100 with Paddle 2.6.2), which
invalidates the capture. Paddle then cannot end it (``cudaStreamEndCapture`` fails inside
``CUDAGraph::EndCapture``, which keeps its capturing graph): every later allocation fails with
"Required cuda_graph_allocator_ shall not be nullptr" and the process aborts at exit in
``CUDAGraph::Reset``. So while a capture is open, ``host_guard`` makes those calls raise a
CaptureError *before* they reach CUDA: the capture stays valid, is ended and dropped cleanly
(backends/cuda.py), and the key runs eagerly with the reason. The simulated backend installs the
same guard, so CI refuses exactly what a GPU refuses.

Host tensors (a CPU tensor in a GPU program; ``mark_host`` on the simulated backend) stay
readable: their reads are host work, which a graph bakes in at capture (NOTE [ Host tensors ] in
io/host_tensors.py); ``host_reads`` (simulated backend) hands the captured values back on replay.
A tensor created on the host inside the function (``paddle.to_tensor(a, place="cpu")``) is a
host tensor; copying it to the device is refused like any host-to-device copy.

NOTE [ Python scalars during capture ]
``paddle.to_tensor(<Python bool, int or float>)`` is everywhere in model code, often hidden in a
Paddle helper (``paddle.where(mask, 0.0, finfo.min)`` calls it on Paddle 3.x). Eager Paddle converts
the scalar on the host and copies it to the device, a copy a capture refuses. Inside a capture it
becomes a device fill instead (``_C_ops.full``, the op Paddle 3.x itself uses for a float or int
scalar on a GPU): the host conversion runs as eager runs it (``_to_tensor_non_static`` with the
CPU place, pure host work: default dtype, ``dtype=``, bfloat16 rounding of this Paddle), and the
fill writes that value, so the result has eager's bits, dtype, shape ([]), place and
stop_gradient. The value is a kernel argument: a replay writes the capture-time value, as for
every Python scalar a graphed function uses (``x * 0.5``). A numpy scalar (``np.float32(0.1)``, a
bool, integer or float one) is a scalar alike, with the dtype eager gives it. Python lists and numpy
arrays (a 0-D one too) stay refused: they are data. The fill happens in ``_to_tensor_non_static``, below the
public ``paddle.to_tensor``, so the whole-step op trace (guards/host_reads.py) records the user's
call with the user's arguments at warmup and at capture alike; where this Paddle lacks that
function, scalars stay refused.

The patches are installed only inside ``host_guard()`` and always restored on exit; they check
calls of the capturing thread only (captures are thread-local: another thread's reads are its own).
"""

import contextlib
import threading
import types

import numpy as np
import paddle

from .paddle_patches import Patches
from .host_errors import copy_error, grad_assignment_error, print_error, read_error, sync_error, what_value
from .host_marks import mark_host
from .traced_ops import paused
from .raw_tensors import RawTensorGuard, host_place, patch_raw_tensors, refused

__all__ = ["host_guard", "gpu_is_host", "constructor_guarded"]

#: Tensor methods that read a tensor's values on the host.
_READS = ("numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__complex__",
          "__array__", "cpu", "pin_memory")

#: Tensor methods that print or format a tensor's values (they read it on the host through numpy()), and how
#: the refusal names them: what the user wrote, not the numpy() Paddle calls.
_FORMATS = (("__str__", "print(t), str(t) or repr(t)"), ("__repr__", "print(t), str(t) or repr(t)"),
            ("__format__", "an f-string or format()"))

#: Python values that are host data (paddle.Tensor(value) copies them to the device).
_HOST_DATA = (list, tuple, bool, int, float, complex)

#: Python types whose to_tensor becomes a device fill during capture (NOTE [ Python scalars during capture ]).
_SCALARS = (bool, int, float)


def _is_scalar(data):
    """A Python bool, int or float, or a numpy scalar of a bool, integer or float dtype."""
    return type(data) in _SCALARS or (isinstance(data, np.generic) and data.dtype.kind in "biuf")


def constructor_guarded():
    """Whether ``paddle.Tensor(array)`` is refused during a capture: where Paddle's Tensor constructor is a
    Python function (3.x). Paddle 2.6's is a C slot that rejects Parameter's arguments when called
    through a Python replacement, so it is left alone there (measured on 2.6.2)."""
    return isinstance(paddle.Tensor.__dict__.get("__init__"), types.FunctionType)


def gpu_is_host(t):
    """On a GPU: is ``t`` host memory (CPU or pinned)?"""
    return not t.place.is_gpu_place()


def _device_of(args, kwargs):
    """The place a ``Tensor.to(...)`` / ``_copy_to(...)`` call names, or None (no place named)."""
    for value in list(args) + [kwargs.get("device"), kwargs.get("place")]:
        if isinstance(value, str) and value.lower().startswith(("cpu", "gpu", "cuda")):
            return value
        if type(value).__name__.endswith("Place"):  # CPUPlace, CUDAPlace, CUDAPinnedPlace, Place
            return value
    return None


def _plain_call(original, tensor, args, kwargs):
    return original(tensor, *args, **kwargs)


class _Guard(RawTensorGuard):
    """The patched entry points of one host_guard() block."""

    def __init__(self, is_host, host_reads):
        self.is_host = is_host
        self.host_reads = host_reads
        self.patches = Patches()
        self.depth = 0  # > 0 inside an allowed call: what it calls in turn is its own business
        self.thread = threading.get_ident()  # the capturing thread (captures are thread-local)
        self.fills_scalars = False  # _to_tensor_non_static is patched: scalars become device fills
        self.scalar_call = False  # inside paddle.to_tensor(<Python scalar>) on the device
        self.dense = {}  # id -> (raw tensor, is host) of the raw tensors Tensor.get_tensor() handed out

    def patch(self, owner, name, make):
        if not hasattr(owner, name):
            return
        current = getattr(owner, name)
        checked = make(current)
        guard = self

        def entry(*args, **kwargs):
            if guard.depth or threading.get_ident() != guard.thread:
                return current(*args, **kwargs)
            return checked(*args, **kwargs)

        self.patches.set(owner, name, entry)  # NOTE [ Paddle patches ] in guards/paddle_patches.py

    def allowed(self, original, *args, **kwargs):
        """Runs an allowed call; the patched calls it makes (to_tensor's own _copy_to) pass."""
        self.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            self.depth -= 1

    # ------------------------------------------------------------------ device -> host
    def read(self, name):
        counted = self.host_reads is not None and name not in ("cpu", "pin_memory")
        return self.host_only(self.is_host, lambda: read_error(f"Tensor.{name}()"),
                              self._counted_read if counted else None)

    def _counted_read(self, original, tensor, args, kwargs):
        return self.host_reads.read(original, (tensor,) + args, kwargs)

    def formatted(self, what):
        # its numpy() goes through read(): host_reads sees it
        return self.host_only(self.is_host, lambda: print_error(what), _plain_call)

    def sync(self, what):
        return refused(lambda: sync_error(what))

    def patch_grad_setter(self):
        """``p.grad = t``: done as an in-place copy where that is eager's assignment, else refused
        (NOTE [ Assigning a grad during capture ]); reading ``p.grad`` is not checked."""
        descriptor = paddle.Tensor.__dict__.get("grad")
        if descriptor is None or not hasattr(descriptor, "__set__"):
            return
        guard = self

        def assign(tensor, value):
            if guard.depth or threading.get_ident() != guard.thread or guard.is_host(tensor):
                return descriptor.__set__(tensor, value)
            with paused():  # the guard's own read: no op of the trace
                grad = descriptor.__get__(tensor, type(tensor))
            if not isinstance(value, paddle.Tensor):
                raise grad_assignment_error(f"to {what_value(value)}")
            if guard.is_host(value):
                raise grad_assignment_error("to a host tensor")
            if grad is None or not grad._is_initialized():
                raise grad_assignment_error("where the parameter had no grad (new grad storage)")
            if grad.shape != value.shape or grad.dtype != value.dtype:
                raise grad_assignment_error(
                    f"with a {value.dtype} tensor of shape {list(value.shape)} to a {grad.dtype} grad of shape "
                    f"{list(grad.shape)}")
            if grad is not value:
                with paddle.no_grad(), paused():  # eager rebinds: no op of the trace
                    guard.allowed(paddle.Tensor.copy_, grad, value, False)

        self.patches.set(paddle.Tensor, "grad", property(descriptor.__get__, assign, None, descriptor.__doc__))

    # ------------------------------------------------------------------ host -> device
    def to_tensor(self, original):
        guard = self

        def to_tensor(data, *args, **kwargs):
            place = kwargs.get("place", args[1] if len(args) > 1 else None)
            on_host = host_place(place)
            if isinstance(data, paddle.Tensor):
                source_host = guard.is_host(data)
                if source_host and not on_host:
                    raise copy_error("paddle.to_tensor() of a host tensor")
                if on_host and not source_host:
                    raise read_error("paddle.to_tensor(device tensor, place=cpu)")
            elif _is_scalar(data) and not on_host and guard.fills_scalars:
                # Not through allowed(): the patched _to_tensor_non_static below must see the call.
                guard.scalar_call = True
                try:
                    return original(data, *args, **kwargs)
                finally:
                    guard.scalar_call = False
            elif not on_host:
                raise copy_error(f"paddle.to_tensor() of {what_value(data)}")
            out = guard.allowed(original, data, *args, **kwargs)
            return mark_host(out) if on_host else out

        return to_tensor

    def constructor(self, original):
        """``paddle.Tensor(array)``: the copy ``paddle.to_tensor`` makes, refused alike."""
        guard = self

        def __init__(self, *args, **kwargs):
            value = kwargs.get("value", args[0] if args else None)
            if not isinstance(value, _HOST_DATA) and type(value).__module__ != "numpy":
                return original(self, *args, **kwargs)  # no data, a tensor, a dtype: no copy from the host
            if not host_place(kwargs.get("place", args[1] if len(args) > 1 else None)):
                raise copy_error(f"paddle.Tensor() of {what_value(value)}")
            guard.allowed(original, self, *args, **kwargs)
            mark_host(self)
            return None

        return __init__

    def scalar_fill(self, original):
        """``_to_tensor_non_static`` of a Python scalar for the device: a fill with the value eager
        would copy (NOTE [ Python scalars during capture ])."""
        guard = self

        def to_tensor_non_static(data, dtype=None, place=None, stop_gradient=True):
            if not guard.scalar_call or not (_is_scalar(data) or (isinstance(data, np.ndarray) and data.ndim == 0)):
                return original(data, dtype, place, stop_gradient)
            guard.scalar_call = False  # one fill per to_tensor call
            return guard.allowed(_device_fill, original, data, dtype, place, stop_gradient)

        return to_tensor_non_static

    def assign(self, original):
        guard = self

        def assign(x, output=None):
            target_host = output is not None and guard.is_host(output)
            if not isinstance(x, paddle.Tensor):
                if not target_host:
                    raise copy_error(f"paddle.assign() of {what_value(x)}")
            elif guard.is_host(x) != target_host and output is not None:
                raise copy_error("paddle.assign() between host and device")
            return guard.allowed(original, x, output)

        return assign

    def set_value(self, original):
        guard = self

        def set_value(self, value, *args, **kwargs):
            if not guard.is_host(self) and (not isinstance(value, paddle.Tensor) or guard.is_host(value)):
                raise copy_error(f"Tensor.set_value() of {what_value(value)}")
            return guard.allowed(original, self, value, *args, **kwargs)

        return set_value

    def setitem(self, original):
        guard = self

        def __setitem__(self, item, value):
            # A numpy array or a list is copied from host memory into the tensor (Paddle's
            # SetTensorFromPyArray); a Python scalar is a kernel argument, frozen like any other.
            if not guard.is_host(self) and (type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"
                                            or isinstance(value, (list, tuple))):
                raise copy_error(f"Tensor.__setitem__() of {what_value(value)}")
            return guard.allowed(original, self, item, value)

        return __setitem__

    def copy_(self, original):
        guard = self

        def copy_(self, src, *args, **kwargs):
            if isinstance(src, paddle.Tensor) and guard.is_host(src) != guard.is_host(self):
                raise (copy_error if guard.is_host(src) else read_error)("Tensor.copy_() between host and device")
            return guard.allowed(original, self, src, *args, **kwargs)

        return copy_

    def move(self, name):
        guard = self

        def make(original):
            def move(self, *args, **kwargs):
                to_host = True if name == "cpu" else (False if name == "cuda" else None)
                if to_host is None:
                    place = _device_of(args, kwargs)
                    to_host = None if place is None else host_place(place)
                if to_host is not None and to_host != guard.is_host(self):
                    if to_host:
                        raise read_error(f"Tensor.{name}()")
                    raise copy_error(f"Tensor.{name}() of a host tensor")
                return guard.allowed(original, self, *args, **kwargs)

            return move

        return make


def _fill_value(host):
    """The Python value of a 0-D host tensor, exact in a double (float16/bfloat16 widen exactly)."""
    if host.dtype in (paddle.float16, paddle.bfloat16):
        return float(host.astype("float32").numpy())
    if host.dtype in (paddle.float32, paddle.float64):
        return float(host.numpy())
    if host.dtype == paddle.bool:
        return bool(host.numpy())
    return int(host.numpy())


_FILLABLE = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")


def _device_fill(original, data, dtype, place, stop_gradient):
    host = original(data, dtype, paddle.CPUPlace(), True)  # eager's conversion, on the host
    if str(host.dtype).replace("paddle.", "").lower() not in _FILLABLE:
        raise copy_error(f"paddle.to_tensor() of {what_value(data)} as {host.dtype}")
    out = paddle._C_ops.full(list(host.shape), _fill_value(host), host.dtype, place)
    out.stop_gradient = stop_gradient
    return out


@contextlib.contextmanager
def host_guard(is_host, host_reads=None):
    """Refuses host reads, host-to-device copies and device syncs with a CaptureError until the
    block exits (NOTE [ Host access during capture ]).

    Args:
        is_host: ``is_host(tensor)`` -> is it host memory (readable, never copied to the device)?
        host_reads: where reads of host tensors go (the simulated backend freezes them), or None.
    """
    guard = _Guard(is_host, host_reads)
    try:
        for name in _READS:
            guard.patch(paddle.Tensor, name, guard.move(name) if name == "cpu" else guard.read(name))
        for name, what in _FORMATS:
            guard.patch(paddle.Tensor, name, guard.formatted(what))
        for name in ("cuda", "to", "_copy_to"):
            guard.patch(paddle.Tensor, name, guard.move(name))
        guard.patch(paddle.Tensor, "set_value", guard.set_value)
        guard.patch(paddle.Tensor, "__setitem__", guard.setitem)
        if constructor_guarded():
            guard.patch(paddle.Tensor, "__init__", guard.constructor)
        guard.patch(paddle.Tensor, "copy_", guard.copy_)
        for module in (paddle, paddle.tensor, getattr(paddle.tensor, "creation", None)):
            if module is not None:
                guard.patch(module, "to_tensor", guard.to_tensor)
                guard.patch(module, "assign", guard.assign)
        creation = getattr(paddle.tensor, "creation", None)
        if creation is not None and hasattr(creation, "_to_tensor_non_static"):
            guard.patch(creation, "_to_tensor_non_static", guard.scalar_fill)
            guard.fills_scalars = True
        patch_raw_tensors(guard)  # raw tensors, device and stream waits (guards/raw_tensors.py)
        guard.patch_grad_setter()
        yield
    finally:
        guard.patches.restore()

