"""The budgets of one wrapper (core/lifecycle.py asks; the entries move): ``max_graphs``, the keys
that may warm up or hold graphs at once (``Places``, NOTE [ Places under max_graphs ]), and
``max_bytes``, the static buffers and graph pools all keys hold (least recently used keys are evicted
beyond it; NOTE [ What a key holds ] in core/memory.py)."""

import collections

from .entry import Phase

__all__ = ["Places", "enforce_max_bytes", "varying_parts"]

# NOTE [ Places under max_graphs ]
# max_graphs bounds the keys that warm up or hold graphs at once: their places. A key that finds
# every place taken runs eagerly, and the wrapper remembers the ticks (the wrapper's call count) of
# its latest refused calls. When it comes again, it may take the place of a key that was called
# less since:
#   * a key still warming up (no graphs to lose) whose latest call is no later than the refused
#     key's previous call: the refused key was called twice while it was not called at all;
#   * a key holding graphs whose latest call is no later than the refused key's call before that:
#     the refused key was called three times meanwhile (a capture costs more than a warmup);
#   * never a key whose graphs a pending backward or an in-flight slot still needs.
# The least recently used such key gives its place (keys in warmup first). So keys seen once (a
# shape at the start, the last short batch of an epoch) give way to a key that repeats, and keys
# taking turns (three shapes in rotation with max_graphs=2) never displace each other: none was
# called more often since the other's latest call, so no capture is thrown away for a key that is
# used no more than the one it replaces. A displaced key in warmup is dropped; one holding graphs
# releases them and keeps its counts (``evictions``), captured again without warmup once it gets a
# place back. WAITING refused keys are remembered, the least recently refused dropped first.
# A key refused before that finds every place still taken and no key to displace is refused again
# without an entry made for it (``refused_again``, asked by the dispatcher before a new key's entry):
# the same books are kept (its call remembered), at the cost of the key alone.

#: Refused keys whose latest calls are remembered (NOTE [ Places under max_graphs ]).
WAITING = 64

_WARMUP, _REPLAY = Phase.WARMUP, Phase.REPLAY


class Places:
    """The ``max_graphs`` places of one wrapper's keys (NOTE [ Places under max_graphs ])."""

    def __init__(self):
        self._waiting = collections.OrderedDict()  # key -> ticks of its latest refused calls, latest last

    def clear(self):
        self._waiting.clear()

    def waiting(self):
        """The refused keys' latest call ticks, ``{key: ticks}`` (the front door's gate reads it: NOTE [ The front
        door ] in core/front.py); cleared in place, never replaced."""
        return self._waiting

    def admit(self, entries, entry, tick, max_graphs, warn_once):
        """Whether ``entry`` (a new key, or one without graphs that captures again) may warm up or capture
        now, at the wrapper's call count ``tick``; may displace another key (returned second: the entry
        that gave its place, or None). A refused key's call is remembered."""
        live = _live(entries, entry)
        if len(live) < max_graphs:
            self._waiting.pop(entry.key, None)
            return True, None
        ticks = self._waiting.get(entry.key, ())
        victim = _displaced(live, ticks)
        if victim is not None:
            self._waiting.pop(entry.key)
            return True, victim
        self._refused(entry.key, ticks, tick)
        if max_graphs:
            warn_once("max_graphs", lambda: _full_message(max_graphs, live, entry))
        return False, None

    def refused_again(self, entries, key, tick, max_graphs):
        """True, with the call remembered as ``admit`` remembers a refused one, when ``key`` (no entry) was refused
        before and ``admit`` would refuse it again now: every place taken, no key to displace. False: the key is
        not waiting, or may get a place (``admit`` decides, with its entry)."""
        waiting = self._waiting
        ticks = waiting.get(key)
        if ticks is None:
            return False
        # _live and _displaced in one pass, no list made: the front of every such call asks (NOTE [ Calls of a key
        # that runs eagerly ] in core/dispatch.py). ``ticks`` is never empty here (_refused stores the call).
        last, before = ticks[-1], (ticks[-2] if len(ticks) > 1 else None)
        live = 0
        for e in entries.values():
            phase = e.phase
            if phase is not _WARMUP and phase is not _REPLAY:
                continue
            live += 1
            if e.graphs is None:
                if e.last_used <= last:  # a key in warmup it displaces
                    return False
            elif before is not None and e.last_used <= before and not e.backward_pending():
                return False
        if live < max_graphs:
            return False
        waiting.move_to_end(key)  # _refused, for a key already waiting: latest refused last, its two latest calls
        waiting[key] = (last, tick)
        return True

    def _refused(self, key, ticks, tick):
        """Remembers a refused call of ``key`` at ``tick`` (``ticks``: its calls remembered before), as the latest
        refused key; the least recently refused keys beyond WAITING are forgotten."""
        self._waiting.pop(key, None)
        self._waiting[key] = (tuple(ticks) + (tick,))[-2:]
        while len(self._waiting) > WAITING:
            self._waiting.popitem(last=False)


def _live(entries, entry=None):
    """The entries, but ``entry``, that hold a place: warming up or holding graphs."""
    return [e for e in entries.values() if e is not entry and e.phase in (Phase.WARMUP, Phase.REPLAY)]


def _displaced(live, ticks):
    """The key that gives its place to a refused key called before at ``ticks``, or None."""
    if not ticks:
        return None
    warm = [e for e in live if not e.has_graphs and e.last_used <= ticks[-1]]
    held = [e for e in live if e.has_graphs and len(ticks) > 1 and e.last_used <= ticks[-2] and
            not e.backward_pending()]
    for group in (warm, held):
        if group:
            return min(group, key=lambda e: e.last_used)
    return None


def varying_parts(labels):
    """``{argument: [its descriptions]}`` for the arguments whose description differs between the
    labels (core/stats.py describe_call: each label's ``parts``), in argument order."""
    seen = collections.OrderedDict()
    for label in labels:
        for name, text in getattr(label, "parts", ()):
            seen.setdefault(name, [])
            if text not in seen[name]:
                seen[name].append(text)
    return collections.OrderedDict((n, [t[len(n):].lstrip(":= ") for t in texts]) for n, texts in seen.items()
                                   if len(texts) > 1)


def _full_message(max_graphs, live, entry):
    labels = [e.label for e in live] + [entry.label]
    varying = varying_parts(labels)
    if varying:
        name, texts = next(iter(varying.items()))
        shown = ", ".join(texts[:4]) + (", ..." if len(texts) > 4 else "")
        if all("[" in text for text in texts):  # tensors: their shapes (or dtypes) differ
            what = (f" The keys differ in argument '{name}' ({shown}): pad '{name}' to a few sizes, or return a "
                    f"few keys for it from dispatch_key_fn (e.g. its padded size); or raise max_graphs.")
        else:  # a Python value is part of the key
            what = (f" The keys differ in argument '{name}' ({shown}), a value each key holds: pass it as a "
                    "tensor, return None from dispatch_key_fn for its rare values, or raise max_graphs.")
    elif getattr(entry.key, "user", False):
        what = " dispatch_key_fn returned that many distinct keys: return fewer, or raise max_graphs."
    else:
        what = " The keys differ in grad mode, autocast or the Layers' training flags; raise max_graphs."
    return (f"max_graphs={max_graphs} keys are already warming up or holding graphs, so key {entry.label} runs "
            "eagerly (correct, without the speed-up) unless it comes again: a key called again takes the place of "
            f"one not called since, so keys seen once give way to keys that repeat.{what}")


def enforce_max_bytes(entries, entry, budget, warn_once, evicted):
    """Evicts least recently used keys until their static buffers and pools fit ``budget`` (None: no budget),
    calling ``evicted(victim, budget)`` for each; returns False (and moves ``entry`` to eager) when
    ``entry`` alone does not fit."""
    if budget is None:
        return True
    own = entry.held_bytes()
    if own > budget:
        reason = (f"its static buffers and graph pools need {own} bytes ({entry.footprint().describe()}), more than "
                  f"max_bytes={budget}")
        entry.fall_back(reason)
        warn_once(
            ("max_bytes", id(entry)),
            f"key {entry.label} runs eagerly: {reason}. Raise max_bytes, or split the function so each "
            "graph holds less.",
        )
        return False
    holders = [e for e in entries.values() if e.has_graphs]
    total = sum(e.held_bytes() for e in holders)
    for victim in sorted(holders, key=lambda e: e.last_used):
        if total <= budget:
            break
        if victim is entry or victim.backward_pending():
            continue
        total -= victim.held_bytes()
        victim.evict()
        evicted(victim, budget)
    return True
