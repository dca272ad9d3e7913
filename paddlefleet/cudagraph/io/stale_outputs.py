"""Outputs a later replay overwrote (``check_stale_outputs``).

NOTE [ Stale outputs ]
With ``clone_outputs=False`` a call returns aliases of the graph's static output buffers, and
the next replay of the same key rewrites them. With ``check_stale_outputs=True`` every alias
handed out is remembered (weakly); the next replay of its key marks the aliases still alive as
stale and releases their storage handle (the static buffer itself is untouched). Afterwards:

* passing a stale tensor to any graphed call raises StaleOutputError naming the replay that
  overwrote it (checked before anything else reads the tensor);
* any Paddle op or backward that reads it fails instead of reading the new values, with the same
  StaleOutputError: this also covers autograd, e.g. ``loss = (y * w).sum()`` whose backward would
  otherwise use the overwritten ``y``. Paddle itself only says "Tensor holds no memory" there, so
  from the first stale output on, every ``paddle._C_ops`` / ``_legacy_C_ops`` op, the Tensor
  operators Paddle implements in C++ and the backward entry points are wrapped for the rest of the
  process (``_translate_for_process``): a wrapper adds one Python call per op, and turns Paddle's
  error into StaleOutputError (the stale output among the op's arguments, or for a backward the
  stale outputs alive). ``y.numpy()``, ``y.item()``, ``print(y)`` and the other host reads of a
  stale output, which Paddle answers with an empty or uninitialised array, raise it too;
* not detected: ``y.shape`` still reads; views taken from ``y`` before the overwrite (``y[0]``,
  ``y.reshape(...)``, ``y.T``) share the static buffer's storage through their own handle and
  silently read the new values, in autograd too. Clone an output before taking views you keep
  across calls.
"""

import functools
import weakref

from ..errors import StaleOutputError
from ..guards.paddle_patches import install_for_process

__all__ = ["StaleOutputs", "any_stale", "check_fresh", "stale_registry"]

# id -> (weakref, message) of outputs a later replay overwrote (NOTE [ Stale outputs ]).
_stale = {}


def _forget(key):
    _stale.pop(key, None)


def any_stale():
    """True while some output a later replay overwrote is alive (check_fresh may raise)."""
    return bool(_stale)


def stale_registry():
    """The dict any_stale() reads (a compiled check reads it too: NOTE [ The front door ] in core/front.py)."""
    return _stale


def check_fresh(tensors):
    """Raises StaleOutputError when one of ``tensors`` is an output a later replay overwrote."""
    if not _stale:
        return
    for t in tensors:
        rec = _stale.get(id(t))
        if rec is not None and rec[0]() is t:
            raise StaleOutputError(rec[1])


class StaleOutputs:
    """The aliases one key handed out at its latest replay, to mark stale at the next one."""

    def __init__(self):
        self._handed = []
        self._replay = 0

    def overwrite(self, name, label, call_site):
        """Called right before a replay rewrites the static outputs: marks the previous
        replay's aliases that are still alive as stale and releases their storage handle."""
        self._replay += 1
        handed, self._handed = self._handed, []
        for index, ref in handed:
            t = ref()
            if t is None or not t._is_initialized():
                continue
            message = (
                f"autocudagraph: this tensor is output {index} of {name} from run #{self._replay - 1} of the "
                f"graph of key {label}, and run #{self._replay} of that graph, called at {call_site}, "
                "overwrote it: with clone_outputs=False outputs are the graph's static buffers. Clone an "
                f"output you keep across calls (y = {name}(...).clone()), or use clone_outputs=True."
            )
            key = id(t)
            _stale[key] = (weakref.ref(t, lambda _, key=key: _forget(key)), message)
            t._clear_data()
            _translate_for_process()

    def hand_out(self, outputs, copies=()):
        """Remembers (weakly) the aliases given to the caller by this replay; ``copies``: indices
        of outputs handed out as copies (host outputs), which no replay overwrites."""
        self._handed = [(i, weakref.ref(o)) for i, o in enumerate(outputs) if i not in copies]


# ---------------------------------------------------------------------------- Paddle's errors, translated
#: Paddle's words for a tensor without storage.
_NO_MEMORY = ("holds no memory", "not initialized")
#: Tensor operators, some implemented in C++, some (``__getitem__``) reaching C++ without a _C_ops call.
_OPERATORS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__div__", "__rdiv__", "__floordiv__", "__mod__", "__pow__", "__rpow__", "__matmul__", "__lt__",
              "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__", "__or__", "__xor__", "__getitem__",
              "__neg__")
#: Host reads Paddle answers without an error for a tensor without storage.
_READS = ("numpy", "item", "tolist", "__array__", "__float__", "__int__", "__bool__", "__index__", "__str__",
          "__repr__", "__format__")
# Whether _translate_for_process ran (NOTE [ Stale outputs ]).
_translating = {"installed": False}


def _stale_message(values):
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            rec = _stale.get(id(t))
            if rec is not None and rec[0]() is t:
                return rec[1]
    return None


def _why(args, kwargs):
    found = _stale_message(list(args) + list(kwargs.values()))
    if found is not None:
        return found
    alive = [rec[1] for rec in list(_stale.values()) if rec[0]() is not None]
    return (f"autocudagraph: Paddle found a tensor without storage ('Tensor holds no memory') while {len(alive)} "
            "output(s) of graphed calls that a later replay overwrote are alive: this op or backward read one of "
            "them (autograd saved it before the overwrite). The latest: " + (alive[-1] if alive else "-"))


def _translated(original):
    """``original`` whose "Tensor holds no memory" error, while stale outputs are alive, is a StaleOutputError."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except RuntimeError as err:
            if _stale and not isinstance(err, StaleOutputError) and any(w in str(err) for w in _NO_MEMORY):
                raise StaleOutputError(_why(args, kwargs)) from err
            raise

    call.__native__ = getattr(original, "__native__", original)  # op traces treat it as the native op
    return call


def _checked_read(original):
    """A host read of a stale output raises instead of returning an empty or uninitialised array."""

    @functools.wraps(original)
    def read(self, *args, **kwargs):
        if _stale:
            found = _stale_message((self,))
            if found is not None:
                raise StaleOutputError(found)
        return original(self, *args, **kwargs)

    read.__native__ = getattr(original, "__native__", original)
    return read


def _translate_for_process():
    """Wraps Paddle's ops, C++ Tensor operators, host reads and backward entry points, once per process, at the
    first stale output (NOTE [ Stale outputs ])."""
    if _translating["installed"]:
        return
    _translating["installed"] = True
    import paddle
    from paddle.base import core

    for module in (paddle._C_ops, getattr(paddle, "_legacy_C_ops", None)):
        for name in dir(module) if module is not None else ():
            op = getattr(module, name)
            if not name.startswith("_") and callable(op) and not isinstance(op, type):
                install_for_process(module, name, _translated(op))
    tensor = paddle.Tensor
    for name in _OPERATORS:
        if name in tensor.__dict__:
            install_for_process(tensor, name, _translated(tensor.__dict__[name]))
    for name in _READS:
        if name in tensor.__dict__:
            install_for_process(tensor, name, _checked_read(tensor.__dict__[name]))
    for name in ("run_backward", "run_partial_grad"):
        if hasattr(core.eager, name):
            install_for_process(core.eager, name, _translated(getattr(core.eager, name)))
