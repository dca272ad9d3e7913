"""Keys: which graph a call may use, or None for eager. Policy only: no device work here.

The default key is the argument structure (non-tensor values included), each tensor's shape,
dtype, place and stop_gradient (small host tensors by value), and the state that changes what a
call computes: grad mode, AMP autocast, and the ``training`` flag of every Layer involved.
``dispatch_key_fn(bound_arguments)`` replaces the argument part; the state part is always kept.

NOTE [ Cheap key parts ]
Every call hashes its key and compares it with a stored one (the entry lookup), so each part of
a key is a value that hashes and compares fast. Paddle's dtype and AMP level are pybind enums: one
hash costs ~0.4 us and one ``==`` ~0.5-1 us (measured on Paddle 2.6.2 and 3.3.1; on 2.6
``t.dtype`` is a new object on every read, so not even identity helps), several times per tensor
per call. A key holds them as ``int(enum)`` instead: the int of an enum value is unique within its
enum and every tensor of one Paddle has dtypes of one enum, so two keys are equal exactly when they
were equal with the enum objects. Places are held as ``place_key`` values for the same reason.
"""

import collections
import inspect
import operator
from typing import Any, NamedTuple

import paddle

from . import state
from .. import native
from ..guards.host_marks import any_marked, is_marked_host
from ..io.arguments import refusal
from ..io.host_tensors import check_host_arrays, check_host_inputs, host_key, host_mask
from ..errors import CudaGraphError
from ..options import call_key_fn
from ..io.nested import leaf_names
from ..io.static_inputs import place_key
from .call import positional_form, positional_spec
from .stats import describe_call

__all__ = ["Key", "StateKey", "KeyMaker", "BoundSignature", "rekeyed"]


class StateKey(NamedTuple):
    """The state part of every key: grad mode, AMP autocast state, and the ``training`` flag of
    each Layer whose flags key the calls (KeyMaker.layers, in order)."""

    grad_enabled: bool
    amp: Any
    training: tuple


class Key(NamedTuple):
    """The key of one call. ``user``: whether ``arguments`` is dispatch_key_fn's key (else the
    argument structure with each tensor's metadata); ``state`` last, as it is read alone."""

    user: bool
    arguments: Any
    state: StateKey

    def with_layers(self, training):
        """This key with the training flags of Layers found later appended to its state."""
        return self._replace(state=self.state._replace(training=self.state.training + tuple(training)))


_new = tuple.__new__
_grad_enabled = paddle.is_grad_enabled
_amp_state = state.amp_state
_dtype_seen = {}  # a dtype's int -> a dtype object read whose int it was (identity: that int)
_TRAINING = operator.attrgetter("training")


class KeyMaker:
    """Makes the key of each call of one wrapped callable.

    Args:
        fn: the wrapped function (taking the owner first when ``bound``).
        key_fn: the user's ``dispatch_key_fn`` or None.
        bound: whether ``fn`` is called with an owner that is not part of the arguments.
        layers: Layers whose training flag keys every call from the start (the owner).
    """

    def __init__(self, fn, key_fn, bound, layers):
        self._fn = fn
        self._key_fn = key_fn
        self._bound = bound
        self._signature = None
        self._plain_defaults = None
        self.layers = list(layers)
        self.who = "autocudagraph"  # the wrapper's kind, for messages

    def signature(self):
        """The signature a call is made with: the function's, without the owner when bound."""
        if self._signature is None:
            sig = inspect.signature(self._fn)
            if self._bound:
                sig = sig.replace(parameters=list(sig.parameters.values())[1:])
            self._signature = sig
        return self._signature

    def bound_arguments(self, args, kwargs):
        """``inspect.BoundArguments`` of a call, defaults applied, the owner left out."""
        bound = self.signature().bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    def named_arguments(self, args, kwargs):
        """``[(name, value)]`` of a call's arguments, for messages."""
        try:
            return list(self.bound_arguments(args, kwargs).arguments.items())
        except TypeError:
            return [("args", args), ("kwargs", kwargs)]

    def plain_defaults(self):
        """True when the defaults of the signature hold no key/value cache and no host array too large to key
        (io/arguments.py, NOTE [ Numpy arguments ] in io/nested.py): then a call whose leaves are all tensors has
        nothing to refuse or check among its named arguments. Read once: the signature is."""
        if self._plain_defaults is None:
            try:
                defaults = [(name, p.default) for name, p in self.signature().parameters.items()
                            if p.default is not inspect.Parameter.empty]
                check_host_arrays(defaults)
                self._plain_defaults = refusal(defaults) is None
            except (TypeError, ValueError, CudaGraphError):  # no signature; a default too large to key
                self._plain_defaults = False
        return self._plain_defaults

    def checked(self, key, call, named):
        """The host tensors of a call whose ``key`` is new (``named``: its ``named_arguments``, or None for a
        call of tensors only with plain_defaults()), once they are checked.

        Raises:
            CudaGraphError: for a host input (CPU tensor, numpy array) too large to be keyed by value.
        """
        host = host_mask(call.tensors)
        if host is not None:
            if named is None:
                named = self.named_arguments(call.args, call.kwargs)
            check_host_inputs(call.tensors, host, leaf_names(named))
        if not key.user and named is not None:  # a dispatch_key_fn key: the user chose the graph
            check_host_arrays(named)  # NOTE [ Numpy arguments ] in io/nested.py
        return [t for t, h in zip(call.tensors, host or ()) if h]

    def label(self, key, named, host_tensors):
        """A readable label for a new key (explain() and messages): its ``named_arguments`` and the
        host tensors ``checked()`` gave. Made only for a key that gets an entry (no budget refused it)."""
        return describe_call(named, host_tensors, key.arguments if key.user else None)

    def state_key(self):
        compiled = native.state_read  # grad mode and autocast read in C++ where it can (native/__init__.py)
        read = None if compiled is None else compiled()
        if read is None:
            read = (_grad_enabled(), _amp_state())
        # tuple.__new__: a NamedTuple's own __new__ is Python code, ~0.3 us a key
        return _new(StateKey, (read[0], read[1], tuple(map(_TRAINING, self.layers))))

    def key(self, args, kwargs, tensors, spec):
        """The call's key, or None when dispatch_key_fn says to run it eagerly."""
        if self._key_fn is None:
            # What a graph fixes of each tensor (io/static_inputs.tensor_meta), in cheap key parts
            # (NOTE [ Cheap key parts ]): shape, dtype as its int, place, stop_gradient; one loop,
            # compiled where it can be (NOTE [ Compiled tensor reads ] in native/__init__.py).
            compiled = native.reads
            metas = None if compiled is None else compiled.metas(tensors)
            if metas is None:
                metas, places = [], []
                for t in tensors:  # io/static_inputs.key_meta, inlined: the fallback is every call's path
                    place = place_key(t.place)
                    places.append(place)
                    metas.append((tuple(t.shape), int(t.dtype), place, t.stop_gradient))
                metas = tuple(metas)
            else:
                places = [m[2] for m in metas]
            host = host_mask(tensors, place_keys=places)
            if host is not None:  # NOTE [ Host tensors ] in io/host_tensors.py: keyed by value
                metas = tuple(m + (host_key(t),) if h else m for m, t, h in zip(metas, tensors, host))
            return _new(Key, (False, (spec, metas), self.state_key()))
        user_key = call_key_fn(self.who, self._key_fn, self.bound_arguments(args, kwargs))
        if user_key is None:
            return None
        try:
            hash(user_key)
        except TypeError as err:
            raise CudaGraphError(
                f"{self.who}: dispatch_key_fn returned an unhashable key {user_key!r} ({err}). "
                "Return a tuple, string or number (or None to run the call eagerly)."
            ) from None
        return Key(True, user_key, self.state_key())

    def is_key_of(self, key, spec, args):
        """True when ``key`` is the key ``key()`` makes for the call f(*args) of positional tensors (no keyword
        argument; ``spec``: its positional_spec, None for any other call; NOTE [ Calls of a key that runs eagerly ]
        in core/dispatch.py): read part by part from the tensors and the state, without making the key. False for
        a key with host parts or of another form."""
        if key.user or spec is None or key.arguments[0] is not spec:
            return False
        metas = key.arguments[1]
        if len(args) != len(metas):
            return False
        marked = any_marked()  # a tensor marked host is keyed by value: never this key's part
        compiled = native.reads  # NOTE [ Compiled tensor reads ] in native/__init__.py: None where it cannot tell
        if compiled is not None and not marked:
            grad, amp, training = key.state  # the tensors, the state and the training flags in one call
            same = compiled.key_of(args, metas, grad, amp, self.layers, training)
            if same is not None:
                return same
        same = None if compiled is None or marked else compiled.match(args, metas)
        if same is False:
            return False
        for t, meta in () if same else zip(args, metas):
            if len(meta) != 4 or t.stop_gradient is not meta[3] or tuple(t.shape) != meta[0]:
                return False
            if marked and is_marked_host(t):
                return False
            d = t.dtype
            if d is not _dtype_seen.get(meta[1]):  # Paddle 3 hands out one object per dtype; Paddle 2.6 one per read
                if int(d) != meta[1]:
                    return False
                _dtype_seen[meta[1]] = d
            if place_key(t.place) != meta[2]:
                return False
        grad, amp, training = key.state
        compiled = native.state_read  # grad mode and autocast read in C++ where it can (native/__init__.py)
        read = None if compiled is None else compiled()
        if read is None:
            read = (_grad_enabled(), _amp_state())
        return (read[0] is grad and read[1] == amp
                and tuple([layer.training for layer in self.layers]) == training)

    def is_call_of(self, key, args):
        """``is_key_of(key, positional_spec(args, None), args)``, the spec made only where the compiled reads
        cannot tell (a call of a key known to run eagerly: NOTE [ Calls of a key that runs eagerly ] in
        core/dispatch.py): where they can, the spec of a call of ``len(args)`` tensors is taken as the call's, and
        the compiled ``key_of`` answers False for an argument that is not a tensor."""
        form = positional_form(len(args))
        if native.reads is not None and form is not None and not any_marked():
            return self.is_key_of(key, form, args)
        return self.is_key_of(key, positional_spec(args, None), args)

    def track(self, layers):
        """Adds Layers found during a capture to those whose training flag keys every call;
        returns the current training flags of the added ones (the lifecycle re-keys the keys
        made before with them: Key.with_layers)."""
        added = [l for l in layers if all(l is not t for t in self.layers)]
        self.layers.extend(added)
        return tuple(layer.training for layer in added)


class BoundSignature:
    """``__signature__`` of a wrapper whose KeyMaker is ``self._keys``: the signature of what it
    wraps, bound where it is bound (a Layer's ``forward`` without ``self``), as
    ``inspect.signature`` of the unwrapped bound method gives. Callers that bind arguments
    against it (Paddle's reentrant ``recompute``) then see the arguments the wrapper takes."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # inspect.signature(the class) goes on to the class's own __init__
        try:
            return obj._keys.signature()
        except (TypeError, ValueError):
            # No signature to give (a builtin): inspect falls back to __wrapped__, which raises alike.
            raise AttributeError("__signature__") from None


def rekeyed(entries, training):
    """``entries`` (key -> entry, in order) with the training flags ``training`` of Layers a
    capture found appended to every key, each entry's own key too, so that keys made before
    (other keys still in warmup included) keep matching the calls made from now on."""
    if not training:
        return entries
    out = collections.OrderedDict()
    for key, entry in entries.items():
        entry.key = key.with_layers(training)
        out[entry.key] = entry
    return out
