"""Gradient bookkeeping: the "no trace" .grad swap around captured backward runs, and the
policy for handing grads back from static buffers.

NOTE [ Paddle .grad handles ]
In Paddle, ``t.grad`` returns a handle that shares the gradient's tensor object, and both
``t.grad = None`` and ``clear_gradient(False)`` release the storage *of every handle sharing
it*; ``t.grad = value`` copies ``value`` into the gradient. So a saved gradient must be held
through a view (a new tensor object on the same storage), and a gradient handed back to
autograd must not be a static buffer: when ``p.grad`` is None autograd adopts the returned
tensor itself, the next backward accumulates into it in place, and ``clear_gradient(False)``
frees it (measured on Paddle 3.3.1). Autograd adopts the same way after
``clear_gradient(True)``: it marks the zeroed grad "fake empty" and the next accumulation
assigns instead of adding. ``t.grad_ = g`` (no copy) re-points the slot at ``g``'s tensor
without freeing anything; GradSwap and rescue_grad use it where Paddle has it.
"""

import paddle
from paddle import _C_ops

from ..io.static_inputs import place_key

__all__ = ["alias", "can_hook", "copy", "GradSwap", "hookable", "merge_leaf_grads", "rescue_grad"]

# The C++ entry points skip Paddle's Python wrappers (measured: view 9.7 us -> 4.6 us,
# clone 9.2 us -> 6.9 us per call on the host); both are copies/views, no arithmetic kernel.
_VIEW = getattr(_C_ops, "view_shape", None)
_ASSIGN = getattr(_C_ops, "assign", None)


def copy(t):
    """A new tensor with ``t``'s values (one device copy), not attached to autograd."""
    if _ASSIGN is not None:
        out = _ASSIGN(t)
        out.stop_gradient = True
        return out
    with paddle.no_grad():
        return t.clone()


def alias(t, shape=None):
    """A new tensor object on ``t``'s storage (no copy), or None for None; ``shape``: ``t``'s own,
    where the caller has it at hand (reading ``t.shape`` builds a new list each time)."""
    if t is None:
        return None
    if _VIEW is not None:
        return _VIEW(t, t.shape if shape is None else shape)
    if hasattr(t, "view"):
        return t.view(t.shape)
    return copy(t)  # Paddle without views: a copy is the safe alias


# ``t.grad_ = g`` re-points t's gradient slot at g's tensor (no copy, nothing freed), unlike
# ``t.grad = g`` (copies) and ``t.grad = None`` (frees every handle's storage).
_REBIND_GRAD = isinstance(getattr(paddle.Tensor, "grad_", None), type(paddle.Tensor.grad))


def _empty_grad(t):
    """A tensor without storage: a .grad slot holding it reads as None and is filled fresh by
    the next backward."""
    empty = paddle.empty([0], dtype=t.dtype)
    empty._clear_data()
    return empty


class GradSwap:
    """Runs a backward with every given tensor's ``.grad`` empty, collects the grads it made,
    and puts the original grads back: the same gradient tensors, so handles to them taken
    before (by the user, an optimizer or a reducer) stay valid and see later accumulation
    (NOTE [ Paddle .grad handles ]).

    Usage::

        swap = GradSwap(leaves)
        with swap:
            paddle.autograd.backward(outputs, grad_outputs)
        grads = swap.collected  # one tensor (or None) per leaf, detached from .grad
    """

    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.collected = None
        self._saved = None

    def __enter__(self):
        self._saved = []
        for t in self.tensors:
            g = t.grad
            if _REBIND_GRAD:
                self._saved.append(g)
                if g is not None:
                    t.grad_ = _empty_grad(t)
                continue
            self._saved.append(alias(g))
            if g is not None:
                t.grad = None
        return self

    def __exit__(self, exc_type, exc, tb):
        collected = []
        for t, saved in zip(self.tensors, self._saved):
            g = t.grad
            if _REBIND_GRAD:
                collected.append(g)
                if saved is not None:
                    t.grad_ = saved
                elif g is not None:
                    t.grad_ = _empty_grad(t)
                continue
            collected.append(alias(g))
            if g is not None:
                t.grad = None
            if saved is not None:
                t.grad = saved
        self.collected = collected
        self._saved = None
        return False


# ``src._share_buffer_to(dst)`` points dst's tensor at src's storage in place: every handle of
# dst (``g = p.grad`` held by the user, an optimizer, a hook) follows, as it follows eager's
# in-place accumulation (NOTE [ Moving an adopted grad ]).
_SHARE_BUFFER = hasattr(paddle.Tensor, "_share_buffer_to")


def rescue_grad(t, buffer):
    """If ``t.grad`` shares ``buffer``'s storage, moves it to a private copy (same values).

    NOTE [ Moving an adopted grad ]
    In eager, ``g = p.grad`` is the same tensor as ``p.grad`` for as long as accumulation adds in
    place: later micro-batches show in ``g``. So an adopted grad is not replaced by a copy
    (``t.grad_ = copy``: ``g`` would keep pointing at the static buffer, which the next replay
    overwrites) but moved: the gradient tensor itself is pointed at the copy's storage, which
    every handle to it sees. Paddle without ``_share_buffer_to`` re-points the grad slot
    instead, and without ``grad_`` cannot do either; there clone_param_grads=False is only as safe
    as its documentation says.
    """
    g = t.grad
    if g is None or g.data_ptr() != buffer.data_ptr():
        return
    if _SHARE_BUFFER:
        copy(g)._share_buffer_to(g)
    elif _REBIND_GRAD:
        t.grad_ = copy(g)


def merge_leaf_grads(returned, collected):
    """Per leaf: the grad paddle.grad returned plus any grad an inner backward (reentrant
    recompute) accumulated into ``.grad`` (collected by a GradSwap)."""
    return [c if r is None else (r if c is None else r + c) for r, c in zip(returned, collected)]


_RESHAPE = getattr(_C_ops, "reshape", None)
_HOOKABLE = {}


def _reshape_passes_grads(t):
    """Whether a reshape of a tensor like ``t`` is a differentiable alias whose backward runs and
    passes grads through unchanged on its place (checked once per place and dtype, by value: a
    missing kernel can return garbage without raising on a GPU Paddle was not built for)."""
    key = (place_key(t.place), t.dtype)
    known = _HOOKABLE.get(key)
    if known is not None:
        return known
    if not t.size:  # nothing to probe with; an empty output has no grad to hook anyway
        return False
    ok = False
    if _RESHAPE is not None:
        try:
            probe = copy(t.reshape([-1])[:1])
            probe.stop_gradient = False
            out = _RESHAPE(probe, probe.shape)
            seed = copy(probe)
            (grad,) = paddle.grad([out], [probe], [seed])
            ok = out.data_ptr() == probe.data_ptr() and grad.numpy().tobytes() == seed.numpy().tobytes()
        except Exception:  # no kernel for the reshape's grad on this place
            ok = False
    _HOOKABLE[key] = ok
    return ok


def can_hook(t):
    """Whether hookable() can alias tensors like ``t``: Paddle ignores hooks registered on a
    PyLayer's outputs, so a differentiable alias (a reshape to its own shape, no copy) is handed
    out instead, where such an alias passes grads through unchanged on ``t``'s place (Paddle 2.6
    on a GPU has no view_shape grad kernel; reshape is checked by value once per place)."""
    return _reshape_passes_grads(t)


def hookable(t, shape=None):
    """``t`` as a differentiable alias whose hooks run (see can_hook(), checked by the caller);
    ``shape``: ``t``'s own, where the caller has it at hand."""
    return _RESHAPE(t, t.shape if shape is None else shape)
