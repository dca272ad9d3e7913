"""Counters a wrapper keeps, and the per-key report behind explain().

Tests pin phase behaviour with them::

    with wrapped.counters.expect(captures=1, replays=3):
        ...
"""

import collections
import contextlib
import dataclasses

import paddle

__all__ = ["Counters", "describe_entries", "describe_call"]

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


def _describe(name, value, host_ids, parts):
    if isinstance(value, paddle.Tensor):
        part = f"{name}: {str(value.dtype).replace('paddle.', '')}{list(value.shape)}"
        if not value.stop_gradient:
            part += " grad"
        if id(value) in host_ids:
            part += f" on CPU = {value.numpy().tolist()}"
        parts.append(part)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _describe(f"{name}[{i}]", v, host_ids, parts)
    elif isinstance(value, dict):
        for k, v in value.items():
            _describe(f"{name}[{k!r}]", v, host_ids, parts)
    elif isinstance(value, paddle.nn.Layer):
        parts.append(f"{name}: {type(value).__name__}")
    else:
        text = repr(value)
        parts.append(f"{name}={text if len(text) <= 40 else text[:37] + '...'}")


def describe_call(named_arguments, host_tensors=(), user_key=None):
    """A short readable description of a key, e.g. ``(x: float32[8, 16] grad, n: int64[1] on
    CPU = [3], mode='train')``, or ``dispatch key ...`` for a key from dispatch_key_fn."""
    if user_key is not None:
        return f"dispatch key {user_key!r}"
    parts = []
    host_ids = {id(t) for t in host_tensors}
    for name, value in named_arguments:
        _describe(name, value, host_ids, parts)
    return "(" + ", ".join(parts) + ")"


def describe_entries(entries):
    """One dict per key: phase, counts, fallback reason, bytes held, input copies."""
    rows = []
    for entry in entries:
        rows.append(
            {
                "key": entry.key,
                "label": entry.label,
                "backend": entry.backend.name if entry.backend is not None else "eager",
                "phase": entry.phase.value,
                "warmup_calls": entry.warmup_calls,
                "captures": entry.captures,
                "replays": entry.replays,
                "fallback_reason": entry.fallback_reason,
                "static_bytes": entry.nbytes(),
                "input_copies": entry.input_copies,
                "input_copies_skipped": entry.input_copies_skipped,
                "evictions": entry.evictions,
                "verified_replays": entry.verified,
            }
        )
    return rows
