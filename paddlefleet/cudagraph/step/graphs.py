"""What one capture of a whole step made: ``StepGraphs``, the step's graph, its static buffers and what
a replay checks and feeds. Made by step/capture.py, read by step/body.py and step/replay_checks.py.

NOTE [ What a whole step holds ]
Beyond what eager holds (parameters, optimizer state, grads kept between calls in persistent mode),
a captured step holds: a static buffer per batch tensor it copies (none for an adopted one), its
static outputs, and one pool (the activations, the grads of a step that clears them, the
optimizer's temporaries: what its one graph allocates). Nothing else stays: the graph reads and
writes the parameters and optimizer state in place. Around its capture it takes the grads
(GradValues: by storage on a GPU, NOTE [ What a failed recording capture leaves ] in
step/rollback.py) and, on the simulated backend only, a copy of the state it may write (Rollback);
both go when the capture ends. What it adds over a raw replay of one graph of the same step is
then its warmup's cached blocks, and those are released before the capture (NOTE [ Allocator
cache before a capture ] in backends/pool_memory.py).
"""

import dataclasses
from typing import Any, List, Optional

from paddle import _C_ops

from ..core.body import Graphs
from ..core.memory import footprint
from .grad_slots import CLOSED, PERSISTENT
from ..io.static_inputs import nbytes

__all__ = ["StepGraphs"]


@dataclasses.dataclass(eq=False)
class StepGraphs(Graphs):
    """What one capture of a step made.

    Attributes:
        graph, pool, backend: the step's graph.
        static_inputs, static_outputs, out_spec, out_consts: the batch buffers and the results.
        out_aliases: OutputAliases where the result holds an input, a Layer tensor or one tensor twice, else None (NOTE
            [ Outputs handed back as they are ] in io/output_aliases.py).
        grad_mode: the grad-slot mode at capture; watched: ``[(param, grad address)]`` checked
            before replays (in persistent mode: the grad storage the graph adds into).
        params: ``[(param, address)]`` the graph updates in place.
        bindings: the step function's globals/closure at capture; trace: the capture's ops.
        read_leaves: the tensors requiring grad that the capture read from outside (stop_gradient checked).
        pending: the capture call's result when the capture executed the step (simulate).
        live: what the capture run made and the graph keeps reading.
    """

    backend: Any
    pool: Any = None
    graph: Any = None
    static_inputs: Any = None
    static_outputs: List[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    out_consts: Optional[list] = None
    out_aliases: Any = None
    layers: list = dataclasses.field(default_factory=list)
    read_leaves: list = dataclasses.field(default_factory=list)
    grad_mode: str = CLOSED
    watched: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)
    bindings: dict = dataclasses.field(default_factory=dict)
    trace: Any = None
    pending: Any = None
    stepped: frozenset = frozenset()  # ids of the optimizers the step updates (their rates are fed)
    moved_beta_pows: int = 0
    returned: Any = None
    live: dict = dataclasses.field(default_factory=dict)
    checks: Any = None  # ReplayChecks, made last (NOTE [ Step replay checks ] in step/replay_checks.py)
    feeds: tuple = ()  # the LRFeeds of the optimizers in ``stepped``
    in_place: bool = False  # every input adopted or a host input: nothing to copy (NOTE [ Adopted inputs of a step ])
    detached: list = dataclasses.field(default_factory=list)  # static_outputs, detached (hand_out)

    def describe(self):
        moved = f"; {self.moved_beta_pows} beta power(s) moved to the device" if self.moved_beta_pows else ""
        grads = ("grads kept between calls (accumulation: clear_grad zero-fills them in place)"
                 if self.grad_mode == PERSISTENT else "grads cleared inside the step (each call starts without grads)")
        return f"whole step, {grads}{moved}"

    def nbytes(self):
        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        return total + sum(nbytes(t) for t in self.static_outputs if t is not None)

    def footprint(self):
        """Bytes held, by component (NOTE [ What a key holds ] in core/memory.py: the grads live in the pool)."""
        return footprint(self.static_inputs, self.static_outputs, graphs=[self.graph])

    def hand_out(self):
        """Detached copies of the static outputs, which the next replay overwrites (the graph's
        own outputs are detached once, at capture: ``detached``)."""
        copies = list(map(_C_ops.assign, self.detached))
        for c in copies:
            c.stop_gradient = True
        return copies

    def handed_result(self, tensors):
        """The result's tensors for a call of ``tensors``: hand_out(), with the call's own tensors and repeated
        outputs where the step returned them (NOTE [ Outputs handed back as they are ] in io/output_aliases.py)."""
        copies = self.hand_out()
        return copies if self.out_aliases is None else self.out_aliases.expand(copies, tensors)

    def release(self):
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.pool = self.static_inputs = self.pending = None
        self.static_outputs, self.detached, self.live = [], [], {}
