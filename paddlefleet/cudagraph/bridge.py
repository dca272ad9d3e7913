"""The autograd bridge: a PyLayer whose forward replays the forward graph and whose backward
replays the backward graph and hands grads back for every input and parameter.

NOTE [ Parameters through the bridge ]
The parameters of the Layers a call uses are inputs of the PyLayer, so their grads come back
through autograd like any other: Paddle accumulates them into ``p.grad``, runs gradient hooks,
DataParallel's reducer and ``main_grad`` hooks exactly as in eager. The backward graph itself
never writes ``p.grad``.
"""

import weakref

import paddle
from paddle.autograd import PyLayer

from .errors import CudaGraphError, PendingBackwardError
from .grad_groups import unstack
from .grads import alias, copy, hand_out, rescue_grad

__all__ = ["GraphedFunction", "hand_out_outputs"]


class _Token:
    """Lives as long as a forward replay's autograd graph (held by the PyLayer ctx)."""

    __slots__ = ("__weakref__", "done")

    def __init__(self):
        self.done = False


def hand_out_outputs(entry):
    """The output tensors given to the caller: copies, or aliases of the static buffers."""
    if entry.clone_outputs:
        return [copy(t) for t in entry.static_outputs]
    if entry.host_outputs:  # host outputs are always copies (NOTE [ Host tensors ] in safety.py)
        host = entry.host_outputs
        return [copy(t) if i in host else alias(t) for i, t in enumerate(entry.static_outputs)]
    return [alias(t) for t in entry.static_outputs]


def _rescue_adopted_grads(entry):
    """Moves a p.grad that lives in a static grad buffer out of it before the replay writes it.

    With clone_param_grads=False, autograd adopts the handed-out buffer itself as p.grad when
    p.grad is None or was zeroed by ``clear_grad()`` (set_to_zero=True marks it "fake empty":
    the next accumulation assigns instead of adding, and Python cannot see that flag). The next
    replay would then overwrite p.grad, corrupting gradient accumulation (measured, Paddle 3.3.1).
    """
    first_param = len(entry.grad_slots) - len(entry.params)
    for p, slot, clone in zip(entry.params, entry.grad_slots[first_param:], entry.hand_out_clone[first_param:]):
        if not clone and slot is not None:
            rescue_grad(p, entry.static_grads[slot])


def _hand_out_grouped(entry, static):
    """Grads to return when parameters are stacked (NOTE [ Grad groups ]): one copy (or none)
    and one unbind per stack instead of one call per parameter."""
    grads = [None] * len(entry.grad_slots)
    grouped = entry.grouped_positions
    for pos, (slot, clone) in enumerate(zip(entry.grad_slots, entry.hand_out_clone)):
        if slot is not None and pos not in grouped:
            grads[pos] = hand_out(static[slot], clone)
    for stack, positions in entry.grad_groups:
        source = copy(stack) if entry.clone_param_grads else stack
        for pos, view in zip(positions, unstack(source)):
            if entry.grad_slots[pos] is not None:
                grads[pos] = view
    return grads


class GraphedFunction(PyLayer):
    """``apply(entry, *tensors, *params)``: static inputs must already hold the call's values."""

    @staticmethod
    def forward(ctx, entry, *inputs):
        entry.fwd_graph.replay()
        entry.generation += 1
        token = _Token()
        entry.inflight = weakref.ref(token)
        ctx.token = token
        ctx.entry = entry
        ctx.generation = entry.generation
        outputs = hand_out_outputs(entry)
        non_diff = [o for o, d in zip(outputs, entry.out_differentiable) if not d]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        if paddle.is_grad_enabled():
            # Paddle runs a PyLayer's backward with grad enabled only for create_graph=True.
            raise CudaGraphError(
                "autocudagraph: a backward with create_graph=True (double backward, e.g. a gradient "
                "penalty) reached a graphed call. The backward graph returns plain tensors, so second-order "
                "grads would be missing. Run that computation eagerly: return None from dispatch_key_fn for "
                "it, or call the function outside the wrapper (wrapped.__wrapped__)."
            )
        if entry.bwd_graph is None or ctx.generation != entry.generation:
            raise PendingBackwardError(
                f"autocudagraph: backward of forward replay #{ctx.generation} ran after replay "
                f"#{entry.generation} of the same graph overwrote its saved activations. Run backward "
                "before calling the graphed function again with the same key, or wrap the extra calls "
                "in dispatch_key_fn returning None."
            )
        with paddle.no_grad():
            buffers = iter(entry.static_grad_outputs)
            for grad, differentiable in zip(grads, entry.out_differentiable):
                if not differentiable:
                    continue
                buf = next(buffers)
                if grad is None:
                    buf.zero_()
                elif grad is not buf:
                    buf.copy_(grad, False)
        if not entry.clone_param_grads and entry.params:
            _rescue_adopted_grads(entry)
        entry.bwd_graph.replay()
        ctx.token.done = True
        static = entry.static_grads
        grads = [
            None if slot is None else hand_out(static[slot], clone)
            for slot, clone in zip(entry.grad_slots, entry.hand_out_clone)
        ] if not entry.grad_groups else _hand_out_grouped(entry, static)
        return tuple(grads)
