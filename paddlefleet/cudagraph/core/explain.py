"""What a wrapper says about its keys: report() (one dict per key) and explain() (readable text);
``Reports``, the Lifecycle's mixin that serves them with stats() (core/stats.py)."""

import collections

from .stats import summarize

__all__ = ["Reports", "describe_entries", "distinct_labels", "explain"]


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
