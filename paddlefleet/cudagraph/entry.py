r"""Per-key state: the Phase enum and the GraphEntry dataclass.

The lifecycle of a key (lifecycle.py moves it; a key that fails to capture or re-capture, or whose
static buffers alone exceed max_bytes, goes to FALLBACK)::

    WARMUP --(warmup_steps eager calls)--> capture --ok--> REPLAY
                                              \--fails--> FALLBACK (eager from then on)
    REPLAY --(parameter moved / evicted)--> RECAPTURE --> capture (no warmup)
"""

import dataclasses
import enum
from typing import Any, List, Optional

__all__ = ["Phase", "GraphEntry"]


class Phase(enum.Enum):
    WARMUP = "warmup"
    REPLAY = "replay"
    RECAPTURE = "recapture"
    FALLBACK = "fallback"


@dataclasses.dataclass(eq=False)
class GraphEntry:
    """Everything one key holds: its phase, graphs, pool and static buffers."""

    key: Any
    backend: Any
    phase: Phase = Phase.WARMUP
    warmup_calls: int = 0
    captures: int = 0
    replays: int = 0
    input_copies: int = 0
    input_copies_skipped: int = 0
    fallback_reason: Optional[str] = None
    last_used: int = 0
    verify_left: int = 0
    verified: int = 0
    evictions: int = 0
    # A readable description of the key (argument shapes and dtypes), for explain() and messages.
    label: str = ""
    # Weak references to the tensors of the latest warmup or capture call (NOTE [ Adopted inputs ]).
    last_inputs: Any = None
    # Indices of outputs that are host (CPU) tensors (NOTE [ Host tensors ] in safety.py).
    host_outputs: list = dataclasses.field(default_factory=list)
    # Fixed at capture (NOTE [ Policies fixed at capture ] in lifecycle.py).
    clone_outputs: bool = True
    clone_param_grads: bool = True
    # Static IO.
    in_spec: Any = None
    static_inputs: Any = None
    out_spec: Any = None
    out_consts: Optional[list] = None
    static_outputs: Optional[list] = None
    out_differentiable: Optional[List[bool]] = None
    static_grad_outputs: Optional[list] = None
    static_grads: Optional[list] = None
    grad_slots: Optional[list] = None
    hand_out_clone: Optional[List[bool]] = None
    # (static stack, positions in the bridge's grads) per NOTE [ Grad groups ].
    grad_groups: list = dataclasses.field(default_factory=list)
    grouped_positions: frozenset = frozenset()
    # Parameters handed through the autograd bridge, and where each lives.
    params: list = dataclasses.field(default_factory=list)
    param_homes: list = dataclasses.field(default_factory=list)
    param_ptrs: list = dataclasses.field(default_factory=list)
    layers: list = dataclasses.field(default_factory=list)
    # Graphs.
    pool: Any = None
    fwd_graph: Any = None
    bwd_graph: Any = None
    live: Any = None
    # In-flight forward replay whose backward has not run (a weakref to its token).
    generation: int = 0
    inflight: Any = None
    # Stale-output detection (check_stale_outputs).
    handed_out: Any = None

    def backward_pending(self):
        """True while the autograd graph of this key's last forward replay still waits for its
        backward (the graphs' saved activations must not be overwritten or freed)."""
        token = self.inflight() if self.inflight is not None else None
        return token is not None and not token.done

    @property
    def has_graphs(self):
        return self.fwd_graph is not None

    def nbytes(self):
        """Bytes held by this key's static buffers (pool internals not included)."""
        from .static_io import nbytes

        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        for group in (self.static_outputs, self.static_grad_outputs, self.static_grads):
            for t in group or ():
                if t is not None:
                    total += nbytes(t)
        return total

    def release(self):
        """Drops graphs, pool and static buffers (the entry keeps its counters)."""
        for graph in (self.bwd_graph, self.fwd_graph):
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = self.pool = self.live = None
        self.static_inputs = self.static_outputs = None
        self.static_grad_outputs = self.static_grads = None
        self.grad_groups = []
        self.grouped_positions = frozenset()
        self.inflight = None
        self.handed_out = None

    def to_recapture(self):
        """Drops the graphs; the next call of this key captures again (no warmup)."""
        self.release()
        self.phase = Phase.RECAPTURE
        self.fallback_reason = None

    def fall_back(self, reason):
        """Moves this key to eager for good."""
        self.release()
        self.phase = Phase.FALLBACK
        self.fallback_reason = reason
