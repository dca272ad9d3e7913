"""The backward body of a block: what its backward graph captures (NOTE [ Backward body ] in
block/capture.py), made by one call, ``backward_body``, and kept (``BackwardBody``) to capture a
second backward graph later (NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py)."""

import paddle

from ..backends import own_grad
from . import hook_registry
from . import stacks as grad_stacks
from .accumulate import Accumulators, split_params
from .hand_out_plan import GradPlan
from .handles import GradSwap, merge_leaf_grads

__all__ = ["BackwardBody", "backward_body"]


class BackwardBody:
    """What a backward graph is captured from: ``body()`` (the function captured), its
    ``grad_outputs`` (static buffers the bridge fills with the outputs' grads before a replay) and
    what the grads go to: the ``accumulators`` (accumulate_in_graph, else None) or the ``bridged``
    parameters; ``anchor``: a leaf that needs grad for the bridge when nothing else it takes does."""

    def __init__(self, body, grad_outputs, hooks, n_leaves, live, needs_grad, bridged, policy, accumulators, anchor):
        self.body, self.grad_outputs, self.hooks, self.n_leaves, self.live = body, grad_outputs, hooks, n_leaves, live
        self.needs_grad, self.bridged, self.policy = needs_grad, bridged, policy
        self.accumulators, self.anchor = accumulators, anchor

    def plan(self, results):
        """The GradPlan of a backward graph's results (grads, then same-shape stacks)."""
        static_grads = results[: self.n_leaves]
        stacks = []
        for idxs, stack in zip(self.live["grad_groups"], results[self.n_leaves:]):
            for i, view in zip(idxs, grad_stacks.unstack(stack)):
                if static_grads[i] is not None:  # a stacked parameter without a grad gets none
                    static_grads[i] = view
            stacks.append((stack, idxs))
        return GradPlan(static_grads, self.needs_grad, self.bridged, self.policy, stacks)


def backward_body(live, static_outputs, out_differentiable, input_buffers, params, options, by_grad, call_tensors=()):
    """The BackwardBody of a captured forward: grads of its differentiable outputs (``live``
    holds them) with respect to the ``input_buffers`` that need grad and the ``params``; with
    ``options.accumulate_in_graph`` added into new Accumulators (NOTE [ Accumulation inside the
    graph ] in grads/accumulate.py), except for shared parameters, which like all parameters
    without it are handed through the bridge (NOTE [ Shared parameters leave the graph ] there;
    ``call_tensors``: the call's own tensors). ``by_grad``: differentiate with paddle.grad (else
    paddle.autograd.backward)."""
    needs_grad = [not b.stop_gradient for b in input_buffers]
    inputs = [b for b, n in zip(input_buffers, needs_grad) if n]
    with paddle.no_grad():
        grad_outputs = []
        for out, differentiable in zip(static_outputs, out_differentiable):
            if differentiable:
                buf = out.detach().clone()
                buf.stop_gradient = True
                grad_outputs.append(buf)
    bridged, accumulated = split_params(params, call_tensors) if options.accumulate_in_graph and params else (
        list(params), [])
    leaves = inputs + bridged + accumulated
    anchor = _anchor(params[0].place) if accumulated and not any(needs_grad) else None
    if not accumulated:
        grad_stacks.probe(params)
    acc = Accumulators(accumulated) if accumulated else None  # last: a failure before it leaves nothing to undo
    # Where the body's split starts: the accumulated parameters, else all parameters (stacks).
    first = len(inputs) + (len(bridged) if acc is not None else 0)
    # NOTE [ Stacks after paddle.grad only for copied grads ] in grads/stacks.py: read before the capture.
    policy = options.clone_param_grads
    copied = [policy is True or (policy == "auto" and hook_registry.may_keep(p)) for p in bridged]
    body = _body(live, out_differentiable, grad_outputs, leaves, first, acc, by_grad, copied)
    return BackwardBody(body, grad_outputs, options.capture_hooks, len(leaves), live, needs_grad,
                        bridged, options.clone_param_grads, acc, anchor)


def _body(live, differentiable, grad_outputs, leaves, first_param, acc, by_grad, copied):
    """The body the backward graph captures: grads of the differentiable outputs with respect to
    ``leaves`` (NOTE [ Backward body ] in block/capture.py), returned; with accumulators (``acc``)
    those of ``leaves[first_param:]`` are also added into them, else the parameters' are also
    copied into same-shape stacks (NOTE [ Grad groups ] in grads/stacks.py): as they arrive, or after
    paddle.grad those whose hand-out copies them (``copied``, per parameter: NOTE [ Stacks after
    paddle.grad only for copied grads ])."""
    outputs = live["outputs"]
    diff_index = [i for i, d in enumerate(differentiable) if d]
    # An output returned more than once (``return y, y``) is differentiated once, with the sum
    # of its grads, as eager's engine accumulates them: paddle.grad refuses duplicates.
    firsts = {}
    for k, i in enumerate(diff_index):
        firsts.setdefault(id(outputs[i]), []).append(k)
    unique = list(firsts.values())

    def backward_body():
        current = [live["outputs"][diff_index[ks[0]]] for ks in unique]
        seeds = []
        for ks in unique:
            seed = grad_outputs[ks[0]]
            for k in ks[1:]:
                seed = seed + grad_outputs[k]
            seeds.append(seed)
        swap = GradSwap(leaves)
        stacking = _stacking(live, leaves, first_param) if acc is None and by_grad else None
        stacks = stacking.begin(current, leaves) if stacking is not None else None
        try:
            with swap, own_grad():
                if by_grad:
                    raw = paddle.grad(current, leaves, seeds, retain_graph=True, allow_unused=True)
                else:
                    paddle.autograd.backward(current, seeds, retain_graph=True)
        finally:
            if stacking is not None:
                stacking.end()
        grads = merge_leaf_grads(raw, swap.collected) if by_grad else swap.collected
        if acc is not None:
            acc.add(grads[first_param:])
            live["grad_groups"] = []
            return list(grads)
        if stacking is not None:  # NOTE [ Stacking grads as they arrive ] in grads/stacks.py
            return list(grads) + stacking.finish(grads, stacks)
        if "grad_groups" not in live:
            live["grad_groups"] = grad_stacks.plan_groups(
                grads, [first_param + i for i in grad_stacks.stacked_after_backward(copied)])
        return list(grads) + grad_stacks.stack_grads(grads, live["grad_groups"])

    return backward_body


def _stacking(live, leaves, first_param):
    """The key's Stacking, planned at its first backward (NOTE [ Stacking grads as they arrive ] in
    grads/stacks.py), or None: its grads are stacked after paddle.grad."""
    if "stacking" not in live:
        stacking = grad_stacks.Stacking.plan(live["outputs"], leaves, range(first_param, len(leaves)))
        live["stacking"] = stacking
        if stacking is not None:
            live["grad_groups"] = stacking.groups
    return live["stacking"]


def _anchor(place):
    """A one-element leaf that needs grad: it makes autograd run the bridge's backward when no
    other input of the bridge needs grad (every parameter accumulates inside the graph)."""
    anchor = paddle.to_tensor([0.0], place=place)
    anchor.stop_gradient = False
    return anchor
