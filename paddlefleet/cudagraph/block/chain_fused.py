"""Fused chains: a chain whose members are pure replayed as one forward graph and one backward
graph (NOTE [ Fused chains ]).

NOTE [ Fused chains ]
A chain (NOTE [ Chains of graphed calls ] in block/chain.py) still launches two graphs per member
and copies between them; for small members (a layer of one matmul) the launches alone cost about
what the eager kernels do. So where every member is *pure* (its capture drew no random numbers
and its Layers hold no buffers or running statistics: BlockGraphs.pure), returns its output itself and takes no argument but
the previous output, the chain captures once more, as one block: a function calling every member
in turn and returning every output (block/capture.py, as any key). Then:

* the chain's first call replays that one forward graph and hands out every output (one PyLayer,
  FusedFunction); each later call is only checked and handed its output. Where the outputs share
  shape and dtype (layers of one width), the graph also copies them into one stack (device copies
  inside the graph) and the first call hands out views of ONE copy of that stack: one copy per run
  instead of one per output, each a fresh tensor no later replay writes (a handed-out output keeps
  the run's other outputs' memory alive while it lives: they share the copy). The forwards ran ahead
  of their calls, so a call is handed its output only if nothing its forward read changed since:
  its parameters (inplace versions, and no ``set_value`` / ``copy_`` anywhere in the process since
  the first call: WRITES), the previous output (same object, inplace version), grad mode, AMP, its
  Layers' training flags. Otherwise the chain breaks there and that call runs alone.
* backward replays the one backward graph when the run was *regular*: every call came, the last
  output got a grad, no other output got one from outside the chain, no hook or retain_grads() was
  taken on an output. That graph is captured from the last output alone (the fused function returns
  the others detached: views, no kernel), so it runs each member's backward kernels as eager does,
  with nothing added between them: each grad is eager's bit for bit.
* any other backward *recomputes* the members that handed out their output: with their own
  graphs, or eagerly where another call has taken those since (NOTE [ Recomputing a fused run ]
  in block/chain_recompute.py). Pure members make the recompute draw and write nothing eager
  would not.

A fused capture that fails leaves the chain unfused (one warning-free fallback, the reason kept
in ``Chain.fused_refusal``).
"""


import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from ..core.paddle_patches import install_for_process
from ..errors import CudaGraphError
from ..grads.handles import alias, copy
from .bridge import DOUBLE_BACKWARD, bridge_grads, hand_out_outputs, new_token, replay_backward
from .capture import CaptureRequest, capture_block
from .chain_recompute import recompute

__all__ = ["WRITES", "FusedFunction", "build_fused", "fusable", "install"]

#: Bumped by every ``Tensor.set_value`` and ``Tensor.copy_`` in the process: writes that leave a
#: tensor's inplace version alone (NOTE [ Fused chains ]).
WRITES = [0]


def install():
    """Counts ``set_value`` and ``copy_`` into WRITES, once per process (NOTE [ Paddle patches ] in
    core/paddle_patches.py)."""
    for name in ("set_value", "copy_"):
        original = getattr(paddle.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            WRITES[0] += 1
            return _original(self, *args, **kwargs)

        counting.__doc__ = getattr(original, "__doc__", None)
        counting.__name__ = name
        install_for_process(paddle.Tensor, name, counting)


def fusable(members, call):
    """Whether a chain of ``members`` with ``call``'s arguments may be fused (see the NOTE)."""
    if len(call.tensors) != 1 or len(call.args) != 1 or call.kwargs:
        return False
    clone = members[0].clone
    return all(m.graphs.pure and m.bare and m.clone == clone for m in members)


def build_fused(members, call):
    """The fused BlockGraphs of ``members`` captured from ``call``, or raises (the chain stays unfused)."""
    head = members[0]
    stacked = [False]  # whether the capture's outputs stack (same shape and dtype): see the NOTE

    def fused(owners, x):  # owners: the members' Layers, so that the capture sees their parameters
        outs, h = [], x
        for member in members:
            h = member.body.run((h,), {})
            outs.append(h)
        # The backward graph takes the last output's grad only (see the NOTE): the others are handed
        # out detached and their grads from outside make a backward irregular.
        stacked[0] = all(o.shape == h.shape and o.dtype == h.dtype for o in outs)
        if stacked[0]:
            stack = _C_ops.empty([len(outs)] + list(h.shape), h.dtype, h.place)
            for view, out in zip(stack.unbind(0), outs):
                _C_ops.assign_out_(out.detach(), view)  # device copies, recorded in the graph
            return stack, outs[-1]
        return tuple(o.detach() for o in outs[:-1]) + (outs[-1],)

    fused.__name__ = f"chain of {len(members)} calls"
    owners = paddle.nn.LayerList([o for o in (m.body.owner() for m in members) if isinstance(o, paddle.nn.Layer)])
    request = CaptureRequest(fused, owners, head.body.options, head.entry.backend, call, [("x", call.args[0])], None,
                             lambda topic, message: None, fused.__name__)
    graphs = capture_block(request)
    backward = graphs.backward
    graphs.stacked = stacked[0]
    last = len(graphs.static_outputs) - 1
    if backward is None or backward.accumulators is not None or graphs.diff_at != (last,):
        graphs.release()
        raise CudaGraphError("the fused chain has no plain backward graph from its last output")
    return graphs


class FusedFunction(PyLayer):
    """``apply(run, fused, args, *args.args)``: the fused graph's static input holds the call's value."""

    @staticmethod
    def forward(ctx, run, fused, args, *tensors):
        if hasattr(ctx, "set_materialize_grads"):
            ctx.set_materialize_grads(False)
        fused.fwd_graph.replay()
        ctx.token = run.fused_token = new_token(fused)
        ctx.run, ctx.fused, ctx.args, ctx.generation = run, fused, args, fused.generation
        if fused.stacked:  # one copy of the stack, one view per output
            stack = fused.static_outputs[0]
            return tuple((copy(stack) if fused.clone_outputs else alias(stack)).unbind(0))
        return tuple(hand_out_outputs(fused))

    @staticmethod
    def backward(ctx, *grads):
        if paddle.is_grad_enabled():
            raise CudaGraphError(DOUBLE_BACKWARD)
        run, fused = ctx.run, ctx.fused
        try:
            if run.regular(grads):
                fed = (None, grads[-1]) if fused.stacked else grads  # the fused graph's outputs
                plan = replay_backward(fused, fed, ctx.generation, ctx.token)  # fed the last output's grad
                out = bridge_grads(fused.backward, plan.hand_out(), len(fused.static_inputs.buffers))
            else:
                out = recompute(run, grads, fused)
        finally:
            ctx.token.done = True
        return ctx.args.grads(out)
