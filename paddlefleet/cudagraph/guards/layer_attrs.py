"""Plain attributes of Layers that a replay would freeze: seen through a version that every
``Layer.__setattr__`` bumps.

NOTE [ Layer attributes a replay freezes ]
A CUDA graph replays the kernels its capture launched, with the Python values they were launched
with: a flag read in ``forward`` (``if self.extra:``), a dropout rate (``layer.drop.p = r``), a
curriculum switch, a sublayer swapped for another. Users change such values between steps. So
``install()`` wraps ``nn.Layer.__setattr__`` and ``__delattr__`` for the process: each
assignment to any attribute of any Layer moves a process clock and stamps the Layer with it
(in its ``__dict__``; a few hundred nanoseconds per assignment). ``AttrWatch`` remembers, at the
end of a capture, the stamps of the Layers a key uses (the Layers the call is bound to or given,
those it called, and all their sublayers) and a shallow copy of their attributes. Before a
replay it compares one int (the clock) and, only when the clock moved, the stamps; where a stamp
moved it compares the attributes by value (tensors and Layers by identity), so setting a value
back (``train()`` after ``eval()``, a rate set to what it was) replays. A change returns the
first differing attribute with both values, and the key is captured again.

The Layer tree's structure is watched alike: ``_parameters``, ``_buffers`` and ``_sub_layers``
are changed in place without ``__setattr__`` (``layer._sub_layers[name] = other``, a ``LayerDict``
entry replaced, ``LayerList.append``, ``add_sublayer``, ``register_buffer``), so an AttrWatch gives each
watched Layer's three dicts a ``StampedDict`` (an OrderedDict whose every mutation stamps its Layer,
copied and pickled as a plain OrderedDict); forward pre/post hooks are stamped by
``register_forward_pre_hook`` / ``register_forward_post_hook``, and a hook handle's ``remove()`` moves
a hooks epoch that makes the next check compare every watched Layer. A replay pays nothing for it
(the clock compare above). The default dtype is watched the same way: Paddle's one setter
(``LayerHelperBase.set_default_dtype``, behind ``paddle.set_default_dtype``) moves the clock, and a
check compares ``paddle.get_default_dtype()`` with the capture's (``to_tensor(0.1)`` and
``create_parameter`` read it: a graph keeps the capture's fill dtype).

Seen: an assignment through the Layer (``self.extra = True``, ``layer.drop.p = 0.2``,
``setattr``, ``del``, a sublayer, parameter or buffer replaced) of any Layer the key uses; a
sublayer, parameter or buffer added, removed, replaced or reordered in its dict however it is done
(``_sub_layers[...]``, ``LayerDict``, ``LayerList``); a forward pre/post hook registered or removed.
Not seen: a value the forward reads from elsewhere (a module global read by a plain function, a
closure, a config object or a dict held by the Layer and changed in place, ``object.__setattr__``
or a write to ``__dict__``, a hook written into the hook dicts directly); a graph replays the
capture's value of those.
"""

import collections
import weakref

import numpy as np
import paddle

from .paddle_patches import Patches, install_for_process
from .refusals import ATTR_WRITTEN
from .traced_ops import paused

__all__ = ["install", "record_writes", "INTERNAL", "AttrWatch", "LayerRecorder", "SlotWatch", "StampedDict",
           "layers_with_sublayers"]

_STAMP = "_autocudagraph_attr_stamp"
_CLOCK = [0]
_HOOK_EPOCH = [0]  # moved by every hook handle's remove(), which does not know its Layer
# Paddle's own bookkeeping: hook tables, helpers, recorders (mutated in place, never compared).
INTERNAL = frozenset(("_helper", "_built", "_op_recorder", "_loaddict_holder", "_original_funcs",
                       "_customized_attrs", "_forward_pre_hooks_with_kwargs_flag",
                       "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called",
                       "_state_dict_hooks", "_non_persistable_buffer_names_set", _STAMP))
_SLOTS = ("_parameters", "_buffers", "_sub_layers")
_WRITES = [None]  # the capture's AttrWrites (NOTE [ Attributes a capture writes ] in guards/attr_writes.py)
_HOOKS = ("_forward_pre_hooks", "_forward_post_hooks")


def _stamp(layer):
    _CLOCK[0] += 1
    layer.__dict__[_STAMP] = _CLOCK[0]


def _mutator(name):
    base = getattr(collections.OrderedDict, name)

    def method(self, *args, **kwargs):
        try:
            return base(self, *args, **kwargs)
        finally:
            self._touch()

    method.__name__ = name
    return method


class StampedDict(collections.OrderedDict):
    """A watched Layer's ``_parameters``, ``_buffers`` or ``_sub_layers``: every mutation stamps the
    Layer (NOTE [ Layer attributes a replay freezes ]); a copy or a pickle is a plain OrderedDict."""

    def __init__(self, items, owner):
        self._owner = weakref.ref(owner)
        collections.OrderedDict.update(self, items)

    def _touch(self):
        owner = self._owner()
        if owner is not None:
            _stamp(owner)
        else:
            _CLOCK[0] += 1

    def __reduce__(self):
        return collections.OrderedDict, (list(self.items()),)

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    def __copy__(self):
        return collections.OrderedDict(self)

    __setitem__ = _mutator("__setitem__")
    __delitem__ = _mutator("__delitem__")
    __ior__ = _mutator("__ior__")
    pop = _mutator("pop")
    popitem = _mutator("popitem")
    clear = _mutator("clear")
    update = _mutator("update")
    setdefault = _mutator("setdefault")
    move_to_end = _mutator("move_to_end")


def _watch_structure(layer):
    """Gives ``layer`` StampedDicts for its parameters, buffers and sublayers (same entries, in order)."""
    held = layer.__dict__
    for name in _SLOTS:
        value = held.get(name)
        if isinstance(value, collections.OrderedDict) and not isinstance(value, StampedDict):
            held[name] = StampedDict(value.items(), layer)


def install():
    """Wraps ``nn.Layer.__setattr__`` / ``__delattr__`` for the process (NOTE [ Layer attributes a
    replay freezes ]); once."""
    layer = paddle.nn.Layer
    if getattr(layer.__setattr__, "_stamps", False):
        return
    setattr_, delattr_ = layer.__setattr__, layer.__delattr__

    def __setattr__(self, name, value):
        if _WRITES[0] is not None:
            _WRITES[0].note(self, name)
        setattr_(self, name, value)
        _CLOCK[0] += 1
        self.__dict__[_STAMP] = _CLOCK[0]

    def __delattr__(self, name):
        if _WRITES[0] is not None:
            _WRITES[0].note(self, name)
        delattr_(self, name)
        _CLOCK[0] += 1
        self.__dict__[_STAMP] = _CLOCK[0]

    __setattr__._stamps = True
    install_for_process(layer, "__setattr__", __setattr__)  # NOTE [ Paddle patches ]
    install_for_process(layer, "__delattr__", __delattr__)
    for name in ("register_forward_pre_hook", "register_forward_post_hook"):
        install_for_process(layer, name, _stamping(getattr(layer, name)))
    _watch_default_dtype()
    helper = _hook_remove_helper()
    if helper is not None:
        remove = helper.remove

        def remove_hook(self):
            remove(self)
            _CLOCK[0] += 1
            _HOOK_EPOCH[0] += 1

        install_for_process(helper, "remove", remove_hook)


def record_writes(writes):
    """Has the stamp patch hand every Layer attribute write to ``writes.note(layer, name)`` before it
    happens (None: to no one); returns the one it handed them to before."""
    before, _WRITES[0] = _WRITES[0], writes
    return before


def _watch_default_dtype():
    from paddle.base.layer_helper_base import LayerHelperBase

    setter = LayerHelperBase.set_default_dtype  # bound to the class that holds the value

    def set_default_dtype(cls, dtype):
        setter(dtype)
        _CLOCK[0] += 1

    install_for_process(LayerHelperBase, "set_default_dtype", classmethod(set_default_dtype))


def _stamping(register):
    def method(self, *args, **kwargs):
        handle = register(self, *args, **kwargs)
        _stamp(self)
        return handle

    method.__name__ = register.__name__
    return method


def _hook_remove_helper():
    """Paddle's HookRemoveHelper (where a Layer's hook handles come from), or None."""
    from paddle.nn.layer import layers

    return getattr(layers, "HookRemoveHelper", None)


def layers_with_sublayers(layers):
    """``[(qualified name, layer)]``: each Layer and all its sublayers, each once."""
    seen, found = set(), []
    for top in layers:
        for name, sub in top.named_sublayers(include_self=True):
            if id(sub) not in seen:
                seen.add(id(sub))
                found.append((f"{type(top).__name__}.{name}" if name else type(top).__name__, sub))
    return found


def _attributes(layer):
    values = {}
    for name, value in vars(layer).items():
        if name in _SLOTS or name in _HOOKS:
            for key, held in value.items():
                values[f"{name[1:]}['{key}']"] = held
            values[f"{name[1:]} (order)"] = tuple(value)
        elif name not in INTERNAL:
            values[name] = value
    return values


def _same(old, new):
    if old is new:
        return True
    if isinstance(old, (paddle.Tensor, paddle.nn.Layer)) or isinstance(new, (paddle.Tensor, paddle.nn.Layer)):
        return False
    if isinstance(old, np.ndarray) or isinstance(new, np.ndarray):
        return isinstance(old, np.ndarray) and isinstance(new, np.ndarray) and old.dtype == new.dtype and \
            np.array_equal(old, new)
    try:
        equal = old == new
    except Exception:
        return False
    return equal is True or (type(equal) is bool and equal) or (isinstance(equal, np.bool_) and bool(equal))


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class AttrWatch:
    """The attributes of a key's Layers at the end of its capture (NOTE [ Layer attributes a
    replay freezes ]).

    Args:
        layers: ``[(qualified name, layer)]`` (layers_with_sublayers).
    """

    def __init__(self, layers):
        self._names = [n for n, _ in layers]
        self._layers = [l for _, l in layers]
        for layer in self._layers:
            _watch_structure(layer)
        self._values = [_attributes(l) for l in self._layers]
        self._stamps = self._read_stamps()
        self._clock = _CLOCK[0]
        self._hook_epoch = _HOOK_EPOCH[0]
        self._dtype = paddle.get_default_dtype()

    def _read_stamps(self):
        return [l.__dict__.get(_STAMP, 0) for l in self._layers]

    def changed(self):
        """None when no attribute of the key's Layers differs from the capture's, else
        ``(where, attribute, old, new)`` of the first that does (``where`` None: the default dtype)."""
        if _CLOCK[0] == self._clock:
            return None
        dtype = paddle.get_default_dtype()
        if dtype != self._dtype:
            return None, "default dtype", self._dtype, dtype
        stamps = self._read_stamps()
        every = self._hook_epoch != _HOOK_EPOCH[0]  # a hook removed: its Layer is not known
        if stamps != self._stamps or every:
            for i, (old, new) in enumerate(zip(self._stamps, stamps)):
                if old != new or every:
                    found = self._differs(i)
                    if found is not None:
                        return found
            self._stamps = stamps
            self._hook_epoch = _HOOK_EPOCH[0]
        self._clock = _CLOCK[0]
        return None

    def _differs(self, i):
        before, now = self._values[i], _attributes(self._layers[i])
        for name in list(before) + [n for n in now if n not in before]:
            missing = object()
            old, new = before.get(name, missing), now.get(name, missing)
            if old is missing or new is missing or not _same(old, new):
                show = lambda v: "(none)" if v is missing else _short(v)  # noqa: E731
                return self._names[i], name, show(old), show(new)
        return None


def attr_message(changed, what="the graphed call"):
    """The reason and warning for a changed attribute ``(where, name, old, new)``."""
    where, name, old, new = changed
    if where is None:
        reason = f"the default dtype changed since capture ({old} -> {new})"
        return reason, (f"paddle.set_default_dtype changed the default dtype since {what} was captured ({old} -> "
                        f"{new}). A CUDA graph keeps the dtype its capture's fills and parameters were made with "
                        "(paddle.to_tensor(0.1)), so the key is captured again.")
    reason = f"attribute '{name}' of {where} changed since capture"
    warning = (f"attribute '{name}' of {where} changed since {what} was captured ({old} -> {new}). "
               "A CUDA graph replays the kernels its capture launched with the old value, so the key is captured "
               "again.")
    return reason, warning


class LayerRecorder:
    """While active, records every Layer called (and snapshots its buffers before it runs)."""

    def __init__(self, snapshot, watch):
        self.layers = []
        self._seen = set()
        self._snapshot = snapshot
        self._watch = watch
        self._patches = Patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py

    def __enter__(self):
        original = paddle.nn.Layer.__call__
        recorder = self

        def recording_call(layer, *args, **kwargs):
            if id(layer) not in recorder._seen:
                recorder._seen.add(id(layer))
                recorder.layers.append(layer)
                with paused():  # the snapshot's copies are no ops of the function's trace
                    recorder._snapshot.add(layer)
                    recorder._watch.add(layer)
            return original(layer, *args, **kwargs)

        self._patches.set(paddle.nn.Layer, "__call__", recording_call)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False


class SlotWatch:
    """Which tensor each buffer and parameter slot of some Layers holds, to refuse a capture
    whose function rebinds one (``self.steps = self.steps + 1``): a graph keeps reading and
    writing the tensor it captured, so the Layer would never see the new one."""

    def __init__(self):
        self._slots = {}

    def add(self, layer):
        for kind in ("_buffers", "_parameters"):
            for name, t in getattr(layer, kind, {}).items():
                self._slots.setdefault((id(layer), kind, name), (layer, kind, name, t))

    def check(self):
        """Raises CaptureError naming the first slot that holds another tensor than before, after
        putting the original tensors back (the capture run's rebinding leaves no trace)."""
        changed = [(layer, kind, name, t) for layer, kind, name, t in self._slots.values()
                   if getattr(layer, kind).get(name) is not t]
        for layer, kind, name, t in changed:
            getattr(layer, kind)[name] = t
        if changed:
            layer, kind, name, _ = changed[0]
            what = "buffer" if kind == "_buffers" else "parameter"
            err = ATTR_WRITTEN.error(  # NOTE [ Attributes a capture writes ] in guards/attr_writes.py
                f"autocudagraph: the function changes attribute '{name}' of {type(layer).__name__}: it rebinds "
                f"{what} '{name}' of {type(layer).__name__} to a new tensor (e.g. self.x = self.x + 1, self.last = out). A graph keeps "
                "using the tensor it captured, so the Layer would never see the update. Keep such state outside "
                f"the graphed function, or update it in place (paddle.assign(new, output=self.{name}) or "
                f"self.{name}.set_value(new))."
            )
            err.attribute = (type(layer).__name__, name)
            raise err
