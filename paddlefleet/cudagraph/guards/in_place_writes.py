"""Copies of the tensors in-place ops are handed, written back later: a capture that executes the
function takes back what it wrote (NOTE [ What a failed simulated capture may have written ] in
step/reachable.py); and the tensors written without an inplace version bump.

NOTE [ Writes without a version bump ]
A capture sees that the function wrote an argument in place by its inplace version. Two writes do
not bump it: ``Tensor.copy_`` and ``Tensor.set_value``. Captured, they write the graph's own copy of
the argument and never the caller's tensor. ``VersionlessWrites`` notes their targets while the
capture runs the function (on every backend: a GPU capture runs it once too), and ``wrote(t)`` says
whether one of them is ``t`` or shares its memory (a view of it), so the capture refuses them as it
refuses any other in-place write of an argument.
"""

import paddle

from .paddle_patches import Patches

__all__ = ["InPlaceWrites", "VersionlessWrites"]

_VERSIONLESS = ("copy_", "set_value")


class InPlaceWrites:
    """While active, copies each tensor an in-place op is handed before the op runs (NOTE [ What
    a failed simulated capture may have written ] in step/reachable.py); ``restore()`` writes the copies back.

    Entered outside the op trace (step/host_reads.OpTrace), whose wrappers then call these: the
    copies are made inside a traced op and are not recorded as ops of the step."""

    def __init__(self):
        self._saved = {}
        self._patches = Patches()

    def _save(self, value):
        if isinstance(value, paddle.Tensor):
            if id(value) not in self._saved and value._is_initialized():
                with paddle.no_grad():
                    self._saved[id(value)] = (value, value.clone())
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, paddle.Tensor):
                    self._save(v)

    def _wrap(self, original):
        def writing(*args, **kwargs):
            for value in args:
                self._save(value)
            for value in kwargs.values():
                self._save(value)
            return original(*args, **kwargs)

        return writing

    def __enter__(self):
        targets = [paddle._C_ops] + ([paddle._legacy_C_ops] if hasattr(paddle, "_legacy_C_ops") else [])
        try:
            for module in targets:
                for name in [n for n in dir(module) if n.endswith("_") and not n.startswith("_")]:
                    original = getattr(module, name)
                    if callable(original):
                        self._patches.set(module, name, self._wrap(original))
            tensor = paddle.Tensor
            names = [n for n in dir(tensor) if n.endswith("_") and not n.startswith("_")] + ["set_value", "__setitem__"]
            for name in names:
                original = getattr(tensor, name, None)
                if callable(original):
                    self._patches.set(tensor, name, self._wrap(original))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self._patches.restore()  # an inherited method is deleted again, not pinned
        return False

    def restore(self):
        with paddle.no_grad():
            for t, saved in self._saved.values():
                if t._is_initialized():
                    t.copy_(saved, False)
        self._saved = {}


class VersionlessWrites:
    """While active, notes the tensors ``copy_`` and ``set_value`` write (NOTE [ Writes without a
    version bump ])."""

    def __init__(self):
        self.targets = []
        self._patches = Patches()

    def _wrap(self, original):
        def writing(tensor, *args, **kwargs):
            if isinstance(tensor, paddle.Tensor):
                self.targets.append(tensor)
            return original(tensor, *args, **kwargs)

        return writing

    def __enter__(self):
        for name in _VERSIONLESS:
            original = getattr(paddle.Tensor, name, None)
            if callable(original):
                self._patches.set(paddle.Tensor, name, self._wrap(original))
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False

    def wrote(self, tensor):
        """Whether a noted write went into ``tensor`` or a tensor sharing its memory."""
        return any(t is tensor or t._is_shared_buffer_with(tensor) for t in self.targets)
