"""Lifecycle: the phase machine of one wrapped callable, per key.

``__call__`` decides per call: no key -> eager; new key -> warmup, then capture; known key ->
replay; a key that fell back -> eager. What a phase does for one kind of call is the *body*'s
(block/graphed.py for autocudagraph blocks): this module owns only the phases, the transitions (which
the entry makes), the fallback with its reason, and the budgets (max_graphs, max_bytes: core/budgets.py).
"""

import collections
import logging
import time
import warnings

from ..io import arguments
from ..guards import saved_hooks
from ..backends import capture_open, in_rerun_replay, in_whole_step, is_own_error, resolve_backend
from ..guards.paddle_patches import install_process_patches
from .body import Action
from .budgets import Places, enforce_max_bytes
from . import host_cost, memory
from .call import Call
from .keys import BoundSignature, KeyMaker, rekeyed
from .entry import GraphEntry, Phase
from ..errors import ReplayShapeError
from ..guards.location import user_location, user_stacklevel
from ..io.stale_outputs import check_fresh
from .explain import Reports
from .stats import Counters
from .pass_through import all_slower, passes_through
from .views import Views

__all__ = ["Lifecycle"]

logger = logging.getLogger(__name__)

# NOTE [ The function's own exceptions ]
# An exception the graphed function raises during its capture call (a ValueError of the user's own,
# a shape error eager raises too) is the call's result, not a failure of the capture: eager would
# raise it, once. The capture marks it (backends.function_errors, own_error); the capture is
# ended and dropped as for any failure, and the exception reaches the caller unchanged. The call is
# not re-run (its Python side effects happen once, as in eager) and the key stays in warmup: the
# next call captures again. Our refusals (CudaGraphError), errors of the capture itself (a CUDA
# error that broke it, backends/cuda.py) and an exception raised by code that asked is_capturing()
# during the call (communication code refusing a capture) stay contained: the key runs eagerly
# with the reason. On the cuda backend a capture records without executing, so device work the
# function did before raising is not applied (eager would have applied it); the simulated backend
# executes it and then takes back what a capture takes back (RNG, Layer buffers, a step's state).

def _raise_own_error(counters, entry, err):
    """Raises ``err`` on when the function raised it itself (backends.own_error), counted, as eager
    raises it (same object, same context). On cuda its frames' locals are dropped first: they hold
    tensors of the dropped capture's pool, and freeing one while a later capture is open aborts
    (NOTE [ Garbage collection around capture ] in backends/cuda.py)."""
    if not is_own_error(err):
        return
    counters.eager("the function raised during capture")
    entry.backend.release_error(err)
    raise err


_CAPTURE_FAILED = (
    "capture of key {label} failed: {reason}. The key runs eagerly from now on (results stay correct, without the "
    "speed-up). Fix the cause and call .reset() to capture again, or return None from dispatch_key_fn for such calls.")
_MISMATCH = (
    "the graph of key {label} does not reproduce eager: {mismatch}. This key now runs eagerly. A graph repeats what "
    "capture saw: Python branches or values read from CPU tensors or Python state, and tensors rebound between "
    "calls, are frozen at capture. Make the function depend only on its tensor arguments and Layers, or return "
    "None from dispatch_key_fn for such calls.")
_IN_FLIGHT = (
    "called again with the same key before the backward of the previous call ran; this call runs eagerly so the "
    "graph's saved activations are not overwritten. Run backward between calls, or give such calls their own key.")

_ENDLESS = (
    "key {label} runs eagerly from now on: {reason}. Keep a value that changes on every call out of the "
    "Layer's attributes (count calls outside the model, or in a tensor buffer updated in place, which a graph "
    "replays), or call .reset() once it stops changing.")

#: Why a graphed call made inside autocudagraph_step runs eagerly (explain() of both says it).
WHOLE_STEP = "called inside autocudagraph_step: the whole step's graph holds its work"


def _head_seen(cost, result):
    """``result``, after keeping on ``cost`` (a key judged alone, whose chained calls are still timed)
    whether the replay that made it started a chain: such a key is not judged in chains (NOTE
    [ Graphed calls that cannot pay ] in core/host_cost.py, as HostCost.timed_replay keeps it). Its
    calls alone are not timed any more: the clock reads and the verdict's re-check cost host time
    on every call of a key that never chains."""
    if cost.chain_head:
        cost.chain_head = False
        cost.chain_verdict = cost.chain_verdict or "head"
    return result


def _nested_reason(warn_once):
    """Why this call runs eagerly whatever its key (it runs inside something else), or None."""
    if in_whole_step():  # the step's own graph captures it (in every phase of the step: first)
        return WHOLE_STEP
    if capture_open():
        return "called inside another capture"
    if saved_hooks.active():  # NOTE [ Saved-tensors hooks ] in guards/saved_hooks.py
        warn_once("saved_hooks", saved_hooks.warning())
        return saved_hooks.REASON
    return None


class Lifecycle(Reports, Views):
    """The phase machine of one wrapped callable: per key, warmup -> capture -> replay, or eager.

    Args:
        body: what each phase runs for this kind of call, a Body (core/body.py): BlockBody for
            blocks, StepBody for whole training steps.
        fn: the wrapped function (keys read its signature).
    """

    __signature__ = BoundSignature()  # what inspect.signature() shows: see BoundSignature

    def __init__(self, body, fn):
        install_process_patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py: the first wrapper
        self._body = body
        self._entries = collections.OrderedDict()
        self._warned = set()
        self._last_refusal = None
        self._tick = 0
        self._latest = None  # the entry of the latest call, last in _entries' order
        self._keyless = None  # (reason, when): calls run eagerly for reason, without a key, while when() holds
        self._growth = memory.growth()  # graphs added to keys after their capture, last seen (core/memory.py)
        self._places = Places()  # max_graphs: NOTE [ Places under max_graphs ] in core/budgets.py
        self._keys = KeyMaker(fn, body.options.dispatch_key_fn, bound=body.bound, layers=body.layers())
        self._keys.who = body.api  # names the wrapper in messages: autocudagraph_step(name)
        self.counters = Counters()
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__name__ = body.name

    # ------------------------------------------------------------------ public
    @property
    def options(self):
        return self._body.options

    @property
    def _options(self):  # one source: the body reads the same options
        return self._body.options

    @_options.setter
    def _options(self, options):
        self._body.options = options

    def reset(self):
        """Drops every graph, pool and static buffer, and zeroes the counters (a slot whose backward
        is pending keeps its graphs until that backward ran: NOTE [ Slots ] in block/slots.py)."""
        for entry in self._entries.values():
            entry.release()
        self._entries.clear()
        self._latest = None
        self._keyless = None
        self._places.clear()
        self._warned.clear()
        self.counters = Counters()

    # ------------------------------------------------------------------ phases
    def __call__(self, *args, **kwargs):
        keyless = self._keyless  # NOTE [ Pass-through wrappers ], NOTE [ Graphed calls that cannot pay ]
        if keyless is not None and keyless[1]():
            self.counters.eager(keyless[0])
            return self._body.run(args, kwargs)
        nested = _nested_reason(self._warn_once)
        if nested is not None:
            if in_rerun_replay():  # a GPU replay of the graph holding this call runs no Python: not counted
                return self._body.run(args, kwargs)
            return self._eager(Call(args, kwargs), nested)
        start = host_cost.clock()
        served = self._body.shortcut(args, kwargs, self._keys)
        if served is not None:  # NOTE [ Chains of graphed calls ] in chains/chain.py
            self.counters.chained_calls += 1
            return host_cost.chained(served[0], start, self._run_graphs(served[0], None, True, served[1]), self._acted)
        if self._options.dispatch_key_fn is not None:
            # One canonical form per call (defaults applied, positional where possible), so that
            # f(x, True) and f(x, flag=True), which dispatch_key_fn sees alike, share a graph.
            bound = self._keys.bound_arguments(args, kwargs)
            args, kwargs = bound.args, bound.kwargs
        call = Call(args, kwargs)
        check_fresh(call.tensors)  # NOTE [ Stale outputs ] in io/stale_outputs.py
        key = self._keys.key(args, kwargs, call.tensors, call.spec)
        if key is None:
            return self._eager(call, "dispatch_key_fn returned None")
        entry = self._entries.get(key)
        if entry is None:
            entry = _new_entry(self, key, call)
            if entry is None:
                return self._eager(call, self._last_refusal)
        self._tick += 1
        entry.last_used = self._tick
        if entry is not self._latest:  # the latest entry is already last: every insertion is moved
            self._entries.move_to_end(key)
            self._latest = entry
        if entry.phase is Phase.REPLAY:
            cost = entry.host_cost
            if cost.timing:  # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
                return host_cost.timed_call(entry, call, self._replay, self._eager, self._acted)
            if cost.timing_chained:  # a call alone is no longer timed: only whether it heads a chain is kept
                return _head_seen(cost, self._replay(entry, call))
            return self._replay(entry, call)
        if entry.phase is Phase.WARMUP:
            if entry.warmup_calls < self._options.warmup_steps or not self._body.ready(entry):
                entry.warmed_up(call.tensors)
                self.counters.warmup_calls += 1
                return entry.host_cost.timed_eager(self._body.warmup, entry, call)
            return self._capture(entry, call)
        if entry.phase is Phase.RECAPTURE:
            return self._recapture(entry, call) if _admitted(self, entry) else self._eager(call, "max_graphs reached")
        return self._eager(call, f"key fell back: {entry.fallback_reason}")

    def _acted(self, entry):  # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
        self._keyless = all_slower(host_cost.act(entry, self._warn_once, self._entries.values())) or self._keyless

    def _eager(self, call, reason):
        self.counters.eager(reason)
        return self._body.run(call.args, call.kwargs)

    def _warn_once(self, topic, message):
        if topic in self._warned:
            return
        self._warned.add(topic)
        warnings.warn(f"{self._body.api}({self.__name__}): {message}", RuntimeWarning, stacklevel=user_stacklevel())

    def _capture(self, entry, call):
        last_inputs = entry.last_inputs
        entry.remember_inputs(call.tensors)
        start = time.perf_counter()
        try:
            named = self._keys.named_arguments(call.args, call.kwargs)
            graphs = self._body.capture(entry, call, named, last_inputs, self._warn_once)
        except Exception as err:  # contained: this key runs eagerly from now on
            _raise_own_error(self.counters, entry, err)  # NOTE [ The function's own exceptions ]
            if _written_first(entry, err, call):  # NOTE [ Attributes a capture writes ] in guards/attr_writes.py
                self.counters.warmup_calls += 1
                return entry.host_cost.timed_eager(self._body.warmup, entry, call)
            reason = f"{type(err).__name__}: {err}"
            where = user_location(err.__traceback__)
            if where is not None:
                reason += f" (at {where})"
            entry.fall_back(reason)
            logger.debug("capture of %s failed", self.__name__, exc_info=True)
            message = _CAPTURE_FAILED.format(label=entry.label, reason=reason.rstrip("."))
            self._warn_once(("capture", id(entry)), message)
            return self._eager(call, "capture failed")
        entry.captured(graphs, self._options.verify_replays)
        entry.capture_ms = (time.perf_counter() - start) * 1e3
        logger.info("%s(%s): captured key %s in %.1f ms on %s", self._body.api, self.__name__, entry.label,
                    entry.capture_ms, entry.backend.name)
        self.counters.captures += 1
        # The training flags of Layers a capture found join every key (keys still in warmup too).
        self._entries = rekeyed(self._entries, self._keys.track(graphs.layers))
        if not enforce_max_bytes(self._entries, entry, self._options.max_bytes, self._warn_once, self._evicted):
            return self._eager(call, "static buffers and graph pools exceed max_bytes")
        return self._graph_call(entry, call, copy=False)

    def _replay(self, entry, call):
        blocked = self._body.blocker(entry, call)
        if blocked is not None and blocked.warning is not None:
            self._warn_once(("blocked", blocked.reason), blocked.warning)
        if blocked is not None and blocked.changed is not None and (endless := entry.attr_changed(blocked.changed)):
            return _endless(self, entry, call, endless)  # NOTE [ Attributes that change on every call ] in core/entry.py
        if blocked is not None and blocked.action is Action.RECAPTURE_ONCE and entry.recaptures:
            entry.fall_back(f"{blocked.reason}, again after a re-capture")
            return self._eager(call, "key fell back: its graphs could not be kept valid")
        if blocked is not None and blocked.action is Action.REWARM:
            entry.to_warmup()  # the blocked warning said why
            entry.warmed_up(call.tensors)
            self.counters.warmup_calls += 1
            return entry.host_cost.timed_eager(self._body.warmup, entry, call)
        if blocked is not None and blocked.action in (Action.RECAPTURE, Action.RECAPTURE_ONCE):
            entry.to_recapture()
            logger.info("%s(%s): re-capturing: %s", self._body.api, self.__name__, blocked.reason)
            return self._recapture(entry, call)
        if blocked is not None and blocked.action is Action.NEW_SLOT:
            return self._capture_slot(entry, call)
        if blocked is not None:
            if blocked.warning is None:  # a body that gives no warning of its own: a block in flight
                self._warn_once("inflight", _IN_FLIGHT)
            return self._eager(call, blocked.reason)
        return self._graph_call(entry, call, copy=True)

    def _evicted(self, victim, budget):
        self.counters.evictions += 1
        logger.info("autocudagraph(%s): evicted key %s to stay within max_bytes=%s", self.__name__, victim.label, budget)

    def _capture_slot(self, entry, call):
        """Captures a new slot of ``entry``'s key from ``call``, whose every slot waits for its
        backward (NOTE [ Slots ] in block/slots.py), and runs it; eager when no slot is made."""
        last_inputs = entry.last_inputs
        entry.remember_inputs(call.tensors)
        named = self._keys.named_arguments(call.args, call.kwargs)
        start = time.perf_counter()
        refused = self._body.add_slot(entry, call, named, last_inputs, self._warn_once)
        if refused is not None:
            return self._eager(call, refused)
        logger.info("%s(%s): captured another slot of key %s in %.1f ms on %s", self._body.api, self.__name__,
                    entry.label, (time.perf_counter() - start) * 1e3, entry.backend.name)
        entry.slot_added()
        self.counters.captures += 1
        self.counters.slot_captures += 1
        # The new slot fits (add_slot checked it); other keys may be evicted for it.
        enforce_max_bytes(self._entries, entry, self._options.max_bytes, self._warn_once, self._evicted)
        return self._graph_call(entry, call, copy=False)

    def _recapture(self, entry, call):
        entry.recaptures += 1
        self.counters.recaptures += 1
        return self._capture(entry, call)

    def _graph_call(self, entry, call, copy):
        try:
            if entry.verify_left <= 0:
                return self._run_graphs(entry, call, copy)
            return _verified_call(self, entry, call, copy)
        except ReplayShapeError as err:  # NOTE [ A replay that changes shape ] in block/replay_fallback.py
            reason = f"{type(err).__name__}: {err}"
            entry.fall_back(reason)
            self._warn_once(("replay_shape", id(entry)), f"replay of key {entry.label} failed: {reason.rstrip('.')}. "
                            "The key runs eagerly from now on (results stay correct, without the speed-up).")
            return self._eager(call, err.eager_reason)

    def _run_graphs(self, entry, call, copy, replayed=None):
        """Replays ``entry`` for ``call`` (or counts ``replayed``, a call the body served)."""
        result, copied, skipped, then = replayed or self._body.replay(entry, call, copy)
        entry.last_used = self._tick
        _bytes_grown(self, entry)
        if then is not None:  # Action.FALL_BACK: this call's result stands, the next calls run eagerly
            entry.fall_back(then.reason)
            self._warn_once(("fall_back", id(entry)), then.warning or f"key {entry.label} runs eagerly: {then.reason}.")
        if copy:
            entry.replays += 1
            self.counters.replays += 1
        entry.input_copies += copied
        entry.input_copies_skipped += skipped
        self.counters.input_copies += copied
        self.counters.input_copies_skipped += skipped
        return result


def _new_entry(lifecycle, key, call):
    """The entry of a new key of ``lifecycle`` (a Lifecycle), or None where the call runs eagerly (the reason in
    ``lifecycle._last_refusal``)."""
    backend, reason = resolve_backend(lifecycle._options.backend, call.tensors)
    if backend is None:
        lifecycle._last_refusal = reason
        lifecycle._keyless = lifecycle._keyless if lifecycle._tick else passes_through(lifecycle._options, reason)  # no key held
        return None
    named = lifecycle._keys.named_arguments(call.args, call.kwargs)
    refused = arguments.refusal(named)
    if refused is not None:  # NOTE [ Argument objects ] in io/arguments.py
        lifecycle._warn_once(("arguments", refused), f"runs eagerly: {refused}.")
        lifecycle._last_refusal = refused
        return None
    host = lifecycle._keys.checked(key, call, named)  # raises for a host input too large to key by value
    entry = GraphEntry(key=key, backend=backend, label=lifecycle._keys.label(key, named, host),
                       eager_if_slower=lifecycle._options.eager_if_slower)
    if not _admitted(lifecycle, entry):  # its label names what varies: NOTE [ Places under max_graphs ]
        lifecycle._last_refusal = "max_graphs reached"
        return None
    lifecycle._entries[key], lifecycle._keyless = entry, None  # a key held: no call passes through again
    return entry


def _bytes_grown(lifecycle, entry):
    """max_bytes checked again where a key grew after its capture (a second grad set was captured by a
    replay: NOTE [ What a key holds ] in core/memory.py)."""
    if memory.growth() != lifecycle._growth:
        lifecycle._growth = memory.growth()
        enforce_max_bytes(lifecycle._entries, entry, lifecycle._options.max_bytes, lifecycle._warn_once,
                          lifecycle._evicted)


def _admitted(lifecycle, entry):
    """Whether ``entry`` gets a place under max_graphs; the key that gives it its place is dropped (in
    warmup) or evicted (holding graphs): NOTE [ Places under max_graphs ] in core/budgets.py."""
    ok, victim = lifecycle._places.admit(lifecycle._entries, entry, lifecycle._tick, lifecycle._options.max_graphs,
                                         lifecycle._warn_once)
    if victim is None:
        return ok
    lifecycle.counters.evictions += 1
    if victim.has_graphs:
        victim.evict()
    else:
        del lifecycle._entries[victim.key]
        if lifecycle._latest is victim:
            lifecycle._latest = None
    logger.info("%s(%s): key %s gives its place under max_graphs=%s to key %s, called more often since",
                lifecycle._body.api, lifecycle.__name__, victim.label, lifecycle._options.max_graphs, entry.label)
    return ok


def _written_first(entry, err, call):
    """Was ``entry``'s capture refused for a Layer attribute it changed, where its last refused capture
    changed no such attribute or another? Then the key warms up again with this call (a value made
    once, a lazy attribute, is left alone by the next capture; NOTE [ Attributes a capture writes ] in
    guards/attr_writes.py) and True is returned."""
    written = getattr(err, "attribute", None)
    if written is None or entry.attr_written == written:
        return False
    logger.debug("capture of key %s changed attribute %s: warming up again", entry.label, written)
    entry.to_warmup()
    entry.attr_written = written
    entry.warmed_up(call.tensors)
    return True


def _endless(lifecycle, entry, call, reason):
    """``entry`` runs eagerly for good: a Layer attribute changes before every call (NOTE [ Attributes
    that change on every call ] in core/entry.py)."""
    entry.fall_back(reason)
    lifecycle._warn_once(("endless", id(entry)), _ENDLESS.format(label=entry.label, reason=reason))
    return lifecycle._eager(call, f"key fell back: {reason}")


def _verified_call(lifecycle, entry, call, copy):
    """A replay of ``entry`` for ``call`` checked against an eager re-run (verify_replays): the replay
    alone runs inside the check, and is counted (its ``then`` applied) after it, so a replay that falls
    back (NOTE [ Values a simulated replay reads ] in block/replay_fallback.py) is never verified."""
    entry.verify_left -= 1
    held = []
    run = lambda: held.append(lifecycle._body.replay(entry, call, copy)) or held[0].result  # noqa: E731
    result, mismatch = lifecycle._body.verified_replay(entry, call, run)
    if held:
        lifecycle._run_graphs(entry, call, copy, replayed=held[0])
    if held and held[0].then is not None:
        return result if mismatch is None else lifecycle._eager(call, "verification found a mismatch")
    lifecycle.counters.verified_replays += 1
    entry.verified += 1
    if mismatch is None:
        return result
    lifecycle.counters.verify_mismatches += 1
    entry.fall_back(mismatch)
    lifecycle._warn_once(("verify", id(entry)), _MISMATCH.format(label=entry.label, mismatch=mismatch))
    return lifecycle._eager(call, "verification found a mismatch")
