"""The grad plan of a key: what the bridge hands autograd for each of its tensor inputs after
a backward replay, built once at capture and read only here.

NOTE [ Grad hand-out ]
The bridge's inputs are the call's tensors, then the parameters of the Layers the call uses.
For each it returns a grad read from a static grad buffer of the backward graph, or None:

* inputs that need grad always get a copy: a leaf keeps the returned tensor as its ``.grad``,
  and a non-leaf's grad can reach a parameter outside the call unchanged (``x = P + t`` passes
  it through), where autograd adopts it as ``P.grad`` and the next replay would overwrite it;
* parameters get a copy with clone_param_grads=True, else an alias of the static buffer
  (NOTE [ Paddle .grad handles ] in grads.py says what autograd then does with it);
* same-shape parameter grads come out of one stack (NOTE [ Grad groups ] in grad_groups.py).
"""

from .grad_groups import unstack
from .grads import copy, hand_out, rescue_grad

__all__ = ["GradPlan"]


class GradPlan:
    """Per bridge input: which static grad it gets and whether it is copied.

    Args:
        static_grads: one static grad (or None) per leaf of the backward body: the inputs that
            need grad, then the parameters; grouped ones are views of their stack.
        input_needs_grad: per call tensor, whether it is such a leaf.
        params: the parameters whose grads follow the inputs'.
        clone_param_grads: the policy fixed at capture (NOTE [ Policies fixed at capture ]).
        groups: ``(stack, leaf indices)`` per stack of same-shape parameter grads.
    """

    def __init__(self, static_grads, input_needs_grad, params, clone_param_grads, groups=()):
        self.static_grads = list(static_grads)
        self.params = list(params)
        self.clone_param_grads = clone_param_grads
        slots, clones, leaf = [], [], 0
        for needs in input_needs_grad:
            slots.append(leaf if needs and self.static_grads[leaf] is not None else None)
            clones.append(needs)
            leaf += needs
        self._first_param = len(slots)
        first_param_leaf = leaf
        for _ in self.params:
            slots.append(leaf if self.static_grads[leaf] is not None else None)
            clones.append(clone_param_grads)
            leaf += 1
        self.slots = slots
        self.clones = clones
        # (stack, bridge positions) per stack; positions follow the call's tensors.
        self.groups = [(stack, [self._first_param + i - first_param_leaf for i in idxs]) for stack, idxs in groups]
        self.grouped = frozenset(pos for _, positions in self.groups for pos in positions)

    def before_replay(self):
        """Moves a parameter's ``.grad`` out of a static buffer before the replay writes it.

        With clone_param_grads=False, autograd adopts the handed-out buffer itself as p.grad when
        p.grad is None or was zeroed by ``clear_grad()`` (set_to_zero=True marks it "fake empty":
        the next accumulation assigns instead of adding, and Python cannot see that flag). The
        next replay would then overwrite p.grad, corrupting gradient accumulation (measured,
        Paddle 3.3.1).
        """
        if self.clone_param_grads or not self.params:
            return
        for p, slot in zip(self.params, self.slots[self._first_param:]):
            if slot is not None:
                rescue_grad(p, self.static_grads[slot])

    def hand_out(self):
        """The grads to return from the bridge's backward, one per bridge input."""
        static = self.static_grads
        if not self.groups:
            return tuple(None if slot is None else hand_out(static[slot], clone)
                         for slot, clone in zip(self.slots, self.clones))
        # Stacks: one copy (or none) and one unbind per stack instead of one call per parameter.
        grads = [None] * len(self.slots)
        for pos, (slot, clone) in enumerate(zip(self.slots, self.clones)):
            if slot is not None and pos not in self.grouped:
                grads[pos] = hand_out(static[slot], clone)
        for stack, positions in self.groups:
            source = copy(stack) if self.clone_param_grads else stack
            for pos, view in zip(positions, unstack(source)):
                if self.slots[pos] is not None:
                    grads[pos] = view
        return tuple(grads)
