"""The whole training step as the second kind of body of the phase machine (core/lifecycle.py): what
warmup, capture, replay and eager mean for a step that runs forward, backward, clipping, the
optimizer and loss scaling.

NOTE [ One step, one graph ]
The step function runs inside a *step scope* in every phase: the optimizers' learning-rate
fill is suppressed and the rate fed from the host before the run (NOTE [ Learning rate under a
step graph ] in step/optimizer_state.py), and grad clears follow the wrapper's grad-slot mode (NOTE
[ Grad slots across steps ] in step/grad_slots.py). Warmup steps are eager steps that also record
what the step does on the host (NOTE [ Host values of a step ] in guards/host_reads.py) and whether
it created state (NOTE [ Persistent state of a step ] in step/rollback.py). The capture runs the
step on static copies of the batch's tensors (or on the tensors themselves where it adopts them:
NOTE [ Adopted inputs of a step ] in
step/capture.py) and checks it against the last warmup step.

The step's graphs are in step/graphs.py, one capture of a step in step/capture.py.
"""

import contextlib
import dataclasses
import weakref
from typing import Any

from ..core.body import Body, Replayed, replay_read_other_values
from ..backends import whole_step
from ..errors import CaptureError
from .capture import StepCapture
from .grad_slots import CLOSED, FREED_AT_WINDOW_END, GradSlots, grad_ptr, representative_grads
from ..guards.host_reads import BindingWatch, OpTrace
from ..guards.traced_ops import held_for as traced_ops_held
from ..core.layers import CAPTURE_LOCK
from ..guards.layer_attrs import LayerRecorder
from ..guards.refusals import FREED_GRADS
from .optimizer_state import (LRFeed, SchedulerWatch, check_supported, inner_optimizer, suppress_lr_fill,
                              unlisted_message, watch_steps)
from ..io.nested import flatten, leaf_names, unflatten
from ..io.static_inputs import strided_copy_works
from .replay_checks import binding_message
from .rollback import EXTRA_WARMUPS, NO_WATCH, LayerWatch, describe_changes, fingerprint

__all__ = ["StepBody"]

_new = tuple.__new__  # Replayed without its Python-level NamedTuple __new__


@dataclasses.dataclass
class _Warm:
    """What the latest warmup step of a key did."""

    trace: Any = None
    bindings: dict = dataclasses.field(default_factory=dict)
    changes: str = ""
    consts: Any = None  # the Python values of its result
    grads_only: bool = False  # every change is a grad made or freed
    stepped: frozenset = frozenset()  # ids of the optimizers it updated


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

        # NOTE [ Traced entry points ] in guards/traced_ops.py: wrapped before any patch, for this run only
        with traced_ops_held(entry.backend), CAPTURE_LOCK, LayerRecorder(watch, NO_WATCH), \
                self._scope(self._lazy_feed(stepped)) as record, \
                OpTrace(on_gpu=entry.backend.cpu_is_host, inputs=call.tensors) as trace, watch_steps(on_step):
            out = self.fn(*call.args, **call.kwargs)
        warm.stepped = frozenset(stepped)
        mode_changed = self._after_host_run(record)
        after = fingerprint(self.optimizers, with_grads=self.slots.mode != CLOSED)
        warm.trace = trace
        self._stepped_schedulers = schedulers.stepped() or self._stepped_schedulers
        warm.consts = flatten(out)[1]
        before, after = {**before, **watch.before}, {**after, **watch.after()}
        warm.changes = describe_changes(before, after)
        warm.grads_only = all(label.startswith("grad of ") for label in set(before) | set(after)
                              if before.get(label) != after.get(label))
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
        if warm.changes and warm.grads_only and self.slots.freed:
            raise FREED_GRADS.error(FREED_AT_WINDOW_END.format(changes=warm.changes, where=self.slots.freed))
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
            return StepCapture(self, entry.backend, call, leaf_names(named), warm, last_inputs).run()

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
            return _new(Replayed, (unflatten(graphs.out_spec, graphs.handed_result(call.tensors), consts), copied,
                                   skipped, None))
        with CAPTURE_LOCK:  # a simulated replay re-runs the step under the op trace (process-wide patches)
            graphs.graph.replay()
        result = unflatten(graphs.out_spec, graphs.handed_result(call.tensors), consts)
        self._remember_between()
        then = _simulated_replay_check(graphs, graphs.live.take_replayed())
        return Replayed(result, copied, skipped, then)


def _simulated_replay_check(graphs, replayed):
    """None when a simulated replay read the host values its capture read (and returned the Python
    values it kept), else a Blocked that moves the key to eager (this call's result, from a re-run
    of the step, is still eager's)."""
    return replay_read_other_values(
        graphs.trace, replayed, "host values", "have silently reused the capture-time values",
        "Pass values that change as tensors (or as arguments: they become part of the key).",
        differs=lambda: graphs.returned.differs(graphs.live["spec"][1]))
