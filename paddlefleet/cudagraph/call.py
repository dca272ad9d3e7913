"""One call of a wrapped callable: its arguments and their flattened tensors."""

from .static_io import flatten, unflatten

__all__ = ["Call"]


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
        self.tensors, self.consts, self.spec = flatten((args, kwargs))

    def rebuild(self, tensors):
        """``(args, kwargs)`` with ``tensors`` in place of this call's tensors."""
        return unflatten(self.spec, tensors, self.consts)
