"""What one capture of a block made: ``BlockGraphs``, the static buffers and graphs of a key.

Made by capture.py, read by replay.py, the bridge and verify.py; released when the key is reset,
evicted, re-captured or falls back.
"""

import dataclasses
from typing import Any, List, Optional

from .static_io import nbytes

__all__ = ["BlockGraphs"]


@dataclasses.dataclass(eq=False)
class BlockGraphs:
    """The graphs, pool and static buffers of one captured key.

    Attributes:
        backend, pool, fwd_graph, bwd_graph: the graphs (bwd_graph None when the capture recorded
            no backward: no grad mode, or nothing needs grad).
        static_inputs: StaticInputs of the call's tensors; in_spec: the call's structure.
        static_outputs, out_spec, out_consts: the outputs and how to rebuild the result.
        out_differentiable: per output, whether it carries grad.
        host_outputs: indices of host (CPU) outputs (NOTE [ Host tensors ] in host.py).
        clone_outputs: the output policy fixed at capture (NOTE [ Policies fixed at capture ]).
        params: ParamSet of the Layers the call used (layers: those Layers).
        static_grad_outputs: where the backward replay reads the outputs' grads.
        grad_plan: GradPlan (NOTE [ Grad hand-out ] in grad_plan.py).
        live: keeps the capture-time autograd graph (saved activations) alive with the graphs.
        handed_out: StaleOutputs when check_stale_outputs is on.
        generation, inflight: the bridge's in-flight forward replay (NOTE in bridge.py).
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
    host_outputs: List[int] = dataclasses.field(default_factory=list)
    clone_outputs: bool = True
    params: Any = None
    layers: list = dataclasses.field(default_factory=list)
    static_grad_outputs: list = dataclasses.field(default_factory=list)
    grad_plan: Any = None
    live: Any = None
    handed_out: Any = None
    generation: int = 0
    inflight: Any = None

    def backward_pending(self):
        """True while the autograd graph of the last forward replay still waits for its backward
        (the graphs' saved activations must not be overwritten or freed)."""
        token = self.inflight() if self.inflight is not None else None
        return token is not None and not token.done

    def nbytes(self):
        """Bytes held by the static buffers (pool internals not included)."""
        total = self.static_inputs.nbytes() if self.static_inputs is not None else 0
        grads = self.grad_plan.static_grads if self.grad_plan is not None else ()
        for group in (self.static_outputs, self.static_grad_outputs, grads):
            total += sum(nbytes(t) for t in group if t is not None)
        return total

    def release(self):
        """Frees the graphs and drops every static buffer."""
        for graph in (self.bwd_graph, self.fwd_graph):
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = self.pool = self.live = None
        self.static_inputs = None
        self.static_outputs, self.static_grad_outputs = [], []
        self.grad_plan = None
        self.inflight = None
        self.handed_out = None
