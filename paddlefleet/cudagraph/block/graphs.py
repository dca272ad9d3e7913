"""What one capture of a block made: ``BlockGraphs``, the static buffers and graphs of a key, the
forward's, with its ``BackwardGraphs`` (the backward's) when the capture recorded a backward.

Made by block/capture.py, read by block/replay.py, the bridge and block/verify.py; released when the key is reset,
evicted, re-captured or falls back.
"""

import dataclasses
from typing import Any, List, Optional

from ..core.body import Graphs
from ..core.memory import footprint
from ..io.static_inputs import nbytes
from .bridge import BridgePlan

__all__ = ["BlockGraphs", "BackwardGraphs"]


@dataclasses.dataclass(eq=False)
class BackwardGraphs:
    """The backward half of a key's graphs.

    Attributes:
        grad_outputs: where the backward replay reads the outputs' grads (static buffers).
        bridged: the parameters handed through the bridge (all trainable ones, or with
            accumulate_in_graph the shared ones); accumulators: Accumulators of the others, or None.
        anchor: a leaf that needs grad, passed to the bridge when nothing else it takes does
            (so that autograd still runs its backward, which accumulates in the graph).
        graph: the first backward graph; sets: its GradSets (grads/buffer_sets.py: the grad
            buffer sets, the second one included), None until the first is captured.
    """

    grad_outputs: list
    bridged: list
    accumulators: Any = None
    anchor: Any = None
    graph: Any = None
    sets: Any = None

    @property
    def grad_plan(self):
        """GradPlan (NOTE [ Grad hand-out ] in grads/hand_out_plan.py) of the first set's buffers."""
        return self.sets.sets[0][1] if self.sets is not None else None

    def plans(self):
        """Every GradPlan (one per buffer set)."""
        return self.sets.plans() if self.sets is not None else []

    def nbytes(self):
        grads = [g for plan in self.plans() for g in plan.static_grads]
        return sum(nbytes(t) for group in (self.grad_outputs, grads) for t in group if t is not None)

    def graphs(self):
        """Every backward graph: the first, then the second grad set's."""
        return [self.graph] + ([g for g, _ in self.sets.sets[1:]] if self.sets is not None else [])

    def release(self):
        if self.accumulators is not None:
            self.accumulators.release()
        if self.sets is not None:
            self.sets.release()
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.sets = None
        self.grad_outputs = []


@dataclasses.dataclass(eq=False)
class BlockGraphs(Graphs):
    """The graphs, pool and static buffers of one captured key.

    Attributes:
        backend, pool, fwd_graph: the forward graph.
        shared_pool: the SharedPool the forward graph joined with other keys' forwards, or None (NOTE
            [ Keys sharing a forward pool ] in backends/shared_pool.py).
        backward: BackwardGraphs, or None when the capture recorded no backward (no grad mode, or
            nothing needs grad).
        static_inputs: StaticInputs of the call's tensors; in_spec: the call's structure.
        static_outputs, out_spec, out_consts: the outputs and how to rebuild the result.
        out_aliases: OutputAliases where the result holds an input, a Layer tensor or one tensor twice, else None (NOTE
            [ Outputs handed back as they are ] in io/output_aliases.py).
        out_differentiable: per output, whether it carries grad.
        host_outputs: indices of host (CPU) outputs (NOTE [ Host tensors ] in io/host_tensors.py).
        clone_outputs: the output policy fixed at capture (NOTE [ Policies fixed at capture ]).
        params: ParamSet of the Layers the call used (layers: those Layers).
        live: keeps the capture-time autograd graph (saved activations) alive with the graphs.
        handed_out: StaleOutputs when check_stale_outputs is on.
        generation, inflight: the bridge's in-flight forward replay (NOTE in block/bridge.py).
        answered: the generation of the latest forward replay whose backward ran, 0 for none (NOTE [ Outputs
            that need grad, and no backward ] in block/slots.py).
        bridge, diff_at, non_diff_at, grad_feeds: per-replay work decided once by settle() (NOTE
            [ Replay work decided at capture ] in block/replay.py).
        links: the graphs that copy another key's static buffer into one of these (a chain's: NOTE [ Link
            graphs ] in chains/link_graphs.py), or None.
    """

    backend: Any
    pool: Any = None
    shared_pool: Any = None
    fwd_graph: Any = None
    backward: Optional[BackwardGraphs] = None
    static_inputs: Any = None
    in_spec: Any = None
    static_outputs: List[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    out_consts: Optional[list] = None
    out_aliases: Any = None
    out_differentiable: List[bool] = dataclasses.field(default_factory=list)
    host_outputs: List[int] = dataclasses.field(default_factory=list)
    clone_outputs: bool = True
    params: Any = None
    layers: list = dataclasses.field(default_factory=list)
    attrs: Any = None  # AttrWatch of the layers and their sublayers (NOTE [ Layer attributes a replay freezes ])
    live: Any = None
    handed_out: Any = None
    generation: int = 0
    inflight: Any = None
    answered: int = 0
    bridge: Any = None  # block/bridge.py's BridgePlan
    diff_at: tuple = ()
    non_diff_at: tuple = ()
    grad_feeds: tuple = ()
    links: Any = None  # chains/link_graphs.py's LinkGraphs that write these buffers (NOTE [ Link graphs ]), or None

    def settle(self):
        """Decides once, after capture, what every replay of these graphs passes and hands out
        (NOTE [ Replay work decided at capture ] in block/replay.py): the bridge's inputs and grads
        (block/bridge.py's BridgePlan), the indices of the outputs that carry a grad and of those that
        do not, and ``(output index, grad-output buffer)`` of each that does."""
        self.diff_at = tuple(i for i, d in enumerate(self.out_differentiable) if d)
        self.non_diff_at = tuple(i for i, d in enumerate(self.out_differentiable) if not d)
        backward = self.backward
        if backward is not None:
            self.bridge = BridgePlan(self)
            self.grad_feeds = tuple(zip(self.diff_at, backward.grad_outputs))

    @property
    def accumulators(self):
        """The backward's Accumulators (accumulate_in_graph), or None."""
        return self.backward.accumulators if self.backward is not None else None

    def backward_pending(self):
        """True while the autograd graph of the last forward replay still waits for its backward
        (the graphs' saved activations must not be overwritten or freed)."""
        token = self.inflight() if self.inflight is not None else None
        return token is not None and not token.done

    def leaf_params(self):
        """The parameters in the order the backward graph returns their grads: the bridged ones,
        then the accumulated ones (all of them without a backward)."""
        if self.backward is None:
            return list(self.params.params)
        acc = self.backward.accumulators
        return list(self.backward.bridged) + (list(acc.params) if acc is not None else [])

    def describe(self):
        """What explain() says about this key's grads, or "" (no backward)."""
        if self.backward is None or self.backward.graph is None:
            return ""
        if self.accumulators is not None:
            bridged = self.backward.bridged
            bridged = f", {len(bridged)} shared one(s) handed out" if bridged else ""
            return f"grads of {self.accumulators.count()} parameter(s) accumulated in the graph{bridged}"
        plans = self.plans()
        copies = sum(p.copies for p in plans)
        rescues = sum(p.rescues for p in plans)
        return hand_out_text(self.backward.grad_plan.policy, copies, rescues, len(plans))

    def grad_copies(self):
        """Device copies of parameter grads made so far (handed out as copies, or moved out when
        adopted); input grads, always copies, are not counted."""
        return sum(p.copies + p.rescues for p in self.plans())

    def plans(self):
        """Every GradPlan of this key (one per buffer set)."""
        return self.backward.plans() if self.backward is not None else []

    def nbytes(self):
        """Bytes held by the static buffers (pool internals not included)."""
        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        total += sum(nbytes(t) for t in self.static_outputs if t is not None)
        return total + (self.backward.nbytes() if self.backward is not None else 0)

    def footprint(self):
        """Bytes held, by component (NOTE [ What a key holds ] in core/memory.py)."""
        bwd = self.backward
        return footprint(self.static_inputs, self.static_outputs,
                         bwd.grad_outputs if bwd is not None else (),
                         [g for plan in self.plans() for g in plan.static_grads],
                         [self.fwd_graph] + (bwd.graphs() if bwd is not None else []))

    def release(self):
        """Frees the graphs and drops every static buffer."""
        if self.links is not None:
            self.links.release()
            self.links = None
        if self.backward is not None:
            self.backward.release()
        if self.fwd_graph is not None:
            self.fwd_graph.reset()
        self.fwd_graph = self.pool = self.shared_pool = self.live = None
        self.static_inputs = None
        self.static_outputs = []
        self.inflight = None
        self.handed_out = None
        self.grad_feeds = ()  # grad_feeds holds the grad-output buffers
        self.bridge = None


def hand_out_text(policy, copies, rescues, sets, slots=1):
    """explain()'s words for how a key handed its parameter grads to Paddle (NOTE [ Grad hand-out ] in grads/hand_out_plan.py)."""
    where = f" in {slots} slots" if slots > 1 else ""
    return (f"parameter grads handed to Paddle with clone_param_grads={policy!r}: {copies} copied when handed out, "
            f"{rescues} copied before a replay would overwrite a grad still held, {sets} set(s) of grad "
            f"buffers{where}")
