"""One call of a wrapped callable: its arguments and their flattened tensors."""

import paddle

from ..io.nested import flatten, unflatten

__all__ = ["Call", "positional_form", "positional_forms", "positional_spec"]

# Number of positional tensor arguments -> their spec.
_POSITIONAL = {}


def positional_spec(args, kwargs):
    """The spec flatten() makes for the common call, f(x, ...) with tensors only, cached; None for any other."""
    if kwargs:
        return None
    for a in args:
        if not isinstance(a, paddle.Tensor):
            return None
    spec = _POSITIONAL.get(len(args))
    if spec is None:
        spec = _POSITIONAL[len(args)] = flatten((args, {}))[2]
    return spec


def positional_forms():
    """The dict positional_form reads, by count (a compiled check reads it too: NOTE [ The front door ] in
    core/front.py)."""
    return _POSITIONAL


def positional_form(n):
    """The spec positional_spec gives a call of ``n`` tensors, or None before any such call was made."""
    return _POSITIONAL.get(n)


class Call:
    """The arguments of one call, flattened once.

    Attributes:
        args, kwargs: as the caller passed them (canonicalised when dispatch_key_fn is set).
        tensors: the tensor leaves, in flatten() order.
        consts: the other leaves, in order.
        spec: the hashable structure (non-tensor values included).
    """

    __slots__ = ("args", "kwargs", "tensors", "consts", "spec")

    def __init__(self, args, kwargs, spec=None):
        """``spec``: positional_spec(args, kwargs) where the caller has it (not None)."""
        self.args = args
        self.kwargs = kwargs
        if spec is None:
            spec = positional_spec(args, kwargs)
        if spec is not None:
            self.tensors, self.consts, self.spec = list(args), [], spec
        else:
            self.tensors, self.consts, self.spec = flatten((args, kwargs))

    def rebuild(self, tensors):
        """``(args, kwargs)`` with ``tensors`` in place of this call's tensors."""
        return unflatten(self.spec, tensors, self.consts)
