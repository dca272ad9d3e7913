"""Counters a wrapper keeps, and the per-key report behind explain().

Tests pin phase behaviour with them::

    with wrapped.counters.expect(captures=1, replays=3):
        ...
"""

import collections
import contextlib
import dataclasses

__all__ = ["Counters", "describe_entries"]

_FIELDS = (
    "captures",
    "replays",
    "fallbacks",
    "warmup_calls",
    "recaptures",
    "evictions",
    "input_copies",
    "input_copies_skipped",
    "verified_replays",
    "verify_mismatches",
)


@dataclasses.dataclass
class Counters:
    """Cumulative counts for one wrapper (all keys together)."""

    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    warmup_calls: int = 0
    recaptures: int = 0
    evictions: int = 0
    input_copies: int = 0
    input_copies_skipped: int = 0
    verified_replays: int = 0
    verify_mismatches: int = 0
    eager_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def eager(self, reason):
        self.fallbacks += 1
        self.eager_reasons[reason] += 1

    def snapshot(self):
        out = {name: getattr(self, name) for name in _FIELDS}
        out["eager_reasons"] = dict(self.eager_reasons)
        return out

    @contextlib.contextmanager
    def expect(self, **deltas):
        """Asserts that the block changes each named counter by exactly the given amount."""
        unknown = set(deltas) - set(_FIELDS)
        if unknown:
            raise ValueError(f"Counters.expect: unknown counters {sorted(unknown)}; known: {_FIELDS}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        got = {name: after[name] - before[name] for name in deltas}
        if got != deltas:
            raise AssertionError(f"counter changes {got} != expected {deltas}")


def describe_entries(entries):
    """One dict per key: phase, counts, fallback reason, bytes held, input copies."""
    rows = []
    for entry in entries:
        rows.append(
            {
                "key": entry.key,
                "backend": entry.backend.name if entry.backend is not None else "eager",
                "phase": entry.phase.value,
                "warmup_calls": entry.warmup_calls,
                "captures": entry.captures,
                "replays": entry.replays,
                "fallback_reason": entry.fallback_reason,
                "static_bytes": entry.nbytes(),
                "input_copies": entry.input_copies,
                "input_copies_skipped": entry.input_copies_skipped,
            }
        )
    return rows
