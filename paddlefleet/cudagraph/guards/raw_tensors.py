"""Paddle's raw tensors and the device's waits, refused while a graph is captured: the part of
host_guard (NOTE [ Host access during capture ] in host_guard.py) for ``Tensor.get_tensor()`` (and
``Tensor.value().get_tensor()``), whose own methods read or write device memory through no Tensor
method, and for ``synchronize()`` of the device, of a Stream and of an Event."""

import paddle

from .host_errors import copy_error, read_error, sync_object_error, what_value
from .refusals import RAW_TENSOR_READ

__all__ = ["RawTensorGuard", "host_place", "patch_raw_tensors", "refused"]

#: Methods of Paddle's raw tensor (``Tensor.get_tensor()``, ``Tensor.value().get_tensor()``) that read
#: its values on the host, and how messages name them.
_RAW_READS = (("__array__", "np.array()"), ("_get_float_element", "_get_float_element()"),
              ("__str__", "str()"), ("__repr__", "repr()"))


def _raw_tensor_classes():
    """Paddle's raw tensor classes (DenseTensor; LoDTensor on Paddle 2.6), each once."""
    try:
        from paddle.base import core
    except ImportError:  # pragma: no cover - Paddle without paddle.base
        return []
    found = []
    for name in ("DenseTensor", "LoDTensor"):
        cls = getattr(core, name, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return found


def _sync_modules():
    """``[(module, name)]`` of the modules with a device ``synchronize()`` and Stream/Event classes."""
    found = [(paddle.device, "paddle.device")]
    cuda_mod = getattr(paddle.device, "cuda", None)
    if cuda_mod is not None:
        found.append((cuda_mod, "paddle.device.cuda"))
    top = getattr(paddle, "cuda", None)
    if top is not None and top is not cuda_mod and hasattr(top, "synchronize"):
        found.append((top, "paddle.cuda"))
    return found


def host_place(place):
    """True for a place that names host memory ("cpu", CPUPlace, CUDAPinnedPlace); False for a
    device place and for None (the current device)."""
    if place is None:
        return False
    if isinstance(place, str):
        return place.lower().startswith(("cpu", "gpu_pinned"))
    for name in ("CPUPlace", "CUDAPinnedPlace"):
        cls = getattr(paddle, name, None)
        if cls is not None and isinstance(place, cls):
            return True
    for probe in ("is_cpu_place", "is_cuda_pinned_place"):
        method = getattr(place, probe, None)
        if method is not None and method():
            return True
    return False


def refused(refuse):
    """A patch (``make(original)``) of a method that always raises ``refuse()``."""

    def make(original):
        def refuse_call(*args, **kwargs):
            raise refuse()

        return refuse_call

    return make


class RawTensorGuard:
    """The raw-tensor and wait entry points of host_guard's _Guard (a mixin: ``self.is_host``,
    ``self.allowed`` and ``self.dense`` are the guard's)."""

    def sync_object(self, what):
        return refused(lambda: sync_object_error(what))

    def get_tensor(self, original):
        guard = self

        def get_tensor(self, *args, **kwargs):
            dense = guard.allowed(original, self, *args, **kwargs)
            guard.dense[id(dense)] = (dense, guard.is_host(self))
            return dense

        return get_tensor

    def dense_is_host(self, dense):
        """Is the raw tensor ``dense`` (``Tensor.get_tensor()``) host memory? As its Tensor was, else
        by its place."""
        known = self.dense.get(id(dense))
        if known is not None and known[0] is dense:
            return known[1]
        try:
            return not dense._place().is_gpu_place()
        except Exception:  # no place to read: not a device tensor we know of
            return True

    def host_only(self, is_host, refuse, then=None):
        """A patch (``make(original)``) of a method that raises ``refuse()`` unless ``is_host(tensor)``
        says its tensor is host memory, and then runs ``then(original, tensor, args, kwargs)`` (by
        default the original, allowed: what it calls in turn passes)."""
        then = then or self._allowed_call

        def make(original):
            def checked(tensor, *args, **kwargs):
                if not is_host(tensor):
                    raise refuse()
                return then(original, tensor, args, kwargs)

            return checked

        return make

    def _allowed_call(self, original, tensor, args, kwargs):
        return self.allowed(original, tensor, *args, **kwargs)

    def dense_read(self, name):
        return self.host_only(self.dense_is_host, lambda: read_error(
            f"{name} of Tensor.get_tensor() (the raw tensor of a device tensor)", RAW_TENSOR_READ))

    def dense_set(self, original):
        guard = self

        def set_(self, value, *args, **kwargs):
            if not guard.dense_is_host(self):
                raise copy_error(f"Tensor.get_tensor().set() of {what_value(value)}")
            return guard.allowed(original, self, value, *args, **kwargs)

        return set_

    def dense_copy(self, original):
        guard = self

        def copy(self, place, *args, **kwargs):
            source_host, target_host = guard.dense_is_host(self), host_place(place)
            if source_host != target_host:
                if target_host:
                    raise read_error("Tensor.get_tensor()._copy() to the host", RAW_TENSOR_READ)
                raise copy_error("Tensor.get_tensor()._copy() of a host tensor to the device")
            return guard.allowed(original, self, place, *args, **kwargs)

        return copy


def patch_raw_tensors(guard):
    """Installs the raw-tensor and wait entry points of ``guard`` (a _Guard)."""
    guard.patch(paddle.Tensor, "get_tensor", guard.get_tensor)
    for cls in _raw_tensor_classes():
        for name, what in _RAW_READS:
            guard.patch(cls, name, guard.dense_read(what))
        guard.patch(cls, "set", guard.dense_set)
        guard.patch(cls, "_copy", guard.dense_copy)
    for owner, prefix in _sync_modules():
        guard.patch(owner, "synchronize", guard.sync(f"{prefix}.synchronize()"))
        for cls_name in ("Stream", "Event"):
            cls = getattr(owner, cls_name, None)
            if isinstance(cls, type):
                for name in ("synchronize", "query", "elapsed_time"):
                    guard.patch(cls, name, guard.sync_object(f"{prefix}.{cls_name}.{name}()"))
