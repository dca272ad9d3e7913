"""One call of a wrapped callable: its arguments and their flattened tensors."""

import paddle

from ..io.nested import flatten, unflatten

__all__ = ["Call"]

# Number of positional tensor arguments -> their spec.
_POSITIONAL = {}


class Call:
    """The arguments of one call, flattened once.

    Attributes:
        args, kwargs: as the caller passed them (canonicalised when dispatch_key_fn is set).
        tensors: the tensor leaves, in flatten() order.
        consts: the other leaves, in order.
        spec: the hashable structure (non-tensor values included).
    """

    __slots__ = ("args", "kwargs", "tensors", "consts", "spec")

    def __init__(self, args, kwargs):
        self.args = args
        self.kwargs = kwargs
        if not kwargs and all(isinstance(a, paddle.Tensor) for a in args):
            # The common call, f(x, ...) with tensors only: the spec flatten() would make, cached.
            spec = _POSITIONAL.get(len(args))
            if spec is None:
                spec = _POSITIONAL[len(args)] = flatten((args, {}))[2]
            self.tensors, self.consts, self.spec = list(args), [], spec
        else:
            self.tensors, self.consts, self.spec = flatten((args, kwargs))

    def rebuild(self, tensors):
        """``(args, kwargs)`` with ``tensors`` in place of this call's tensors."""
        return unflatten(self.spec, tensors, self.consts)
