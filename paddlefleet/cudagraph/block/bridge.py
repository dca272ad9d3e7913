"""The autograd bridge: a PyLayer whose forward replays the forward graph and whose backward
replays the backward graph and hands grads back for every input and parameter.

NOTE [ Parameters through the bridge ]
The parameters of the Layers a call uses are inputs of the PyLayer, so their grads come back
through autograd like any other: Paddle accumulates them into ``p.grad``, runs gradient hooks,
DataParallel's reducer and ``main_grad`` hooks exactly as in eager. The backward graph itself
never writes ``p.grad``.

NOTE [ One forward in flight ]
A forward replay's saved activations live in the graphs' static buffers until its backward
replay reads them. Each forward replay bumps ``graphs.generation`` and leaves a token that the
PyLayer ctx keeps alive; a backward whose generation is not the latest raises
PendingBackwardError instead of reading activations a later replay overwrote. A key keeps
several forwards in flight with one BlockGraphs per forward (NOTE [ Slots ] in block/slots.py):
a call never replays a slot whose token is still pending.
"""

import weakref

import paddle
from paddle.autograd import PyLayer

from ..errors import CudaGraphError, PendingBackwardError
from ..grads.accumulate import own_backward
from ..grads.handles import alias, copy

__all__ = ["GraphedFunction", "hand_out_outputs"]


class _Token:
    """Lives as long as a forward replay's autograd graph (held by the PyLayer ctx); ``hooked``: the
    grads hooks on its outputs returned, by output index (NOTE [ Hooks on graphed outputs ] in
    grads/handles.py), or None."""

    __slots__ = ("__weakref__", "done", "hooked")

    def __init__(self):
        self.done = False
        self.hooked = None

    def keep_hooked(self, index, grad):
        if self.hooked is None:
            self.hooked = {}
        self.hooked[index] = grad


def hand_out_outputs(graphs):
    """The output tensors given to the caller: copies, or aliases of the static buffers."""
    if graphs.clone_outputs:
        return [copy(t) for t in graphs.static_outputs]
    if graphs.host_outputs:  # host outputs are always copies (NOTE [ Host tensors ] in io/host_tensors.py)
        host = graphs.host_outputs
        return [copy(t) if i in host else alias(t) for i, t in enumerate(graphs.static_outputs)]
    return [alias(t) for t in graphs.static_outputs]


class GraphedFunction(PyLayer):
    """``apply(graphs, *tensors, *bridged params[, anchor])``: static inputs must already hold the
    call's values."""

    @staticmethod
    def forward(ctx, graphs, *inputs):
        graphs.fwd_graph.replay()
        graphs.generation += 1
        token = _Token()
        graphs.inflight = weakref.ref(token)
        ctx.token = token
        ctx.graphs = graphs
        ctx.generation = graphs.generation
        outputs = hand_out_outputs(graphs)
        if graphs.non_diff_at:  # NOTE [ Replay work decided at capture ] in block/replay.py
            ctx.mark_non_differentiable(*[outputs[i] for i in graphs.non_diff_at])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        if paddle.is_grad_enabled():
            # Paddle runs a PyLayer's backward with grad enabled only for create_graph=True.
            raise CudaGraphError(
                "autocudagraph: a backward with create_graph=True (double backward, e.g. a gradient "
                "penalty) reached a graphed call. The backward graph returns plain tensors, so second-order "
                "grads would be missing. Run that computation eagerly: return None from dispatch_key_fn for "
                "it, or call the function outside the wrapper (wrapped.__wrapped__)."
            )
        backward = graphs.backward
        if backward is None or backward.graph is None or ctx.generation != graphs.generation:
            raise PendingBackwardError(
                f"autocudagraph: backward of forward replay #{ctx.generation} ran after replay "
                f"#{graphs.generation} of the same graph overwrote its saved activations. Run backward "
                "before calling the graphed function again with the same key, or wrap the extra calls "
                "in dispatch_key_fn returning None."
            )
        # Grad mode is off here (checked above): the copies record nothing without a no_grad() block.
        hooked = ctx.token.hooked  # grads the outputs' hooks returned: NOTE [ Hooks on graphed outputs ]
        for i, buf in graphs.grad_feeds:  # (output index, its grad-output buffer), decided at capture
            grad = grads[i] if hooked is None else hooked.pop(i, grads[i])
            if grad is None:
                buf.zero_()
            elif grad is not buf:
                buf.copy_(grad, False)
        acc = backward.accumulators
        if acc is not None:
            acc.prepare()
        graph, plan, adopted = backward.sets.next()
        plan.before_replay(adopted)
        with own_backward():  # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py
            graph.replay()
        ctx.token.done = True
        if acc is not None:
            acc.combine(plan.static_grads[len(plan.static_grads) - len(acc.params):])
            acc.after_backward()
        grads = plan.hand_out()
        return grads if backward.anchor is None else grads + (None,)
