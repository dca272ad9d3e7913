"""GraphedCallable: the warmup -> capture -> replay lifecycle of one wrapped callable.

``__call__`` decides per call (no key -> eager; new key -> warmup/capture; known key ->
replay). Capture builds the static buffers and both graphs of a key; replay copies the call's
tensors in and runs the graphs through the autograd bridge.

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
clone_outputs and clone_param_grads are copied into the entry at capture. Changing the
wrapper's options afterwards never mixes policies within one graph.
"""

import collections
import contextlib
import logging
import warnings
import weakref

import paddle

from . import arguments, grad_groups, safety, saved_hooks, state, verify
from .backends import is_capturing, resolve_backend
from .bridge import GraphedFunction, hand_out_outputs
from .capture import (
    CAPTURE_LOCK,
    GradBodyFailed,
    LayerRecorder,
    accumulation_nodes,
    name_unknown_leaves,
    param_homes,
)
from .dispatch import KeyMaker
from .entry import GraphEntry, Phase
from .errors import CaptureError, CudaGraphError, InputMismatchError
from .grads import GradSwap, hookable, merge_leaf_grads
from .options import GraphOptions
from .static_io import StaticInputs, flatten, holds_tensor, leaf_names, unflatten
from .stats import Counters, describe_call, describe_entries

__all__ = ["GraphedCallable"]

logger = logging.getLogger(__name__)

class GraphedCallable:
    """A callable with per-key CUDA graphs. Made by autocudagraph(); see its docstring.

    Args:
        fn: the function; for a bound method or Layer, the unbound function taking ``owner``
            first.
        options: validated GraphOptions.
        owner: the Layer (or object) ``fn`` is bound to, or None.
    """

    def __init__(self, fn, options, owner=None):
        if not isinstance(options, GraphOptions):
            raise TypeError(f"GraphedCallable: options must be GraphOptions, got {options!r}")
        self._fn = fn
        self._owner_ref = weakref.ref(owner) if owner is not None else None
        self._options = options
        self._entries = collections.OrderedDict()
        self._warned = set()
        self._last_refusal = None
        self._tick = 0
        self._keys = KeyMaker(
            fn, options.dispatch_key_fn, bound=owner is not None,
            layers=[owner] if isinstance(owner, paddle.nn.Layer) else [],
        )
        self.counters = Counters()
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __get__(self, obj, objtype=None):
        # A wrapper stored as a class attribute and read through an instance would be called
        # without the instance; say how to graph a method instead.
        if obj is None:
            return self
        raise TypeError(
            f"autocudagraph: {self.__name__} was wrapped as a plain function but is read as an attribute of "
            f"{type(obj).__name__}, so it would be called without the instance. Decorate the method in the "
            "class body (@autocudagraph above def), or apply autocudagraph to the Layer instance."
        )

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo):
        # NOTE [ Copies of a graphed Layer ]: copy.deepcopy(layer) copies the wrapper that its
        # __dict__ holds. A copy bound to the original Layer would silently compute with the
        # original's parameters, so the copy is a fresh wrapper (no graphs, same options) bound
        # to the Layer's copy.
        owner = self._owner_ref() if self._owner_ref is not None else None
        clone = GraphedCallable(self._fn, self._options, owner=memo.get(id(owner), owner))
        memo[id(self)] = clone
        return clone

    def __reduce__(self):
        # Pickling (e.g. paddle.save of a whole Layer) keeps the binding and drops the graphs.
        owner = self._owner_ref() if self._owner_ref is not None else None
        return (GraphedCallable, (self._fn, self._options, owner))

    # ------------------------------------------------------------------ public
    @property
    def options(self):
        return self._options

    def stats(self):
        """Counters of this wrapper plus ``graphs``, the number of keys holding graphs now."""
        out = self.counters.snapshot()
        out["graphs"] = sum(1 for e in self._entries.values() if e.has_graphs)
        out["keys"] = len(self._entries)
        out["static_bytes"] = sum(e.nbytes() for e in self._entries.values() if e.has_graphs)
        return out

    def report(self):
        """One dict per key (phase, counts, fallback reason, bytes held, input copies)."""
        return describe_entries(self._entries.values())

    def explain(self):
        """A readable report: every key's phase and counts, and a reason for every eager call.

        Example::

            autocudagraph(block): 2 key(s), 1 holding graphs, 4096 static bytes
              key (x: float32[8, 16], w: float32[16, 16] grad): replay on simulate; 1 warmup, 1 capture(s), 5 replays; ...
              key (x: float32[4, 16], ...): fallback on simulate; ...; fell back: CaptureError: ... (at model.py:12 in block)
              eager calls: 3
                2 x warmup (before the capture of their key)
                1 x capture failed
        """
        stats = self.stats()
        lines = [
            f"autocudagraph({self.__name__}): {stats['keys']} key(s), {stats['graphs']} holding graphs, "
            f"{stats['static_bytes']} static bytes"
        ]
        backends = {e.backend.describe() for e in self._entries.values() if e.backend is not None}
        if backends:
            lines.append(f"  backend: {'; '.join(sorted(backends))}")
        for row in self.report():
            line = (
                f"  key {row['label'] or repr(row['key'])[:80]}: {row['phase']} on {row['backend']}; "
                f"{row['warmup_calls']} warmup, {row['captures']} capture(s), {row['replays']} replays; "
                f"{row['static_bytes']} static bytes; input copies {row['input_copies']} made, "
                f"{row['input_copies_skipped']} skipped"
            )
            if row["evictions"]:
                line += f"; evicted {row['evictions']} time(s) (max_bytes)"
            if row["verified_replays"]:
                line += f"; {row['verified_replays']} call(s) verified against eager"
            if row["fallback_reason"]:
                line += f"; fell back: {row['fallback_reason']}"
            lines.append(line)
        reasons = collections.Counter(self.counters.eager_reasons)
        if self.counters.warmup_calls:
            reasons["warmup (before the capture of their key)"] = self.counters.warmup_calls
        if reasons:
            lines.append(f"  eager calls: {sum(reasons.values())}")
            for reason, count in reasons.most_common():
                lines.append(f"    {count} x {reason}")
        return "\n".join(lines)

    def reset(self):
        """Drops every graph, pool and static buffer, and zeroes the counters. A key whose backward
        is still pending keeps its graphs until that backward has run (they go with it)."""
        for entry in self._entries.values():
            if not entry.backward_pending():
                entry.release()
        self._entries.clear()
        self._warned.clear()
        self.counters = Counters()

    # ------------------------------------------------------------------ call
    def _owner(self):
        if self._owner_ref is None:
            return None
        owner = self._owner_ref()
        if owner is None:
            raise CudaGraphError(
                f"autocudagraph({self.__name__}): the Layer this wrapper was bound to was garbage-collected; "
                "the wrapper holds it weakly so that it does not keep the Layer alive. Keep a reference to "
                "the Layer, or apply autocudagraph to the Layer you call."
            )
        return owner

    def _run(self, args, kwargs):
        if self._owner_ref is None:
            return self._fn(*args, **kwargs)
        return self._fn(self._owner(), *args, **kwargs)

    def _eager(self, args, kwargs, reason):
        self.counters.eager(reason)
        return self._run(args, kwargs)

    def _warn_once(self, topic, message):
        if topic in self._warned:
            return
        self._warned.add(topic)
        warnings.warn(message, RuntimeWarning, stacklevel=safety.user_stacklevel())

    def __call__(self, *args, **kwargs):
        if is_capturing():
            return self._eager(args, kwargs, "called inside another capture")
        if saved_hooks.active():  # NOTE [ Saved-tensors hooks ] in saved_hooks.py
            self._warn_once("saved_hooks", saved_hooks.warning(self.__name__))
            return self._eager(args, kwargs, saved_hooks.REASON)
        if self._options.dispatch_key_fn is not None:
            # One canonical form per call (defaults applied, positional where possible), so that
            # f(x, True) and f(x, flag=True), which dispatch_key_fn sees alike, share a graph.
            bound = self._keys.bound_arguments(args, kwargs)
            args, kwargs = bound.args, bound.kwargs
        tensors, consts, spec = flatten((args, kwargs))
        safety.check_fresh(tensors)  # NOTE [ Stale outputs ] in safety.py
        key = self._keys.key(args, kwargs, tensors, spec)
        if key is None:
            return self._eager(args, kwargs, "dispatch_key_fn returned None")
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, tensors, args, kwargs)
            if entry is None:
                return self._eager(args, kwargs, self._last_refusal)
        self._tick += 1
        entry.last_used = self._tick
        self._entries.move_to_end(key)
        phase = entry.phase
        if phase is Phase.REPLAY:
            return self._replay(entry, args, kwargs, tensors, consts, spec)
        if phase is Phase.WARMUP:
            if entry.warmup_calls < self._options.warmup_steps:
                entry.warmup_calls += 1
                self.counters.warmup_calls += 1
                entry.last_inputs = [weakref.ref(t) for t in tensors]
                return self._run(args, kwargs)
            return self._capture_call(entry, args, kwargs, tensors, consts, spec)
        if phase is Phase.RECAPTURE:
            if not self._budget_allows(entry):
                return self._eager(args, kwargs, "max_graphs reached")
            self.counters.recaptures += 1
            return self._capture_call(entry, args, kwargs, tensors, consts, spec)
        return self._eager(args, kwargs, f"key fell back: {entry.fallback_reason}")

    # ------------------------------------------------------------------ keys
    def _budget_allows(self, entry):
        live = sum(1 for e in self._entries.values() if e is not entry and e.phase in (Phase.WARMUP, Phase.REPLAY))
        if live < self._options.max_graphs:
            return True
        self._warn_once(
            "max_graphs",
            f"autocudagraph({self.__name__}): max_graphs={self._options.max_graphs} keys are already warming "
            "up or holding graphs; further keys run eagerly (correct, without the speed-up). Raise "
            "max_graphs, or return fewer distinct keys from dispatch_key_fn (e.g. pad shapes to a few sizes).",
        )
        return False

    def _new_entry(self, key, tensors, args, kwargs):
        backend, reason = resolve_backend(self._options.backend, tensors)
        if backend is None:
            self._last_refusal = reason
            return None
        named = self._keys.named_arguments(args, kwargs)
        refused = arguments.refusal(named)  # NOTE [ Argument objects ] in arguments.py
        if refused is not None:
            self._warn_once(("arguments", refused), f"autocudagraph({self.__name__}): runs eagerly: {refused}.")
            self._last_refusal = refused
            return None
        host = safety.host_mask(tensors)
        if host is not None:
            safety.check_host_inputs(tensors, host, leaf_names(named))
        entry = GraphEntry(key=key, backend=backend)
        host_tensors = [t for t, h in zip(tensors, host or ()) if h]
        entry.label = describe_call(named, host_tensors, key[1] if key[0] == "user" else None)
        if not self._budget_allows(entry):
            self._last_refusal = "max_graphs reached"
            return None
        self._entries[key] = entry
        return entry

    # ------------------------------------------------------------------ capture
    def _capture_call(self, entry, args, kwargs, tensors, consts, spec):
        with CAPTURE_LOCK:
            return self._capture_call_locked(entry, args, kwargs, tensors, consts, spec)

    def _capture_call_locked(self, entry, args, kwargs, tensors, consts, spec):
        last_inputs = entry.last_inputs
        grad_mode = paddle.is_grad_enabled()
        try:
            try:
                self._capture(entry, args, kwargs, tensors, consts, spec, by_grad=True)
            except GradBodyFailed as failed:
                # Paddle leaves grad mode off when a saved-tensors unpack hook raised inside
                # paddle.grad (NOTE [ Saved-tensors hooks ]): the retry must see the call's mode.
                paddle.set_grad_enabled(grad_mode)
                # NOTE [ Backward body ]: paddle.grad refused; capture again with backward().
                logger.debug("autocudagraph(%s): paddle.grad backward body failed: %r", self.__name__, failed.error)
                entry.release()
                entry.last_inputs = last_inputs  # the retry is the same call, not a later one
                self._capture(entry, args, kwargs, tensors, consts, spec, by_grad=False)
                self._warn_once(
                    ("grad_fallback", id(entry)),
                    f"autocudagraph({self.__name__}): paddle.grad could not differentiate key {entry.label} "
                    f"({type(failed.error).__name__}: {failed.error}); it was captured with "
                    "paddle.autograd.backward instead. Gradient hooks of its parameters now run inside the "
                    "capture and would be replayed with the graph. If its parameters have hooks (main_grad, "
                    "DataParallel), return None from dispatch_key_fn for such calls.",
                )
        except Exception as err:  # contained: this key runs eagerly from now on
            paddle.set_grad_enabled(grad_mode)  # the eager re-run computes in the call's grad mode
            if isinstance(err, GradBodyFailed):
                err = err.error
            reason = f"{type(err).__name__}: {err}"
            where = safety.user_location(err.__traceback__)
            if where is not None:
                reason += f" (at {where})"
            entry.fall_back(reason)
            logger.debug("capture of %s failed", self.__name__, exc_info=True)
            self._warn_once(
                ("capture", id(entry)),
                f"autocudagraph({self.__name__}): capture of key {entry.label} failed: {reason.rstrip('.')}. The key runs "
                "eagerly from now on (results stay correct, without the speed-up). Fix the cause and call "
                ".reset() to capture again, or return None from dispatch_key_fn for such calls.",
            )
            return self._eager(args, kwargs, "capture failed")
        entry.captures += 1
        self.counters.captures += 1
        if not self._enforce_max_bytes(entry):
            return self._eager(args, kwargs, "static buffers exceed max_bytes")
        return self._graph_call(entry, args, kwargs, tensors, copy=False)

    def _capture(self, entry, args, kwargs, tensors, consts, spec, by_grad=True):
        opts = self._options
        backend = entry.backend
        owner = self._owner()
        names = leaf_names(self._keys.named_arguments(args, kwargs))
        host = safety.host_mask(tensors, on_gpu=backend.name == "cuda")
        # NOTE [ Adopted inputs ] in static_io.py: the same tensor as in the previous call.
        last = entry.last_inputs or ()
        adopt = [
            len(last) == len(tensors) and last[i]() is t and t.is_contiguous() and not (host and host[i])
            for i, t in enumerate(tensors)
        ]
        entry.last_inputs = [weakref.ref(t) for t in tensors]
        static = StaticInputs(tensors, names, adopt=adopt, host=host)
        for i in static.host:
            if safety.is_marked_host(tensors[i]):
                safety.mark_host(static.buffers[i])
        # A capture that runs the body must not leave its in-place writes in the caller's tensors.
        adopted_values = [(static.buffers[i], static.buffers[i].clone()) for i in static.adopted] if (
            backend.capture_executes) else []
        static_args, static_kwargs = unflatten(spec, static.buffers, consts)
        grad_enabled = paddle.is_grad_enabled()
        fn = self._fn
        live = {}

        def forward_body():
            with paddle.set_grad_enabled(grad_enabled):
                if owner is None:
                    out = fn(*static_args, **static_kwargs)
                else:
                    out = fn(owner, *static_args, **static_kwargs)
            out_tensors, out_consts, out_spec = flatten(out)
            live["outputs"] = out_tensors
            live["spec"] = (out_spec, out_consts)
            return out_tensors

        snapshot = state.BufferSnapshot(enabled=backend.capture_executes)
        watch = state.SlotWatch()
        layer_args = [c for c in consts if isinstance(c, paddle.nn.Layer)]
        bound_layers = ([owner] if isinstance(owner, paddle.nn.Layer) else []) + layer_args
        for layer in bound_layers:
            snapshot.add(layer)
            for _, sub in layer.named_sublayers(include_self=True):
                watch.add(sub)
        rng = state.rng_snapshot()
        captured = False
        entry.pool = backend.new_pool()
        entry.clone_outputs = opts.clone_outputs
        entry.clone_param_grads = opts.clone_param_grads
        try:
            entry.fwd_graph = backend.new_graph(entry.pool)
            with LayerRecorder(snapshot, watch) as recorder:
                outputs = entry.fwd_graph.capture(forward_body, opts.capture_hooks)
            watch.check()
            for value in live["spec"][1]:
                if holds_tensor(value):
                    raise CaptureError(
                        f"autocudagraph: the function returns a {type(value).__name__} object holding tensors. "
                        "Only tensors returned directly or in list/tuple/dict nests are replayed; this object "
                        "would be returned as captured, with frozen values and no grads. Return a tuple or a "
                        "dict of tensors instead."
                    )
            written = static.written()
            if written:
                with paddle.no_grad():
                    for buf, value in adopted_values:
                        paddle.assign(value, output=buf)
                raise CaptureError(
                    f"autocudagraph: the function writes its input(s) {', '.join(map(repr, written))} in place. "
                    "A graph writes into its own copy of an input, so the caller's tensor would not change "
                    "(and the capture run would apply the write twice). Return the new value instead of "
                    "writing the argument, or write it after the call."
                )
            entry.static_inputs = static
            entry.in_spec = spec
            entry.static_outputs = list(outputs)
            entry.out_spec, entry.out_consts = live["spec"]
            entry.out_differentiable = [not o.stop_gradient for o in outputs]
            out_host = safety.host_mask(outputs, on_gpu=backend.name == "cuda") if outputs else None
            entry.host_outputs = [i for i, h in enumerate(out_host or ()) if h]
            if opts.check_stale_outputs and not opts.clone_outputs:
                entry.handed_out = safety.StaleOutputs()
            layers = bound_layers + [l for l in recorder.layers if all(l is not b for b in bound_layers)]
            self._entries = self._keys.track(layers, self._entries)
            homes = param_homes(layers)
            entry.layers = layers
            entry.param_homes = [(sub, name, p, p.stop_gradient) for sub, name, p in homes]
            entry.param_ptrs = [p.data_ptr() for _, _, p in homes]
            input_ids = {id(t) for t in tensors}
            entry.params = [p for _, _, p in homes if not p.stop_gradient and id(p) not in input_ids]
            needs_grad = [not b.stop_gradient for b in static.buffers]
            # The tensors whose grads the bridge returns: inputs that need grad, then parameters.
            leaves = [b for b, n in zip(static.buffers, needs_grad) if n] + entry.params
            if grad_enabled and any(entry.out_differentiable):
                self._refuse_unknown_leaves(entry, leaves)
            wants_backward = grad_enabled and any(entry.out_differentiable) and (any(needs_grad) or entry.params)
            if wants_backward:
                self._capture_backward(entry, live, leaves, needs_grad, tensors, opts, by_grad)
            else:
                entry.out_differentiable = [False] * len(outputs)
            # Keeps the capture-time outputs and their autograd graph (the saved activations) alive
            # as long as the graphs: a CUDA graph keeps writing and reading those addresses, so the
            # allocator must never hand them to another tensor.
            entry.live = live
            captured = True
        finally:
            snapshot.restore()
            # A failed capture leaves RNG as the eager re-run that replaces it expects.
            if backend.capture_executes or not captured:
                state.restore_rng(rng)
        entry.phase = Phase.REPLAY
        entry.verify_left = opts.verify_replays

    def _refuse_unknown_leaves(self, entry, leaves):
        """Raises CaptureError when the outputs depend on leaves that need grad but would not get
        it: neither call arguments nor parameters of the Layers the call uses."""
        outputs = [o for o, d in zip(entry.static_outputs, entry.out_differentiable) if d]
        known = {leaf.grad_fn.node_ptr() for leaf in leaves if getattr(leaf, "grad_fn", None) is not None}
        unknown = set(accumulation_nodes(outputs)) - known
        if unknown:
            names = name_unknown_leaves(self._fn, unknown)
            raise CaptureError(
                f"autocudagraph: the function uses tensors that require grad but are neither arguments "
                f"nor parameters of a Layer it calls or is bound to: {', '.join(names)}. Their grads "
                "would be lost. Pass them as arguments, or use them through a Layer."
            )

    def _capture_backward(self, entry, live, leaves, needs_grad, tensors, opts, by_grad):
        outputs = entry.static_outputs
        diff_index = [i for i, d in enumerate(entry.out_differentiable) if d]
        with paddle.no_grad():
            grad_outputs = []
            for i in diff_index:
                buf = outputs[i].detach().clone()
                buf.stop_gradient = True
                grad_outputs.append(buf)

        first_param = len(leaves) - len(entry.params)
        grad_groups.probe(entry.params)

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
            # NOTE [ Grad groups ] in grad_groups.py: same-shape parameter grads are also
            # copied into one stack each, so that handing them out costs one copy per stack.
            if "grad_groups" not in live:
                live["grad_groups"] = grad_groups.plan_groups(grads, range(first_param, len(leaves)))
            return list(grads) + grad_groups.stack_grads(grads, live["grad_groups"])

        entry.bwd_graph = entry.backend.new_graph(entry.pool)
        # NOTE [ Recompute under CUDA graphs ] in state.py: only a recording capture needs it.
        guard = state.RngRewindGuard() if not entry.backend.capture_executes else contextlib.nullcontext()
        try:
            with guard:
                results = list(entry.bwd_graph.capture(backward_body, opts.capture_hooks))
        except Exception as err:
            # Our own refusals (a host sync, say) would fail the same way with backward().
            if by_grad and not isinstance(err, CudaGraphError):
                raise GradBodyFailed(err) from err
            raise
        if isinstance(guard, state.RngRewindGuard):
            guard.check()
        entry.static_grads = results[: len(leaves)]
        entry.grad_groups = []
        for idxs, stack in zip(live["grad_groups"], results[len(leaves):]):
            for i, view in zip(idxs, grad_groups.unstack(stack)):
                entry.static_grads[i] = view
            # Positions in the bridge's returned tuple: the call's tensors, then the parameters.
            entry.grad_groups.append((stack, [len(tensors) + i - first_param for i in idxs]))
        entry.grouped_positions = frozenset(pos for _, positions in entry.grad_groups for pos in positions)
        entry.static_grad_outputs = grad_outputs
        # One grad slot per PyLayer tensor input: the call's tensors, then the parameters.
        slots, clones, leaf_i = [], [], 0
        for t, n in zip(tensors, needs_grad):
            if n:
                slots.append(leaf_i if entry.static_grads[leaf_i] is not None else None)
                # Always a copy: a leaf keeps the returned tensor as its .grad, and a non-leaf's
                # grad can reach a parameter outside the call unchanged (x = P + t passes it
                # through), where autograd adopts it as P.grad and the next replay overwrites it.
                clones.append(True)
                leaf_i += 1
            else:
                slots.append(None)
                clones.append(False)
        for _ in entry.params:
            slots.append(leaf_i if entry.static_grads[leaf_i] is not None else None)
            clones.append(entry.clone_param_grads)
            leaf_i += 1
        entry.grad_slots = slots
        entry.hand_out_clone = clones

    # ------------------------------------------------------------------ replay
    def _params_moved(self, entry):
        for (sub, name, p, frozen), ptr in zip(entry.param_homes, entry.param_ptrs):
            if sub._parameters.get(name) is not p or p.stop_gradient != frozen or p.data_ptr() != ptr:
                return f"parameter '{name}' of {type(sub).__name__} was replaced, moved or (un)frozen"
        return None

    def _replay(self, entry, args, kwargs, tensors, consts, spec):
        if self._options.dispatch_key_fn is not None:
            if spec != entry.in_spec:
                raise InputMismatchError(
                    "autocudagraph: the call's argument structure differs from the one its key was "
                    "captured with. Include the structure in the key that dispatch_key_fn returns."
                )
            entry.static_inputs.check(tensors)
        moved = self._params_moved(entry)
        if moved is None and entry.static_inputs.adopted:
            moved = entry.static_inputs.moved(tensors)
            if moved is not None:  # NOTE [ Adopted inputs ] in static_io.py
                moved = f"input '{moved}' is another tensor than the one the graph reads in place"
        if moved is not None:
            entry.to_recapture()
            logger.info("autocudagraph(%s): re-capturing: %s", self.__name__, moved)
            self.counters.recaptures += 1
            return self._capture_call(entry, args, kwargs, tensors, consts, spec)
        if entry.backward_pending():
            self._warn_once(
                "inflight",
                f"autocudagraph({self.__name__}): called again with the same key before the backward of "
                "the previous call ran; this call runs eagerly so the graph's saved activations are not "
                "overwritten. Run backward between calls, or give such calls their own key.",
            )
            return self._eager(args, kwargs, "previous replay's backward still pending")
        return self._graph_call(entry, args, kwargs, tensors, copy=True)

    def _graph_call(self, entry, args, kwargs, tensors, copy):
        if entry.verify_left > 0:
            return verify.verified_call(self, entry, args, kwargs, tensors, copy)
        return self._run_graphs(entry, tensors, copy)

    def _run_graphs(self, entry, tensors, copy):
        if copy:
            copied, skipped = entry.static_inputs.copy_in(tensors)
            entry.replays += 1
            self.counters.replays += 1
        else:
            copied, skipped = 0, 0
        entry.input_copies += copied
        entry.input_copies_skipped += skipped
        self.counters.input_copies += copied
        self.counters.input_copies_skipped += skipped
        if entry.bwd_graph is not None and paddle.is_grad_enabled():
            outputs = GraphedFunction.apply(entry, *tensors, *entry.params)
            if isinstance(outputs, paddle.Tensor):
                outputs = [outputs]
            # Paddle ignores hooks registered on a PyLayer's outputs (measured, 3.3.1): hand out a
            # reshape alias of each differentiable output so y.register_hook(...) works as in eager.
            outputs = [hookable(o) if d else o for o, d in zip(outputs, entry.out_differentiable)]
        else:
            entry.fwd_graph.replay()
            outputs = hand_out_outputs(entry)
            for o in outputs:
                o.stop_gradient = True
        if entry.handed_out is not None:  # NOTE [ Stale outputs ] in safety.py
            # After the replay: this call's inputs may be the previous outputs (y = f(f(x))).
            entry.handed_out.overwrite(self.__name__, entry.label, safety.user_call_site())
            entry.handed_out.hand_out(outputs, entry.host_outputs)
        return unflatten(entry.out_spec, outputs, entry.out_consts)

    def _enforce_max_bytes(self, entry):
        """Evicts least recently used keys until the static buffers fit max_bytes; returns False
        (and moves ``entry`` to eager) when ``entry`` alone does not fit."""
        budget = self._options.max_bytes
        if budget is None:
            return True
        own = entry.nbytes()
        if own > budget:
            reason = f"its static buffers need {own} bytes, more than max_bytes={budget}"
            entry.fall_back(reason)
            self._warn_once(
                ("max_bytes", id(entry)),
                f"autocudagraph({self.__name__}): key {entry.label} runs eagerly: {reason}. Raise max_bytes, "
                "or split the function so each graph holds less.",
            )
            return False
        holders = [e for e in self._entries.values() if e.has_graphs]
        total = sum(e.nbytes() for e in holders)
        for victim in sorted(holders, key=lambda e: e.last_used):
            if total <= budget:
                break
            if victim is entry or victim.backward_pending():
                continue
            total -= victim.nbytes()
            victim.to_recapture()
            victim.evictions += 1
            self.counters.evictions += 1
            logger.info("autocudagraph(%s): evicted key %s to stay within max_bytes=%s", self.__name__, victim.label, budget)
        return True
