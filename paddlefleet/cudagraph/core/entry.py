r"""Per-key state: the Phase enum and the GraphEntry, which owns its transitions.

The lifecycle of a key (core/lifecycle.py asks for each move; the entry makes it)::

    WARMUP --(warmup_steps eager calls)--> capture --ok--> REPLAY
                                              \--fails--> FALLBACK (eager from then on)
    REPLAY --(parameter or adopted input moved / evicted)--> RECAPTURE --> capture (no warmup)
    REPLAY --(what the warmup traced changed: a frozen parameter, a Layer attribute)--> WARMUP
    REPLAY --(verify mismatch / static buffers over max_bytes)--> FALLBACK
"""

import dataclasses
import enum
import weakref
from typing import Any, Optional

from .host_cost import HostCost, measured
from .memory import Footprint

__all__ = ["ATTR_RECAPTURES", "Phase", "GraphEntry"]

# NOTE [ Graph pool bytes ]
# A graph's memory lives in a pool of its own (Paddle 2.6: one private pool per graph; Paddle
# >= 3.1: the forward and backward graphs of one key share one, NOTE [ One pool per key ] in
# backends/cuda.py): the static outputs and grad buffers, the activations the backward reads, the
# kernels' temporaries and whatever the capture allocates. So every graph's capture is measured
# by the backend that makes it (backends/pool_memory.py): the device memory the process has
# reserved after the capture less what it had before (memory a capture takes from memory already
# reserved is not seen, so this is what the graph made the process reserve). A key's pool bytes
# are the sum over the graphs its record holds now (its forward and backward graphs, a second
# grad set captured at a later replay, every slot), 0 once they are released; max_bytes counts
# them with the static buffers outside the pools (NOTE [ What a key holds ] in core/memory.py).
# The simulated backend has no device memory: its pools are not measured (explain() says "not
# measured" rather than a number) unless it models them (SimulatedBackend.pool_model).

# NOTE [ Attributes that change on every call ]
# A Layer attribute changed since capture makes the key capture again (NOTE [ Layer attributes a
# replay freezes ] in guards/layer_attrs.py): right for a value changed now and then (a flag, a
# dropout rate), endless for one changed before every call (``model.seen = step`` between calls;
# one the function itself changes, ``self.calls += 1``, is refused at its capture: NOTE [ Attributes
# a capture writes ] in guards/attr_writes.py): every call would capture and none replay, slower than
# eager and never done. So the entry counts the captures
# again for one attribute with no replay between them (``attr_changed``); when that attribute
# changes once more after ATTR_RECAPTURES such captures in a row, the key runs eagerly for good,
# with the attribute and the values seen as its reason. A replay between two changes, or a change
# of another attribute, starts the count again.

#: Captures again in a row for one changed Layer attribute before its key runs eagerly.
ATTR_RECAPTURES = 3


class Phase(enum.Enum):
    WARMUP = "warmup"
    REPLAY = "replay"
    RECAPTURE = "recapture"
    FALLBACK = "fallback"


@dataclasses.dataclass(eq=False)
class GraphEntry:
    """One key: its phase, what its capture made (``graphs``), and its counts.

    Attributes:
        key: the dispatch key; label: a readable form of it for explain() and messages.
        backend: the backend that captures and replays this key.
        graphs: what the capture made, a Graphs (core/body.py: a block's Slots of BlockGraphs,
            NOTE [ Slots ] in block/slots.py; StepGraphs for steps), None before capture and
            after a release (which keeps what a pending backward still needs).
        last_inputs: weak references to the tensors of the latest warmup or capture call
            (NOTE [ Adopted inputs ] in io/static_inputs.py).
        capture_ms: host milliseconds of this key's latest capture (forward and backward graphs,
            static buffers), None before the first.
        host_cost: HostCost, the host time of its eager and graphed calls (NOTE [ Graphed calls
            that cannot pay ] in core/host_cost.py).
        chain: what this key knows about chains, a ChainRecord (chains/record.py: the chain it heads,
            why calls after it are not chained to it, the host time of its chained calls), made by
            chains/ when they first need it; None before. release() tells it (``forget``).
        eager_if_slower: the key runs eagerly once its graphed calls were measured slower than
            its eager calls (the option; NOTE [ Graphed calls that cannot pay ]).
    """

    key: Any
    backend: Any
    label: str = ""
    phase: Phase = Phase.WARMUP
    graphs: Any = None
    fallback_reason: Optional[str] = None
    last_inputs: Any = None
    last_used: int = 0
    verify_left: int = 0
    warmup_calls: int = 0
    captures: int = 0
    recaptures: int = 0
    recapture_reason: str = ""  # why its graphs were last released to be captured again
    replays: int = 0
    input_copies: int = 0
    input_copies_skipped: int = 0
    evictions: int = 0
    verified: int = 0
    capture_ms: Optional[float] = None
    host_cost: Optional[HostCost] = None
    chain: Any = None
    eager_if_slower: bool = False
    attr_streak: Any = None  # ((where, attribute), replays then, values seen): NOTE [ Attributes that change on every call ]
    attr_written: Any = None  # (where, attribute) its last refused capture changed: NOTE [ Attributes a capture writes ]
    eager_decision: Any = None  # (fallback_reason, the Decision of its calls): NOTE [ Calls of a key that runs eagerly ]

    def __post_init__(self):
        if self.host_cost is None:
            self.host_cost = HostCost(measure=measured(self.backend), judge=self.eager_if_slower)

    @property
    def has_graphs(self):
        return self.graphs is not None

    def nbytes(self):
        """Bytes held by this key's static buffers (pool internals not included)."""
        if self.graphs is None:
            return 0
        return self.graphs.nbytes()

    def footprint(self):
        """The bytes its graphs hold, by component (NOTE [ What a key holds ] in core/memory.py)."""
        return self.graphs.footprint() if self.graphs is not None else Footprint()

    @property
    def pool_bytes(self):
        """Device memory its live graphs' captures made the process reserve (NOTE [ Graph pool
        bytes ]); 0 where none is measured (simulate)."""
        return self.footprint().pool or 0

    def held_bytes(self):
        """Bytes this key holds on the device, each once: what max_bytes counts (Footprint.held)."""
        return self.footprint().held

    def backward_pending(self):
        """True while a forward replay of this key waits for its backward."""
        return self.graphs is not None and self.graphs.backward_pending()

    def remember_inputs(self, tensors):
        self.last_inputs = [weakref.ref(t) for t in tensors]

    def attr_changed(self, changed):
        """Counts a capture again for ``changed`` = ``(where, attribute, old, new)``; returns why the key
        runs eagerly when that attribute changed after ATTR_RECAPTURES captures again in a row (NOTE
        [ Attributes that change on every call ]), else None."""
        where, name, old, new = changed
        streak = self.attr_streak
        if streak is None or streak[0] != (where, name) or streak[1] != self.replays:
            streak = ((where, name), self.replays, [])
        seen = streak[2] + [f"{old} -> {new}"]
        self.attr_streak = ((where, name), self.replays, seen)
        if len(seen) <= ATTR_RECAPTURES:
            return None
        return (f"attribute '{name}' of {where} changed before every call (capture's value -> call's: "
                f"{', '.join(seen)}), and a graph replays the value of its capture: the key was captured again "
                f"{ATTR_RECAPTURES} times in a row without a replay")

    # ------------------------------------------------------------------ transitions
    def warmed_up(self, tensors):
        """Counts one eager warmup call."""
        self.warmup_calls += 1
        self.remember_inputs(tensors)

    def captured(self, graphs, verify_replays):
        """The capture succeeded: replay from now on."""
        self.graphs = graphs
        self.phase = Phase.REPLAY
        self.captures += 1
        self.attr_written = None
        self.verify_left = verify_replays

    def slot_added(self):
        """Another slot of this key was captured (NOTE [ Slots ] in block/slots.py)."""
        self.captures += 1

    def release(self):
        """Drops graphs, pool and static buffers (the entry keeps its counts), and the chain built
        from this key (chains/record.py: ChainRecord.forget); its backwards are no longer timed (the
        hooks that time them go: NOTE [ Graphed calls that cannot pay ] in core/host_cost.py)."""
        self.host_cost.stop_backward()
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        if self.chain is not None:
            self.chain.forget()

    def to_recapture(self):
        """Drops the graphs; the next call of this key captures again (no warmup)."""
        self.release()
        self.phase = Phase.RECAPTURE
        self.fallback_reason = None

    def to_warmup(self):
        """Drops the graphs; the key warms up again (warmup_steps eager calls) before its next capture."""
        self.release()
        self.phase = Phase.WARMUP
        self.warmup_calls = 0
        self.fallback_reason = None

    def evict(self):
        """Dropped to stay within max_bytes; captured again when next called."""
        self.to_recapture()
        self.evictions += 1

    def fall_back(self, reason):
        """Moves this key to eager for good."""
        self.release()
        self.phase = Phase.FALLBACK
        self.fallback_reason = reason
