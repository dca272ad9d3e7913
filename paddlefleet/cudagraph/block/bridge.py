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

NOTE [ Bridge inputs ]
The PyLayer takes the bridged parameters (then the anchor) and those of the call's tensors that need
grad, in that order; a tensor that needs no grad gets no grad edge from Paddle and no grad from the
bridge, so leaving it out changes nothing autograd does, and Paddle's apply and backward node cost
grow with every input (measured on a CPU: about 0.3 us per input in apply and 0.8 us in apply and
backward together, on 2.6.2 and on 3.3.1). Which call tensors need grad is fixed per key (the key
holds stop_gradient; with dispatch_key_fn the replay preconditions check it), and the parameters'
stop_gradient by the parameter-address check, so the first tensor the bridge takes needs grad
(NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py) without a search; a call
where it does not takes the general path. BridgePlan decides this, and the order of the grads the
backward returns, once per key.
"""

import operator
import weakref

import paddle
from paddle.autograd import PyLayer

from ..core.call_state import grad_enabled
from ..errors import CudaGraphError, PendingBackwardError
from ..grads.accumulate import own_backward
from ..grads.handles import alias, copy
from . import partial_grad

__all__ = ["DOUBLE_BACKWARD", "BridgePlan", "GraphedFunction", "Token", "hand_out_outputs", "new_token",
           "replay_backward"]


class Token:
    """Lives as long as a forward replay's autograd graph (held by the PyLayer ctx); ``hooked``: the
    grads hooks on its outputs returned, by output index (NOTE [ Hooks on graphed outputs ] in
    grads/handles.py), or None; ``watch``: what the block's hooks (block/hooks.py) run after this
    replay's backward, ``watch(grad, given)`` with the grad Paddle passed its first output and the
    grad it gave its first input, or None; ``timer``: ``(BackwardTimes, call number)``, where this
    replay's backward marks its start (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py), or None."""

    __slots__ = ("__weakref__", "done", "hooked", "watch", "timer")

    def __init__(self):
        self.done = False
        self.hooked = None
        self.watch = None
        self.timer = None

    def keep_hooked(self, index, grad):
        if self.hooked is None:
            self.hooked = {}
        self.hooked[index] = grad


def new_token(graphs):
    """The token of a forward replay of ``graphs`` just made (NOTE [ One forward in flight ])."""
    graphs.generation += 1
    token = Token()
    graphs.inflight = weakref.ref(token)
    if graphs.backend.replays_python:  # NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py
        partial_grad.note_pending(token)
    return token


def hand_out_outputs(graphs):
    """The output tensors given to the caller: copies, or aliases of the static buffers."""
    if graphs.clone_outputs:
        return [copy(t) for t in graphs.static_outputs]
    if graphs.host_outputs:  # host outputs are always copies (NOTE [ Host tensors ] in io/host_tensors.py)
        host = graphs.host_outputs
        return [copy(t) if i in host else alias(t) for i, t in enumerate(graphs.static_outputs)]
    return [alias(t) for t in graphs.static_outputs]


class BridgePlan:
    """What every replay of one key passes through the bridge and hands back, decided once at capture
    (NOTE [ Bridge inputs ]; BlockGraphs.settle).

    Attributes:
        n: the call's tensors; needs: the indices of those that need grad (the key fixes which);
        tail: the bridged parameters, then the anchor; ids: ``id`` of each tail tensor where Paddle
            keeps one grad edge per argument (2.6: BridgeArgs.ids), else None;
        order: per bridge input, the index of its grad in GradPlan.hand_out() (None: the anchor's).
    """

    __slots__ = ("n", "needs", "tail", "ids", "order", "_pick")

    def __init__(self, graphs):
        backward, buffers = graphs.backward, graphs.static_inputs.buffers
        self.n = n = len(buffers)
        self.tail = tuple(backward.bridged) + (() if backward.anchor is None else (backward.anchor,))
        needs = tuple(i for i, b in enumerate(buffers) if not b.stop_gradient)
        self.needs = needs if self.tail or needs else None  # None: nothing needs grad, every tensor goes
        self.ids = None if partial_grad.one_slot() else [id(t) for t in self.tail]
        self.order = order = tuple(range(n, n + len(backward.bridged))) + \
            (() if backward.anchor is None else (None,)) + (needs if self.needs is not None else tuple(range(n)))
        # One C call picks every grad (itemgetter of one index returns the item itself, not a tuple).
        self._pick = operator.itemgetter(*order) if len(order) > 1 and None not in order else None

    def args(self, tensors):
        """The BridgeArgs of a call's ``tensors``."""
        needs = self.needs
        if needs is None:
            return partial_grad.BridgeArgs(list(self.tail) + tensors, len(self.tail))
        bridged = list(self.tail)
        bridged += [tensors[i] for i in needs]
        if bridged[0].stop_gradient:  # never, where the key and the parameter check held: the general path
            return partial_grad.BridgeArgs(bridged, len(self.tail))
        ids = self.ids
        if ids is not None and needs:  # read only by BridgeArgs: the tail's are shared by every call
            ids = ids + [id(t) if t.is_leaf else None for t in bridged[len(ids):]]
        return partial_grad.BridgeArgs.leading(bridged, ids)

    def grads(self, handed):
        """GradPlan.hand_out()'s grads (the call tensors', then the parameters') in the bridge's order."""
        pick = self._pick
        if pick is not None:
            return list(pick(handed))
        return [None if j is None else handed[j] for j in self.order]


class GraphedFunction(PyLayer):
    """``apply(graphs, args, *args.args)`` with ``args = graphs.bridge.args(tensors)``: static
    inputs must already hold the call's values."""

    @staticmethod
    def forward(ctx, graphs, args, *inputs):
        graphs.fwd_graph.replay()
        ctx.held = (graphs, args, new_token(graphs), graphs.generation)  # one attribute of the C++ ctx
        outputs = hand_out_outputs(graphs)
        if graphs.non_diff_at:  # NOTE [ Replay work decided at capture ] in block/replay.py
            ctx.mark_non_differentiable(*[outputs[i] for i in graphs.non_diff_at])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if grad_enabled():
            raise CudaGraphError(DOUBLE_BACKWARD)
        graphs, args, token, generation = ctx.held
        timer = token.timer
        if timer is not None:  # a timed replay: its backward starts here
            timer[0].started(timer[1], True)
        try:
            plan = replay_backward(graphs, grads, generation, token)
        except BaseException:
            token.done = True  # Paddle never runs a failed backward again: the forward waits no more
            raise
        handed = plan.hand_out()
        if token.watch is not None:  # the block's hooks watch this backward (see Token)
            token.watch(grads[0], handed[0])
        return args.grads(graphs.bridge.grads(handed))


#: Paddle runs a PyLayer's backward with grad enabled only for create_graph=True.
DOUBLE_BACKWARD = (
    "autocudagraph: a backward with create_graph=True (double backward, e.g. a gradient "
    "penalty) reached a graphed call. The backward graph returns plain tensors, so second-order "
    "grads would be missing. Run that computation eagerly: return None from dispatch_key_fn for "
    "it, or call the function outside the wrapper (wrapped.__wrapped__)."
)


def replay_backward(graphs, grads, generation, token):
    """One backward replay of ``graphs`` for its forward replay number ``generation`` (whose
    ``token`` it marks done): ``grads`` holds one grad per output (None where none reached it).
    Returns the GradPlan of the buffer set the replay wrote; its hand_out() gives the grads.
    The bridge's backward and a chain's (chains/bridge.py) both run it, grad mode off."""
    backward = graphs.backward
    if backward is None or backward.graph is None or generation != graphs.generation:
        raise PendingBackwardError(
            f"autocudagraph: backward of forward replay #{generation} ran after replay "
            f"#{graphs.generation} of the same graph overwrote its saved activations. Run backward "
            "before calling the graphed function again with the same key, or wrap the extra calls "
            "in dispatch_key_fn returning None."
        )
    hooked = token.hooked  # grads the outputs' hooks returned: NOTE [ Hooks on graphed outputs ] in grads/handles.py
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
    if graphs.backend.replays_python:  # a replay that runs the body: NOTE [ Shared parameters leave the graph ]
        with own_backward():
            graph.replay()
    else:  # a replay that runs no Python runs no hook to quiet (and no context manager's host time)
        graph.replay()
    token.done = True
    graphs.answered = generation  # NOTE [ Outputs that need grad, and no backward ] in block/slots.py
    if acc is not None:
        acc.combine(plan.static_grads[len(plan.static_grads) - len(acc.params):])
        acc.after_backward()
    return plan
