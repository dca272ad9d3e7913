"""Nested IO: flatten a call's arguments or results into tensors + a hashable spec, and back;
static input buffers and the copy-in that skips same-address inputs.

NOTE [ Static input surface ]
A graph reads its inputs from fixed addresses. At capture every tensor argument gets a static
buffer (a contiguous copy); each replay first copies the call's tensors into those buffers.
A caller that passes the static buffer itself (or a tensor at the same address with the same
layout) pays no copy.
"""

import paddle

from .errors import InputMismatchError

__all__ = ["flatten", "unflatten", "leaf_names", "StaticInputs", "tensor_meta", "nbytes"]

_TENSOR = "T"
_CONST = "C"
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _const_key(value):
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, paddle.nn.Layer):
        return ("layer", id(value))
    try:
        hash(value)
    except TypeError:
        return ("object", type(value).__qualname__, id(value))
    return ("value", type(value).__qualname__, value)


def _flatten(value, tensors, consts):
    if isinstance(value, paddle.Tensor):
        tensors.append(value)
        return _TENSOR
    if isinstance(value, (list, tuple)):
        kind = type(value)
        return (kind, tuple(_flatten(v, tensors, consts) for v in value))
    if isinstance(value, dict):
        return (dict, tuple(value.keys()), tuple(_flatten(v, tensors, consts) for v in value.values()))
    consts.append(value)
    return (_CONST, _const_key(value))


def flatten(tree):
    """Returns ``(tensors, consts, spec)``: the tensor leaves in order, the other leaves in
    order, and a hashable spec of the structure (non-tensor values included by value)."""
    tensors, consts = [], []
    spec = _flatten(tree, tensors, consts)
    return tensors, consts, spec


def _unflatten(spec, tensors, consts):
    if spec == _TENSOR:
        return next(tensors)
    tag = spec[0]
    if tag == _CONST:
        return next(consts)
    if tag is dict:
        return {k: _unflatten(s, tensors, consts) for k, s in zip(spec[1], spec[2])}
    items = [_unflatten(s, tensors, consts) for s in spec[1]]
    if tag is list:
        return items
    if tag is tuple:
        return tuple(items)
    if hasattr(tag, "_fields"):  # namedtuple
        return tag(*items)
    return tag(items)


def unflatten(spec, tensors, consts):
    """Inverse of flatten()."""
    return _unflatten(spec, iter(tensors), iter(consts))


def _names(value, prefix, out):
    if isinstance(value, paddle.Tensor):
        out.append(prefix)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _names(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _names(v, f"{prefix}[{k!r}]", out)


def leaf_names(named_arguments):
    """Names of the tensor leaves of ``{argument name: value}``, in flatten() order
    (e.g. ``x``, ``batch['ids']``, ``args[1]``)."""
    out = []
    for name, value in named_arguments:
        _names(value, name, out)
    return out


def tensor_meta(t):
    """The parts of a tensor that a graph fixes: shape, dtype, place, stop_gradient."""
    return (tuple(t.shape), t.dtype, t.place, t.stop_gradient)


def nbytes(t):
    """Bytes of a tensor's elements."""
    size = 1
    for d in t.shape:
        size *= d
    return size * t.element_size()


def _alloc(t):
    with paddle.no_grad():
        buf = t.detach().clone()
    buf.stop_gradient = t.stop_gradient
    return buf


class StaticInputs:
    """The static input buffers of one key and the copy into them.

    Attributes:
        buffers: one contiguous tensor per tensor argument, in flatten() order.
        names: the argument name of each buffer (for error messages).
    """

    def __init__(self, tensors, names):
        self.buffers = [_alloc(t) for t in tensors]
        self.names = list(names)
        self._ptrs = [b.data_ptr() for b in self.buffers]

    def check(self, tensors):
        """Raises InputMismatchError when a tensor's shape or dtype differs from its buffer."""
        for i, (t, b) in enumerate(zip(tensors, self.buffers)):
            if t.shape != b.shape or t.dtype != b.dtype:
                name = self.names[i] if i < len(self.names) else f"tensor #{i}"
                raise InputMismatchError(
                    f"autocudagraph: input '{name}' was captured with shape {list(b.shape)} and dtype "
                    f"{b.dtype} but got shape {list(t.shape)} and dtype {t.dtype}; shapes and dtypes "
                    "are fixed per graph. Include them in the key that dispatch_key_fn returns, or pad "
                    "to a captured size."
                )
        if len(tensors) != len(self.buffers):
            raise InputMismatchError(
                f"autocudagraph: the call passed {len(tensors)} tensors but the graph was captured with "
                f"{len(self.buffers)}. Include the argument structure in the key that dispatch_key_fn returns."
            )

    def copy_in(self, tensors):
        """Copies the call's tensors into the buffers; returns ``(copied, skipped)``."""
        copied = skipped = 0
        with paddle.no_grad():
            for t, b, ptr in zip(tensors, self.buffers, self._ptrs):
                if t is b or (t.data_ptr() == ptr and t.is_contiguous()):
                    skipped += 1
                    continue
                b.copy_(t, False)
                copied += 1
        return copied, skipped

    def nbytes(self):
        return sum(nbytes(b) for b in self.buffers)
