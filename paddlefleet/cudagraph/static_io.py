"""Nested IO: flatten a call's arguments or results into tensors + a hashable spec, and back;
static input buffers and the copy-in that skips same-address inputs.

NOTE [ Static input surface ]
A graph reads its inputs from fixed addresses. At capture every tensor argument gets a static
buffer (a contiguous copy); each replay first copies the call's tensors into those buffers.
A caller that passes the static buffer itself (or a tensor at the same address with the same
layout) pays no copy.

NOTE [ Adopted inputs ]
An argument that was the very same tensor in the last warmup call and in the capture call (a
weight passed as an argument, an input buffer the caller refills in place) is *adopted*: its
own storage is the static buffer, as a parameter's is, so calls that pass it again copy nothing
and see its in-place updates. A graph never copies another tensor into an adopted one (that
would overwrite the caller's tensor): when a call passes a different tensor there, the key is
captured again with an ordinary static buffer for that argument. Host (CPU) inputs are keyed by
value (NOTE [ Host tensors ] in host.py) and never copied.
"""

import numpy as np
import paddle

from .errors import InputMismatchError

__all__ = ["flatten", "unflatten", "holds_tensor", "leaf_names", "StaticInputs", "tensor_meta", "numel", "nbytes"]

_TENSOR = "T"
_CONST = "C"
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _const_key(value):
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


def place_key(place):
    """A hashable value that compares equal for equal places.

    Paddle 2.6's Place objects hash alike but compare by identity (measured on 2.6.2), so they
    cannot be a key themselves; ``str(place)`` costs ~4 us, a GPU's device id well under 1 us.
    """
    if place.is_gpu_place():
        return place.gpu_device_id()
    if place.is_cpu_place():
        return "cpu"
    return str(place)


def tensor_meta(t, place=None):
    """The parts of a tensor that a graph fixes: shape, dtype, place, stop_gradient."""
    return (tuple(t.shape), t.dtype, place_key(t.place if place is None else place), t.stop_gradient)


def numel(t):
    """Number of elements, from the shape (Tensor.numel() is a device op)."""
    size = 1
    for d in t.shape:
        size *= d
    return size


def nbytes(t):
    """Bytes of a tensor's elements."""
    return numel(t) * t.element_size()


def _alloc(t):
    with paddle.no_grad():
        buf = t.detach().clone()
    buf.stop_gradient = t.stop_gradient
    return buf


def _adopt(t):
    buf = t.detach()  # same storage, a leaf of its own
    buf.stop_gradient = t.stop_gradient
    return buf


class StaticInputs:
    """The static input buffers of one key and the copy into them.

    Args:
        tensors: the call's tensors at capture.
        names: the argument name of each tensor.
        adopt: per tensor, use its own storage as the buffer (NOTE [ Adopted inputs ]).
        host: per tensor, a host input keyed by value: never copied, checked by check().

    Attributes:
        buffers: one contiguous tensor per tensor argument, in flatten() order.
        names: the argument name of each buffer (for error messages).
        adopted: indices of adopted arguments.
        host: indices of host arguments.
    """

    def __init__(self, tensors, names, adopt=None, host=None):
        adopt = adopt or [False] * len(tensors)
        host = host or [False] * len(tensors)
        self.buffers = [_adopt(t) if a else _alloc(t) for t, a in zip(tensors, adopt)]
        self.names = list(names)
        self._ptrs = [b.data_ptr() for b in self.buffers]
        self.adopted = [i for i, a in enumerate(adopt) if a]
        self.host = [i for i, h in enumerate(host) if h]
        self._versions = [b._inplace_version() for b in self.buffers]
        # What copy_in() looks at: (index, buffer, address) of the arguments it may copy.
        self._slots = [(i, b, p) for i, (b, p) in enumerate(zip(self.buffers, self._ptrs)) if not host[i]]

    def name(self, i):
        return self.names[i] if i < len(self.names) else f"tensor #{i}"

    def written(self):
        """Names of the buffers written in place since they were made (by the function)."""
        return [self.name(i) for i, (b, v) in enumerate(zip(self.buffers, self._versions)) if b._inplace_version() != v]

    def moved(self, tensors):
        """Name of the first adopted argument for which the call passes another tensor, or None."""
        for i in self.adopted:
            t = tensors[i]
            if t.data_ptr() != self._ptrs[i] or not t.is_contiguous():
                return self.name(i)
        return None

    def check(self, tensors):
        """Raises InputMismatchError when a tensor's shape, dtype or stop_gradient differs from its
        buffer (or a host tensor's value from the captured one)."""
        for i, (t, b) in enumerate(zip(tensors, self.buffers)):
            if t.shape != b.shape or t.dtype != b.dtype:
                name = self.name(i)
                raise InputMismatchError(
                    f"autocudagraph: input '{name}' was captured with shape {list(b.shape)} and dtype "
                    f"{b.dtype} but got shape {list(t.shape)} and dtype {t.dtype}; shapes and dtypes "
                    "are fixed per graph. Include them in the key that dispatch_key_fn returns, or pad "
                    "to a captured size."
                )
            if t.stop_gradient != b.stop_gradient:
                name = self.name(i)
                raise InputMismatchError(
                    f"autocudagraph: input '{name}' was captured with stop_gradient={b.stop_gradient} but got "
                    f"stop_gradient={t.stop_gradient}; the backward graph fixes which inputs get grads, so "
                    "this call would silently lose or invent a grad. Include stop_gradient in the key that "
                    "dispatch_key_fn returns."
                )
        if len(tensors) != len(self.buffers):
            raise InputMismatchError(
                f"autocudagraph: the call passed {len(tensors)} tensors but the graph was captured with "
                f"{len(self.buffers)}. Include the argument structure in the key that dispatch_key_fn returns."
            )
        for i in self.host:
            if tensors[i].numpy().tobytes() != self.buffers[i].numpy().tobytes():
                raise InputMismatchError(
                    f"autocudagraph: CPU input '{self.name(i)}' holds {tensors[i].numpy().tolist()} but the graph "
                    f"of this key was captured with {self.buffers[i].numpy().tolist()}; a graph bakes in the "
                    "values of CPU inputs. Include them in the key that dispatch_key_fn returns."
                )

    def copy_in(self, tensors):
        """Copies the call's tensors into the buffers; returns ``(copied, skipped)``."""
        copied, skipped = 0, len(self.host)  # host inputs: same value by key, nothing to copy
        with paddle.no_grad():
            for i, b, ptr in self._slots:
                t = tensors[i]
                if t is b or (t.data_ptr() == ptr and t.is_contiguous()):
                    skipped += 1
                    continue
                b.copy_(t, False)
                copied += 1
        return copied, skipped

    def nbytes(self):
        """Bytes of the buffers this object allocated (adopted arguments are the caller's)."""
        adopted = set(self.adopted)
        return sum(nbytes(b) for i, b in enumerate(self.buffers) if i not in adopted)
