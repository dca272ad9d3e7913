"""The whole training step as the second kind of body of the phase machine (core/lifecycle.py): what
warmup, capture, replay and eager mean for a step that runs forward, backward, clipping, the
optimizer and loss scaling.

NOTE [ One step, one graph ]
The step function runs inside a *step scope* in every phase: the optimizers' learning-rate
fill is suppressed and the rate fed from the host before the run (NOTE [ Learning rate under a
step graph ] in step/optimizer_state.py), and grad clears follow the wrapper's grad-slot mode (NOTE
[ Grad slots across steps ] in step/grad_slots.py). Warmup steps are eager steps that also record
what the step does on the host (NOTE [ Host values of a step ] in step/host_reads.py) and whether
it created state (NOTE [ Persistent state of a step ] in step/rollback.py). The capture runs the
step on static copies of the batch's tensors (or on the tensors themselves where it adopts them:
NOTE [ Adopted inputs of a step ]) and checks it against the last warmup step.

NOTE [ Adopted inputs of a step ]
A batch tensor passed in the last warmup call and again in the capture call (a loader that refills
one device buffer in place, a benchmark's fixed batch) is adopted as blocks adopt it (NOTE
[ Adopted inputs ] in io/static_inputs.py): its own storage is the graph's input, so a replay that
is passed it again copies nothing - on a GPU that is one device copy, and its launch, less per
tensor per call. Its in-place updates are what the graph reads, as eager reads them, and a step that
writes its input in place writes the caller's tensor, as eager does. A call that passes another
tensor there cannot be served by copying into it (that would overwrite the caller's tensor): the
key is captured again (ReplayChecks, Action.RECAPTURE), and that capture adopts nothing the call
does not pass again, so a loader that hands out a new tensor per step pays one extra capture, then
copies as before. The adopted tensor's storage is kept alive while the key holds its graph.

NOTE [ The capture call of a step ]
On the simulated backend a capture executes the step: that run *is* this call's step (it
consumed the RNG and updated the parameters as eager would), so its results are handed out and
the graph is not replayed for this call. A CUDA capture only records: the graph is replayed
once for this call, and Paddle's random kernels start from the offsets the capture recorded,
which the generator already moved past (NOTE [ RNG across capture ] in block/capture.py). A failed
capture on the simulated backend is taken back (step_state.Rollback) before the call runs
eagerly.
"""

import contextlib
import dataclasses
import weakref
from typing import Any, List, Optional

import paddle
from paddle import _C_ops

from ..core import state
from ..core.body import Action, Blocked, Body, Graphs, Replayed
from ..backends.paddle_patches import Patches
from ..backends import function_errors, whole_step
from ..errors import CaptureError
from .grad_scaler import live_scalers
from .grad_slots import CLOSED, GradSlots, grad_ptr, representative_grads
from ..io.host_tensors import host_mask
from .host_reads import BindingWatch, OpTrace, describe_trace_difference
from ..core.layers import CAPTURE_LOCK, LayerRecorder
from .optimizer_state import (LRFeed, SchedulerWatch, check_supported, inner_optimizer, move_beta_pows_to_device,
                              optimizer_params, suppress_lr_fill, unlisted_message, watch_steps)
from ..io.static_inputs import (StaticInputs, contiguous_outputs, flatten, holds_tensor, leaf_names, nbytes,
                                strided_copy_works, unflatten)
from .replay_checks import ReplayChecks, binding_message
from .returned_values import ReturnedValues, tag_learning_rates
from .rollback import (EXTRA_WARMUPS, NO_WATCH, GradValues, LayerWatch, Rollback, describe_changes, fingerprint,
                       step_params)

__all__ = ["StepBody", "StepGraphs"]

_new = tuple.__new__  # Replayed without its Python-level NamedTuple __new__


@dataclasses.dataclass(eq=False)
class StepGraphs(Graphs):
    """What one capture of a step made.

    Attributes:
        graph, pool, backend: the step's graph.
        static_inputs, static_outputs, out_spec, out_consts: the batch buffers and the results.
        grad_mode: the grad-slot mode at capture; watched: ``[(param, grad address)]`` checked
            before replays (in persistent mode: the grad storage the graph adds into).
        params: ``[(param, address)]`` the graph updates in place.
        bindings: the step function's globals/closure at capture; trace: the capture's ops.
        pending: the capture call's result when the capture executed the step (simulate).
        live: what the capture run made and the graph keeps reading.
    """

    backend: Any
    pool: Any = None
    graph: Any = None
    static_inputs: Any = None
    static_outputs: List[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    out_consts: Optional[list] = None
    layers: list = dataclasses.field(default_factory=list)
    grad_mode: str = CLOSED
    watched: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)
    bindings: dict = dataclasses.field(default_factory=dict)
    trace: Any = None
    pending: Any = None
    stepped: frozenset = frozenset()  # ids of the optimizers the step updates (their rates are fed)
    moved_beta_pows: int = 0
    returned: Any = None
    live: dict = dataclasses.field(default_factory=dict)
    checks: Any = None  # ReplayChecks, made last (NOTE [ Step replay checks ] in step/replay_checks.py)
    feeds: tuple = ()  # the LRFeeds of the optimizers in ``stepped``
    in_place: bool = False  # every input adopted or a host input: nothing to copy (NOTE [ Adopted inputs of a step ])
    detached: list = dataclasses.field(default_factory=list)  # static_outputs, detached (hand_out)

    def describe(self):
        moved = f"; {self.moved_beta_pows} beta power(s) moved to the device" if self.moved_beta_pows else ""
        return f"whole step, grad slots {self.grad_mode}{moved}"

    def nbytes(self):
        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        return total + sum(nbytes(t) for t in self.static_outputs if t is not None)

    def hand_out(self):
        """Detached copies of the static outputs, which the next replay overwrites (the graph's
        own outputs are detached once, at capture: ``detached``)."""
        copies = list(map(_C_ops.assign, self.detached))
        for c in copies:
            c.stop_gradient = True
        return copies

    def release(self):
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.pool = self.static_inputs = self.pending = None
        self.static_outputs, self.detached, self.live = [], [], {}


@dataclasses.dataclass
class _Warm:
    """What the latest warmup step of a key did."""

    trace: Any = None
    bindings: dict = dataclasses.field(default_factory=dict)
    changes: str = ""
    consts: Any = None  # the Python values of its result
    stepped: frozenset = frozenset()  # ids of the optimizers it updated


@contextlib.contextmanager
def _refuse_paddle_scaler():
    """paddle.amp.GradScaler decides on the host; refuse it by name inside a capture."""
    classes = [c for c in (getattr(paddle.amp, "GradScaler", None), getattr(paddle.amp, "AmpScaler", None)) if c]
    with Patches() as patches:  # NOTE [ Paddle patches ] in backends/paddle_patches.py
        for cls in classes:
            for name in ("step", "minimize", "update"):
                original = cls.__dict__.get(name)
                if original is not None:
                    patches.set(cls, name, _refusing_scaler(name, original))
        yield


def _refusing_scaler(name, original):
    def refusing(self, *args, **kwargs):
        if getattr(self, "_enable", False):
            raise CaptureError(
                f"autocudagraph_step: paddle.amp.GradScaler.{name}() was called during capture. It reads "
                "found_inf on the host to skip the update and keeps its counters in Python, so a graph "
                "would freeze its decisions. Use paddlefleet.cudagraph.GraphGradScaler (same API, decisions "
                "on the device) in a graphed step."
            )
        return original(self, *args, **kwargs)

    return refusing


class StepBody(Body):
    """Warmup, capture, replay and eager run of one training-step function.

    Args:
        fn: the step function; options: StepOptions.
    """

    api = "autocudagraph_step"

    def __init__(self, fn, options):
        self.fn = fn
        self.options = options
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.optimizers = [inner_optimizer(opt) for opt in options.optimizers]  # Fleet wrappers unwrapped
        self.slots = GradSlots()
        self._feeds = [LRFeed(opt) for opt in self.optimizers]
        self._bindings = BindingWatch(fn)
        self._warm = weakref.WeakKeyDictionary()
        self._unlisted = {}  # NOTE [ Optimizers outside optimizers= ]: id -> optimizer seen at warmup
        self._stepped_schedulers = []  # NOTE [ A scheduler stepped inside the step ]
        self._scoped = False  # once a key warms up, eager calls run in the step scope too
        self._between = []  # NOTE [ Grad slots across steps ]: grads after the last call

    # ------------------------------------------------------------------ scope
    def _feed(self, only):
        """Writes the rates of the optimizers whose ids are in ``only`` (NOTE [ Feed only what the
        step updates ] in step/optimizer_state.py)."""
        for feed in self._feeds:
            if id(feed.opt) in only:
                feed.feed()

    def _lazy_feed(self, stepped=None):
        """``on_fill(opt)`` for an eager run: writes the rate prepared now where Paddle's fill
        would be, and adds the optimizer's id to ``stepped``."""
        pending = {id(feed.opt): (feed, feed.prepare()) for feed in self._feeds}

        def on_fill(opt):
            if stepped is not None:
                stepped.add(id(opt))
            feed, value = pending.pop(id(opt), (None, None))
            if value is not None:
                feed.commit(value)

        return on_fill

    @contextlib.contextmanager
    def _scope(self, on_fill=None):
        """The step scope; ``on_fill(opt)`` is called where Paddle would fill a learning rate."""
        with self.slots.scope() as record, suppress_lr_fill(self.optimizers, on_fill), whole_step():
            yield record

    def _after_host_run(self, record):
        changed = self.slots.observe(record)
        self._between = representative_grads(self.optimizers)
        return changed

    def _remember_between(self):
        self._between = [(p, grad_ptr(p)) for p, _ in self._between]

    # ------------------------------------------------------------------ eager and warmup
    def run(self, args, kwargs):
        """The step, eagerly (fallback and keys without graphs)."""
        if not self._scoped:
            return self.fn(*args, **kwargs)
        with self._scope(self._lazy_feed()) as record:
            out = self.fn(*args, **kwargs)
        self._after_host_run(record)
        return out

    def warmup(self, entry, call):
        """An eager step that also records its ops and whether it created state."""
        self._scoped = True
        warm = self._warm.setdefault(entry, _Warm())
        warm.bindings = self._bindings.snapshot()
        watch = LayerWatch()
        before = fingerprint(self.optimizers, with_grads=self.slots.mode != CLOSED)
        schedulers = SchedulerWatch(self.optimizers)
        # The recorder and the trace patch process-wide entry points: one at a time (CAPTURE_LOCK).
        stepped = set()

        def on_step(opt):
            if not any(o is opt for o in self.optimizers):
                self._unlisted.setdefault(id(opt), opt)

        with CAPTURE_LOCK, LayerRecorder(watch, NO_WATCH), self._scope(self._lazy_feed(stepped)) as record, OpTrace(
                on_gpu=entry.backend.name == "cuda") as trace, watch_steps(on_step):
            out = self.fn(*call.args, **call.kwargs)
        warm.stepped = frozenset(stepped)
        mode_changed = self._after_host_run(record)
        after = fingerprint(self.optimizers, with_grads=self.slots.mode != CLOSED)
        warm.trace = trace
        self._stepped_schedulers = schedulers.stepped() or self._stepped_schedulers
        warm.consts = flatten(out)[1]
        warm.changes = describe_changes({**before, **watch.before}, {**after, **watch.after()})
        if mode_changed:
            warm.changes = warm.changes or "the step leaves grads for the next call (gradient accumulation)"
        return out

    def unlisted_error(self, unlisted):
        """The CaptureError for optimizers stepped by the step but missing from optimizers=."""
        return CaptureError(unlisted_message(unlisted, self.optimizers, self._bindings.snapshot()))

    def ready(self, entry):
        """May ``entry`` capture now? Not while its warmup steps still create state (up to
        EXTRA_WARMUPS more of them; after that the capture refuses with what changed)."""
        warm = self._warm.get(entry)
        if warm is None or not warm.changes:
            return True
        return entry.warmup_calls >= self.options.warmup_steps + EXTRA_WARMUPS

    # ------------------------------------------------------------------ capture
    def capture(self, entry, call, named, last_inputs, warn_once):
        """Captures ``entry``'s key from ``call`` (``named``: its ``[(argument name, value)]``);
        returns its StepGraphs or raises."""
        warm = self._warm.get(entry)
        if warm is None or warm.trace is None:
            raise CaptureError(
                "autocudagraph_step: this key has no warmup step to compare the capture with (it is captured again "
                "after a reset). Call reset() on the step to warm it up again."
            )
        if warm.changes:
            raise CaptureError(
                f"autocudagraph_step: every warmup step of this key created or replaced state: {warm.changes}. A graph "
                "keeps reading the tensors that exist at capture, so the step would silently train stale ones. "
                "Create parameters and optimizer state before training (or in the first step only), and update "
                "tensors in place (paddle.assign(new, output=t)) instead of rebinding them."
            )
        changed = BindingWatch.changed(warm.bindings, self._bindings.snapshot())
        if changed is not None:
            raise CaptureError(binding_message(changed, "the last warmup step and the capture"))
        if self._unlisted:
            raise self.unlisted_error(list(self._unlisted.values()))
        if self._stepped_schedulers:
            raise CaptureError(SchedulerWatch.message(self._stepped_schedulers))
        for opt in self.optimizers:
            check_supported(opt)
        strided_copy_works()  # probed outside any capture (NOTE [ Strided static outputs ] in io/static_inputs.py)
        with CAPTURE_LOCK:
            return _StepCapture(self, entry.backend, call, leaf_names(named), warm, last_inputs).run()

    # ------------------------------------------------------------------ replay
    def blocker(self, entry, call):
        """None when ``call`` can replay ``entry``'s graph now, else a Blocked (NOTE [ Step replay
        checks ] in step/replay_checks.py)."""
        graphs = entry.graphs
        if self.options.dispatch_key_fn is not None:
            graphs.static_inputs.check(call.tensors)
        return graphs.checks.blocked(self.slots.mode, self._between, call.tensors)

    def replay(self, entry, call, copy):
        """Runs ``entry``'s graph for ``call``."""
        graphs = entry.graphs
        if graphs.pending is not None:  # NOTE [ The capture call of a step ]
            result, graphs.pending = graphs.pending, None
            self._remember_between()
            return Replayed(result)
        for feed in graphs.feeds:  # NOTE [ Feed only what the step updates ] in step/optimizer_state.py
            feed.feed()
        consts = graphs.returned.for_replay()  # NOTE [ Python values in a step's result ]
        if not copy:
            copied, skipped = 0, 0
        elif graphs.in_place:  # the blocker found every adopted input where the graph reads it
            copied, skipped = 0, len(call.tensors)
        else:
            copied, skipped = graphs.static_inputs.copy_in(call.tensors)
        if graphs.trace is None:
            # A recording replay runs none of the step's Python: the grads are where the blocker
            # (or, on the capture call, the capture) last saw them, so _between stays as it is.
            graphs.graph.replay()
            return _new(Replayed, (unflatten(graphs.out_spec, graphs.hand_out(), consts), copied, skipped, None))
        with CAPTURE_LOCK:  # a simulated replay re-runs the step under the op trace (process-wide patches)
            graphs.graph.replay()
        result = unflatten(graphs.out_spec, graphs.hand_out(), consts)
        self._remember_between()
        replayed = graphs.live.get("trace")
        then = _simulated_replay_check(graphs, replayed) if replayed is not graphs.trace else None
        return Replayed(result, copied, skipped, then)


def _refuse_written_copies(static):
    """Raises CaptureError where the step wrote an input it copies (an adopted input is the caller's
    tensor: written as eagerly)."""
    written = static.written(skip=static.adopted)
    if written:
        raise CaptureError(
            f"autocudagraph_step: the step writes its input(s) {', '.join(map(repr, written))} in place. The "
            "graph writes into its own copy of such an input, so the caller's tensor would not change on replays. "
            "Return the new value instead, write it after the step, or pass the very same tensor on every call "
            "(then the graph reads and writes it in place: NOTE [ Adopted inputs of a step ]).")


def _simulated_replay_check(graphs, replayed):
    """None when a simulated replay read the host values its capture read (and returned the Python
    values it kept), else a Blocked that moves the key to eager (this call's result, from a re-run
    of the step, is still eager's)."""
    diff = describe_trace_difference(graphs.trace, replayed, "capture", "replay")
    if diff is None:
        diff = graphs.returned.differs(graphs.live["spec"][1])
    if diff is None:
        return None
    reason = f"a replay read other host values than the capture: {diff}"
    return Blocked(Action.FALL_BACK, reason, (
        f"{reason}. On a GPU this replay would have silently reused the capture-time values; the simulated "
        "backend re-runs Python, so this result is still eager's. The key runs eagerly from now on. Pass "
        "values that change as tensors (or as arguments: they become part of the key)."))


def _unlisted_optimizers(body):
    """``[(name, optimizer)]`` the step function reads (its globals and closure) that optimizers=
    lacks: their learning rate (and Adam's beta powers) reach the step as host values that change
    every step, which is what a changing op argument at an optimizer op usually is."""
    listed = {id(inner_optimizer(opt)) for opt in body.optimizers}
    found = {}
    for name, value in body._bindings.snapshot().items():
        inner = inner_optimizer(value)
        if inner is not None and id(inner) not in listed:
            found.setdefault(id(inner), (name, inner))
    return list(found.values())


def _unlisted_optimizers_hint(body):
    """A sentence naming the optimizers of _unlisted_optimizers, or ""."""
    missing = _unlisted_optimizers(body)
    if not missing:
        return ""
    return (f" The step uses {', '.join(f'{n} ({type(o).__name__})' for n, o in missing)}, which optimizers= does "
            "not list: autocudagraph_step feeds the learning rate of the listed optimizers only. Pass every "
            f"optimizer the step steps: add {', '.join(n for n, _ in missing)} to optimizers=[...].")


class _StepCapture:
    """One capture of a step (NOTE [ The capture call of a step ])."""

    def __init__(self, body, backend, call, names, warm, last_inputs=None):
        self.body = body
        self.last_inputs = last_inputs or []  # weak references to the last warmup call's tensors
        self.backend = backend
        self.call = call
        self.names = names
        self.warm = warm
        self.on_gpu = backend.name == "cuda"
        self.schedulers = SchedulerWatch(body.optimizers)  # their state before the capture

    def run(self):
        body, backend = self.body, self.backend
        graphs = StepGraphs(backend=backend, pool=backend.new_pool(), grad_mode=body.slots.mode)
        place = _device_place(body.optimizers) if self.on_gpu else None
        graphs.moved_beta_pows = sum(move_beta_pows_to_device(o, place, self.on_gpu) for o in body.optimizers)
        # Unlisted optimizers the step steps are rolled back too: the capture is refused (their
        # learning rate changes), and the eager call that replaces it must not update twice.
        rolled_back = list(body.optimizers) + [opt for _, opt in _unlisted_optimizers(body)]
        rollback = Rollback(rolled_back, live_scalers(), roots=[body.fn]) if backend.capture_executes else None
        # NOTE [ What a failed recording capture leaves ] in step/rollback.py
        grads = GradValues(step_params(rolled_back, roots=[body.fn])) if rollback is None else None
        rng = state.rng_snapshot()
        # A recording capture changes no tensor, but its Python ran: the scalers' stages advanced.
        stages = [(scaler, scaler.python_state()) for scaler in live_scalers()]
        try:
            self._capture(graphs, rollback)
        except BaseException:
            if rollback is not None:
                rollback.restore()
                for feed in body._feeds:  # the rollback put the previous step's rate back
                    feed.forget()
            else:
                grads.restore()
                state.restore_rng(rng)
                self.schedulers.restore()
                for scaler, stage in stages:
                    scaler.set_python_state(stage)
            graphs.release()
            raise
        return graphs

    def _capture(self, graphs, rollback):
        body, call = self.body, self.call
        host = host_mask(call.tensors, on_gpu=self.on_gpu)
        static = StaticInputs(call.tensors, self.names, adopt=_adoptable(call.tensors, self.last_inputs, host),
                              host=host)
        args, kwargs = call.rebuild(static.buffers)
        live, fn, on_gpu = graphs.live, body.fn, self.on_gpu
        stepped = live["stepped"] = set()  # the optimizers whose rate Paddle would fill

        def filled(opt):
            stepped.add(id(opt))

        def step_body():
            with body._scope(filled) as record, OpTrace(on_gpu=on_gpu, where=graphs.trace is None) as trace, \
                    function_errors():
                out = fn(*args, **kwargs)
            tensors, consts, spec = flatten(out)
            live.update(trace=trace, record=record, spec=(spec, consts))
            return contiguous_outputs(tensors)  # NOTE [ Strided static outputs ] in io/static_inputs.py

        watch = LayerWatch(values=rollback.buffers if rollback is not None else None)
        before = fingerprint(body.optimizers, with_grads=graphs.grad_mode != CLOSED)
        guard = state.RngRewindGuard() if not self.backend.capture_executes else contextlib.nullcontext()
        body._feed(self.warm.stepped)
        graphs.graph = self.backend.new_graph(graphs.pool)

        def on_step(opt):
            if not any(o is opt for o in body.optimizers):
                raise body.unlisted_error([opt])

        writes = rollback.writes if rollback is not None else contextlib.nullcontext()
        with LayerRecorder(watch, NO_WATCH), guard, _refuse_paddle_scaler(), watch_steps(
                on_step), tag_learning_rates(), writes:
            outputs = graphs.graph.capture(step_body, body.options.capture_hooks)
        if isinstance(guard, state.RngRewindGuard):
            guard.check()
        self._check(live, before, watch, graphs)
        _refuse_written_copies(static)
        graphs.static_inputs = static
        graphs.in_place = len(static.adopted) + len(static.host) == len(static.buffers)
        graphs.static_outputs = list(outputs)
        graphs.detached = [o.detach() for o in graphs.static_outputs]
        graphs.stepped = self.warm.stepped
        graphs.feeds = tuple(feed for feed in body._feeds if id(feed.opt) in graphs.stepped)
        graphs.out_spec = live["spec"][0]
        graphs.returned = ReturnedValues(graphs.out_spec, live["spec"][1], self.warm.consts, self.call)
        graphs.out_consts = graphs.returned.consts
        graphs.layers = _unique(watch.layers)
        graphs.trace = live["trace"] if self.backend.capture_executes else None
        graphs.bindings = body._bindings.snapshot()
        graphs.params = [(p, p.data_ptr()) for opt in body.optimizers for p in optimizer_params(opt)]
        body._after_host_run(live["record"])
        graphs.watched = list(body._between)
        graphs.checks = ReplayChecks(graphs, body._bindings)
        if self.backend.capture_executes:
            graphs.pending = unflatten(graphs.out_spec, graphs.hand_out(), graphs.out_consts)

    def _check(self, live, before, watch, graphs):
        body = self.body
        stepped = self.schedulers.stepped()
        if stepped:
            raise CaptureError(SchedulerWatch.message(stepped))
        new = [k for k, opt in enumerate(body.optimizers) if id(opt) in live["stepped"] - self.warm.stepped]
        if new:  # its rate was not fed before the capture
            raise CaptureError(
                f"autocudagraph_step: the capture step updates optimizers[{new[0]}] "
                f"({type(body.optimizers[new[0]]).__name__}), which the last warmup step of this key did not. A key "
                "must update the same optimizers on every call; give other phases their own key (e.g. a Python bool "
                "argument)."
            )
        trace = live["trace"]
        host = trace.host_inputs()
        if host:
            i, op, line = host[0]
            raise CaptureError(
                f"autocudagraph_step: op #{i} {op}{f' at {line}' if line else ''} reads a host (CPU) tensor inside the "
                "step. A graph reads host memory once, at capture. Keep the step's tensors on the device."
            )
        after = fingerprint(body.optimizers, with_grads=graphs.grad_mode != CLOSED)
        changes = describe_changes({**before, **watch.before}, {**after, **watch.after()})
        if changes:
            raise CaptureError(
                f"autocudagraph_step: the capture step created or replaced state: {changes}. A graph keeps using the "
                "tensors that existed at capture, so later steps would silently train stale ones. Create "
                "parameters and optimizer state before training, and update tensors in place."
            )
        diff = describe_trace_difference(self.warm.trace, trace, "last warmup step", "capture")
        if diff is not None:
            raise CaptureError(
                f"autocudagraph_step: the step reads a host value that changes between steps: {diff}. A graph replays "
                "every op with its capture-time arguments, so later steps would silently reuse them. Pass such "
                "values as tensors (updated in place) or as arguments of the step (they become part of the key)."
                + _unlisted_optimizers_hint(body)
            )
        if live["record"].leaves_grads and graphs.grad_mode == CLOSED:
            raise CaptureError(
                "autocudagraph_step: the capture step left grads for the next call, but its warmup steps cleared them. "
                "A step must clear grads on every call or on none of a key's calls; give accumulation phases "
                "their own key (e.g. a Python bool argument)."
            )
        for value in live["spec"][1]:
            if holds_tensor(value):
                raise CaptureError(
                    f"autocudagraph_step: the step returns a {type(value).__name__} object holding tensors; it would be "
                    "returned as captured, with frozen values. Return tensors in a tuple, list or dict."
                )


def _adoptable(tensors, last_inputs, host):
    """Per tensor: was it the very same tensor in the last warmup call (NOTE [ Adopted inputs of a
    step ])? Host inputs are keyed by value and never adopted, nor is a non-contiguous tensor."""
    if len(last_inputs) != len(tensors):
        return None
    return [last_inputs[i]() is t and t.is_contiguous() and not (host and host[i]) for i, t in enumerate(tensors)]


def _device_place(optimizers):
    for opt in optimizers:
        for p in optimizer_params(opt):
            if p.place.is_gpu_place():
                return paddle.CUDAPlace(p.place.gpu_device_id())
    return None


def _unique(layers):
    seen, out = set(), []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out
