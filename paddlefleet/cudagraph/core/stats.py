"""Counters a wrapper keeps, the per-key report and explain().

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

from .location import user_stacklevel

__all__ = ["Counters", "Reports", "describe_entries", "describe_call", "distinct_labels", "explain", "slot_stats", "summarize"]

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
    """Cumulative counts for one wrapper (all keys together)."""

    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    warmup_calls: int = 0
    recaptures: int = 0
    evictions: int = 0
    input_copies: int = 0
    input_copies_skipped: int = 0
    verified_replays: int = 0
    verify_mismatches: int = 0
    slot_captures: int = 0
    chained_calls: int = 0  # replays served by a chain (NOTE [ Chains of graphed calls ] in chains/chain.py)
    eager_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def eager(self, reason):
        self.eager_calls += 1
        self.eager_reasons[reason] += 1

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
    out.update(slot_stats(entries))
    return out


def slot_stats(entries):
    """``{"slots": slots held by all keys, "slot_bytes": {key label: [static bytes per slot]}}``
    (NOTE [ Slots ] in block/slots.py: forwards of one key in flight, each in its own static buffers)."""
    held = {e.label or repr(e.key): e.graphs.slot_bytes() for e in entries
            if e.graphs is not None and hasattr(e.graphs, "slot_bytes")}
    return {"slots": sum(len(b) for b in held.values()), "slot_bytes": held}


def describe_entries(entries):
    """One dict per key: phase, counts, fallback reason, bytes held, input copies, capture time."""
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
                "pool_bytes": entry.pool_bytes if entry.backend is not None and
                entry.backend.reserved_bytes() is not None else None,
                "input_copies": entry.input_copies,
                "input_copies_skipped": entry.input_copies_skipped,
                "evictions": entry.evictions,
                "verified_replays": entry.verified,
                "capture_ms": round(entry.capture_ms, 2) if entry.capture_ms is not None else None,
                "host_cost": entry.host_cost.describe(),
                "grads": entry.graphs.describe() if entry.graphs is not None else "",
                "slot_bytes": entry.graphs.slot_bytes() if hasattr(entry.graphs, "slot_bytes") else [],
                "chain": "; ".join(filter(None, [entry.chain.describe() if entry.chain is not None and entry.graphs
                                                 is not None else "", entry.chain_note])),
            }
        )
    return rows


def explain(name, stats, entries, counters, api="autocudagraph"):
    """A readable report of one wrapper: every key's phase and counts, and a reason for every
    eager call; ``api``: the public name of the wrapper (the body's, core/body.py).

    Example::

        autocudagraph(block): 2 key(s), 1 holding graphs, 4096 static bytes
          key (x: float32[8, 16], w: float32[16, 16] grad): replay on simulate; 1 warmup, 1 capture(s), 5 replays; ...
          key (x: float32[4, 16], ...): fallback on simulate; ...; fell back: CaptureError: ... (at model.py:12 in block)
          warmup calls: 2 (eager, before the capture of their key)
          eager calls: 1
            1 x capture failed
    """
    entries = list(entries)
    lines = [
        f"{api}({name}): {stats['keys']} key(s), {stats['graphs']} holding graphs, "
        f"{stats['static_bytes']} static bytes, {stats['pool_bytes']} graph pool bytes"
    ]
    backends = {e.backend.describe() for e in entries if e.backend is not None}
    if backends:
        lines.append(f"  backend: {'; '.join(sorted(backends))}")
    rows = describe_entries(entries)
    for row, label in zip(rows, distinct_labels(rows)):
        line = (
            f"  key {label}: {row['phase']} on {row['backend']}; "
            f"{row['warmup_calls']} warmup, {row['captures']} capture(s), {row['replays']} replays; "
            f"{row['static_bytes']} static bytes, "
            f"{'pool bytes not measured' if row['pool_bytes'] is None else str(row['pool_bytes']) + ' pool bytes'}; "
            f"input copies {row['input_copies']} made, "
            f"{row['input_copies_skipped']} skipped"
        )
        if row["slot_bytes"]:
            sizes = sorted(set(row["slot_bytes"]))
            line += f"; {len(row['slot_bytes'])} slot(s) of {' / '.join(map(str, sizes))} static bytes each"
        if row["capture_ms"] is not None:
            line += f"; captured in {row['capture_ms']:.{1 if row['capture_ms'] >= 10 else 2}f} ms"
        if row["host_cost"]:
            line += f"; {row['host_cost']}"
        if row["grads"]:
            line += f"; {row['grads']}"
        if row["chain"]:
            line += f"; {row['chain']}"
        if row["evictions"]:
            line += f"; evicted {row['evictions']} time(s) (max_bytes)"
        if row["verified_replays"]:
            line += f"; {row['verified_replays']} call(s) verified against eager"
        if row["fallback_reason"]:
            line += f"; fell back: {row['fallback_reason']}"
        lines.append(line)
    # The same counts as stats(): warmup calls apart from eager_calls (the calls run eagerly for a reason).
    if counters.warmup_calls:
        lines.append(f"  warmup calls: {counters.warmup_calls} (eager, before the capture of their key)")
    if counters.chained_calls:
        lines.append(f"  chained calls: {counters.chained_calls} of the replays, served by a chain of consecutive "
                     "graphed calls through one autograd bridge")
    if counters.eager_calls:
        lines.append(f"  eager calls: {counters.eager_calls}")
        for reason, count in collections.Counter(counters.eager_reasons).most_common():
            lines.append(f"    {count} x {reason}")
    return "\n".join(lines)


def distinct_labels(rows):
    """explain()'s label of each key: its arguments, then where keys read alike, what else tells them apart
    (``[no_grad]``, ``[eval]``, ``[some Layers in eval]``, ``[amp ...]``), then ``#2``, ``#3``."""
    labels = [row["label"] or repr(row["key"])[:80] for row in rows]
    groups = collections.defaultdict(list)
    for i, label in enumerate(labels):
        groups[label].append(i)
    for label, members in groups.items():
        if len(members) < 2:
            continue
        states = [getattr(rows[i]["key"], "state", None) for i in members]
        tagged = [label + "".join(_state_tags(state, states)) for state in states]
        seen = collections.Counter()
        for i, text in zip(members, tagged):
            seen[text] += 1
            labels[i] = text if seen[text] == 1 else f"{text} #{seen[text]}"
    return labels


def _state_tags(state, states):
    """What of a key's grad mode, training flags and AMP state differs from other keys of its label."""
    if state is None or any(s is None for s in states):
        return []
    tags = []
    if len({s.grad_enabled for s in states}) > 1 and not state.grad_enabled:
        tags.append(" [no_grad]")
    if len({s.training for s in states}) > 1 and not all(state.training):
        tags.append(" [eval]" if not any(state.training) else " [some Layers in eval]")
    if len({s.amp for s in states}) > 1:
        level, dtype = state.amp if isinstance(state.amp, tuple) else (state.amp, None)
        tags.append(f" [amp level {level}, {dtype}]" if level else " [no amp]")
    return tags


class Reports:
    """What a wrapper (core/lifecycle.py Lifecycle) reports about its keys: a mixin over its
    ``counters``, ``_entries``, ``__name__`` and ``_body.api``."""

    def stats(self):
        """Counters of this wrapper plus ``graphs`` (keys holding graphs now), ``keys``,
        ``static_bytes``, ``grad_copies`` (by the keys holding graphs now), ``slots``, ``slot_bytes``,
        ``capture_ms`` (``{key label: host ms of its latest capture}``) and ``key_bytes`` (``{key
        label: bytes of its static buffers}``, keys holding graphs): summarize()."""
        return summarize(self.counters, self._entries.values())

    def report(self):
        """One dict per key (phase, counts, fallback reason, bytes held, input copies)."""
        return describe_entries(self._entries.values())

    def explain(self):
        """A readable report: every key's phase and counts, and why each eager call ran eagerly."""
        return explain(self.__name__, self.stats(), self._entries.values(), self.counters, api=self._body.api)
