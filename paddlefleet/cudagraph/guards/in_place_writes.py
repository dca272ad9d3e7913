"""Copies of the tensors in-place ops are handed, written back later: a capture that executes the
function takes back what it wrote (NOTE [ What a failed simulated capture may have written ] in
step/reachable.py)."""

import paddle

from .paddle_patches import Patches
from .traced_ops import paused

__all__ = ["InPlaceWrites"]


class InPlaceWrites:
    """While active, copies each tensor an in-place op is handed before the op runs (NOTE [ What
    a failed simulated capture may have written ] in step/reachable.py); ``restore()`` writes the copies back.

    Its copies are made under ``traced_ops.paused()``: they are no ops of the function's trace."""

    def __init__(self):
        self._saved = {}
        self._patches = Patches()

    def _save(self, value):
        if isinstance(value, paddle.Tensor):
            if id(value) not in self._saved and value._is_initialized():
                with paddle.no_grad(), paused():  # a copy of ours, no op of the function's trace
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
