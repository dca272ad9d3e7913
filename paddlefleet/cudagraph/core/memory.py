"""Every byte a key holds on the device, by component (``Footprint``), and the sum max_bytes counts.

NOTE [ What a key holds ]
A key's graphs hold, beyond what eager holds (parameters, their grads as Paddle keeps them, the
user's tensors):

* ``inputs``: the static input buffers it allocated (an adopted input is the caller's tensor,
  NOTE [ Adopted inputs ] in io/static_inputs.py: 0 bytes);
* ``outputs``: the static outputs (an output that is an input buffer is counted once, as input);
* ``grad_outputs``: the buffers a block's backward reads its outputs' grads from;
* ``grads``: the static grad buffers of every grad buffer set (NOTE [ Two grad buffer sets ] in
  grads/hand_out_plan.py: the second set too, captured by a later replay, by a chain's as well);
* ``pool``: what each graph's capture made the process reserve (NOTE [ Graph pool bytes ] in
  core/entry.py), measured by the backend for each graph, so a graph captured at any moment (a
  second grad set at a replay, a new slot) is counted by the graph that holds it, and released
  with it. On a GPU the pool holds what the capture allocated: the static outputs and grad
  buffers, the saved activations the backward reads, the kernels' temporaries (freed at the end of
  the capture but kept by a private pool), grads grouped into a stack a second time as computed
  where they are stacked after paddle.grad (NOTE [ Stacking grads as they arrive ] in
  grads/stacks.py) and its fragmentation;
* ``cache_released``: the allocator's cached blocks given back right before its captures (NOTE
  [ Allocator cache before a capture ] in backends/pool_memory.py): what the warmup left cached.
  Held by nobody afterwards.

``held`` is what max_bytes counts, each byte once: where pools are measured, the outputs and grad
buffers live inside them, so ``held = inputs + grad_outputs + pool``; where they are not (the
simulated backend, unless it models pools), ``held`` is the static buffers alone. Grads a key
accumulates in its graph (accumulate_in_graph) are the parameters' own ``grad``/``main_grad``,
held as eagerly: not counted. A whole step's grads live in its pool.
"""

import dataclasses
from typing import Optional

from ..backends.pool_memory import distinct_bytes

__all__ = ["Footprint", "footprint", "COMPONENTS", "grown", "growth"]

#: The components of a Footprint, in the order explain() names them.
COMPONENTS = ("inputs", "outputs", "grad_outputs", "grads", "pool", "cache_released")

#: Graphs captured into a key's record after its capture (a second grad buffer set), process-wide:
#: a wrapper that sees it move checks max_bytes again (core/lifecycle.py). One int in a list.
_GROWN = [0]


def grown():
    """Called after a graph joined a key's record outside the key's capture (a second grad set)."""
    _GROWN[0] += 1


def growth():
    """The count grown() moved; a wrapper compares it with what it last saw."""
    return _GROWN[0]


@dataclasses.dataclass
class Footprint:
    """Bytes one key (or several, added) holds, by component (NOTE [ What a key holds ]).
    ``pool`` is None where no graph's pool is measured."""

    inputs: int = 0
    outputs: int = 0
    grad_outputs: int = 0
    grads: int = 0
    pool: Optional[int] = None
    cache_released: int = 0

    def __add__(self, other):
        pool = None if self.pool is None and other.pool is None else (self.pool or 0) + (other.pool or 0)
        return Footprint(self.inputs + other.inputs, self.outputs + other.outputs,
                         self.grad_outputs + other.grad_outputs, self.grads + other.grads, pool,
                         self.cache_released + other.cache_released)

    @property
    def static(self):
        """Bytes of the static buffers (stats()["static_bytes"])."""
        return self.inputs + self.outputs + self.grad_outputs + self.grads

    @property
    def held(self):
        """What max_bytes counts: every byte once (outputs and grads live in a measured pool)."""
        if self.pool is None:
            return self.static
        return self.inputs + self.grad_outputs + self.pool

    def as_dict(self):
        out = {name: getattr(self, name) for name in COMPONENTS}
        out["held"] = self.held
        return out

    def describe(self):
        """explain()'s words, e.g. ``holds 5 MiB: inputs 4096, outputs 4096, grad outputs 4096, grads
        8192, pools 5 MiB (the outputs and grads inside); cache released before capture 2 MiB``."""
        parts = [f"inputs {_size(self.inputs)}", f"outputs {_size(self.outputs)}",
                 f"grad outputs {_size(self.grad_outputs)}", f"grads {_size(self.grads)}"]
        if self.pool is not None:  # a backend without device memory (simulate) measures none: nothing said
            parts.append(f"pools {_size(self.pool)} (the outputs and grads inside)")
        text = f"holds {_size(self.held)}: " + ", ".join(parts)
        if self.cache_released:
            text += f"; allocator cache released before capture {_size(self.cache_released)}"
        return text


def _size(n):
    """``4096`` below 1 MiB, else ``12.5 MiB``."""
    return str(n) if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def footprint(static_inputs=None, outputs=(), grad_outputs=(), grads=(), graphs=()):
    """The Footprint of one capture's record: its StaticInputs, static outputs, grad-output buffers,
    static grads (every set) and graphs (their measured pools and released cache)."""
    inputs = static_inputs.nbytes() if static_inputs is not None else 0
    seen = {b.data_ptr() for b in static_inputs.buffers if b._is_initialized()} if static_inputs is not None else set()
    pools = [g.pool_bytes for g in graphs if g is not None and g.pool_bytes is not None]
    return Footprint(
        inputs=inputs,
        outputs=distinct_bytes(outputs, seen),
        grad_outputs=distinct_bytes(grad_outputs, seen),
        grads=distinct_bytes(grads, seen),
        pool=sum(pools) if pools else None,
        cache_released=sum(g.cache_released for g in graphs if g is not None),
    )
