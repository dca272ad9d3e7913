"""What a CUDA graph cannot do and the simulated backend must refuse as a GPU would: ops whose
output shape depends on tensor values, indexing that reads a tensor value on the host, and a
replay whose outputs change shape.

NOTE [ Shapes from tensor values ]
A GPU kernel whose output shape depends on the values of its input (how many elements a mask
selects, how many distinct values there are) computes that shape on the device and copies it
to the host before it can allocate the output: a device-to-host copy that waits for the device,
which a capturing CUDA stream refuses (CUDA error 900, as ``.item()``). So on a GPU the capture
of such a key fails and the key runs eagerly; the simulated backend refuses the same calls
during capture so that CI says what a GPU would do. Found by reading Paddle's Python API (each
of these calls ``paddle._C_ops.<op>`` by attribute, so patching the module attribute catches
every route to it) and its indexing code (paddle/fluid/pybind/slice_utils.h: a boolean tensor
index becomes ``masked_select`` or ``nonzero`` + ``gather_nd``; a 0-D integer tensor index and a
tensor slice bound are copied to the host to read their value), and by tracing which ops each
API runs on Paddle 2.6.2 and 3.3.1:

    paddle.nonzero, paddle.where(cond) with one argument      _C_ops.nonzero
    paddle.masked_select, Tensor.masked_select                 _C_ops.masked_select
    paddle.unique, paddle.unique_consecutive                   _C_ops.unique, _C_ops.unique_consecutive
    paddle.bincount                                            _C_ops.bincount
    paddle.repeat_interleave(x, repeats_tensor)                _C_ops.repeat_interleave_with_tensor_index
    x[bool_tensor] (also inside a tuple index)                 Tensor.__getitem__ (C++ indexing)
    x[int_tensor_0d], x[:t], and the same in x[...] = v        Tensor.__getitem__ / __setitem__

Not refused, because their output shape is fixed: ``x[mask] = v`` (``masked_fill_`` on 3.3.1,
``where_`` on 2.6.2 for a full-shape mask), ``paddle.where(cond, x, y)``, ``masked_fill``,
indexing with an N-D integer tensor (a gather). A call whose tensors are all host tensors
(``mark_host``) is allowed: on a GPU its work stays on the host, keyed by value. Anything this
list misses is caught, later, by check_replay_shapes(): a simulated replay whose outputs change
shape fails with ReplayShapeError instead of handing out the captured shapes.
"""

import contextlib

import paddle

from ..errors import ReplayShapeError
from .paddle_patches import Patches
from .refusals import DEVICE_INDEX, VALUE_SHAPE

__all__ = ["refuse_value_shapes", "check_replay_shapes", "VALUE_SHAPED_OPS"]

#: ``paddle._C_ops`` functions whose output shape depends on tensor values, and the public
#: calls that reach them (for messages).
VALUE_SHAPED_OPS = {
    "nonzero": "paddle.nonzero() (or paddle.where(cond) with one argument)",
    "masked_select": "paddle.masked_select()",
    "unique": "paddle.unique()",
    "unique_consecutive": "paddle.unique_consecutive()",
    "bincount": "paddle.bincount()",
    "repeat_interleave_with_tensor_index": "paddle.repeat_interleave() with a tensor of repeats",
}

_FIX = (
    "Compute it outside the graphed function and pass the result in, use a fixed-shape form "
    "(paddle.where(mask, x, 0), masked_fill, a padded index), or return None from dispatch_key_fn "
    "for such calls."
)


def _value_shape_error(what):
    return VALUE_SHAPE.error(
        f"autocudagraph: {what} was called during capture. Its output's shape depends on tensor values, "
        "so a GPU must copy that shape to the host, a sync that a capturing CUDA stream refuses (CUDA "
        f"error 900), and a graph could only ever hand out the captured shape. {_FIX}"
    )


def _host_read_error(what):
    return DEVICE_INDEX.error(
        f"autocudagraph: {what} during capture. Paddle reads that tensor's value on the host, which waits "
        "for the device and a capturing CUDA stream refuses (CUDA error 900). Index with Python ints or "
        "slices, pass the index as a Python value (it is then part of the key), or index outside the "
        "graphed function."
    )


def _tensors(args, kwargs):
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, paddle.Tensor)]


def _refusing_op(name, original, is_host):
    def refuse(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        if tensors and all(is_host(t) for t in tensors):
            return original(*args, **kwargs)
        raise _value_shape_error(VALUE_SHAPED_OPS[name])

    return refuse


def _index_problem(item, is_host, setting):
    """What in a Tensor index needs a tensor's value on the host (or None)."""
    for it in item if isinstance(item, tuple) else (item,):
        if isinstance(it, paddle.Tensor) and not is_host(it):
            if it.dtype == paddle.bool and not setting:
                return "value", "indexing with a boolean tensor (x[mask])"
            if len(it.shape) == 0 and it.dtype != paddle.bool:
                return "read", f"{'writing' if setting else 'indexing'} with a 0-D integer tensor (x[t])"
        elif isinstance(it, slice):
            bounds = (it.start, it.stop, it.step)
            if any(isinstance(b, paddle.Tensor) and not is_host(b) for b in bounds):
                return "read", f"{'writing' if setting else 'indexing'} with a tensor slice bound (x[:t])"
    return None


def _checking_getitem(original, is_host):
    def __getitem__(self, item):
        problem = _index_problem(item, is_host, setting=False)
        if problem is not None:
            kind, what = problem
            raise _value_shape_error(what) if kind == "value" else _host_read_error(what)
        return original(self, item)

    return __getitem__


def _checking_setitem(original, is_host):
    def __setitem__(self, item, value):
        problem = _index_problem(item, is_host, setting=True)
        if problem is not None:
            raise _host_read_error(problem[1])
        return original(self, item, value)

    return __setitem__


@contextlib.contextmanager
def refuse_value_shapes(is_host):
    """Makes the calls of NOTE [ Shapes from tensor values ] raise CaptureError until the block
    exits; ``is_host(t)`` tells a host tensor, whose calls are allowed."""
    ops = paddle._C_ops
    patches = Patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py
    try:
        for name in VALUE_SHAPED_OPS:
            if hasattr(ops, name):
                patches.set(ops, name, _refusing_op(name, getattr(ops, name), is_host))
        for name, make in (("__getitem__", _checking_getitem), ("__setitem__", _checking_setitem)):
            original = paddle.Tensor.__dict__.get(name)
            if original is not None:
                patches.set(paddle.Tensor, name, make(original, is_host))
        yield
    finally:
        patches.restore()


def check_replay_shapes(static, fresh):
    """Raises ReplayShapeError when a replay's results differ in number, shape or dtype from the
    static buffers of its capture (before anything is copied into them)."""
    if len(fresh) != len(static):
        raise ReplayShapeError(
            f"autocudagraph: a simulated replay computed {len(fresh)} tensors where its capture computed "
            f"{len(static)}: the function took another path than at capture, which a GPU graph would not "
            "follow (it replays the captured kernels). Keep the function's path independent of tensor values "
            "and Python state, or return None from dispatch_key_fn for such calls."
        )
    for i, (s, f) in enumerate(zip(static, fresh)):
        if s.shape != f.shape or s.dtype != f.dtype:
            raise ReplayShapeError(
                f"autocudagraph: a simulated replay computed result #{i} with shape {list(f.shape)} "
                f"({f.dtype}) where its capture computed {list(s.shape)} ({s.dtype}). The shape depends on "
                "tensor values, which a CUDA graph cannot follow: on a GPU such a capture fails (or every "
                f"replay hands out the captured shape). {_FIX}"
            )
