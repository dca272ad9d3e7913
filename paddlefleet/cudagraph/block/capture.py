"""Capture of a block: static inputs, the forward graph, the backward graph and the grad plan of
one key, refused (CaptureError) where a graph would not reproduce eager.

NOTE [ RNG across capture ]
Warmup calls are ordinary eager calls: they consume random numbers exactly as eager does.
The simulated backend *executes* the body while capturing, so it restores every RNG state
after capture; the capture call then replays, consuming what the eager call would. A CUDA
capture only records: Paddle's random kernels read the generator when captured and advance it
on every later replay, so the generator is left as the capture moved it. The same holds for
what the function writes in place: a capture that executes the body writes the Layers' buffers
(put back by BufferSnapshot) and any other tensor it updates in place (a closure's, a global's,
a dict attribute's); InPlaceWrites (guards/in_place_writes.py) copies each tensor an in-place op is
handed during the capture and writes the copies back after it, so the capture call's replay
applies each update once, as on a GPU (a view shares its tensor's memory: writing the view's copy
back restores the tensor too), and each argument of a kernel that writes its inputs under a name
without a trailing ``_`` (``batch_norm``'s running statistics outside any Layer: NOTE [ Kernels
that write their inputs ] in guards/in_place_writes.py).

NOTE [ Backward body ]
The backward graph is captured from ``paddle.grad(outputs, leaves, grad_outputs)`` run under a
GradSwap: paddle.grad runs no accumulation node of the leaves, so no gradient hook of a
parameter (a main_grad hook, DataParallel's reducer, a user hook) runs inside the capture,
where its kernels would be recorded and applied a second time by every replay; those hooks run
once, in the caller's backward, when the bridge hands the grads to autograd. What an inner
backward (reentrant recompute) accumulated into ``.grad`` is collected by the GradSwap and added
to what paddle.grad returned. The simulated backend re-runs the same body on replay. Where
paddle.grad refuses the graph (some PyLayers), the key is captured again with
``paddle.autograd.backward``, and parameter hooks then also run at capture (docs/guides/limitations.md).

NOTE [ Policies fixed at capture ]
clone_outputs and clone_param_grads are read from the options once, at capture, into the
BlockGraphs and its GradPlan. Changing the wrapper's options afterwards never mixes policies
within one graph.
"""

import dataclasses
import logging
import weakref
from typing import Any, Callable, List, Optional, Tuple

import paddle

from ..backends import function_errors
from ..core import memory, state
from ..guards.in_place_writes import InPlaceWrites
from ..guards.layer_attrs import AttrWatch, SlotWatch, layers_with_sublayers
from ..guards.refusals import INPUT_WRITTEN, LOST_LEAF
from ..guards.session import CaptureSession
from .graphs import BackwardGraphs, BlockGraphs
from ..errors import CaptureError, CudaGraphError, ReplayTraceError
from ..grads.backward_body import backward_body
from ..grads.buffer_sets import GradSets
from ..io.host_tensors import host_mask, is_marked_host, mark_host
from ..core.grad_nodes import grad_node
from ..core.layers import CAPTURE_LOCK, ParamSet, accumulation_nodes, name_unknown_leaves
from ..io.stale_outputs import StaleOutputs
from ..io.nested import check_rebuild, flatten, holds_tensor, leaf_names
from ..io.output_aliases import run_aliases
from ..io.static_inputs import StaticInputs, contiguous_outputs, strided_copy_works
from ..guards.traced_ops import install as install_traced_ops
from .replay_fallback import check_replay_trace, traced_backward

__all__ = ["CaptureRequest", "capture_block", "capture_second_backward"]

logger = logging.getLogger(__name__)


class _GradBodyFailed(Exception):
    """The paddle.grad backward body failed; the capture is retried with backward()."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass(frozen=True)
class CaptureRequest:
    """What the capture of one key of a block needs.

    Attributes:
        fn, owner: the function and the Layer it is bound to (or None).
        options: GraphOptions; backend: the key's backend.
        call: the capture call; named: its ``[(argument name, value)]``.
        last_inputs: weak references to the previous call's tensors (NOTE [ Adopted inputs ]).
        warn_once: ``(topic, message)`` -> None, the wrapper's once-per-topic warning.
        label: the key's readable label, for messages.
        writes: InPlaceWrites of a capture that executes the function (NOTE [ RNG across capture ]),
            set by capture_block.
    """

    fn: Callable[..., Any]
    owner: Any
    options: Any
    backend: Any
    call: Any
    named: List[Tuple[str, Any]]
    last_inputs: Optional[list]
    warn_once: Callable[[Any, str], None]
    label: str
    writes: Optional[InPlaceWrites] = None
    share_pool: bool = True


def capture_block(request):
    """Captures one key of a block (a CaptureRequest) and returns its BlockGraphs; raises when it
    cannot."""
    for name, value in request.named:  # NOTE [ Containers keep their type ] in io/nested.py
        check_rebuild(value, f"argument {name}")
    strided_copy_works()  # probed outside any capture (NOTE [ Strided static outputs ] in io/static_inputs.py)
    grad_mode = paddle.is_grad_enabled()
    # NOTE [ RNG across capture ]: what the function writes in place while a capture executes it is written back.
    if request.backend.replays_python:
        install_traced_ops()  # NOTE [ Traced entry points ] in guards/traced_ops.py: before any patch
        request = dataclasses.replace(request, writes=InPlaceWrites())
    with CAPTURE_LOCK:
        try:
            return _capture_with_retry(request, grad_mode)
        except BaseException:
            paddle.set_grad_enabled(grad_mode)  # the eager re-run computes in the call's grad mode
            raise
        finally:
            if request.writes is not None:
                request.writes.restore()


def _capture_with_retry(request, grad_mode):
    fn, warn_once, label = request.fn, request.warn_once, request.label
    try:
        return _BlockCapture(request, by_grad=True).run()
    except _GradBodyFailed as failed:
        # Paddle leaves grad mode off when a saved-tensors unpack hook raised inside paddle.grad
        # (NOTE [ Saved-tensors hooks ] in guards/saved_hooks.py): the retry must see the call's mode.
        paddle.set_grad_enabled(grad_mode)
        # NOTE [ Backward body ]: paddle.grad refused; capture again with backward().
        logger.debug("autocudagraph(%s): paddle.grad backward body failed: %r", fn, failed.error)
        graphs = _BlockCapture(request, by_grad=False).run()
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

    def __init__(self, request, by_grad):
        self.fn = request.fn
        self.owner = request.owner
        self.writes = request.writes
        self.opts = request.options
        self.backend = request.backend
        self.call = request.call
        self.names = leaf_names(request.named)
        self.last_inputs = request.last_inputs or ()
        self.by_grad = by_grad
        self.label = request.label
        self.share_pool = request.share_pool

    def run(self):
        shared = self._forward_pool()
        pool = shared if shared is not None else self.backend.new_pool()
        graphs = BlockGraphs(backend=self.backend, pool=pool, clone_outputs=self.opts.clone_outputs)
        graphs.shared_pool = shared
        try:
            self._capture(graphs)
            _forward_liveness(graphs, self.label)  # NOTE [ Sharing a pool safely ] in backends/shared_pool.py
        except BaseException:
            if graphs.accumulators is not None:  # made for this capture: take them back
                graphs.accumulators.undo()
            graphs.release()
            raise
        return graphs

    def _forward_pool(self):
        """The pool the forward graphs of keys share, where this key's forward may join it (NOTE [ Keys
        sharing a forward pool ] in backends/shared_pool.py), else None."""
        opts = self.opts
        if not self.share_pool or not opts.clone_outputs or opts.clone_param_grads is True or opts.accumulate_in_graph:
            return None
        return self.backend.forward_pool()

    # ------------------------------------------------------------------ static inputs
    def _static_inputs(self):
        tensors = self.call.tensors
        host = host_mask(tensors, on_gpu=self.backend.cpu_is_host)
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
            backend.replays_python) else []
        snapshot, watch, bound_layers = self._watch_layers()
        # NOTE [ One capture session ] in guards/session.py; NOTE [ Values a simulated replay reads ] in
        # block/replay_fallback.py: the forward is traced where the backend's replays run it.
        names = _tensor_names(bound_layers) if backend.replays_python else None  # for messages
        session = CaptureSession(backend, snapshot, watch, double_backward=True, writes=self.writes,
                                 trace={"inputs": static.buffers, "names": names, "keep_writes": True})
        live, grad_enabled = session.record, paddle.is_grad_enabled()
        body = self._forward_body(session, static.buffers, call.rebuild(static.buffers), grad_enabled)
        rng = state.rng_snapshot()
        captured = False
        try:
            graphs.fwd_graph = backend.new_graph(graphs.pool)
            outputs = session.capture(graphs.fwd_graph, body, opts.capture_hooks)
            _refuse_objects_holding_tensors(live["spec"][1])
            _refuse_written_inputs(static, adopted_values, session.versionless)
            graphs.static_inputs, graphs.in_spec = static, call.spec
            graphs.static_outputs = list(outputs)
            graphs.out_spec, graphs.out_consts = live["spec"]
            graphs.out_aliases = live["aliases"]  # NOTE [ Outputs handed back as they are ] in io/output_aliases.py
            graphs.out_differentiable = [not o.stop_gradient for o in live["outputs"]]
            out_host = host_mask(outputs, on_gpu=backend.cpu_is_host) if outputs else None
            graphs.host_outputs = [i for i, h in enumerate(out_host or ()) if h]
            if opts.check_stale_outputs and not opts.clone_outputs:
                graphs.handed_out = StaleOutputs()
            graphs.layers = bound_layers + [l for l in session.layers if all(l is not b for b in bound_layers)]
            graphs.params = ParamSet(graphs.layers)
            graphs.attrs = AttrWatch(layers_with_sublayers(graphs.layers))  # NOTE [ Layer attributes a replay freezes ]
            self._backward(graphs, live, grad_enabled)
            graphs.settle()  # NOTE [ Replay work decided at capture ] in block/replay.py
            # Keeps the capture-time outputs and their autograd graph (the saved activations) alive
            # as long as the graphs: a CUDA graph keeps writing and reading those addresses, so the
            # allocator must never hand them to another tensor.
            graphs.live = live
            captured = True
        finally:
            snapshot.restore()
            # A failed capture leaves RNG as the eager re-run that replaces it expects.
            if backend.replays_python or not captured:
                state.restore_rng(rng)

    def _forward_body(self, session, buffers, static_call, grad_enabled):
        """The forward the graph captures (and a simulated replay re-runs): the function on the
        static inputs, each run recorded in the session's record and, where the backend's replays run
        it, compared with the capture's run before anything is copied into the static outputs (NOTE
        [ Values a simulated replay reads ] in block/replay_fallback.py)."""
        (static_args, static_kwargs), fn, owner, live = static_call, self.fn, self.owner, session.record

        def forward_body():
            if "backward_differs" in live:  # the last replay's backward ran other values than the capture's
                raise ReplayTraceError(f"a replay's backward read other values than the capture's: "
                                       f"{live['backward_differs']}. On a GPU the backward graph would reuse the "
                                       "capture's values; that call's grads were eager's, and this call runs eagerly")
            replay = live.captured
            with session.function_run() as trace, paddle.set_grad_enabled(grad_enabled), function_errors():
                out = fn(*static_args, **static_kwargs) if owner is None else fn(owner, *static_args, **static_kwargs)
            out_tensors, out_consts, out_spec = flatten(out)
            if trace is not None:  # before anything is copied into the static outputs
                trace.note_result(out_consts)
                if replay:
                    check_replay_trace(live["trace"], trace)
                    live.take_replayed()  # compared: not kept (it holds what the run wrote, to undo it)
            if not replay:  # the capture run: NOTE [ Containers keep their type ] in io/nested.py
                check_rebuild(out, "the result")
            # NOTE [ Outputs handed back as they are ] in io/output_aliases.py
            kept = run_aliases(out_tensors, buffers, live, lambda: self._bound_layers() + session.layers)
            live["outputs"] = kept
            live["spec"] = (out_spec, out_consts)
            return contiguous_outputs(kept)  # NOTE [ Strided static outputs ] in io/static_inputs.py

        return forward_body

    def _bound_layers(self):
        layer_args = [c for c in self.call.consts if isinstance(c, paddle.nn.Layer)]
        return ([self.owner] if isinstance(self.owner, paddle.nn.Layer) else []) + layer_args

    def _watch_layers(self):
        """``(snapshot, watch, layers)``: the Layers the call is bound to or given, their buffers
        snapshotted (restored after a capture that runs the body) and their slots watched."""
        snapshot = state.BufferSnapshot(enabled=self.backend.replays_python)
        watch = SlotWatch()
        layer_args = [c for c in self.call.consts if isinstance(c, paddle.nn.Layer)]
        bound_layers = ([self.owner] if isinstance(self.owner, paddle.nn.Layer) else []) + layer_args
        for layer in bound_layers:
            snapshot.add(layer)
            for _, sub in layer.named_sublayers(include_self=True):
                watch.add(sub)
        return snapshot, watch, bound_layers

    # ------------------------------------------------------------------ backward
    def _backward(self, graphs, live, grad_enabled):
        buffers = graphs.static_inputs.buffers
        params = graphs.params.params
        # The tensors whose grads the backward body computes: inputs that need grad, then parameters.
        leaves = [b for b in buffers if not b.stop_gradient] + params
        differentiable = grad_enabled and any(graphs.out_differentiable)
        if differentiable:
            self._refuse_unknown_leaves(graphs, live, leaves)
        if not (differentiable and leaves):
            graphs.out_differentiable = [False] * len(graphs.static_outputs)
            return
        # NOTE [ Accumulation inside the graph ] in grads/accumulate.py: accumulators made before the capture.
        backward = backward_body(live, graphs.static_outputs, graphs.out_differentiable, buffers, params, self.opts,
                                 self.by_grad, self.call.tensors)
        acc = backward.accumulators
        graphs.backward = BackwardGraphs(backward.grad_outputs, backward.bridged, acc, backward.anchor)
        saved = acc.snapshot() if acc is not None and self.backend.replays_python else None
        try:
            results = self._capture_backward(graphs, backward.body, live)
        finally:
            if saved is not None:  # a capture that runs the body must not accumulate
                acc.restore(saved)
        # NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py. Not for a backward() body: it runs
        # parameter hooks, which a second capture would run once more; nor where the body accumulates.
        second = backward.bridged and acc is None and self.opts.clone_param_grads is not True and self.by_grad
        graphs.backward.sets = GradSets(graphs.backward.graph, backward.plan(results), backward if second else None)
        _backward_liveness(graphs.backward.graph, graphs.backward.sets.sets[0][1], f"the backward graph of key {self.label}")
        if acc is not None and self.by_grad:  # a backward() body runs the parameters' hooks itself
            acc.register(graphs)

    def _capture_backward(self, graphs, body, live):
        bwd = graphs.backward
        own = graphs.shared_pool is not None or not _shares_pool(bwd, self.opts)
        bwd.graph = self.backend.new_graph(self.backend.new_pool() if own else graphs.pool)
        if self.backend.replays_python:  # NOTE [ Values a simulated replay reads ] in block/replay_fallback.py
            body = traced_backward(body, live)
        # NOTE [ Random draws seen from generator state ], NOTE [ Recompute under CUDA graphs ] in guards/rng.py.
        session = CaptureSession(self.backend, backward=True)
        try:
            return list(session.capture(bwd.graph, body, self.opts.capture_hooks))
        except Exception as err:
            # Our own refusals (a host sync, say) would fail the same way with backward().
            if self.by_grad and not isinstance(err, CudaGraphError):
                raise _GradBodyFailed(err) from err
            raise

    def _refuse_unknown_leaves(self, graphs, live, leaves):
        """Raises CaptureError when the outputs depend on leaves that need grad but would not get
        it: neither call arguments nor parameters of the Layers the call uses."""
        outputs = [o for o, d in zip(live["outputs"], graphs.out_differentiable) if d]
        known = {node.node_ptr() for node in map(grad_node, leaves) if node is not None}
        unknown = set(accumulation_nodes(outputs)) - known
        if unknown:
            names = name_unknown_leaves(self.fn, unknown)
            raise LOST_LEAF.error(
                f"autocudagraph: the function uses tensors that require grad but are neither arguments "
                f"nor parameters of a Layer it calls or is bound to: {', '.join(names)}. Their grads "
                "would be lost. Pass them as arguments, or use them through a Layer."
            )


def capture_second_backward(graphs):
    """Captures the second backward graph of a key, outside any backward pass (NOTE [ Two grad
    buffer sets ] in grads/hand_out_plan.py). A failure only leaves the key with one set (copies instead)."""
    sets = graphs.backward.sets
    recipe = sets.take_recipe()
    backend = graphs.backend
    with CAPTURE_LOCK:
        # A capture that runs the body leaves no trace (a recompute inside re-runs a forward).
        rng = state.rng_snapshot()
        snapshot = state.BufferSnapshot(enabled=backend.replays_python)
        for layer in graphs.layers:
            snapshot.add(layer)
        graph = backend.new_graph(backend.new_pool())  # its grads live while the first set replays: NOTE [ Sharing a pool safely ]
        try:
            results = list(graph.capture(recipe.body, recipe.hooks))
        except Exception:  # contained: the first set keeps serving, with copies where adopted
            logger.debug("second backward capture failed", exc_info=True)
            graph.reset()
            return
        finally:
            snapshot.restore()
            if backend.replays_python:  # NOTE [ RNG across capture ]
                state.restore_rng(rng)
    plan = recipe.plan(results)
    _backward_liveness(graph, plan, "the second grad buffer set's backward graph")
    sets.add_second(graph, plan)
    memory.grown()  # max_bytes is checked again (NOTE [ What a key holds ] in core/memory.py)


def _shares_pool(backward, opts):
    """Whether a key's backward graph may share its forward's pool (NOTE [ Sharing a pool safely ] in
    backends/shared_pool.py): only where its static grads are dead after every backward (handed out
    as copies, or accumulated into the parameters' own grads), since a forward replay, earlier in the
    pool, may overwrite them while a ``p.grad`` still aliases them."""
    return not backward.bridged or opts.clone_param_grads is True


def _forward_liveness(graphs, label):
    """The forward graph holds live data while its backward is pending, or always where its static
    outputs are handed out uncopied."""
    ref = weakref.ref(graphs)
    graph = graphs.fwd_graph
    graph.what = f"the forward graph of key {label}"
    graph.live = (lambda: True) if not graphs.clone_outputs else (
        lambda: ref() is not None and ref().backward_pending())


def _backward_liveness(graph, plan, what):
    """A backward graph holds live data while a ``p.grad`` aliases one of its static grads."""
    ref = weakref.ref(plan)
    graph.what = what
    graph.live = lambda: ref() is not None and bool(ref().adopted())


def _refuse_objects_holding_tensors(out_consts):
    for value in out_consts:
        if holds_tensor(value):
            raise CaptureError(
                f"autocudagraph: the function returns a {type(value).__name__} object holding tensors. "
                "Only tensors returned directly or in list/tuple/dict/dataclass nests are replayed; this "
                "object would be returned as captured, with frozen values and no grads. Return a tuple, "
                "a dict or a dataclass of tensors instead."
            )


def _refuse_written_inputs(static, adopted_values, versionless):
    written = static.written()
    written += [static.name(i) for i, b in enumerate(static.buffers)
                if versionless.wrote(b) and static.name(i) not in written]
    if not written:
        return
    with paddle.no_grad():
        for buf, value in adopted_values:
            paddle.assign(value, output=buf)
    raise INPUT_WRITTEN.error(
        f"autocudagraph: the function writes its input(s) {', '.join(map(repr, written))} in place. "
        "A graph writes into its own copy of an input, so the caller's tensor would not change "
        "(and the capture run would apply the write twice). Return the new value instead of "
        "writing the argument, or write it after the call."
    )


def _tensor_names(layers):
    """``{id(tensor): "Layer.name"}`` of the parameters and buffers of ``layers``, for messages."""
    names = {}
    for layer in layers:
        for name, t in layer.named_parameters():
            names.setdefault(id(t), f"parameter {name}")
        for name, t in layer.named_buffers():
            names.setdefault(id(t), f"buffer {name}")
    return names
