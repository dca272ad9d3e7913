"""Counters a wrapper keeps, stats() and key labels (the per-key report and explain(): core/explain.py).

Tests pin phase behaviour with them::

    with wrapped.counters.expect(captures=1, replays=3):
        ...

``eager_calls`` counts every call that ran eagerly for a reason other than warmup (a key that
fell back, dispatch_key_fn returning None, a pending backward, ...); ``explain()`` lists the
reasons. It was called ``fallbacks`` before; that name still works for one release, with a
DeprecationWarning (it clashed with Phase.FALLBACK, which is one of those reasons).
"""

import collections
import contextlib
import dataclasses
import types
import warnings

import paddle

from ..guards.location import user_stacklevel
from .memory import Footprint

__all__ = ["Counters", "describe_call", "slot_stats", "summarize"]

_FIELDS = (
    "captures",
    "replays",
    "eager_calls",
    "warmup_calls",
    "recaptures",
    "evictions",
    "input_copies",
    "input_copies_skipped",
    "verified_replays",
    "verify_mismatches",
    "slot_captures",
    "chained_calls",
)


_OLD_NAMES = types.MappingProxyType({"fallbacks": "eager_calls"})


def _renamed(name):
    new = _OLD_NAMES.get(name)
    if new is not None:
        warnings.warn(
            f"autocudagraph: the counter '{name}' is now called '{new}' (it counts every eager call, not "
            f"only keys that fell back); '{name}' will be removed in the next release.",
            DeprecationWarning,
            stacklevel=user_stacklevel(),  # the caller's line (also through contextlib for expect())
        )
    return new


class Snapshot(dict):
    """A dict of counter values that still answers to a counter's old name, with a warning."""

    def __missing__(self, key):
        new = _renamed(key)
        if new is None:
            raise KeyError(key)
        return self[new]

    def get(self, key, default=None):
        if key in self:
            return self[key]
        new = _renamed(key)
        return self[new] if new is not None and new in self else default


@dataclasses.dataclass
class Counters:
    """Cumulative counts for one wrapper (all keys together).

    NOTE [ Tallies of calls without a Decision ]
    A wrapper's call that runs eagerly under a keyless rule (NOTE [ Pass-through wrappers ] in
    core/pass_through.py), or as a call of the key known to run eagerly (NOTE [ Calls of a key that runs
    eagerly ] in core/dispatch.py), costs about the function's own call, and counting it as ``eager_calls``
    and ``eager_reasons`` (an attribute and a Counter entry) was a third of what the wrapper added to it
    (0.28 of 0.91 us on the CPU machine, all keys slower). Such a call adds one to a tally (``tally(reason)``:
    a one-item list the rule or the known key holds) instead, and the tallies are folded into ``eager_calls``
    and ``eager_reasons`` whenever either is read or written, so every reader (stats(), explain(), ``expect``)
    sees them counted.
    """

    captures: int = 0
    replays: int = 0
    _eager_calls: int = 0
    warmup_calls: int = 0
    recaptures: int = 0
    evictions: int = 0
    input_copies: int = 0
    input_copies_skipped: int = 0
    verified_replays: int = 0
    verify_mismatches: int = 0
    slot_captures: int = 0
    chained_calls: int = 0  # replays served by a chain (NOTE [ Chains of graphed calls ] in chains/chain.py)
    _eager_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    _tallies: dict = dataclasses.field(default_factory=dict)  # reason -> [calls not yet folded]

    def tally(self, reason):
        """The one-item list the calls that run eagerly for ``reason`` without a Decision (a keyless rule's, the
        key known to run eagerly's) are counted in (NOTE [ Tallies of calls without a Decision ])."""
        cell = self._tallies.get(reason)
        if cell is None:
            cell = self._tallies[reason] = [0]
        return cell

    def _fold(self):
        for reason, cell in self._tallies.items():
            n = cell[0]
            if n:
                cell[0] = 0
                self._eager_calls += n
                self._eager_reasons[reason] += n

    @property
    def eager_calls(self):
        self._fold()
        return self._eager_calls

    @eager_calls.setter
    def eager_calls(self, value):
        self._fold()
        self._eager_calls = value

    @property
    def eager_reasons(self):
        self._fold()
        return self._eager_reasons

    def eager(self, reason):
        self._eager_calls += 1
        self._eager_reasons[reason] += 1

    @property
    def fallbacks(self):
        """Deprecated name of eager_calls."""
        return getattr(self, _renamed("fallbacks"))

    def snapshot(self):
        out = Snapshot((name, getattr(self, name)) for name in _FIELDS)
        out["eager_reasons"] = dict(self.eager_reasons)
        return out

    @contextlib.contextmanager
    def expect(self, **deltas):
        """Asserts that the block changes each named counter by exactly the given amount."""
        deltas = {(_renamed(name) if name in _OLD_NAMES else name): n for name, n in deltas.items()}
        unknown = set(deltas) - set(_FIELDS)
        if unknown:
            raise ValueError(f"Counters.expect: unknown counters {sorted(unknown)}; known: {_FIELDS}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        got = {name: after[name] - before[name] for name in deltas}
        if got != deltas:
            raise AssertionError(f"counter changes {got} != expected {deltas}")


class Label(str):
    """A key's readable label (a str) that keeps its ``parts``: ``[(argument, its description)]``, which
    the max_graphs warning compares between keys (core/budgets.py varying_parts)."""

    parts = ()


def _describe(name, value, host_ids, parts):
    if isinstance(value, paddle.Tensor):
        part = f"{str(value.dtype).replace('paddle.', '')}{list(value.shape)}"
        if not value.stop_gradient:
            part += " grad"
        if id(value) in host_ids:
            part += f" on CPU = {value.numpy().tolist()}"
        parts.append((name, f"{name}: {part}"))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _describe(f"{name}[{i}]", v, host_ids, parts)
    elif isinstance(value, dict):
        for k, v in value.items():
            _describe(f"{name}[{k!r}]", v, host_ids, parts)
    elif isinstance(value, paddle.nn.Layer):
        parts.append((name, f"{name}: {type(value).__name__}"))
    else:
        text = repr(value)
        parts.append((name, f"{name}={text if len(text) <= 40 else text[:37] + '...'}"))


def describe_call(named_arguments, host_tensors=(), user_key=None):
    """A short readable description of a key, e.g. ``(x: float32[8, 16] grad, n: int64[1] on
    CPU = [3], mode='train')``, or ``dispatch key ...`` for a key from dispatch_key_fn: a Label."""
    if user_key is not None:
        return Label(f"dispatch key {user_key!r}")
    parts = []
    host_ids = {id(t) for t in host_tensors}
    for name, value in named_arguments:
        _describe(name, value, host_ids, parts)
    label = Label("(" + ", ".join(text for _, text in parts) + ")")
    label.parts = tuple(parts)
    return label


def summarize(counters, entries):
    """A wrapper's stats(): its counters plus ``graphs`` (keys holding graphs now), ``keys``,
    ``static_bytes`` and ``grad_copies`` (by the keys holding graphs now)."""
    entries = list(entries)
    out = counters.snapshot()
    out["graphs"] = sum(1 for e in entries if e.has_graphs)
    out["keys"] = len(entries)
    out["static_bytes"] = sum(e.nbytes() for e in entries)
    # Device copies of parameter grads by the keys holding graphs now (NOTE [ Grad hand-out ]).
    out["grad_copies"] = sum(e.graphs.grad_copies() for e in entries if e.graphs is not None)
    out["capture_ms"] = {e.label: round(e.capture_ms, 2) for e in entries if e.capture_ms is not None}
    out["key_bytes"] = {e.label: e.nbytes() for e in entries if e.has_graphs}
    # NOTE [ Graph pool bytes ] in core/entry.py: 0 on a backend without device memory (simulate).
    out["pool_bytes"] = sum(e.pool_bytes for e in entries)
    out["key_pool_bytes"] = {e.label: e.pool_bytes for e in entries if e.has_graphs}
    # NOTE [ What a key holds ] in core/memory.py: every component, and the sum max_bytes counts.
    held = [(e.label, e.footprint()) for e in entries if e.has_graphs]
    out["held_bytes"] = sum(f.held for _, f in held)
    out["memory"] = sum((f for _, f in held), Footprint()).as_dict()
    out["key_memory"] = {label: f.as_dict() for label, f in held}
    out.update(slot_stats(entries))
    return out


def slot_stats(entries):
    """``{"slots": slots held by all keys, "slot_bytes": {key label: [static bytes per slot]}}``
    (NOTE [ Slots ] in block/slots.py: forwards of one key in flight, each in its own static buffers)."""
    held = {e.label or repr(e.key): e.graphs.slot_bytes() for e in entries
            if e.graphs is not None and hasattr(e.graphs, "slot_bytes")}
    return {"slots": sum(len(b) for b in held.values()), "slot_bytes": held}
