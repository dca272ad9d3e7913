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

Seen: an assignment through the Layer (``self.extra = True``, ``layer.drop.p = 0.2``,
``setattr``, ``del``, a sublayer, parameter or buffer replaced) of any Layer the key uses.
Not seen: a value the forward reads from elsewhere (a module global read by a plain function, a
closure, a config object or a dict held by the Layer and changed in place, ``object.__setattr__``
or a write to ``__dict__``); a graph replays the capture's value of those.
"""

import numpy as np
import paddle

from ..errors import CaptureError
from .paddle_patches import Patches, install_for_process

__all__ = ["install", "AttrWatch", "LayerRecorder", "SlotWatch", "layers_with_sublayers"]

_STAMP = "_autocudagraph_attr_stamp"
_CLOCK = [0]
# Paddle's own bookkeeping: hook tables, helpers, recorders (mutated in place, never compared).
_INTERNAL = frozenset(("_helper", "_op_recorder", "_loaddict_holder", "_original_funcs", "_customized_attrs",
                       "_forward_pre_hooks", "_forward_post_hooks", "_forward_pre_hooks_with_kwargs_flag",
                       "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called",
                       "_state_dict_hooks", "_non_persistable_buffer_names_set", _STAMP))
_SLOTS = ("_parameters", "_buffers", "_sub_layers")


def install():
    """Wraps ``nn.Layer.__setattr__`` / ``__delattr__`` for the process (NOTE [ Layer attributes a
    replay freezes ]); once."""
    layer = paddle.nn.Layer
    if getattr(layer.__setattr__, "_stamps", False):
        return
    setattr_, delattr_ = layer.__setattr__, layer.__delattr__

    def __setattr__(self, name, value):
        setattr_(self, name, value)
        _CLOCK[0] += 1
        self.__dict__[_STAMP] = _CLOCK[0]

    def __delattr__(self, name):
        delattr_(self, name)
        _CLOCK[0] += 1
        self.__dict__[_STAMP] = _CLOCK[0]

    __setattr__._stamps = True
    install_for_process(layer, "__setattr__", __setattr__)  # NOTE [ Paddle patches ]
    install_for_process(layer, "__delattr__", __delattr__)


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
        if name in _SLOTS:
            for key, held in value.items():
                values[f"{name[1:]}['{key}']"] = held
        elif name not in _INTERNAL:
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
        self._values = [_attributes(l) for l in self._layers]
        self._stamps = self._read_stamps()
        self._clock = _CLOCK[0]

    def _read_stamps(self):
        return [l.__dict__.get(_STAMP, 0) for l in self._layers]

    def changed(self):
        """None when no attribute of the key's Layers differs from the capture's, else
        ``(where, attribute, old, new)`` of the first that does."""
        if _CLOCK[0] == self._clock:
            return None
        stamps = self._read_stamps()
        if stamps != self._stamps:
            for i, (old, new) in enumerate(zip(self._stamps, stamps)):
                if old != new:
                    found = self._differs(i)
                    if found is not None:
                        return found
            self._stamps = stamps
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
            raise CaptureError(
                f"autocudagraph: the function rebinds {what} '{name}' of {type(layer).__name__} to a new "
                "tensor (e.g. self.x = self.x + 1). A graph keeps using the tensor it captured, so the "
                f"Layer would never see the update. Update it in place instead (paddle.assign(new, "
                f"output=self.{name}) or self.{name}.set_value(new))."
            )
