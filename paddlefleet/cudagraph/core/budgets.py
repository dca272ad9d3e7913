"""The budgets of one wrapper (core/lifecycle.py asks; the entries move): ``max_graphs``, the keys
that may warm up or hold graphs at once, and ``max_bytes``, the static buffers and graph pools all
keys hold (least recently used keys are evicted beyond it; NOTE [ What a key holds ] in core/memory.py)."""

from .entry import Phase

__all__ = ["budget_allows", "enforce_max_bytes"]


def budget_allows(entries, entry, max_graphs, warn_once):
    """Whether ``entry`` may warm up or capture next to the other keys of ``entries``."""
    live = sum(1 for e in entries.values() if e is not entry and e.phase in (Phase.WARMUP, Phase.REPLAY))
    if live < max_graphs:
        return True
    warn_once(
        "max_graphs",
        f"max_graphs={max_graphs} keys are already warming up or holding graphs; further "
        "keys run eagerly (correct, without the speed-up). Raise max_graphs, or return fewer distinct "
        "keys from dispatch_key_fn (e.g. pad shapes to a few sizes).",
    )
    return False


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
