"""Capture of a block: static inputs, the forward graph, the backward graph and the grad plan of
one key, refused (CaptureError) where a graph would not reproduce eager.

NOTE [ RNG across capture ]
Warmup calls are ordinary eager calls: they consume random numbers exactly as eager does.
The simulated backend *executes* the body while capturing, so it restores every RNG state
after capture; the capture call then replays, consuming what the eager call would. A CUDA
capture only records: Paddle's random kernels read the generator when captured and advance it
on every later replay, so the generator is left as the capture moved it.

NOTE [ Backward body ]
The backward graph is captured from ``paddle.grad(outputs, leaves, grad_outputs)`` run under a
GradSwap: paddle.grad runs no accumulation node of the leaves, so no gradient hook of a
parameter (a main_grad hook, DataParallel's reducer, a user hook) runs inside the capture,
where its kernels would be recorded and applied a second time by every replay; those hooks run
once, in the caller's backward, when the bridge hands the grads to autograd. What an inner
backward (reentrant recompute) accumulated into ``.grad`` is collected by the GradSwap and added
to what paddle.grad returned. The simulated backend re-runs the same body on replay. Where
paddle.grad refuses the graph (some PyLayers), the key is captured again with
``paddle.autograd.backward``, and parameter hooks then also run at capture (docs/limitations.md).

NOTE [ Policies fixed at capture ]
clone_outputs and clone_param_grads are read from the options once, at capture, into the
BlockGraphs and its GradPlan. Changing the wrapper's options afterwards never mixes policies
within one graph.
"""

import contextlib
import logging

import paddle

from ..grads import stacks as grad_stacks
from ..core import state
from ..grads.accumulate import Accumulators, split_params
from .graphs import BlockGraphs
from ..errors import CaptureError, CudaGraphError
from ..grads.hand_out_plan import GradPlan
from ..grads.handles import GradSwap, can_hook, merge_leaf_grads
from ..io.host_tensors import host_mask, is_marked_host, mark_host
from ..core.layers import CAPTURE_LOCK, LayerRecorder, ParamSet, accumulation_nodes, name_unknown_leaves
from ..io.stale_outputs import StaleOutputs
from ..io.static_inputs import (StaticInputs, check_rebuild, contiguous_outputs, flatten, holds_tensor, leaf_names,
                                strided_copy_works)

__all__ = ["capture_block", "capture_second_backward"]

logger = logging.getLogger(__name__)


class _GradBodyFailed(Exception):
    """The paddle.grad backward body failed; the capture is retried with backward()."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


def capture_block(fn, owner, options, backend, call, named, last_inputs, warn_once, label):
    """Captures one key of a block and returns its BlockGraphs; raises when it cannot.

    Args:
        fn, owner: the function and the Layer it is bound to (or None).
        options: GraphOptions; backend: the key's backend.
        call: the capture call; named: its ``[(argument name, value)]``.
        last_inputs: weak references to the previous call's tensors (NOTE [ Adopted inputs ]).
        warn_once: ``(topic, message)`` -> None, the wrapper's once-per-topic warning.
        label: the key's readable label, for messages.
    """
    for name, value in named:  # NOTE [ Containers keep their type ] in io/static_inputs.py
        check_rebuild(value, f"argument {name}")
    names = leaf_names(named)
    strided_copy_works()  # probed outside any capture (NOTE [ Strided static outputs ] in io/static_inputs.py)
    grad_mode = paddle.is_grad_enabled()
    with CAPTURE_LOCK:
        try:
            return _capture_with_retry(fn, owner, options, backend, call, names, last_inputs, warn_once, label,
                                       grad_mode)
        except BaseException:
            paddle.set_grad_enabled(grad_mode)  # the eager re-run computes in the call's grad mode
            raise


def _capture_with_retry(fn, owner, options, backend, call, names, last_inputs, warn_once, label, grad_mode):
    try:
        return _BlockCapture(fn, owner, options, backend, call, names, last_inputs, by_grad=True).run()
    except _GradBodyFailed as failed:
        # Paddle leaves grad mode off when a saved-tensors unpack hook raised inside paddle.grad
        # (NOTE [ Saved-tensors hooks ] in core/saved_hooks.py): the retry must see the call's mode.
        paddle.set_grad_enabled(grad_mode)
        # NOTE [ Backward body ]: paddle.grad refused; capture again with backward().
        logger.debug("autocudagraph(%s): paddle.grad backward body failed: %r", fn, failed.error)
        graphs = _BlockCapture(fn, owner, options, backend, call, names, last_inputs, by_grad=False).run()
        warn_once(
            ("grad_fallback", label),
            f"paddle.grad could not differentiate key {label} ({type(failed.error).__name__}: {failed.error}); "
            "it was captured with paddle.autograd.backward instead. Gradient hooks of its parameters now run "
            "inside the capture and would be replayed with the graph. If its parameters have hooks (main_grad, "
            "DataParallel), return None from dispatch_key_fn for such calls.",
        )
        return graphs


class _BlockCapture:
    """One attempt at capturing a key (the retry with backward() is a second attempt)."""

    def __init__(self, fn, owner, options, backend, call, names, last_inputs, by_grad):
        self.fn = fn
        self.owner = owner
        self.opts = options
        self.backend = backend
        self.call = call
        self.names = names
        self.last_inputs = last_inputs or ()
        self.by_grad = by_grad

    def run(self):
        graphs = BlockGraphs(backend=self.backend, pool=self.backend.new_pool(), clone_outputs=self.opts.clone_outputs)
        try:
            self._capture(graphs)
        except BaseException:
            if graphs.accumulators is not None:  # made for this capture: take them back
                graphs.accumulators.undo()
            graphs.release()
            raise
        return graphs

    # ------------------------------------------------------------------ static inputs
    def _static_inputs(self):
        tensors = self.call.tensors
        host = host_mask(tensors, on_gpu=self.backend.name == "cuda")
        # NOTE [ Adopted inputs ] in io/static_inputs.py: the same tensor as in the previous call.
        last = self.last_inputs
        adopt = [
            len(last) == len(tensors) and last[i]() is t and t.is_contiguous() and not (host and host[i])
            for i, t in enumerate(tensors)
        ]
        static = StaticInputs(tensors, self.names, adopt=adopt, host=host)
        for i in static.host:
            if is_marked_host(tensors[i]):
                mark_host(static.buffers[i])
        return static

    # ------------------------------------------------------------------ forward
    def _capture(self, graphs):
        backend, opts, call = self.backend, self.opts, self.call
        static = self._static_inputs()
        # A capture that runs the body must not leave its in-place writes in the caller's tensors.
        adopted_values = [(static.buffers[i], static.buffers[i].clone()) for i in static.adopted] if (
            backend.capture_executes) else []
        static_args, static_kwargs = call.rebuild(static.buffers)
        grad_enabled = paddle.is_grad_enabled()
        fn, owner, live = self.fn, self.owner, {}

        def forward_body():
            with paddle.set_grad_enabled(grad_enabled):
                out = fn(*static_args, **static_kwargs) if owner is None else fn(owner, *static_args, **static_kwargs)
            out_tensors, out_consts, out_spec = flatten(out)
            if "spec" not in live:  # the capture run: NOTE [ Containers keep their type ] in io/static_inputs.py
                check_rebuild(out, "the result")
            live["outputs"] = out_tensors
            live["spec"] = (out_spec, out_consts)
            return contiguous_outputs(out_tensors)  # NOTE [ Strided static outputs ] in io/static_inputs.py

        snapshot = state.BufferSnapshot(enabled=backend.capture_executes)
        watch = state.SlotWatch()
        layer_args = [c for c in call.consts if isinstance(c, paddle.nn.Layer)]
        bound_layers = ([owner] if isinstance(owner, paddle.nn.Layer) else []) + layer_args
        for layer in bound_layers:
            snapshot.add(layer)
            for _, sub in layer.named_sublayers(include_self=True):
                watch.add(sub)
        rng = state.rng_snapshot()
        captured = False
        try:
            graphs.fwd_graph = backend.new_graph(graphs.pool)
            # NOTE [ Random kernels under a recording capture ] in core/state.py.
            rng_guard = state.RecordingRngGuard(enabled=not backend.capture_executes)
            with LayerRecorder(snapshot, watch) as recorder, rng_guard:
                outputs = graphs.fwd_graph.capture(forward_body, opts.capture_hooks)
            watch.check()
            rng_guard.check()
            _refuse_objects_holding_tensors(live["spec"][1])
            _refuse_written_inputs(static, adopted_values)
            graphs.static_inputs, graphs.in_spec = static, call.spec
            graphs.static_outputs = list(outputs)
            graphs.out_spec, graphs.out_consts = live["spec"]
            graphs.out_differentiable = [not o.stop_gradient for o in live["outputs"]]
            out_host = host_mask(outputs, on_gpu=backend.name == "cuda") if outputs else None
            graphs.host_outputs = [i for i, h in enumerate(out_host or ()) if h]
            if opts.check_stale_outputs and not opts.clone_outputs:
                graphs.handed_out = StaleOutputs()
            graphs.layers = bound_layers + [l for l in recorder.layers if all(l is not b for b in bound_layers)]
            graphs.params = ParamSet(graphs.layers, {id(t) for t in call.tensors})
            self._backward(graphs, live, grad_enabled)
            # Keeps the capture-time outputs and their autograd graph (the saved activations) alive
            # as long as the graphs: a CUDA graph keeps writing and reading those addresses, so the
            # allocator must never hand them to another tensor.
            graphs.out_hookable = [d and can_hook(o) for o, d in zip(graphs.static_outputs, graphs.out_differentiable)]
            graphs.live = live
            captured = True
        finally:
            snapshot.restore()
            # A failed capture leaves RNG as the eager re-run that replaces it expects.
            if backend.capture_executes or not captured:
                state.restore_rng(rng)

    # ------------------------------------------------------------------ backward
    def _backward(self, graphs, live, grad_enabled):
        needs_grad = [not b.stop_gradient for b in graphs.static_inputs.buffers]
        params = graphs.params.params
        # The tensors whose grads the backward body computes: inputs that need grad, then parameters.
        leaves = [b for b, n in zip(graphs.static_inputs.buffers, needs_grad) if n] + params
        differentiable = grad_enabled and any(graphs.out_differentiable)
        if differentiable:
            self._refuse_unknown_leaves(graphs, live, leaves)
        if not (differentiable and (any(needs_grad) or params)):
            graphs.out_differentiable = [False] * len(graphs.static_outputs)
            return
        with paddle.no_grad():
            grad_outputs = []
            for i, d in enumerate(graphs.out_differentiable):
                if d:
                    buf = graphs.static_outputs[i].detach().clone()
                    buf.stop_gradient = True
                    grad_outputs.append(buf)
        inputs = leaves[: len(leaves) - len(params)]
        bridged, accumulated = _split_accumulated(params, self.opts.accumulate_in_graph, self.call.tensors)
        leaves = inputs + bridged + accumulated
        # NOTE [ Accumulation inside the graph ] in grads/accumulate.py: made before the capture.
        acc = Accumulators(accumulated) if accumulated else None
        # Where the body's split starts: the accumulated parameters, else all parameters (stacks).
        first = len(inputs) + (len(bridged) if acc is not None else 0)
        graphs.accumulators = acc
        graphs.bridged = bridged
        saved = acc.snapshot() if acc is not None and self.backend.capture_executes else None
        try:
            if acc is not None and not any(needs_grad):
                graphs.anchor = _anchor(params[0].place)
            if acc is None:
                grad_stacks.probe(params)
            body = _backward_body(live, graphs.out_differentiable, grad_outputs, leaves, first, acc,
                                  self.by_grad)
            results = self._capture_backward(graphs, body)
        finally:
            if saved is not None:  # a capture that runs the body must not accumulate
                acc.restore(saved)
        graphs.static_grad_outputs = grad_outputs
        recipe = _Recipe(body, self.opts.capture_hooks, len(leaves), live, needs_grad, graphs.bridged,
                         self.opts.clone_param_grads)
        graphs.grad_plan = recipe.plan(results)
        # NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py. Not for a backward() body: it runs
        # parameter hooks, which a second capture would run once more; nor where the body accumulates.
        if graphs.bridged and acc is None and self.opts.clone_param_grads is not True and self.by_grad:
            graphs.recipe = recipe
        if acc is not None and self.by_grad:  # a backward() body runs the parameters' hooks itself
            acc.register(graphs)

    def _capture_backward(self, graphs, backward_body):
        graphs.bwd_graph = self.backend.new_graph(graphs.pool)
        # NOTE [ Recompute under CUDA graphs ] in core/state.py: only a recording capture needs it.
        guard = state.RngRewindGuard() if not self.backend.capture_executes else contextlib.nullcontext()
        try:
            with guard:
                results = list(graphs.bwd_graph.capture(backward_body, self.opts.capture_hooks))
        except Exception as err:
            # Our own refusals (a host sync, say) would fail the same way with backward().
            if self.by_grad and not isinstance(err, CudaGraphError):
                raise _GradBodyFailed(err) from err
            raise
        if isinstance(guard, state.RngRewindGuard):
            guard.check()
        return results

    def _refuse_unknown_leaves(self, graphs, live, leaves):
        """Raises CaptureError when the outputs depend on leaves that need grad but would not get
        it: neither call arguments nor parameters of the Layers the call uses."""
        outputs = [o for o, d in zip(live["outputs"], graphs.out_differentiable) if d]
        known = {leaf.grad_fn.node_ptr() for leaf in leaves if getattr(leaf, "grad_fn", None) is not None}
        unknown = set(accumulation_nodes(outputs)) - known
        if unknown:
            names = name_unknown_leaves(self.fn, unknown)
            raise CaptureError(
                f"autocudagraph: the function uses tensors that require grad but are neither arguments "
                f"nor parameters of a Layer it calls or is bound to: {', '.join(names)}. Their grads "
                "would be lost. Pass them as arguments, or use them through a Layer."
            )


class _Recipe:
    """What a backward graph is captured from, kept to capture a second one later."""

    def __init__(self, body, hooks, n_leaves, live, needs_grad, bridged, policy):
        self.body, self.hooks, self.n_leaves, self.live = body, hooks, n_leaves, live
        self.needs_grad, self.bridged, self.policy = needs_grad, bridged, policy

    def plan(self, results):
        """The GradPlan of a backward graph's results (grads, then same-shape stacks)."""
        static_grads = results[: self.n_leaves]
        stacks = []
        for idxs, stack in zip(self.live["grad_groups"], results[self.n_leaves:]):
            for i, view in zip(idxs, grad_stacks.unstack(stack)):
                static_grads[i] = view
            stacks.append((stack, idxs))
        return GradPlan(static_grads, self.needs_grad, self.bridged, self.policy, stacks)


def capture_second_backward(graphs):
    """Captures the second backward graph of a key, outside any backward pass (NOTE [ Two grad
    buffer sets ] in grads/hand_out_plan.py). A failure only leaves the key with one set (copies instead)."""
    recipe, graphs.recipe, graphs.second_wanted = graphs.recipe, None, False
    backend = graphs.backend
    with CAPTURE_LOCK:
        # A capture that runs the body leaves no trace (a recompute inside re-runs a forward).
        rng = state.rng_snapshot()
        snapshot = state.BufferSnapshot(enabled=backend.capture_executes)
        for layer in graphs.layers:
            snapshot.add(layer)
        graph = backend.new_graph(graphs.pool)
        try:
            results = list(graph.capture(recipe.body, recipe.hooks))
        except Exception:  # contained: the first set keeps serving, with copies where adopted
            logger.debug("second backward capture failed", exc_info=True)
            graph.reset()
            return
        finally:
            snapshot.restore()
            if backend.capture_executes:  # NOTE [ RNG across capture ]
                state.restore_rng(rng)
    graphs.second = (graph, recipe.plan(results))


def _backward_body(live, differentiable, grad_outputs, leaves, first_param, acc, by_grad):
    """The body the backward graph captures: grads of the differentiable outputs with respect to
    ``leaves`` (NOTE [ Backward body ]), returned; with accumulators (``acc``) those of
    ``leaves[first_param:]`` are also added into them, else the parameters' are also copied into
    same-shape stacks (NOTE [ Grad groups ] in stacks.py)."""
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
        with swap:
            if by_grad:
                raw = paddle.grad(current, leaves, seeds, retain_graph=True, allow_unused=True)
            else:
                paddle.autograd.backward(current, seeds, retain_graph=True)
        grads = merge_leaf_grads(raw, swap.collected) if by_grad else swap.collected
        if acc is not None:
            acc.add(grads[first_param:])
            live["grad_groups"] = []
            return list(grads)
        if "grad_groups" not in live:
            live["grad_groups"] = grad_stacks.plan_groups(grads, range(first_param, len(leaves)))
        return list(grads) + grad_stacks.stack_grads(grads, live["grad_groups"])

    return backward_body


def _split_accumulated(params, accumulate_in_graph, inputs):
    """``(bridged, accumulated)`` parameters (NOTE [ Shared parameters leave the graph ] in
    grads/accumulate.py); ``inputs``: the call's own tensors."""
    if not (accumulate_in_graph and params):
        return list(params), []
    return split_params(params, inputs)


def _anchor(place):
    """A one-element leaf that needs grad: it makes autograd run the bridge's backward when no
    other input of the bridge needs grad (every parameter accumulates inside the graph)."""
    anchor = paddle.to_tensor([0.0], place=place)
    anchor.stop_gradient = False
    return anchor


def _refuse_objects_holding_tensors(out_consts):
    for value in out_consts:
        if holds_tensor(value):
            raise CaptureError(
                f"autocudagraph: the function returns a {type(value).__name__} object holding tensors. "
                "Only tensors returned directly or in list/tuple/dict/dataclass nests are replayed; this "
                "object would be returned as captured, with frozen values and no grads. Return a tuple, "
                "a dict or a dataclass of tensors instead."
            )


def _refuse_written_inputs(static, adopted_values):
    written = static.written()
    if not written:
        return
    with paddle.no_grad():
        for buf, value in adopted_values:
            paddle.assign(value, output=buf)
    raise CaptureError(
        f"autocudagraph: the function writes its input(s) {', '.join(map(repr, written))} in place. "
        "A graph writes into its own copy of an input, so the caller's tensor would not change "
        "(and the capture run would apply the write twice). Return the new value instead of "
        "writing the argument, or write it after the call."
    )
