"""Copies of the tensors in-place ops are handed, written back later: a capture that executes the
function takes back what it wrote (NOTE [ What a failed simulated capture may have written ] in
step/reachable.py); and the tensors written without an inplace version bump.

NOTE [ Kernels that write their inputs ]
In-place ops are named with a trailing ``_``, but some kernels also write inputs under another name:
``batch_norm`` updates its running mean and variance (its ``mean_out``/``variance_out`` are the
inputs' memory), and so may others (a fused optimizer kernel, a later Paddle's op). They are found
by enumeration, not by a list: the first time a ``_C_ops`` op without a trailing ``_`` runs inside
InPlaceWrites in this process, its tensor arguments are copied first and its outputs compared with
them: an output that shares an argument's memory with the argument's shape and dtype marks the op as
one that writes its inputs (``_WRITES_INPUTS``), and from then on its tensor arguments are copied
before it runs, as an in-place op's are. An op whose outputs share no argument's memory is marked as
not writing. (A view op returning its argument unchanged in shape may be marked as writing: its copy
is written back unchanged, which costs a copy during a capture run and nothing else.)

NOTE [ Writes without a version bump ]
A capture sees that the function wrote an argument in place by its inplace version. Two writes do
not bump it: ``Tensor.copy_`` and ``Tensor.set_value``. Captured, they write the graph's own copy of
the argument and never the caller's tensor. ``VersionlessWrites`` notes their targets while the
capture runs the function (on every backend: a GPU capture runs it once too), and ``wrote(t)`` says
whether one of them is ``t`` or shares its memory (a view of it), so a block's or a step's capture
refuses them as it refuses any other in-place write of an argument it copies.
"""

import paddle

from .paddle_patches import Patches
from .traced_ops import paused

__all__ = ["InPlaceWrites", "VersionlessWrites"]

_VERSIONLESS = ("copy_", "set_value")
_WRITES_INPUTS = {}  # _C_ops op name without a trailing "_" -> whether it writes an argument (NOTE above)


def _tensors(values):
    found = []
    for v in values:
        if isinstance(v, paddle.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, paddle.Tensor))
    return found


def _aliases(out, arg):
    return (out._is_initialized() and arg._is_initialized() and out.shape == arg.shape and out.dtype == arg.dtype
            and out._is_shared_buffer_with(arg))


class InPlaceWrites:
    """While active, copies each tensor an in-place op is handed before the op runs (NOTE [ What
    a failed simulated capture may have written ] in step/reachable.py); ``restore()`` writes the copies back.

    Its copies are made under ``traced_ops.paused()``: they are no ops of the function's trace."""

    def __init__(self):
        self._saved = {}
        self._patches = Patches()
        self._probing = False

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

    def _wrap_unnamed(self, name, original):
        """An op without a trailing ``_``: probed once, then copied-before like an in-place op
        when it writes its arguments (NOTE [ Kernels that write their inputs ])."""
        def maybe_writing(*args, **kwargs):
            verdict = _WRITES_INPUTS.get(name)
            if verdict is False or self._probing:  # an op inside a probe's own copies is none of the function's
                return original(*args, **kwargs)
            if verdict:
                for value in list(args) + list(kwargs.values()):
                    self._save(value)
                return original(*args, **kwargs)
            inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t._is_initialized()]
            known = set(self._saved)
            self._probing = True
            try:
                for t in inputs:  # copied as an in-place op's arguments are: kept only where written
                    self._save(t)
            finally:
                self._probing = False
            out = original(*args, **kwargs)
            outs = _tensors(out if isinstance(out, (list, tuple)) else [out])
            written = {id(t) for t in inputs if any(_aliases(o, t) for o in outs)}
            _WRITES_INPUTS[name] = bool(written)
            for t in inputs:
                if id(t) not in written and id(t) not in known:
                    self._saved.pop(id(t), None)
            return out

        return maybe_writing

    def __enter__(self):
        targets = [paddle._C_ops] + ([paddle._legacy_C_ops] if hasattr(paddle, "_legacy_C_ops") else [])
        try:
            for module in targets:
                for name in [n for n in dir(module) if not n.startswith("_")]:
                    original = getattr(module, name)
                    if not callable(original) or _WRITES_INPUTS.get(name) is False:
                        continue
                    wrapped = self._wrap(original) if name.endswith("_") else self._wrap_unnamed(name, original)
                    self._patches.set(module, name, wrapped)
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
        if not tensor._is_initialized():
            return any(t is tensor for t in self.targets)
        return any(t is tensor or (t._is_initialized() and t._is_shared_buffer_with(tensor)) for t in self.targets)
