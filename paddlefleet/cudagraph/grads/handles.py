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

import weakref

import paddle
from paddle import _C_ops

__all__ = ["alias", "copy", "GradSwap", "merge_leaf_grads", "rescue_grad", "route_hooks", "routed"]

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


# NOTE [ Hooks on graphed outputs ]
# Paddle runs the hooks registered on a PyLayer's outputs but drops the grads they return: the
# PyLayer's backward gets the grads as they came (measured on 2.6.2 and 3.3.1). Eager passes on what a
# hook returns, so a graphed call must too. Each differentiable output the bridge hands out is
# remembered here (by id, held weakly) with its forward replay's token and its output index; a hook
# registered on such an output (``Tensor._register_grad_hook``, which grads/hook_registry.py wraps for
# the whole process) is wrapped so that it also leaves the grad it returns on that token, and the
# bridge's backward takes that grad instead of the one Paddle passes. Paddle chains the hooks of one
# tensor itself (each gets what the previous one returned), so the last one left is the grad eager
# would pass on. This replaces a differentiable reshape alias of each output, whose own node honours
# hooks: one more op per call and one more node per backward (about 6.5 us of host time per call and
# backward on the CPU, against a weak reference per output), and a reshape grad kernel that Paddle
# 2.6 lacks on Hopper GPUs, where hooks on outputs were lost.
_ROUTES = {}  # id(output) -> (KeyedRef to the output, weakref to its forward replay's token, output index)


def _forget_route(ref):
    route = _ROUTES.get(ref.key)
    if route is not None and route[0] is ref:
        del _ROUTES[ref.key]


def route_hooks(outputs, indices, token_ref):
    """Remembers ``outputs[i]`` for each of ``indices`` as an output of the forward replay whose
    token ``token_ref`` refers to (NOTE [ Hooks on graphed outputs ])."""
    for i in indices:
        o = outputs[i]
        key = id(o)
        _ROUTES[key] = (weakref.KeyedRef(o, _forget_route, key), token_ref, i)


def routed(tensor, hook):
    """``hook`` as it is registered on ``tensor``: for an output of a graphed call, wrapped to also
    leave the grad it returns on the output's token (``token.keep_hooked(index, grad)``), else ``hook``
    itself (NOTE [ Hooks on graphed outputs ])."""
    route = _ROUTES.get(id(tensor))
    if route is None or route[0]() is not tensor:
        return hook
    _, token_ref, index = route

    def routed_hook(grad):
        result = hook(grad)
        token = token_ref()
        if token is not None:  # what Paddle passes on: the hook's result, or its input for None
            token.keep_hooked(index, grad if result is None else result)
        return result

    return routed_hook
