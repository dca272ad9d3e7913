"""Layer attributes a capture writes: a per-call side effect a replay would not repeat, refused.

NOTE [ Attributes a capture writes ]
A replay runs no Python on a GPU, so a graphed function that writes a Layer attribute on every
call (``self.calls += 1``, ``self.last = out``, ``self.seen = step``) writes it once, at capture;
eager writes it on every call. Seen after the capture, that write is invisible: AttrWatch (NOTE
[ Layer attributes a replay freezes ] in guards/layer_attrs.py) compares a Layer with its state
at the end of the capture, which the replays never change. So the capture session records the
writes themselves: while ``AttrWrites`` is entered (around the graph's capture of a block's
forward or backward and of a whole step), the ``Layer.__setattr__`` / ``__delattr__`` stamp
patch of layer_attrs hands it each write before it happens, and the first write of each
``(Layer, attribute)`` keeps the value held before (the instance's, a parameter, buffer or
sublayer slot's, or the class attribute's) and the user's line. After the capture a value that
differs from the one held before is refused (``ATTR_WRITTEN``) on every backend; the simulated
backend, whose replays re-run the Python, refuses it too, since a GPU would freeze it. A value
made once cannot be told from a per-call write by one capture (a lazy attribute first made by the
capture call, with ``warmup_steps=0`` or after a cache was reset between calls; Paddle's
``BatchNorm1D`` sets its ``_data_format`` on its first call): so the first such refusal of a key
only warms it up again (the call runs eagerly, as a warmup call; core/lifecycle.py), and the key
is refused for good when its next capture changes the same attribute again (a successful capture
forgets it).

Compared by value: None, bools, numbers, strings, bytes, numpy scalars and dtypes, Paddle dtypes,
enums, and tuples, lists and dicts of them (same types); anything else (a tensor, a Layer, an
object) by identity: ``self.last = out`` assigns a new tensor on every call. So an idempotent
cache (``self._shape = tuple(x.shape)`` on every call) and a lazy attribute made in a warmup call
(written once, then equal or not written) are captured. Writes of
Paddle's own bookkeeping (``_INTERNAL``) and of a Layer made during the capture (its
``__init__`` writes; ``nn.ReLU()(x)`` in a forward) are not compared. A capture that fails or is
refused puts every recorded attribute back as it was before (the call then runs eagerly and
writes it once, as eager does), except where the function raised its own exception (eager would
have left its writes). Writes between calls, outside the function, stay AttrWatch's: the key is
captured again, and runs eagerly after ATTR_RECAPTURES captures in a row (NOTE [ Attributes that
change on every call ] in core/entry.py).
"""

import enum
import threading

import numpy as np
import paddle

from . import layer_attrs
from .location import user_call_site
from .refusals import ATTR_WRITTEN

__all__ = ["AttrWrites", "same_value", "written"]

_MISSING = object()
_SLOTS = ("_parameters", "_buffers", "_sub_layers")
_OWN_ERROR = "_autocudagraph_function_error"  # backends.base.own_error's mark: the function's own exception
_BY_VALUE = (type(None), bool, int, float, complex, str, bytes, np.generic, np.dtype, enum.Enum,
             type(paddle.float32), range, slice)


def same_value(old, new):
    """Is ``new`` the value ``old`` was, for a replay (NOTE [ Attributes a capture writes ])?"""
    if old is new:
        return True
    if type(old) is not type(new):
        return False
    if isinstance(old, (tuple, list)):
        return len(old) == len(new) and all(same_value(a, b) for a, b in zip(old, new))
    if isinstance(old, dict):
        return list(old) == list(new) and all(same_value(old[k], new[k]) for k in old)
    if isinstance(old, float) and old != old:
        return new != new  # NaN
    if isinstance(old, _BY_VALUE):
        try:
            return bool(old == new)
        except Exception:
            return False
    return False


def written(err, where, name):
    """``err`` marked with the attribute its capture changed: the key warms up again once for it
    (NOTE [ Attributes a capture writes ])."""
    err.attribute = (where, name)
    return err


def _held(layer, name):
    """``(where, value)``: the value ``layer.name`` reads now, and where it lives."""
    held = layer.__dict__
    if name in held:
        return "__dict__", held[name]
    for slot in _SLOTS:
        values = held.get(slot)
        if values is not None and name in values:
            return slot, values[name]
    value = getattr(type(layer), name, _MISSING)
    if hasattr(value, "__set__"):  # a property: its setter's own writes are recorded
        try:
            return "descriptor", getattr(layer, name)
        except Exception:
            return "descriptor", _MISSING
    return ("class", value) if value is not _MISSING else (None, _MISSING)


def _put_back(layer, name, where, value):
    held = layer.__dict__
    if where == "descriptor":
        return
    held.pop(name, None)
    for slot in _SLOTS:
        values = held.get(slot)
        if values is not None and name in values:
            del values[name]
    if where == "__dict__":
        held[name] = value
    elif where in _SLOTS:
        held[where][name] = value


def _show(value):
    if value is _MISSING:
        return "(not set)"
    if isinstance(value, paddle.Tensor):  # never its values: a recording capture's outputs hold none yet
        return f"a {str(value.dtype).replace('paddle.', '')} tensor of shape {list(value.shape)} (id {id(value):#x})"
    if isinstance(value, paddle.nn.Layer):
        return f"a {type(value).__name__} (id {id(value):#x})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class AttrWrites:
    """The Layer attribute writes of one capture (NOTE [ Attributes a capture writes ]); entered
    around the graph's capture, ``check()`` after it, ``undo()`` when it failed."""

    def __init__(self):
        self._first = {}  # (id(layer), name) -> (layer, name, where, value before, user's line)
        self._made = {}  # id -> Layer made during the capture (kept alive so that ids stay unique)
        self._outer = None
        self._thread = None

    def __enter__(self):
        self._thread = threading.get_ident()  # writes of other threads are not the capture's
        self._outer = layer_attrs.record_writes(self)
        return self

    def __exit__(self, *exc):
        layer_attrs.record_writes(self._outer)
        return False

    def note(self, layer, name):
        """Called by the stamp patch before ``layer.name`` is assigned or deleted."""
        if self._outer is not None:
            self._outer.note(layer, name)
        key = (id(layer), name)
        if threading.get_ident() != self._thread or key in self._first or id(layer) in self._made or (
                name in layer_attrs.INTERNAL):
            return
        if "_parameters" not in layer.__dict__:  # Layer.__init__ runs now: a Layer made by this call
            self._made[id(layer)] = layer
            return
        where, value = _held(layer, name)
        self._first[key] = (layer, name, where, value, user_call_site())

    def changed(self):
        """The first recorded write whose value differs from the one held before, or None."""
        for layer, name, where, old, line in self._first.values():
            new = _held(layer, name)[1]
            if not same_value(old, new):
                return layer, name, old, new, line
        return None

    def undo(self):
        """Puts every recorded attribute back as it was before the capture (last write first)."""
        for layer, name, where, old, _ in reversed(list(self._first.values())):
            _put_back(layer, name, where, old)

    def check(self, what="the graphed function", layers=()):
        """Raises ATTR_WRITTEN's CaptureError for the first attribute the capture changed, after
        putting every recorded attribute back; ``layers``: ``[(qualified name, Layer)]`` to name it by."""
        found = self.changed()
        if found is None:
            return
        layer, name, old, new, line = found
        self.undo()
        where = next((n for n, l in layers if l is layer), type(layer).__name__)
        raise written(ATTR_WRITTEN.error(
            f"autocudagraph: {what} changes attribute '{name}' of {where} ({_show(old)} -> {_show(new)}, at {line}). "
            f"A graph replays its kernels without running Python, so every replay would leave '{name}' at "
            f"{_show(new)} while eager changes it on every call. Keep such state outside the graphed function "
            "(count after the call returns), or keep the value in a tensor buffer updated in place "
            f"(register_buffer, then paddle.assign(new, output=self.<buffer>)), which a graph replays."), where, name)

    def failed(self, err):
        """After the capture raised ``err``: undo the writes unless the function raised it itself."""
        if not getattr(err, _OWN_ERROR, False):
            self.undo()
