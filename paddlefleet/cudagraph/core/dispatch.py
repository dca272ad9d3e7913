"""The dispatcher: what one call of a wrapper does, decided without running its body or device code.

NOTE [ One call through the dispatcher ]
A wrapper's ``__call__`` (core/lifecycle.py) is two lines: ``dispatch()`` returns a Decision, a value
(an Action, the key's entry, the Call, the reason and the warnings to give), and the runner
(core/runner.py) carries it out, one method per Action. The dispatcher reads, in this order: a
wrapper that passes calls through (NOTE [ Pass-through wrappers ] in core/pass_through.py), a call
made inside something else (a whole step, another capture, saved-tensors hooks), a chain that
claims the call (NOTE [ Chains of graphed calls ] in chains/chain.py), the key, the entry (a new
key gets its place under max_graphs here: NOTE [ Places under max_graphs ] in core/budgets.py),
and then the entry's phase: WARMUP -> a timed eager sample while the key's host cost asks for one
(NOTE [ Graphed calls that cannot pay ] in core/host_cost.py), else warm up or capture; REPLAY -> the
body's ``blocker`` (core/body.py) turned into replay, capture again, warm up again, a new slot, an
eager call or a fall-back; RECAPTURE -> capture again; FALLBACK -> eager. It keeps the wrapper's
books (the entries' order, the places, an attribute's streak of captures again) but runs no
user code and no device code and moves no phase of the call's key (the runner does, and gives the
Decision's warnings): a test pins a call's Decision with a stand-in body that may not run
(tests/core/test_dispatch.py). The one exception is a key that gives its place under max_graphs to
this call's: it is evicted (its graphs released) or dropped here.

NOTE [ Calls of a key that runs eagerly ]
A key that fell back (its capture failed, eager_if_slower sent it eager, it alone exceeds max_bytes, ...) stays
in FALLBACK until reset(), and each of its calls runs the function eagerly, counted with its reason: nothing
but the key decides such a call, so two things make it cost little more than the function's own call:
* dispatch() takes the key of the common call, f(x, ...) with tensors only and no dispatch_key_fn, from the
  arguments as passed (the Key a Call's tensors and spec give: positional_spec in core/call.py): where the
  latest call's entry has that key, read part by part (``KeyMaker.is_key_of`` in core/keys.py: the same parts
  KeyMaker.key reads, each compared, no Key made nor hashed; the latest entry is always held under its key),
  else made and looked up.
  This serves every phase (a replayed key's calls too). A FALLBACK entry's calls get its Decision, made once
  per fallback reason; the books are kept as for any call (the wrapper's tick, the entry's last use, the
  entries' order).
* That call also arms the front path: ``Lifecycle.__call__`` asks the wrapper's KnownEager (the key that
  fell back whose call came last) whether the call is one of that key, and if so counts it and runs the
  function without dispatch(). ``KnownEager.take`` answers yes only where dispatch() would decide the same
  (each a test in tests/core/test_eager_calls.py): the key is still in FALLBACK with the same reason; no
  keyless rule (the front path is asked only without one); no capture, whole step or re-running replay in this
  thread, no saved-tensors hooks (the nested reasons), no chain open (``Body.idle``: a chain's claim acts on an
  open chain), no stale output alive (check_fresh would look); no dispatch_key_fn (armed only by a call without
  one, and dropped when the wrapper's options are set) and no keyword argument; and ``KeyMaker.is_call_of`` the
  entry's key (is_key_of without making the spec; the tensors, grad mode, autocast and the training flags read
  and compared in one compiled call where it can: ``key_of``, NOTE [ Compiled tensor reads ] in
  native/__init__.py): no tensor marked host, the same number of positional arguments, each a tensor whose shape,
  dtype (its int, or the very dtype object read before with that int), place key and stop_gradient are the key's,
  read from the tensor on every call (an in-place op, ``paddle.assign(output=)`` or a flipped stop_gradient
  changes them on the same object); and grad mode, the autocast state and the training flag of every tracked Layer
  as in the entry's key (a capture of another key may have added Layers: the entry's own key is compared,
  extended). It keeps the same books.
Any other call (keyword or non-tensor arguments, dispatch_key_fn, another key) takes the full path; a new
key warms up and captures as before.
A key refused under max_graphs that dispatch() refused again (no entry made: NOTE [ Places under max_graphs ]
in core/budgets.py) arms the same front path with ``KnownRefused``: its later calls are refused from the front
while dispatch() would refuse them the same way, under the same conditions as above plus the key still without
an entry and ``Places.refused_again`` (every place taken, no key it may displace yet; the call remembered as
dispatch() remembers it). A call that may displace a key goes through dispatch() and gets its place there. Both
take() answers are read in C where a Layer graphed in place is called through its front door (NOTE [ The front door ]
in core/front.py).
"""

import enum
import logging
from typing import Any, NamedTuple, Optional

import paddle

from ..backends import capture_open, in_rerun_replay, in_whole_step, plain_thread, resolve_backend
from ..guards import saved_hooks
from ..io import arguments
from ..io.stale_outputs import any_stale, check_fresh
from . import state
from . import host_cost
from .body import Action as Blocker
from .call import Call, positional_spec
from .entry import GraphEntry, Phase
from .front import known_gate, refused_gate
from .pass_through import condition_gate, passes_through

__all__ = ["Action", "Decision", "KnownEager", "KnownRefused", "WHOLE_STEP", "admitted", "dispatch", "keyless_rule",
           "nested_reason"]

logger = logging.getLogger(__name__)

#: Why a graphed call made inside autocudagraph_step runs eagerly (explain() of both says it).
WHOLE_STEP = "called inside autocudagraph_step: the whole step's graph holds its work"

IN_FLIGHT = (
    "called again with the same key before the backward of the previous call ran; this call runs eagerly so the "
    "graph's saved activations are not overwritten. Run backward between calls, or give such calls their own key.")

#: Why a call whose key finds every place under max_graphs taken runs eagerly (NOTE [ Places under max_graphs ]).
MAX_GRAPHS = "max_graphs reached"

ENDLESS = (
    "key {label} runs eagerly from now on: {reason}. Keep a value that changes on every call out of the "
    "Layer's attributes (count calls outside the model, or in a tensor buffer updated in place, which a graph "
    "replays), or call .reset() once it stops changing.")


class Action(enum.Enum):
    """What the runner does with one call; the value names the runner's method (core/runner.py)."""

    EAGER = "_eager_call"  # runs eagerly, counted with the reason (None: a GPU replay's re-run, not counted)
    CHAINED = "_chained"  # a chain serves it (Decision.plan: the chain's own)
    WARMUP = "_warmup"  # an eager warmup call of the key (Decision.blocked set: the key warms up again first)
    CAPTURE = "_capture"  # the key's capture, then its first replay
    RECAPTURE = "_recapture"  # the key captured again (Decision.blocked set: its graphs are dropped first)
    NEW_SLOT = "_new_slot"  # another slot of the key captured (NOTE [ Slots ] in block/slots.py)
    REPLAY = "_replay"  # the key's graphs replayed (timed from Decision.start when it is not None)
    TIMED_EAGER = "_timed_eager"  # an eager call of a key warming up, timed against its replays to come
    FALL_BACK = "_fall_back"  # the key runs eagerly from now on (Decision.reason), this call too


class Decision(NamedTuple):
    """What one call does: the Action, the key's entry (None before a key), the Call (None where the
    call runs with its arguments as passed), the reason (an eager call's, counted by stats(); a
    fall-back's; the blocker's), the body's Blocked that led here, the warnings ``((topic, message),
    ...)`` the runner gives once per wrapper before it acts, the clock reading a timed call started
    at, and a chain's plan (CHAINED)."""

    action: Action
    entry: Optional[GraphEntry] = None
    call: Optional[Call] = None
    reason: Optional[str] = None
    blocked: Any = None
    warn: tuple = ()
    start: Optional[float] = None
    plan: Any = None


Tensor = paddle.Tensor
_new = tuple.__new__  # a Decision made positionally, on the calls of every replay: half the cost of Decision(...)
_EAGER, _REPLAY, _CHAINED = Action.EAGER, Action.REPLAY, Action.CHAINED
_FALLBACK = Phase.FALLBACK


def keyless_rule(rule, counters):
    """``(reason, when, Decision, tally, gate)`` for a wrapper's keyless ``rule`` = ``(reason, when)``
    (core/pass_through.py: its calls run eagerly for reason, without a key, while ``when`` is None or ``when()``
    holds), the Decision made once, the wrapper's ``counters.tally(reason)`` its calls add one to (NOTE [ Tallies
    of calls without a Decision ] in core/stats.py), what a compiled front door reads for ``when()``
    (``condition_gate``); or None."""
    if rule is None:
        return None
    return (rule[0], rule[1], Decision(Action.EAGER, reason=rule[0]), counters.tally(rule[0]),
            condition_gate(rule[1]))


def nested_reason(wrapper):
    """Why a call of ``wrapper`` runs eagerly whatever its key (it runs inside something else), or None."""
    if plain_thread() and not saved_hooks.active():  # the common call: one read of this thread's nesting
        return None
    if in_whole_step():  # the step's own graph captures it (in every phase of the step: first)
        return WHOLE_STEP
    if capture_open():
        return "called inside another capture"
    if saved_hooks.active():  # NOTE [ Saved-tensors hooks ] in guards/saved_hooks.py
        wrapper._warn_once("saved_hooks", saved_hooks.warning())
        return saved_hooks.REASON
    return None


def dispatch(wrapper, args, kwargs):
    """The Decision for the call ``wrapper(*args, **kwargs)`` (NOTE [ One call through the dispatcher ]).

    ``wrapper`` is the Lifecycle (core/lifecycle.py): its ``_keyless``, ``_body``, ``_keys``,
    ``_options``, ``_entries``, ``_tick``, ``_latest`` and ``_places`` are read and kept."""
    keyless = wrapper._keyless  # NOTE [ Pass-through wrappers ], NOTE [ Graphed calls that cannot pay ]
    if keyless is not None and (keyless[1] is None or keyless[1]()):
        return keyless[2]
    nested = nested_reason(wrapper)
    if nested is not None:
        # A GPU replay of the graph holding this call runs no Python: the re-run of a replay is not counted.
        return Decision(Action.EAGER, reason=None if in_rerun_replay() else nested)
    start = host_cost.clock()
    body = wrapper._body
    claimed = body.claim(args, kwargs, wrapper._keys)
    if claimed is not None:  # NOTE [ Chains of graphed calls ] in chains/chain.py
        return _new(Decision, (_CHAINED, claimed[0], None, None, None, (), start, claimed[1]))
    spec = None if body.options.dispatch_key_fn is not None else positional_spec(args, kwargs)
    if spec is not None:  # f(x, ...) with tensors only: NOTE [ Calls of a key that runs eagerly ]
        check_fresh(args)  # NOTE [ Stale outputs ] in io/stale_outputs.py
        entry = wrapper._latest  # a call of the latest call's key: the key read part by part, not made
        if entry is not None and wrapper._keys.is_key_of(entry.key, spec, args):
            key = entry.key
        else:
            key = wrapper._keys.key(args, kwargs, args, spec)
            entry = wrapper._entries.get(key)
        if entry is not None and entry.phase is _FALLBACK:
            _used(wrapper, key, entry)
            decision = _fell_back(entry)
            known = wrapper._known_eager
            if known is None or known.entry is not entry:
                wrapper._known_eager = KnownEager(entry, decision.reason, wrapper.counters, wrapper)
            return decision
        call = Call(args, kwargs, spec)
    else:
        if body.options.dispatch_key_fn is not None:
            # One canonical form per call (defaults applied, positional where possible), so that
            # f(x, True) and f(x, flag=True), which dispatch_key_fn sees alike, share a graph.
            bound = wrapper._keys.bound_arguments(args, kwargs)
            args, kwargs = bound.args, bound.kwargs
        call = Call(args, kwargs)
        check_fresh(call.tensors)  # NOTE [ Stale outputs ] in io/stale_outputs.py
        key = wrapper._keys.key(args, kwargs, call.tensors, call.spec)
        if key is None:
            return Decision(Action.EAGER, call=call, reason="dispatch_key_fn returned None")
        entry = wrapper._entries.get(key)
    if entry is None:
        if "max_graphs" in wrapper._warned and wrapper._places.refused_again(
                wrapper._entries, key, wrapper._tick, wrapper._options.max_graphs):  # NOTE [ Places under max_graphs ]
            wrapper._last_refusal = MAX_GRAPHS
            if spec is not None:  # NOTE [ Calls of a key that runs eagerly ]: the front path
                known = wrapper._known_eager
                if not isinstance(known, KnownRefused) or known.key != key:
                    wrapper._known_eager = KnownRefused(key, wrapper.counters, wrapper)
            return Decision(Action.EAGER, call=call, reason=MAX_GRAPHS)
        entry = _new_entry(wrapper, key, call)
        if entry is None:
            return Decision(Action.EAGER, call=call, reason=wrapper._last_refusal)
    _used(wrapper, key, entry)
    return _by_phase(wrapper, body, entry, call)


def _used(wrapper, key, entry):
    """Counts a call of ``entry`` (under ``key``): the wrapper's tick, the entry's last use, the entries' order."""
    wrapper._tick += 1
    entry.last_used = wrapper._tick
    if entry is not wrapper._latest:  # the latest entry is already last: every insertion is moved
        wrapper._entries.move_to_end(key)
        wrapper._latest = entry


def _fell_back(entry):
    """The Decision of a call of ``entry``, a key that fell back: made once per reason (NOTE [ Calls of a key
    that runs eagerly ])."""
    made = entry.eager_decision
    if made is None or made[0] is not entry.fallback_reason:
        made = entry.eager_decision = (entry.fallback_reason, Decision(
            Action.EAGER, entry, reason=f"key fell back: {entry.fallback_reason}"))
    return made[1]


class KnownEager:
    """The key that fell back whose call came last through dispatch(), as the front of a call checks it
    (NOTE [ Calls of a key that runs eagerly ]): its entry, the reason its calls are counted with."""

    __slots__ = ("entry", "reason", "fallback_reason", "tally", "gate", "_idle", "_call_of")

    def __init__(self, entry, reason, counters, wrapper):
        self.entry, self.reason, self.fallback_reason = entry, reason, entry.fallback_reason
        self.tally = counters.tally(reason)  # NOTE [ Tallies of calls without a Decision ] in core/stats.py
        self._idle, self._call_of = wrapper._body.idle, wrapper._keys.is_call_of  # the wrapper's own, looked up once
        self.gate = known_gate(entry, wrapper, _FALLBACK)  # take() read in C: NOTE [ The front door ] in core/front.py

    def take(self, wrapper, args):
        """True, with the wrapper's books kept as dispatch() keeps them, when dispatch() would run the call
        ``wrapper(*args)`` eagerly as a call of this key, without asking the body anything; else False."""
        entry = self.entry
        if (entry.phase is not _FALLBACK or entry.fallback_reason is not self.fallback_reason or not plain_thread()
                or saved_hooks.active() or any_stale() or not self._idle() or not self._call_of(entry.key, args)):
            return False
        wrapper._tick += 1  # _used(), inline: this runs on every such call without a front door
        entry.last_used = wrapper._tick
        if entry is not wrapper._latest:
            wrapper._entries.move_to_end(entry.key)
            wrapper._latest = entry
        return True


class KnownRefused:
    """The key refused under max_graphs, without an entry, whose call came last through dispatch(), as the front
    of a call checks it (NOTE [ Calls of a key that runs eagerly ])."""

    __slots__ = ("key", "tally", "gate")
    reason = MAX_GRAPHS

    def __init__(self, key, counters, wrapper):
        self.key = key
        self.tally = counters.tally(MAX_GRAPHS)  # NOTE [ Tallies of calls without a Decision ] in core/stats.py
        self.gate = refused_gate(key, wrapper, MAX_GRAPHS)  # take() read in C: NOTE [ The front door ] in core/front.py

    def take(self, wrapper, args):
        """True, with the wrapper's books kept as dispatch() keeps them, when dispatch() would refuse the call
        ``wrapper(*args)`` as a call of this key; else False."""
        key = self.key
        if (not plain_thread() or saved_hooks.active() or any_stale() or not wrapper._body.idle()
                or not wrapper._keys.is_call_of(key, args)
                or key in wrapper._entries or not wrapper._places.refused_again(
                    wrapper._entries, key, wrapper._tick, wrapper._options.max_graphs)):
            return False
        wrapper._last_refusal = MAX_GRAPHS
        return True


def _by_phase(wrapper, body, entry, call):
    """The Decision for ``call`` of ``entry`` (a key with its place), by the key's phase."""
    phase = entry.phase
    if phase is Phase.REPLAY:
        # timing: NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
        timed = host_cost.clock() if entry.host_cost.verdict is None else None
        blocked = body.blocker(entry, call)
        if blocked is None:
            return _new(Decision, (_REPLAY, entry, call, None, None, (), timed, None))
        return _unblocked(entry, call, blocked)
    if phase is Phase.WARMUP:
        warmups_left = body.options.warmup_steps - entry.warmup_calls
        if entry.host_cost.wants_eager(max(warmups_left, 0)):  # eager samples first: core/host_cost.py
            return Decision(Action.TIMED_EAGER, entry, call, host_cost.TIMED)
        if warmups_left > 0 or not body.ready(entry):
            return Decision(Action.WARMUP, entry, call)
        return Decision(Action.CAPTURE, entry, call)
    if phase is Phase.RECAPTURE:
        if admitted(wrapper, entry):
            return Decision(Action.RECAPTURE, entry, call)
        return Decision(Action.EAGER, entry, call, MAX_GRAPHS)
    return Decision(Action.EAGER, entry, call, f"key fell back: {entry.fallback_reason}")


def _unblocked(entry, call, blocked):
    """The Decision for a call of ``entry`` (in REPLAY) that the body's ``blocked`` (a Blocked) keeps
    from replaying now."""
    warn = () if blocked.warning is None else ((("blocked", blocked.reason), blocked.warning),)
    if blocked.changed is not None:  # NOTE [ Attributes that change on every call ] in core/entry.py
        endless = entry.attr_changed(blocked.changed)
        if endless:
            warn += ((("endless", id(entry)), ENDLESS.format(label=entry.label, reason=endless)),)
            return Decision(Action.FALL_BACK, entry, call, endless, blocked, warn)
    action = blocked.action
    if action is Blocker.RECAPTURE_ONCE and entry.recaptures:
        return Decision(Action.FALL_BACK, entry, call, f"{blocked.reason}, again after a re-capture", blocked, warn)
    if action is Blocker.REWARM:  # the blocked warning says why
        return Decision(Action.WARMUP, entry, call, blocked.reason, blocked, warn)
    if action is Blocker.RECAPTURE or action is Blocker.RECAPTURE_ONCE:
        return Decision(Action.RECAPTURE, entry, call, blocked.reason, blocked, warn)
    if action is Blocker.NEW_SLOT:
        return Decision(Action.NEW_SLOT, entry, call, blocked.reason, blocked, warn)
    if not warn:  # a body that gives no warning of its own: a block in flight
        warn = (("inflight", IN_FLIGHT),)
    return Decision(Action.EAGER, entry, call, blocked.reason, blocked, warn)


def _new_entry(wrapper, key, call):
    """The entry of a new key of ``wrapper`` (a Lifecycle), or None where the call runs eagerly (the reason in
    ``wrapper._last_refusal``)."""
    backend, reason = resolve_backend(wrapper._options.backend, call.tensors)
    if backend is None:
        wrapper._last_refusal = reason
        if not wrapper._tick:  # no key held yet: NOTE [ Pass-through wrappers ] in core/pass_through.py
            wrapper._keyless = keyless_rule(passes_through(wrapper._options, reason), wrapper.counters)
        return None
    keys = wrapper._keys
    # A call of tensors only whose signature's defaults are plain: nothing to refuse, no host array to check,
    # so the arguments are named only for a label that is read (NOTE [ Places under max_graphs ]).
    named = None if not call.consts and keys.plain_defaults() else keys.named_arguments(call.args, call.kwargs)
    refused = None if named is None else arguments.refusal(named)
    if refused is not None:  # NOTE [ Argument objects ] in io/arguments.py
        wrapper._warn_once(("arguments", refused), f"runs eagerly: {refused}.")
        wrapper._last_refusal = refused
        return None
    host = keys.checked(key, call, named)  # raises for a host input too large to key by value

    def label():
        return keys.label(key, keys.named_arguments(call.args, call.kwargs) if named is None else named, host)

    # The label is made for a key that gets its place, or for the max_graphs warning while it is still to give
    # (Places.admit warns under a max_graphs above 0).
    warns = wrapper._options.max_graphs and "max_graphs" not in wrapper._warned
    entry = GraphEntry(key=key, backend=backend, label=label() if warns else None,
                       eager_if_slower=wrapper._options.eager_if_slower)
    if not admitted(wrapper, entry, label):  # its label names what varies: NOTE [ Places under max_graphs ]
        wrapper._last_refusal = MAX_GRAPHS
        return None
    if entry.label is None:
        entry.label = label()
    wrapper._entries[key], wrapper._keyless = entry, None  # a key held: no call passes through again
    return entry


def admitted(wrapper, entry, label=None):
    """Whether ``entry`` gets a place under max_graphs; the key that gives it its place is dropped (in
    warmup) or evicted (holding graphs): NOTE [ Places under max_graphs ] in core/budgets.py. ``label()``
    makes the entry's label where it has none yet."""
    ok, victim = wrapper._places.admit(wrapper._entries, entry, wrapper._tick, wrapper._options.max_graphs,
                                       wrapper._warn_once)
    if victim is None:
        return ok
    wrapper.counters.evictions += 1
    if victim.has_graphs:
        victim.evict()
    else:
        del wrapper._entries[victim.key]
        if wrapper._latest is victim:
            wrapper._latest = None
    if entry.label is None:
        entry.label = label()
    logger.info("%s(%s): key %s gives its place under max_graphs=%s to key %s, called more often since",
                wrapper._body.api, wrapper.__name__, victim.label, wrapper._options.max_graphs, entry.label)
    return ok
