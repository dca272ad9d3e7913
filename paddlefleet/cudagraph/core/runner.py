"""The runner: carries out the dispatcher's Decision for one call (core/dispatch.py), one method per
Action. ``Runner`` is the Lifecycle's mixin (core/lifecycle.py); it moves the key's phase, runs the
body's phases (warmup, capture, replay) and gives the warnings, as the Decision says.
"""

import logging
import time

from ..backends import is_own_error
from ..errors import ReplayShapeError
from ..guards.location import user_location
from ..io.nested import flatten
from . import host_cost, memory
from .budgets import enforce_max_bytes
from .call_state import grad_enabled
from .dispatch import dispatch
from .keys import rekeyed

__all__ = ["Runner"]

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

_CAPTURE_FAILED = (
    "capture of key {label} failed: {reason}. The key runs eagerly from now on (results stay correct, without the "
    "speed-up). Fix the cause and call .reset() to capture again, or return None from dispatch_key_fn for such calls.")
_MISMATCH = (
    "the graph of key {label} does not reproduce eager: {mismatch}. This key now runs eagerly. A graph repeats what "
    "capture saw: Python branches or values read from CPU tensors or Python state, and tensors rebound between "
    "calls, are frozen at capture. Make the function depend only on its tensor arguments and Layers, or return "
    "None from dispatch_key_fn for such calls.")


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


class Runner:
    """Carries out Decisions; a mixin over the Lifecycle's ``_body``, ``_keys``, ``_entries``, ``_options``,
    ``counters``, ``_eager``, ``_warn_once``, ``_acted`` and ``_evicted``."""

    def _run(self, decision, args, kwargs):
        """The result of the call ``(*args, **kwargs)`` whose Decision is ``decision``."""
        for topic, message in decision.warn:
            self._warn_once(topic, message)
        return getattr(self, decision.action._value_)(decision, args, kwargs)

    def _eager_call(self, d, args, kwargs):
        if d.reason is None:  # a GPU replay of the graph holding this call runs no Python: not counted
            return self._body.run(args, kwargs)
        if d.call is not None:  # canonicalised (dispatch_key_fn)
            args, kwargs = d.call.args, d.call.kwargs
        self.counters.eager(d.reason)
        return self._body.run(args, kwargs)

    def _chained(self, d, args, kwargs):
        replayed = self._body.serve(d.plan, args)
        if replayed is None:  # the chain broke at this call (its replay changed a shape): the call runs alone
            return self._run(dispatch(self, args, kwargs), args, kwargs)
        self.counters.chained_calls += 1
        entry = d.entry
        result = self._run_graphs(entry, None, True, replayed)
        cost = entry.chain.cost  # a served key's chain record (chains/record.py)
        if cost.timing(entry.host_cost):  # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
            cost.add(entry.host_cost, host_cost.clock() - d.start)
            self._acted(entry)
        return result

    def _warmup(self, d, args=None, kwargs=None):
        entry, call = d.entry, d.call
        if d.blocked is not None:  # what the warmup traced changed: the key warms up again
            entry.to_warmup()
        entry.warmed_up(call.tensors)
        return self._warmup_call(entry, call)

    def _warmup_call(self, entry, call):
        """One warmup call of ``entry``'s key (it has warmed_up), counted and timed as an eager sample."""
        self.counters.warmup_calls += 1
        return _eager_sample(self._body, entry, self._body.warmup, entry, call)

    def _timed_eager(self, d, args, kwargs):
        """An eager sample of a key still warming up (NOTE [ Graphed calls that cannot pay ])."""
        return _eager_sample(self._body, d.entry, self._eager, d.call, d.reason)

    def _fall_back(self, d, args, kwargs):
        d.entry.fall_back(d.reason)
        return self._eager(d.call, f"key fell back: {d.reason}")

    def _capture(self, d, args=None, kwargs=None):
        entry, call = d.entry, d.call
        last_inputs = entry.last_inputs
        entry.remember_inputs(call.tensors)
        start = time.perf_counter()
        try:
            named = self._keys.named_arguments(call.args, call.kwargs)
            graphs = self._body.capture(entry, call, named, last_inputs, self._warn_once)
        except Exception as err:  # contained: this key runs eagerly from now on
            _raise_own_error(self.counters, entry, err)  # NOTE [ The function's own exceptions ]
            if _written_first(entry, err, call):  # NOTE [ Attributes a capture writes ] in guards/attr_writes.py
                return self._warmup_call(entry, call)
            reason = f"{type(err).__name__}: {err}"
            where = user_location(err.__traceback__)
            if where is not None:
                reason += f" (at {where})"
            entry.fall_back(reason)
            logger.debug("capture of %s failed", self.__name__, exc_info=True)
            self._warn_once(("capture", id(entry)), _CAPTURE_FAILED.format(label=entry.label, reason=reason.rstrip(".")))
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

    def _recapture(self, d, args=None, kwargs=None):
        entry = d.entry
        if d.blocked is not None:  # a replay the body blocked: the key's graphs go first
            entry.to_recapture()
            entry.recapture_reason = d.reason
            logger.info("%s(%s): re-capturing: %s", self._body.api, self.__name__, d.reason)
        entry.recaptures += 1
        self.counters.recaptures += 1
        return self._capture(d)

    def _new_slot(self, d, args=None, kwargs=None):
        """Captures a new slot of the key from the call, whose every slot waits for its backward (NOTE
        [ Slots ] in block/slots.py), and runs it; eager when no slot is made."""
        entry, call = d.entry, d.call
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

    def _replay(self, d, args=None, kwargs=None):
        entry = d.entry
        result = self._graph_call(entry, d.call, True)
        if d.start is not None:  # timed: NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
            cost = entry.host_cost
            times = cost.graphed_backward()  # asked first: add_replay makes the verdict (and clears skip)
            cost.add_replay(host_cost.clock() - d.start)
            if times is not None and times.armed and entry.has_graphs:  # this replay's backward is timed too
                self._body.time_backward(entry, times)
            self._acted(entry)
        return result

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
        """Replays ``entry`` for ``call`` (or counts ``replayed``, a call a chain served)."""
        result, copied, skipped, then = replayed or self._body.replay(entry, call, copy)
        entry.last_used = self._tick
        if memory.growth() != self._growth:
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


def _eager_sample(body, entry, run, *args):
    """``run(*args)``, its host time kept as one of ``entry``'s eager calls, and its backward timed where
    it can be seen (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py)."""
    start = host_cost.clock()
    result = run(*args)
    cost = entry.host_cost
    cost.add_eager(host_cost.clock() - start)
    if cost.backward is not None and grad_enabled():
        cost.eager_backward(flatten(result)[0], body.layers())
    return result


def _bytes_grown(runner, entry):
    """max_bytes checked again where a key grew after its capture (a second grad set was captured by a
    replay: NOTE [ What a key holds ] in core/memory.py)."""
    runner._growth = memory.growth()
    enforce_max_bytes(runner._entries, entry, runner._options.max_bytes, runner._warn_once, runner._evicted)


def _verified_call(runner, entry, call, copy):
    """A replay of ``entry`` for ``call`` checked against an eager re-run (verify_replays): the replay
    alone runs inside the check, and is counted (its ``then`` applied) after it, so a replay that falls
    back (NOTE [ Values a simulated replay reads ] in block/replay_fallback.py) is never verified."""
    entry.verify_left -= 1
    held = []
    run = lambda: held.append(runner._body.replay(entry, call, copy)) or held[0].result  # noqa: E731
    result, mismatch = runner._body.verified_replay(entry, call, run)
    if held:
        runner._run_graphs(entry, call, copy, replayed=held[0])
    if held and held[0].then is not None:
        return result if mismatch is None else runner._eager(call, "verification found a mismatch")
    runner.counters.verified_replays += 1
    entry.verified += 1
    if mismatch is None:
        return result
    runner.counters.verify_mismatches += 1
    entry.fall_back(mismatch)
    runner._warn_once(("verify", id(entry)), _MISMATCH.format(label=entry.label, mismatch=mismatch))
    return runner._eager(call, "verification found a mismatch")


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
