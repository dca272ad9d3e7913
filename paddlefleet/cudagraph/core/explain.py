"""What a wrapper says about its keys: report() (one dict per key) and explain() (readable text);
``Reports``, the Lifecycle's mixin that serves them with stats() (core/stats.py)."""

import collections
import types

from .front import behind
from .stats import summarize

__all__ = ["Reports", "describe_entries", "distinct_labels", "explain", "explain_model", "report_model"]


def _plain_key(key):
    """A key as plain values: the state parts a label does not show (grad mode, training flags, AMP)."""
    state = getattr(key, "state", None)
    if state is None:
        return {"user": False, "grad_enabled": None, "training": [], "amp_level": None, "amp_dtype": None}
    level, dtype = state.amp if isinstance(state.amp, tuple) else (state.amp, None)
    return {"user": bool(key.user), "grad_enabled": bool(state.grad_enabled), "training": [bool(t) for t in
            state.training], "amp_level": level, "amp_dtype": None if dtype is None else str(dtype)}


def _round(value):
    return None if value is None else round(value, 2)


def describe_entries(entries):
    """report(): one dict per key, of plain values only (str, int, float, bool, None, and lists and dicts
    of them), in least recently used order:

    * ``label``: the key's arguments as explain() names them; ``key``: what else keys it (``user``:
      dispatch_key_fn's key; ``grad_enabled``; ``training``: the Layers' training flags; ``amp_level``,
      ``amp_dtype``); ``backend``; ``phase``: "warmup", "replay", "recapture" (its graphs released: captured
      again at its next call) or "fallback" (eager for good, ``fallback_reason`` says why);
    * counts: ``warmup_calls``, ``captures``, ``recaptures``, ``replays``, ``verified_replays``,
      ``evictions``, ``input_copies``, ``input_copies_skipped``, ``no_backward`` (calls whose outputs needed
      grad and were freed without a backward, since each slot's latest backward);
    * bytes: ``static_bytes``, ``slot_bytes`` (per slot), ``pool_bytes`` (None where not measured),
      ``memory`` (every component a key holding graphs holds, NOTE [ What a key holds ] in core/memory.py;
      None for other keys) and ``holds``, the same in words;
    * ``capture_ms``; ``host_us``: ``{"eager", "graphed", "chained"}`` host microseconds per forward call
      and ``{"eager_backward", "graphed_backward"}`` per backward (lower quartiles, None where not
      measured; NOTE [ Graphed calls that cannot pay ] in core/host_cost.py), ``slowdown`` (how much slower the
      host ran during the eager calls than during the replays; the eager side is divided by it where compared)
      and ``host_cost``, the same in words;
    * ``grads``, ``chain``, ``pool``: explain()'s words about the key's grads, its chain and the memory pool its
      forward shares with other keys' ("" for none); ``recapture_reason``: why its graphs were last
      captured again ("" for never).
    """
    rows = []
    for entry in entries:
        graphs, cost, chain = entry.graphs, entry.host_cost, entry.chain  # chain: chains/record.py, or None
        unanswered = graphs.unanswered()[1] if graphs is not None and hasattr(graphs, "unanswered") else 0
        rows.append(
            {
                "label": str(entry.label) or repr(entry.key)[:80],
                "key": _plain_key(entry.key),
                "backend": entry.backend.name if entry.backend is not None else "eager",
                "phase": entry.phase.value,
                "warmup_calls": entry.warmup_calls,
                "captures": entry.captures,
                "recaptures": entry.recaptures,
                "replays": entry.replays,
                "fallback_reason": entry.fallback_reason,
                "static_bytes": entry.nbytes(),
                "memory": entry.footprint().as_dict() if entry.has_graphs else None,  # NOTE [ What a key holds ]
                "holds": entry.footprint().describe() if entry.has_graphs else "",
                "pool_bytes": entry.pool_bytes if entry.backend is not None and
                entry.backend.reserved_bytes() is not None else None,
                "input_copies": entry.input_copies,
                "input_copies_skipped": entry.input_copies_skipped,
                "evictions": entry.evictions,
                "verified_replays": entry.verified,
                "no_backward": unanswered,
                "capture_ms": _round(entry.capture_ms),
                "host_us": _host_us(cost, chain),
                "host_cost": cost.describe() + (chain.cost.describe() if chain is not None and cost.describe() else ""),
                "grads": graphs.describe() if graphs is not None else "",
                "slot_bytes": list(graphs.slot_bytes()) if hasattr(graphs, "slot_bytes") else [],
                "chain": chain.describe(graphs is not None) if chain is not None else "",
                "pool": graphs.pool_words() if hasattr(graphs, "pool_words") else "",
                "recapture_reason": entry.recapture_reason,
            }
        )
    return rows


def _plural(n, word, many=None):
    return f"{n} {word if n == 1 else (many or word + 's')}"


_FELL_BACK = "key fell back: "


def _reasons(rows, counters):
    """Why calls ran eagerly: ``{reason: calls}``, a key's fall-back reason once (not per call)."""
    reasons = collections.Counter()
    for reason, n in counters.eager_reasons.items():
        reasons[reason[len(_FELL_BACK):] if reason.startswith(_FELL_BACK) else reason] += n
    for row in rows:
        if row["fallback_reason"] and row["fallback_reason"] not in reasons:
            reasons[row["fallback_reason"]] += 0
    return reasons


def _verdict(rows, counters, backends):
    """explain()'s first line after the name: graphed, warming up or eager, why, how fast; and the reasons
    it said (said once: the lines below refer to them)."""
    calls = counters.replays + counters.eager_calls + counters.warmup_calls + counters.captures
    if not calls:
        return "not called yet", set()
    phases = {row["phase"] for row in rows}
    word = "graphed" if "replay" in phases else "warming up" if phases & {"warmup", "recapture"} else "eager"
    reasons, said, parts = _reasons(rows, counters), set(), []
    if counters.replays:
        parts.append(f"{counters.replays} of {_plural(calls, 'call')} replayed a graph")
    if counters.eager_calls:
        parts.append(f"{counters.eager_calls}" + ("" if counters.replays else f" of {_plural(calls, 'call')}") +
                     " ran eagerly")
    if counters.warmup_calls:
        parts.append(f"{counters.warmup_calls} warmed up")
    if counters.captures:
        parts.append(_plural(counters.captures, "capture"))
    text = f"{word}: {', '.join(parts)}"
    if word == "graphed":
        text += "; " + _speed(rows, backends)
    if len(reasons) == 1:
        said.update(reasons)
        text += f"; eager because {next(iter(reasons))}"
    elif reasons:
        text += f"; eager for {_plural(len(reasons), 'reason')} (below)"
    return text, said


def _host_us(cost, chain):
    """A key's ``host_us`` row: its HostCost's lower quartiles, and its chain record's (chains/record.py)."""
    backward = cost.backward_us or (None, None)
    return {"eager": _round(cost.eager_us()), "graphed": _round(cost.graphed_us()),
            "chained": _round(chain.cost.us() if chain is not None else None),
            "eager_backward": _round(backward[0]), "graphed_backward": _round(backward[1]),
            "slowdown": round(cost.slowdown(), 3)}


def _speed(rows, backends):
    """How much host time a graphed call takes against an eager one (forward, and backward where both were
    timed), for the busiest measured key."""
    measured = [row for row in rows if row["host_us"]["eager"] and row["host_us"]["graphed"]]
    if not measured:
        return "speed not measured" + (f" on {', '.join(sorted(backends))}" if backends else "")
    row = max(measured, key=lambda r: r["replays"])
    us = row["host_us"]
    eager, graphed, call = us["eager"], us["graphed"], "forward call"
    if us["eager_backward"] is not None and us["graphed_backward"] is not None:
        eager, graphed, call = eager + us["eager_backward"], graphed + us["graphed_backward"], "call (forward and backward)"
    eager /= us["slowdown"]  # at the replays' host speed (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py)
    ratio = f"{eager / graphed:.1f}x less" if graphed <= eager else f"{graphed / eager:.1f}x more"
    return f"a graphed {call} takes {ratio} host time than eager ({graphed:.1f} against {eager:.1f} us, measured)"


_STATES = types.MappingProxyType({"replay": "graphed", "warmup": "warming up",
                                  "recapture": "released (captured again at its next call)",
                                  "fallback": "eager from now on"})


def _key_lines(row, label, said):
    """explain()'s lines for one key: its state and counts, then its details in words."""
    counts = (f"{_plural(row['warmup_calls'], 'warmup call')}, {_plural(row['captures'], 'capture')}, "
              f"{_plural(row['replays'], 'replay')}")
    line = f"  key {label}: {_STATES[row['phase']]}; {counts} on {row['backend']}"
    reason = row["fallback_reason"]
    if reason:
        line += "; why: above" if reason in said else f"; why: {reason}"
        said.add(reason)
    lines, details = [line], []
    if len(row["slot_bytes"]) > 1:
        sizes = " / ".join(map(str, sorted(set(row["slot_bytes"]))))
        details.append(f"{row['static_bytes']} static bytes in {len(row['slot_bytes'])} slots of {sizes} static "
                       "bytes each")
    if row["holds"]:  # every component of a key holding graphs: NOTE [ What a key holds ] in core/memory.py
        details.append(row["holds"])
    elif row["static_bytes"] and not details:
        pool = "" if row["pool_bytes"] is None else f", {row['pool_bytes']} graph pool bytes"
        details.append(f"{row['static_bytes']} static bytes{pool}")
    if row["capture_ms"] is not None:
        details.append(f"captured in {row['capture_ms']:.{1 if row['capture_ms'] >= 10 else 2}f} ms")
    if row["input_copies"] or row["input_copies_skipped"]:
        details.append(f"input copies {row['input_copies']} made, {row['input_copies_skipped']} skipped")
    if row["evictions"]:
        details.append(f"evicted {_plural(row['evictions'], 'time')} to make room (max_graphs, max_bytes)")
    if row["verified_replays"]:
        details.append(f"{row['verified_replays']} call(s) verified against eager")
    if details:
        lines.append("    " + "; ".join(details))
    if row["no_backward"]:
        lines.append(f"    no backward: {row['no_backward']} call(s) since its latest backward returned outputs that "
                     "needed grad and were freed without a backward (evaluation? call it under paddle.no_grad())")
    for name in ("grads", "chain", "pool"):
        if row[name]:
            lines.append(f"    {name}: {row[name]}")
    if row["recapture_reason"]:
        lines.append(f"    captured again: {row['recapture_reason']}")
    if row["host_cost"]:
        lines.append(f"    host time: {row['host_cost']}")
    return lines


def explain(name, stats, entries, counters, api="autocudagraph"):
    """A readable report of one wrapper: a verdict first (graphed, warming up or eager, why, how fast),
    then each key's state and details, then why calls ran eagerly; every reason said once.
    ``api``: the public name of the wrapper (the body's, core/body.py).

    Example::

        autocudagraph(layers.0: FFN.forward): graphed: 5 of 8 calls replayed a graph, 1 ran eagerly, 1 warmed
        up, 1 capture; eager because max_graphs reached; speed not measured on simulate
          key (x: float32[8, 16], w: float32[16, 16] grad): replays; 1 warmup call, 1 capture, 5 replays on simulate
            4096 static bytes; captured in 2.31 ms; input copies 5 made, 0 skipped
            grads: parameter grads handed to Paddle with clone_param_grads='auto': ...
          eager calls: 1
            1 x max_graphs reached
          backend: simulate (CPU, static-buffer semantics, host syncs refused during capture)
    """
    entries = list(entries)
    rows = describe_entries(entries)
    backends = {e.backend.name for e in entries if e.backend is not None}
    verdict, said = _verdict(rows, counters, backends)
    lines = [f"{api}({name}): {verdict}"]
    for row, label in zip(rows, distinct_labels(rows)):
        lines.extend(_key_lines(row, label, said))
    if counters.chained_calls:
        lines.append(f"  chained calls: {counters.chained_calls} of the replays, served by a chain of consecutive "
                     "graphed calls through one autograd bridge")
    if counters.eager_calls and len(_reasons(rows, counters)) > 1:
        lines.append(f"  eager calls: {counters.eager_calls}")
        for reason, count in collections.Counter(counters.eager_reasons).most_common():
            if reason.startswith(_FELL_BACK) and reason[len(_FELL_BACK):] in said:
                reason = "key fell back (why: on its key above)"
            lines.append(f"    {count} x {reason}")
    if stats["static_bytes"] and len(rows) > 1:
        pool = f", {stats['pool_bytes']} graph pool bytes" if any(r["pool_bytes"] for r in rows) else ""
        lines.append(f"  memory: {stats['static_bytes']} static bytes held by {_plural(stats['graphs'], 'key')}{pool}, "
                     f"{stats['held_bytes']} bytes held in all (what max_bytes counts)")
    described = {e.backend.describe() for e in entries if e.backend is not None}
    if described:
        lines.append(f"  backend: {'; '.join(sorted(described))}")
    return "\n".join(lines)


def distinct_labels(rows):
    """explain()'s label of each key (report() rows): its arguments, then where keys read alike, what else
    tells them apart (``[no_grad]``, ``[eval]``, ``[some Layers in eval]``, ``[amp ...]``), then ``#2``, ``#3``."""
    labels = [row["label"] for row in rows]
    groups = collections.defaultdict(list)
    for i, label in enumerate(labels):
        groups[label].append(i)
    for label, members in groups.items():
        if len(members) < 2:
            continue
        states = [rows[i]["key"] for i in members]
        tagged = [label + "".join(_state_tags(state, states)) for state in states]
        seen = collections.Counter()
        for i, text in zip(members, tagged):
            seen[text] += 1
            labels[i] = text if seen[text] == 1 else f"{text} #{seen[text]}"
    return labels


def _state_tags(state, states):
    """What of a key's grad mode, training flags and AMP state differs from other keys of its label."""
    tags = []
    if len({s["grad_enabled"] for s in states}) > 1 and not state["grad_enabled"]:
        tags.append(" [no_grad]")
    if len({tuple(s["training"]) for s in states}) > 1 and not all(state["training"]):
        tags.append(" [eval]" if not any(state["training"]) else " [some Layers in eval]")
    if len({(s["amp_level"], s["amp_dtype"]) for s in states}) > 1:
        level, dtype = state["amp_level"], state["amp_dtype"]
        tags.append(f" [amp level {level}, {dtype}]" if level else " [no amp]")
    return tags


def _graphed_layers(model):
    """``[(place, wrapper)]``: the graphed forwards of ``model`` and its sublayers, by place in ``model``."""
    found = []
    for place, layer in model.named_sublayers(include_self=True):
        for value in vars(layer).values():
            value = behind(value)  # a Layer graphed in place holds a front door: NOTE [ The front door ]
            if isinstance(value, Reports):
                found.append((place, value))
    return found


def explain_model(model):
    """explain() of every graphed Layer in ``model`` (a Layer graphed in place, or whose class graphs its
    forward), each named by its place in ``model`` (``layers.3``, from ``named_sublayers``), which the
    wrapper's own explain() and report() use from then on."""
    found = _graphed_layers(model)
    if not found:
        return f"autocudagraph: no graphed Layer in {type(model).__name__}"
    return "\n".join(wrapper.explain() for wrapper in _placed(found))


def report_model(model):
    """``{place: report()}`` of every graphed Layer in ``model`` (plain data; see explain_model)."""
    return {wrapper.place: wrapper.report() for wrapper in _placed(_graphed_layers(model))}


def _placed(found):
    for place, wrapper in found:
        wrapper.place = place or "(the model)"
    return [wrapper for _, wrapper in found]


class Reports:
    """What a wrapper (core/lifecycle.py Lifecycle) reports about its keys: a mixin over its
    ``counters``, ``_entries``, ``__name__`` and ``_body.api``. ``place``: where its Layer sits in a
    model (``layers.3``), once explain_model() or report_model() found it, else None."""

    place = None

    def stats(self):
        """Counters of this wrapper plus ``graphs`` (keys holding graphs now), ``keys``,
        ``static_bytes``, ``grad_copies`` (by the keys holding graphs now), ``slots``, ``slot_bytes``,
        ``capture_ms`` (``{key label: host ms of its latest capture}``) and ``key_bytes`` (``{key
        label: bytes of its static buffers}``, keys holding graphs), ``held_bytes`` (what max_bytes counts),
        ``memory`` and ``key_memory`` (every component, all keys and per key label: NOTE [ What a key
        holds ] in core/memory.py): summarize()."""
        return summarize(self.counters, self._entries.values())

    def report(self):
        """One dict of plain values per key: phase, counts, why it fell back, bytes, host times
        (describe_entries() lists the fields)."""
        return describe_entries(self._entries.values())

    def explain(self):
        """A readable report: a verdict first (graphed, warming up or eager, why, how fast), then each key's
        state and details, then why calls ran eagerly."""
        name = self.__name__ if self.place is None else f"{self.place}: {self.__name__}"
        return explain(name, self.stats(), self._entries.values(), self.counters, api=self._body.api)
