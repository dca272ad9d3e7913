"""Nested IO: flatten a call's arguments or results into tensors + a hashable spec, and back;
the names of their leaves, and the check that a container comes back equal (NOTE [ Containers keep
their type ]). A key's constants are keyed here too (NOTE [ Numpy arguments ]).
"""

import dataclasses

import numpy as np
import paddle

from ..errors import CaptureError

__all__ = ["MAX_HOST_KEY_ELEMENTS", "flatten", "unflatten", "check_rebuild", "holds_tensor", "leaf_names",
           "const_names"]

_TENSOR = "T"
_CONST = "C"
_NODE = "N"  # a container rebuilt with its own type: (_NODE, type, names, children)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_SCALAR_TYPES = frozenset(_SCALARS)
_Tensor = paddle.Tensor


#: Largest host array or CPU tensor (in elements) that a call's key holds by value (NOTE [ Host
#: tensors ] in io/host_tensors.py; NOTE [ Numpy arguments ]).
MAX_HOST_KEY_ELEMENTS = 1024

# NOTE [ Numpy arguments ]
# A numpy array argument is host data: whatever the function reads from it (a shape, a scale,
# ``float(a[0])``) is baked into the graph at capture, as a CPU tensor's values are. So an array is
# part of the key by value (dtype, shape and bytes), never by identity: a buffer refilled in place,
# or a fresh array that reuses a freed one's id, selects the graph made for its contents (or a new
# one). An array larger than MAX_HOST_KEY_ELEMENTS is refused when a key would be made
# (check_host_arrays), naming the argument: pass it as a tensor, which is copied into the graph.


def _array_key(value):
    if value.size <= MAX_HOST_KEY_ELEMENTS:
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return ("ndarray too large", value.dtype.str, value.shape, id(value))


def _const_key(value):
    if type(value) is np.ndarray:  # NOTE [ Numpy arguments ]
        return _array_key(value)
    if isinstance(value, (float, complex, np.floating, np.complexfloating)):
        # By bits, not by ==: 0.0 == -0.0 (1/x differs) and nan != nan (a new key every call).
        c = complex(value)
        return (type(value), c.real.hex(), c.imag.hex())
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, paddle.nn.Layer):
        return ("layer", id(value))
    try:
        hash(value)
    except TypeError:
        return ("object", type(value).__qualname__, id(value))
    return ("value", type(value).__qualname__, value)


# NOTE [ Containers keep their type ]
# flatten() keeps the type of every container it walks, and unflatten() rebuilds each with that
# type, so a call's arguments reach the captured function, and its results reach the caller, as
# the same kinds of objects eager would give: a ModelOutput-style dict subclass keeps its
# attribute access, a namedtuple its fields, a dataclass its class.
#   exact tuple / list / dict   rebuilt directly (the fast path: no lookup)
#   namedtuple                  cls._make(items)
#   other tuple / list subclass cls(items)
#   dict subclass               cls(**items) for a dataclass (ModelOutput style), else cls(pairs)
#   dataclass holding a tensor  cls.__new__(cls), then each field set (frozen ones too)
#   dataclass without tensors   a value like any other object (passed through as itself)
# A rebuild must give back an equal object: same type, same items or fields, and no state the
# recipe loses (an attribute besides its items, an __init__ that needs other arguments). Capture
# checks every container of the call's arguments and of its result (check_rebuild) and refuses
# one that does not come back equal, naming its type, so the key runs eagerly. Attributes of a
# container are not part of the key: a later call whose containers differ only there replays.
_SEQ, _MAP, _DATACLASS, _OTHER = "seq", "map", "dataclass", "other"
_KINDS = {}  # type -> kind
_FIELDS = {}  # dataclass type -> field names
_RECIPES = {}  # container type -> rebuild(names, items)


def _kind(cls):
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, (list, tuple)):
            kind = _SEQ
        elif issubclass(cls, dict):
            kind = _MAP
        elif dataclasses.is_dataclass(cls) and isinstance(cls, type):
            kind = _DATACLASS
            _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
        else:
            kind = _OTHER
        _KINDS[cls] = kind
    return kind


def _flatten(value, tensors, consts):
    cls = type(value)
    if cls is _Tensor:
        tensors.append(value)
        return _TENSOR
    if cls is tuple or cls is list:
        return (cls, tuple([_flatten(v, tensors, consts) for v in value]))
    if cls is dict:
        return (dict, tuple(value), tuple([_flatten(v, tensors, consts) for v in value.values()]))
    if isinstance(value, _Tensor):  # a Parameter, or another Tensor subclass
        tensors.append(value)
        return _TENSOR
    if cls not in _SCALAR_TYPES:
        kind = _kind(cls)
        if kind is _SEQ:
            return (_NODE, cls, None, tuple([_flatten(v, tensors, consts) for v in value]))
        if kind is _MAP:
            return (_NODE, cls, tuple(dict.keys(value)),
                    tuple([_flatten(v, tensors, consts) for v in dict.values(value)]))
        if kind is _DATACLASS:
            node = _flatten_dataclass(value, cls, tensors, consts)
            if node is not None:
                return node
    consts.append(value)
    return (_CONST, _const_key(value))


def _flatten_dataclass(value, cls, tensors, consts):
    """The node of a dataclass holding a tensor, or None (it is then a value like any object)."""
    names = _FIELDS[cls]
    n_tensors, n_consts = len(tensors), len(consts)
    missing = object()
    fields = [getattr(value, name, missing) for name in names]
    if any(f is missing for f in fields):
        return None
    children = tuple([_flatten(f, tensors, consts) for f in fields])
    if len(tensors) > n_tensors:
        return (_NODE, cls, names, children)
    del consts[n_consts:]
    return None


def flatten(tree):
    """Returns ``(tensors, consts, spec)``: the tensor leaves in order, the other leaves in
    order, and a hashable spec of the structure (container types and non-tensor values
    included; NOTE [ Containers keep their type ])."""
    tensors, consts = [], []
    spec = _flatten(tree, tensors, consts)
    return tensors, consts, spec


def _recipe(cls):
    """``rebuild(names, items)`` for a container type (NOTE [ Containers keep their type ])."""
    recipe = _RECIPES.get(cls)
    if recipe is not None:
        return recipe
    kind = _kind(cls)
    if kind is _SEQ and issubclass(cls, tuple) and hasattr(cls, "_make") and hasattr(cls, "_fields"):
        recipe = lambda names, items: cls._make(items)  # noqa: E731
    elif kind is _SEQ:
        recipe = lambda names, items: cls(items)  # noqa: E731
    elif kind is _MAP and dataclasses.is_dataclass(cls):
        recipe = lambda names, items: cls(**dict(zip(names, items)))  # noqa: E731
    elif kind is _MAP:
        recipe = lambda names, items: cls(zip(names, items))  # noqa: E731
    else:
        def recipe(names, items):
            obj = cls.__new__(cls)
            for name, item in zip(names, items):
                object.__setattr__(obj, name, item)  # also for frozen dataclasses
            return obj
    _RECIPES[cls] = recipe
    return recipe


def _unflatten(spec, tensors, consts):
    if spec is _TENSOR:
        return next(tensors)
    tag = spec[0]
    if tag is tuple:
        return tuple([_unflatten(s, tensors, consts) for s in spec[1]])
    if tag is list:
        return [_unflatten(s, tensors, consts) for s in spec[1]]
    if tag is dict:
        return {k: _unflatten(s, tensors, consts) for k, s in zip(spec[1], spec[2])}
    if tag == _CONST:
        return next(consts)
    _, cls, names, children = spec
    return _recipe(cls)(names, [_unflatten(s, tensors, consts) for s in children])


def holds_tensor(value, depth=2):
    """True when a non-tensor leaf (an object flatten() keeps as a constant) holds a tensor in its
    attributes or dataclass fields, looked for ``depth`` levels down. Such a tensor would be
    neither a static input nor a replayed output: the graph would keep the capture-time one."""
    if depth < 0 or isinstance(value, _SCALARS) or isinstance(value, paddle.nn.Layer):
        return False
    if isinstance(value, paddle.Tensor):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_tensor(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v, depth - 1) for v in value.values())
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        return any(holds_tensor(v, depth - 1) for v in fields.values())
    return False


def unflatten(spec, tensors, consts):
    """Inverse of flatten()."""
    if spec is _TENSOR:  # a bare tensor, the result of most blocks: no iterators to make
        return tensors[0]
    return _unflatten(spec, iter(tensors), iter(consts))


def _child_name(prefix, cls, names, i):
    if names is None:
        return f"{prefix}[{i}]"
    if issubclass(cls, dict):
        return f"{prefix}[{names[i]!r}]"
    return f"{prefix}.{names[i]}"


def _names(spec, prefix, out, consts=False):
    if spec is _TENSOR:
        if not consts:
            out.append(prefix)
        return
    tag = spec[0]
    if tag == _CONST:
        if consts:
            out.append(prefix)
    elif tag is tuple or tag is list:
        for i, s in enumerate(spec[1]):
            _names(s, f"{prefix}[{i}]", out, consts)
    elif tag is dict:
        for k, s in zip(spec[1], spec[2]):
            _names(s, f"{prefix}[{k!r}]", out, consts)
    elif tag == _NODE:
        _, cls, names, children = spec
        for i, s in enumerate(children):
            _names(s, _child_name(prefix, cls, names, i), out, consts)


def const_names(spec, prefix):
    """Where the non-tensor leaves of a flattened nest are, as ``prefix[0]``, ``prefix['k']``,
    ``prefix.field``: in the order flatten() lists them."""
    out = []
    _names(spec, prefix, out, consts=True)
    return out


def leaf_names(named_arguments):
    """Names of the tensor leaves of ``{argument name: value}``, in flatten() order
    (e.g. ``x``, ``batch['ids']``, ``args[1]``, ``out.logits``)."""
    out = []
    for name, value in named_arguments:
        _names(flatten(value)[2], name, out)
    return out


# ---------------------------------------------------------------------------- rebuild checks

_MISSING = object()


def check_rebuild(value, label):
    """Raises CaptureError when a container in ``value`` would not come back from unflatten()
    as an equal object of its own type (NOTE [ Containers keep their type ]).

    Args:
        value: an argument of the call, or its result.
        label: how to name ``value`` in the message ("argument batch", "the result").
    """
    _check_node(value, flatten(value)[2], label)


def _items(value, kind, names):
    if kind is _SEQ:
        return list(value)
    if kind is _MAP:
        return list(dict.values(value))
    return [getattr(value, n) for n in names]


def _check_node(value, spec, path):
    if spec is _TENSOR or spec[0] == _CONST:
        return
    tag = spec[0]
    if tag is tuple or tag is list:
        items, paths = list(value), [f"{path}[{i}]" for i in range(len(value))]
        children = spec[1]
    elif tag is dict:
        items, paths = list(value.values()), [f"{path}[{k!r}]" for k in value]
        children = spec[2]
    else:
        _, cls, names, children = spec
        items = _items(value, _kind(cls), names)
        paths = [_child_name(path, cls, names, i) for i in range(len(items))]
        problem = _rebuild_problem(value, cls, names, items)
        if problem is not None:
            raise CaptureError(
                f"autocudagraph: {path} (type {cls.__name__}) cannot be rebuilt as an equal object: "
                f"{problem}. A graphed call hands its arguments to the function, and its results to you, in "
                "containers rebuilt around the graph's static buffers, so this one would arrive changed. Use a "
                "dict, list, tuple, namedtuple or dataclass whose fields hold all of its state, or make "
                f"{_how(cls)} return an equal object; until then this key runs eagerly."
            )
    for item, child, child_path in zip(items, children, paths):
        _check_node(item, child, child_path)


def _how(cls):
    """How _recipe() rebuilds ``cls``, for messages."""
    name = cls.__name__
    kind = _kind(cls)
    if kind is _SEQ:
        return f"{name}._make(items)" if hasattr(cls, "_make") and hasattr(cls, "_fields") else f"{name}(items)"
    if kind is _MAP:
        return f"{name}(**items)" if dataclasses.is_dataclass(cls) else f"{name}(key-value pairs)"
    return f"{name}.__new__ with its fields set"


def _rebuild_problem(value, cls, names, items):
    """What differs between ``value`` and its rebuild from ``items``, or None."""
    how = _how(cls)
    try:
        rebuilt = _recipe(cls)(names, items)
    except Exception as err:  # the user's constructor: reported as our conversion's failure
        return f"{how} raised {type(err).__name__}: {err}"
    if type(rebuilt) is not cls:
        return f"{how} returned a {type(rebuilt).__name__}"
    kind = _kind(cls)
    if kind is _MAP and tuple(dict.keys(rebuilt)) != names:
        return f"{how} gave keys {list(dict.keys(rebuilt))} instead of {list(names)}"
    got = _items(rebuilt, kind, names)
    if len(got) != len(items) or any(a is not b for a, b in zip(got, items)):
        return f"{how} did not keep the items it was given"
    return _state_problem(value, rebuilt, kind, names, how)


def _state_problem(value, rebuilt, kind, names, how):
    """An attribute of ``value`` (besides dataclass fields and attributes mirroring its items)
    that ``rebuilt`` does not have alike, or None."""
    own = getattr(value, "__dict__", None)
    new = getattr(rebuilt, "__dict__", None)
    own = own if isinstance(own, dict) else {}
    new = new if isinstance(new, dict) else {}
    fields = set(names) if kind is _DATACLASS else ()
    for attr in sorted(set(own) | set(new), key=str):
        if attr in fields:
            continue
        a, b = own.get(attr, _MISSING), new.get(attr, _MISSING)
        if a is b:
            continue
        if kind is _MAP and a is dict.get(value, attr, _MISSING) and b is dict.get(rebuilt, attr, _MISSING):
            continue  # an attribute that mirrors the item of the same name (ModelOutput style)
        if type(a) in _SCALAR_TYPES and type(a) is type(b) and _const_key(a) == _const_key(b):
            continue
        if a is _MISSING:
            return f"{how} adds the attribute {attr!r}"
        return f"it holds the attribute {attr!r} ({type(a).__name__}) besides its items, which {how} does not restore"
    return None
