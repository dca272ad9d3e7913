"""Lifecycle: the phase machine of one wrapped callable, per key.

``__call__`` is two steps: the dispatcher (core/dispatch.py) decides what the call does (no key ->
eager; new key -> warmup, then capture; known key -> replay; a key that fell back -> eager), and the
runner (core/runner.py) carries the decision out (NOTE [ One call through the dispatcher ] in
core/dispatch.py). What a phase does for one kind of call is the *body*'s (block/graphed.py for
autocudagraph blocks): this module owns the wrapper's state (its entries, places, counters), the
fallback with its reason, and the budgets (max_graphs, max_bytes: core/budgets.py).
"""

import collections
import logging
import warnings

from .. import native
from ..guards.paddle_patches import install_process_patches
from ..guards.location import user_stacklevel
from .budgets import Places
from . import host_cost, memory
from .dispatch import Action, dispatch, keyless_rule
from .keys import BoundSignature, KeyMaker
from .explain import Reports
from .stats import Counters
from .pass_through import all_slower, no_places
from .runner import Runner
from .views import Views

__all__ = ["Lifecycle"]

logger = logging.getLogger(__name__)

_REPLAY, _CHAINED, _EAGER = Action.REPLAY, Action.CHAINED, Action.EAGER


class Lifecycle(Reports, Views, Runner):
    """The phase machine of one wrapped callable: per key, warmup -> capture -> replay, or eager.

    Args:
        body: what each phase runs for this kind of call, a Body (core/body.py): BlockBody for
            blocks, StepBody for whole training steps.
        fn: the wrapped function (keys read its signature).
    """

    __signature__ = BoundSignature()  # what inspect.signature() shows: see BoundSignature

    def __init__(self, body, fn):
        install_process_patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py: the first wrapper
        native.load()  # NOTE [ Compiled tensor reads ] in native/__init__.py: built or loaded once per process
        self._body = body
        self._run_eager = body.eager_runner()  # body.run, laid out once: the calls that run eagerly without a Decision
        self._eager_parts = body.eager_parts()  # the same for the front door: NOTE [ The front door ] in core/front.py
        self._entries = collections.OrderedDict()
        self._warned = set()
        self._last_refusal = None
        self._tick = 0
        self._latest = None  # the entry of the latest call, last in _entries' order
        self.counters = Counters()
        # (reason, when, Decision, tally): calls run eagerly for reason, without a key, while when() holds
        self._keyless = keyless_rule(no_places(body.options), self.counters)
        self._known_eager = None  # KnownEager: NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py
        self._growth = memory.growth()  # graphs added to keys after their capture, last seen (core/memory.py)
        self._places = Places()  # max_graphs: NOTE [ Places under max_graphs ] in core/budgets.py
        self._keys = KeyMaker(fn, body.options.dispatch_key_fn, bound=body.bound, layers=body.layers())
        self._keys.who = body.api  # names the wrapper in messages: autocudagraph_step(name)
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
        self._known_eager = None  # its calls were judged under the options before (dispatch_key_fn among them)
        if not self._entries:
            self._keyless = keyless_rule(no_places(options), self.counters)

    def reset(self):
        """Drops every graph, pool and static buffer, and zeroes the counters (a slot whose backward
        is pending keeps its graphs until that backward ran: NOTE [ Slots ] in block/slots.py)."""
        for entry in self._entries.values():
            entry.release()
        self._entries.clear()
        self._latest = None
        self.counters = Counters()
        self._keyless = keyless_rule(no_places(self._options), self.counters)
        self._known_eager = None
        self._places.clear()
        self._warned.clear()

    # ------------------------------------------------------------------ phases
    def __call__(self, *args, **kwargs):
        keyless = self._keyless  # NOTE [ Pass-through wrappers ] in core/pass_through.py: no key, no Decision
        if keyless is not None:
            when = keyless[1]  # None: always (NOTE [ Pass-through wrappers ] in core/pass_through.py)
            if when is None or when():
                keyless[3][0] += 1  # its tally: NOTE [ Tallies of calls without a Decision ] in core/stats.py
                return self._run_eager(args, kwargs)
        else:
            known = self._known_eager  # NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py
            if known is not None and not kwargs and known.take(self, args):
                known.tally[0] += 1  # NOTE [ Tallies of calls without a Decision ] in core/stats.py
                return self._run_eager(args, kwargs)
        return self._carry_out(dispatch(self, args, kwargs), args, kwargs)

    def _dispatched(self, *args, **kwargs):
        """A call whose front door already asked what ``__call__`` asks first (the keyless rule's condition, the
        known key's take) and was told no: dispatch() decides it (NOTE [ The front door ] in core/front.py)."""
        return self._carry_out(dispatch(self, args, kwargs), args, kwargs)

    def _carry_out(self, decision, args, kwargs):
        """Runs the call ``(args, kwargs)`` as ``decision`` says (NOTE [ One call through the dispatcher ] in
        core/dispatch.py)."""
        action = decision.action
        if action is _REPLAY:  # the most frequent decisions straight to their method (no warning to give)
            return self._replay(decision)
        if action is _CHAINED:
            return self._chained(decision, args, kwargs)
        if action is _EAGER and not decision.warn:
            return self._eager_call(decision, args, kwargs)
        return self._run(decision, args, kwargs)

    def _acted(self, entry):  # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
        self._keyless = keyless_rule(all_slower(host_cost.act(entry, self._warn_once, self._entries.values())),
                                     self.counters) or self._keyless

    def _eager(self, call, reason):
        self.counters.eager(reason)
        return self._body.run(call.args, call.kwargs)

    def _warn_once(self, topic, message):
        """Warns ``message`` (a string, or a callable making it: made only when warned) once per ``topic``."""
        if topic in self._warned:
            return
        self._warned.add(topic)
        if callable(message):
            message = message()
        warnings.warn(f"{self._body.api}({self.__name__}): {message}", RuntimeWarning, stacklevel=user_stacklevel())

    def _evicted(self, victim, budget):
        self.counters.evictions += 1
        logger.info("autocudagraph(%s): evicted key %s to stay within max_bytes=%s", self.__name__, victim.label, budget)
