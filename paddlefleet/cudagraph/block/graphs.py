"""What one capture of a block made: ``BlockGraphs``, the static buffers and graphs of a key.

Made by block/capture.py, read by block/replay.py, the bridge and block/verify.py; released when the key is reset,
evicted, re-captured or falls back.
"""

import dataclasses
from typing import Any, List, Optional

from ..grads.hand_out_plan import choose
from ..io.static_inputs import nbytes

__all__ = ["BlockGraphs"]


@dataclasses.dataclass(eq=False)
class BlockGraphs:
    """The graphs, pool and static buffers of one captured key.

    Attributes:
        backend, pool, fwd_graph, bwd_graph: the graphs (bwd_graph None when the capture recorded
            no backward: no grad mode, or nothing needs grad).
        static_inputs: StaticInputs of the call's tensors; in_spec: the call's structure.
        static_outputs, out_spec, out_consts: the outputs and how to rebuild the result.
        out_differentiable: per output, whether it carries grad; out_hookable: per output,
            whether it is handed out through a hookable alias (grads.can_hook).
        host_outputs: indices of host (CPU) outputs (NOTE [ Host tensors ] in io/host_tensors.py).
        clone_outputs: the output policy fixed at capture (NOTE [ Policies fixed at capture ]).
        params: ParamSet of the Layers the call used (layers: those Layers).
        bridged: the parameters handed through the bridge (all trainable ones, or with
            accumulate_in_graph the shared ones); accumulators: Accumulators of the others, or None.
        anchor: a leaf that needs grad, passed to the bridge when nothing else it takes does
            (so that autograd still runs its backward, which accumulates in the graph).
        static_grad_outputs: where the backward replay reads the outputs' grads.
        grad_plan: GradPlan (NOTE [ Grad hand-out ] in grads/hand_out_plan.py) of bwd_graph's buffers.
        second: ``(graph, GradPlan)`` of the second backward graph, or None (NOTE [ Two grad
            buffer sets ] in grads/hand_out_plan.py); recipe: what capturing it needs (None: never);
            second_wanted: a backward found its only buffer set adopted; last_set: the set the
            last backward replay wrote.
        live: keeps the capture-time autograd graph (saved activations) alive with the graphs.
        handed_out: StaleOutputs when check_stale_outputs is on.
        generation, inflight: the bridge's in-flight forward replay (NOTE in block/bridge.py).
    """

    backend: Any
    pool: Any = None
    fwd_graph: Any = None
    bwd_graph: Any = None
    static_inputs: Any = None
    in_spec: Any = None
    static_outputs: List[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    out_consts: Optional[list] = None
    out_differentiable: List[bool] = dataclasses.field(default_factory=list)
    out_hookable: List[bool] = dataclasses.field(default_factory=list)
    host_outputs: List[int] = dataclasses.field(default_factory=list)
    clone_outputs: bool = True
    params: Any = None
    layers: list = dataclasses.field(default_factory=list)
    bridged: list = dataclasses.field(default_factory=list)
    accumulators: Any = None
    anchor: Any = None
    static_grad_outputs: list = dataclasses.field(default_factory=list)
    grad_plan: Any = None
    second: Any = None
    recipe: Any = None
    second_wanted: bool = False
    last_set: int = 0
    live: Any = None
    handed_out: Any = None
    generation: int = 0
    inflight: Any = None

    def backward_pending(self):
        """True while the autograd graph of the last forward replay still waits for its backward
        (the graphs' saved activations must not be overwritten or freed)."""
        token = self.inflight() if self.inflight is not None else None
        return token is not None and not token.done

    def backward_set(self):
        """``(graph, plan, adopted)`` for the next backward replay (NOTE [ Two grad buffer sets ]
        in grads/hand_out_plan.py): ``adopted`` lists parameters to move out of the chosen buffers first."""
        sets = [(self.bwd_graph, self.grad_plan)] + ([self.second] if self.second is not None else [])
        k, adopted = choose([plan for _, plan in sets], self.last_set)
        if adopted and self.second is None and self.recipe is not None:
            self.second_wanted = True
        self.last_set = k
        graph, plan = sets[k]
        return graph, plan, adopted

    def leaf_params(self):
        """The parameters in the order the backward graph returns their grads: the bridged ones,
        then the accumulated ones."""
        return list(self.bridged) + (list(self.accumulators.params) if self.accumulators is not None else [])

    def describe(self):
        """What explain() says about this key's grads, or "" (no backward)."""
        if self.bwd_graph is None:
            return ""
        if self.accumulators is not None:
            bridged = f", {len(self.bridged)} shared one(s) handed out" if self.bridged else ""
            return f"grads of {self.accumulators.count()} parameter(s) accumulated in the graph{bridged}"
        plans = self.plans()
        copies = sum(p.copies for p in plans)
        rescues = sum(p.rescues for p in plans)
        return (f"grads handed out with clone_param_grads={self.grad_plan.policy!r}: {copies} copied, "
                f"{rescues} moved out of adopted buffers, {len(plans)} buffer set(s)")

    def grad_copies(self):
        """Device copies of parameter grads made so far (handed out as copies, or moved out when
        adopted); input grads, always copies, are not counted."""
        return sum(p.copies + p.rescues for p in self.plans())

    def plans(self):
        """Every GradPlan of this key (one per buffer set)."""
        return [p for p in (self.grad_plan, self.second[1] if self.second else None) if p is not None]

    def nbytes(self):
        """Bytes held by the static buffers (pool internals not included)."""
        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        grads = [g for plan in self.plans() for g in plan.static_grads]
        for group in (self.static_outputs, self.static_grad_outputs, grads):
            total += sum(nbytes(t) for t in group if t is not None)
        return total

    def release(self):
        """Frees the graphs and drops every static buffer."""
        if self.accumulators is not None:
            self.accumulators.release()
        for graph in (self.second[0] if self.second else None, self.bwd_graph, self.fwd_graph):
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = self.pool = self.live = None
        self.second = self.recipe = None
        self.static_inputs = None
        self.static_outputs, self.static_grad_outputs = [], []
        self.grad_plan = None
        self.inflight = None
        self.handed_out = None
