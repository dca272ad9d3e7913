"""The grad plan of a key: what the bridge hands autograd for each of its tensor inputs after
a backward replay, built once at capture and read only here.

NOTE [ Grad hand-out ]
The bridge's inputs are the call's tensors, then the parameters of the Layers the call uses.
For each it returns a grad read from a static grad buffer of the backward graph, or None:

* inputs that need grad always get a copy: a leaf keeps the returned tensor as its ``.grad``,
  and a non-leaf's grad can reach a parameter outside the call unchanged (``x = P + t`` passes
  it through), where autograd adopts it as ``P.grad`` and the next replay would overwrite it;
* parameters, by ``clone_param_grads``: True, a copy; False, an alias of the static buffer;
  "auto" (the default), an alias unless a gradient hook of the parameter may keep the grad
  (NOTE [ Grad consumers ] in hook_registry.py), checked at every backward;
* an aliased grad that autograd adopted as ``p.grad`` must not be overwritten by the next backward
  replay while ``p.grad`` lives in it: that replay writes into a second set of static grad buffers
  (a second backward graph, captured the first time it is needed, NOTE [ Two grad buffer sets ]);
  only where ``p.grad`` lives in both sets is it moved out with a copy (``before_replay``);
* same-shape parameter grads come out of one stack (NOTE [ Grad groups ] in grads/stacks.py).
"""

from . import hook_registry
from .stacks import unstack
from .handles import copy, hand_out, rescue_grad

__all__ = ["GradPlan", "POLICIES", "choose"]

#: Values of clone_param_grads.
POLICIES = (True, False, "auto")


class GradPlan:
    """Per bridge input: which static grad it gets and whether it is copied.

    Args:
        static_grads: one static grad (or None) per leaf of the backward body: the inputs that
            need grad, then the parameters; grouped ones are views of their stack.
        input_needs_grad: per call tensor, whether it is such a leaf.
        params: the parameters whose grads follow the inputs'.
        policy: clone_param_grads, fixed at capture (NOTE [ Policies fixed at capture ]).
        groups: ``(stack, leaf indices)`` per stack of same-shape parameter grads.
    """

    def __init__(self, static_grads, input_needs_grad, params, policy, groups=()):
        self.static_grads = list(static_grads)
        self.params = list(params)
        self.policy = policy
        slots, leaf = [], 0
        for needs in input_needs_grad:
            slots.append(leaf if needs and self.static_grads[leaf] is not None else None)
            leaf += needs
        self._inputs = len(slots)
        first_param_leaf = leaf
        for _ in self.params:
            slots.append(leaf if self.static_grads[leaf] is not None else None)
            leaf += 1
        self.slots = slots
        # (stack, parameter indices) per stack.
        self.groups = [(stack, [i - first_param_leaf for i in idxs]) for stack, idxs in groups]
        grouped = {i for _, idxs in self.groups for i in idxs}
        self._single = [i for i in range(len(self.params)) if i not in grouped and self.slots[self._inputs + i] is not None]
        self._copies = None
        self._generation = None
        #: Copies of parameter grads made: handed out, and rescued (adopted grads moved out
        #: before a replay). Input grads are always copies and not counted.
        self.copies = 0
        self.rescues = 0

    def param_copies(self):
        """Per parameter, whether its handed-out grad is a copy (NOTE [ Grad hand-out ])."""
        if self.policy != "auto":
            return [bool(self.policy)] * len(self.params)
        if self._generation != hook_registry.generation():
            self._copies = [hook_registry.may_keep(p) for p in self.params]
            self._generation = hook_registry.generation()
        return self._copies

    def input_grad(self, i):
        """The static grad buffer of call tensor ``i`` (overwritten by the next backward replay), or
        None where it gets no grad."""
        slot = self.slots[i]
        return None if slot is None else self.static_grads[slot]

    def adopted(self):
        """Indices of the parameters whose ``p.grad`` lives in this plan's static buffers."""
        if self.policy is True or not self.params:
            return []
        found, slots, n = [], self.slots, self._inputs
        for i, (p, copied) in enumerate(zip(self.params, self.param_copies())):
            slot = slots[n + i]
            if not copied and slot is not None:
                g = p.grad
                if g is not None and g.data_ptr() == self.static_grads[slot].data_ptr():
                    found.append(i)
        return found

    def before_replay(self, adopted):
        """Moves the adopted ``p.grad`` of parameters ``adopted`` out of the static buffers (one
        copy each) before the replay writes them."""
        for i in adopted:
            rescue_grad(self.params[i], self.static_grads[self.slots[self._inputs + i]])
        self.rescues += len(adopted)

    def hand_out(self, inputs=True):
        """The grads to return from the bridge's backward, one per bridge input (``inputs``
        False: None for the call's tensors, whose grads the caller reads from input_grad())."""
        static, slots, n = self.static_grads, self.slots, self._inputs
        grads = [None if slot is None or not inputs else copy(static[slot]) for slot in slots[:n]]
        copied = 0
        param_grads = [None] * len(self.params)
        copies = self.param_copies()
        for i in self._single:
            param_grads[i] = hand_out(static[slots[n + i]], copies[i])
            copied += copies[i]
        # Stacks: one copy (or none) and one unbind per stack instead of one call per parameter.
        for stack, idxs in self.groups:
            wanted = [copies[i] for i in idxs]
            views = unstack(copy(stack) if all(wanted) else stack)
            for i, view, want in zip(idxs, views, wanted):
                if slots[n + i] is not None:
                    param_grads[i] = copy(view) if want and not all(wanted) else view
            copied += sum(wanted)
        self.copies += copied
        return tuple(grads + param_grads)


def choose(plans, last):
    """The buffer set the next backward replay writes: ``(index, adopted)``.

    NOTE [ Two grad buffer sets ]
    A grad autograd adopted as ``p.grad`` lives in a static buffer until ``p.grad`` is freed
    (``clear_grad(set_to_zero=False)``) or re-pointed. Paddle does not tell whether such a
    ``p.grad`` still holds live values (gradient accumulation) or was zeroed by
    ``clear_grad()`` ("fake empty": the next accumulation assigns), so the next replay must not
    write into it either way. With two buffer sets, the replay alternates: it writes the set
    after the one used last, unless a ``p.grad`` lives there, then the other one. ``adopted`` lists
    the parameters whose ``p.grad`` lives in the chosen set anyway (both sets taken, or only one
    set captured so far): they are moved out with a copy. Training loops that free grads never
    adopt, and keep one set.
    """
    order = [(last + 1) % len(plans), last % len(plans)] if len(plans) > 1 else [0]
    adopted = None
    for k in order:
        adopted = plans[k].adopted()
        if not adopted:
            return k, adopted
    return order[-1], adopted
