"""Static input buffers and the copy-in that skips same-address inputs; what a graph fixes of a
tensor (``tensor_meta``, ``place_key``) and its size.

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
value (NOTE [ Host tensors ] in io/host_tensors.py) and never copied.

NOTE [ Strided static outputs ]
A function may return a view of another output or of an input (``h, h[:, :3]``, ``h.t()``,
``x[1:]``). Such an output is a non-contiguous static buffer, and a simulated replay copies the
fresh result into it with ``Tensor.copy_``. Paddle 2.6 copies into a non-contiguous destination as
if it were contiguous (measured on 2.6.2: ``h[:, :3].copy_(v)`` fills the first six elements of
``h``), which writes wrong values into the view and corrupts the tensor it views. Where a probe
finds that (feature detection, once), the static output of a non-contiguous result is a
contiguous copy of it made by the captured forward (``contiguous_outputs``), outside autograd:
the backward still differentiates the function's own results, so the grads flow, and are summed,
exactly as in eager (a differentiable clone would add a node and change the order in which
autograd sums the grads of the tensor viewed).
"""

import numpy as np
import paddle

from ..errors import InputMismatchError

__all__ = ["StaticInputs", "tensor_meta", "key_meta", "place_key", "numel", "nbytes", "contiguous_outputs",
           "strided_copy_works"]


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


def key_meta(t):
    """tensor_meta as a call's key holds it: the dtype as its int (NOTE [ Cheap key parts ] in core/keys.py)."""
    return (tuple(t.shape), int(t.dtype), place_key(t.place), t.stop_gradient)


def numel(t):
    """Number of elements, from the shape (Tensor.numel() is a device op)."""
    size = 1
    for d in t.shape:
        size *= d
    return size


def nbytes(t):
    """Bytes of a tensor's elements."""
    return numel(t) * t.element_size()


_STRIDED_COPY = []  # [bool] once probed: copy_ honours a non-contiguous destination's strides


def strided_copy_works():
    """Whether ``Tensor.copy_`` writes a non-contiguous destination through its strides (probed
    once on the host, before any capture: a probe inside one would be a host read; NOTE [ Strided
    static outputs ])."""
    if not _STRIDED_COPY:
        cpu = paddle.CPUPlace()
        with paddle.no_grad():
            base = paddle.to_tensor(np.zeros([2, 2], dtype="float32"), place=cpu)
            view = base[:, :1]
            if view.is_contiguous():  # no strided views on this Paddle: nothing to get wrong
                _STRIDED_COPY.append(True)
            else:
                view.copy_(paddle.to_tensor(np.ones([2, 1], dtype="float32"), place=cpu), False)
                _STRIDED_COPY.append(base.numpy().tolist() == [[1.0, 0.0], [1.0, 0.0]])
    return _STRIDED_COPY[0]


def contiguous_outputs(tensors):
    """``tensors`` with each non-contiguous one replaced by a contiguous copy outside autograd (one per distinct
    tensor, so an output returned twice stays one tensor) where ``copy_`` cannot write a strided
    static output (NOTE [ Strided static outputs ]); else ``tensors`` unchanged. strided_copy_works()
    must have run (before the capture)."""
    if _STRIDED_COPY[0] or all(t.is_contiguous() for t in tensors):
        return tensors
    clones = {}
    out = []
    for t in tensors:
        if not t.is_contiguous():
            if id(t) not in clones:
                with paddle.no_grad():
                    clones[id(t)] = t.clone()
            t = clones[id(t)]
        out.append(t)
    return out


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

    def written(self, skip=()):
        """Names of the buffers written in place since they were made (by the function), but those
        at the indices ``skip``."""
        return [self.name(i) for i, (b, v) in enumerate(zip(self.buffers, self._versions))
                if b._inplace_version() != v and i not in skip]

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
        """Copies the call's tensors into the buffers; returns ``(copied, skipped)``.

        NOTE [ Copy-in without no_grad ]
        ``Tensor.copy_`` writes values only: it records no autograd node, leaves the buffer a leaf
        with its own stop_gradient and does not bump its inplace version, with grad enabled or not
        (measured on 2.6.2 and 3.3.1; InputCopiesTest in tests/block/test_safety.py pins it). So it
        runs without a ``no_grad()`` block, whose context manager cost about a microsecond per replay.
        """
        copied, skipped = 0, len(self.host)  # host inputs: same value by key, nothing to copy
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
