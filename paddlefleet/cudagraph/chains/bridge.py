"""The autograd bridge of a chain (NOTE [ Chains of graphed calls ] in chains/chain.py): one PyLayer
whose forward replays the head's forward graph and makes every member's output, and whose
backward replays the backward graphs of the members that handed out their output, last first.
"""


import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from .. import native
from ..core.call_state import grad_enabled
from ..errors import CudaGraphError
from ..grads.handles import alias, copy
from . import outputs as chain_outputs
from .link_graphs import linked_copy
from .links import OUTSIDE, bar
from ..block.bridge import DOUBLE_BACKWARD, new_token, replay_backward

__all__ = ["ChainFunction", "member_backwards", "replay_forward"]

class ChainFunction(PyLayer):
    """``apply(run, *run.args.args)``: every member's parameters and the head call's tensors (NOTE
    [ paddle.grad through a graphed call ] in block/partial_grad.py). The
    head's static inputs must already hold the call's values. Returns one output per member."""

    @staticmethod
    def forward(ctx, run, *tensors):
        if hasattr(ctx, "set_materialize_grads"):
            ctx.set_materialize_grads(False)  # None for outputs nothing used: their calls never came
        ctx.run = run
        return tuple(_replay_forwards(run))

    @staticmethod
    def backward(ctx, *grads):
        if grad_enabled():
            raise CudaGraphError(DOUBLE_BACKWARD)
        return _replay_backwards(ctx.run, grads)


def _replay_forwards(run):
    """The head's forward replay; returns one output per member: the head's to hand out now,
    the others' to be filled when their call comes (ChainRun.hand_out)."""
    head, later = run.members[0], run.members[1:]
    replay_forward(run, 0)
    outputs = [copy(head.out_buf) if head.clone else alias(head.out_buf)]
    made = iter(_unfilled([m.out_buf for m in later if m.clone]))
    # an alias: the member's replay writes it when its call comes
    outputs += [next(made) if m.clone else alias(m.out_buf) for m in later]
    return outputs


def _unfilled(statics):
    """A new tensor like each of ``statics`` (its shape, dtype and place), unfilled: made in one compiled call where
    the compiled module is loaded (``empty_like_each``: NOTE [ Compiled tensor reads ] in native/__init__.py), else
    one ``_C_ops.empty`` each. A chain's head makes one per later member, while the device waits for the host."""
    compiled = native.reads
    made = compiled.empty_like_each(statics) if compiled is not None and statics else None
    return made if made is not None else [_C_ops.empty(s.shape, s.dtype, s.place) for s in statics]


def replay_forward(run, j):
    """Member ``j``'s forward replay (its static inputs hold its call's values), its in-flight
    token kept by the run (NOTE [ One forward in flight ] in block/bridge.py)."""
    graphs = run.members[j].graphs
    graphs.fwd_graph.replay()
    run.tokens.append(new_token(graphs))
    run.generations.append(graphs.generation)


def _add(a, b):
    """The grad of an output from outside the chain plus the one the next member gave it (two
    terms: the sum is the same in either order, as eager's)."""
    if a is None:
        return b
    if b is None:
        return a
    return paddle.add(a, b)


def _replay_backwards(run, grads):
    """The grads of the bridge's tensors, in the order ChainRun.start gave them."""
    head, params = member_backwards(run, grads)
    return run.args.grads([g for of_member in params for g in of_member] + head)


def member_backwards(run, grads):
    """The backwards of the members that handed out their output, last first: ``(the head call's
    tensors' grads, [each member's parameter grads])``."""
    members, handed = run.members, run.handed
    run.break_at(handed, "backward ran")  # no call is handed an output after its backward
    head_grads = [None] * len(run.call.tensors)
    param_grads = [[None] * len(m.params) for m in members]
    given = None  # the grad the member after this one gave its first argument
    try:
        for j in reversed(range(handed)):
            if grads[j] is not None and j < handed - 1:  # NOTE [ Outputs with consumers outside the chain ]
                bar(members[j].entry, OUTSIDE)
            total = chain_outputs.output_grad(run, j, _add(grads[j], given), given)
            static, given = total is not None and total is given, None
            if total is None:  # nothing reached this output: its call's backward does not run (eager)
                continue
            inputs, param_grads[j] = _replayed_backward(run, j, total, static)
            if j == 0:
                head_grads = inputs
            else:
                given = inputs[0]
    finally:
        for token in run.tokens:
            token.done = True
    return head_grads, param_grads


def _replayed_backward(run, j, grad, static):
    """Member ``j``'s backward graph replayed (its input's grad a static buffer); ``static``: ``grad`` is the next
    member's static input grad, which a link graph may copy into the grad-output buffer (NOTE [ Link graphs ] in
    chains/link_graphs.py)."""
    graphs, token = run.members[j].graphs, run.tokens[j]
    if static and token.hooked is None:
        feed = graphs.grad_feeds[0][1]
        if linked_copy(graphs, feed, grad):
            grad = feed  # replay_backward copies nothing into a buffer handed itself
    plan = replay_backward(graphs, (grad,), run.generations[j], token)
    out = plan.hand_out(inputs=j == 0)
    n = len(run.call.tensors)
    return (list(out[:n]) if j == 0 else [plan.input_grad(0)]), list(out[n:])
