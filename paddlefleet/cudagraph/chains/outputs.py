"""The outputs a chain handed out, whose grad the next member's part never passes through
autograd (NOTE [ Chains of graphed calls ] in chains/chain.py): their hooks and retain_grads()
are kept and applied by the chain's backward, and paddle.grad with respect to one of them that
the next member consumed is refused.

NOTE [ Hooks on a chain's outputs ]
Eagerly, a hook registered on a layer's output gets the whole grad of that output: what the
next layer gave it plus what other consumers gave it. In a chain, the next layer's part is
computed inside the chain's one grad node, so a hook Paddle ran would see only the others'. So
the registration of a hook on an output a chain handed out, and ``retain_grads()`` on one, are
taken by the chain (grads/hook_registry.py lets one taker answer first): its backward adds both
parts, runs the hooks in the order they were registered (a hook's result replaces the grad, as in
Paddle) and retains the grad where asked; ``remove()`` of such a hook works as usual.
"""

import paddle

from ..guards.paddle_patches import install_for_process
from ..errors import CudaGraphError
from ..grads import hook_registry
from ..grads.handles import copy
from .table import TABLE
from ..block import partial_grad

__all__ = ["install", "output_grad", "track"]

def track(run):
    TABLE.runs.add(run)


def _find(t):
    """``(run, index)`` of an output a chain handed out, or None."""
    for run in list(TABLE.runs):
        j = run.index_of(t)
        if j is not None:
            return run, j
    return None


def output_grad(run, j, total, given):
    """The grad member ``j``'s backward gets: ``total`` after the hooks taken for output ``j``
    (NOTE [ Hooks on a chain's outputs ]); ``given`` is the part that is a static buffer (a hook may
    keep what it is handed: it gets a copy)."""
    hooks = run.hooks.get(j)
    if not hooks or total is None:
        return total
    if total is given:
        total = copy(total)
    for _, hook in hooks:
        if hook is None:
            out = run.refs[j]()
            if out is not None:
                out._copy_gradient_from(total)
            continue
        result = hook(total)
        if result is not None:
            total = result
    return total


def _at_output(t, act):
    """``act(run, index)`` when ``t`` is an output a chain handed out, else None (Paddle's own way)."""
    found = _find(t)
    return None if found is None else act(*found)


def _take_hook(t, hook):
    return _at_output(t, lambda run, j: _add_hook(run, j, hook))


def _add_hook(run, j, hook):
    """Keeps ``hook`` (None: retain_grads()) for output ``j``; returns its id."""
    hook_id = next(TABLE.hook_ids)
    run.hooks.setdefault(j, []).append((hook_id, hook))
    return hook_id


def _drop_hook(t, hook_id):
    return _at_output(t, lambda run, j: _remove_hook(run, j, hook_id))


def _remove_hook(run, j, hook_id):
    hooks = run.hooks.get(j, [])
    kept = [(i, h) for i, h in hooks if i != hook_id]
    if len(kept) == len(hooks):
        return None
    if kept:
        run.hooks[j] = kept
    else:
        del run.hooks[j]
    return True


def install():
    """Lets chains take hooks and retain_grads(), and checks paddle.grad first (NOTE [ paddle.grad
    through a graphed call ] in block/partial_grad.py), once per process, from the first wrapper with
    chain_calls=True (NOTE [ Paddle patches ] in guards/paddle_patches.py)."""
    hook_registry.set_taker(_take_hook, _drop_hook)
    retain = paddle.Tensor.retain_grads

    def retain_grads(self):
        if _at_output(self, lambda run, j: _add_hook(run, j, None)) is None:
            return retain(self)
        return None

    retain_grads.__doc__ = getattr(retain, "__doc__", None)
    install_for_process(paddle.Tensor, "retain_grads", retain_grads)
    partial_grad.add_check(_refuse_partial_grad)


def _refuse_partial_grad(inputs):
    """paddle.grad is refused, before Paddle starts it, with respect to an output the next call of
    its chain consumed."""
    for t in inputs or ():
        found = _find(t) if isinstance(t, paddle.Tensor) else None
        if found is not None and found[1] < found[0].handed - 1:
            raise CudaGraphError(
                "autocudagraph: paddle.grad with respect to the output of a graphed call that the next graphed "
                "call took as its input, both replayed as one chain (NOTE [ Chains of graphed calls ] in "
                "chains/chain.py): the grad the next call gives it is computed inside the chain and would be "
                "missing. Pass chain_calls=False to autocudagraph for these calls.")
