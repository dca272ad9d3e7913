"""The grad buffer sets of a key's backward (NOTE [ Two grad buffer sets ] in
grads/hand_out_plan.py): the first set, captured with the forward, and the second, captured the
first time a backward finds the only set adopted. ``GradSets`` is the one owner of the second
set: a backward asks it which set to write (``next``), which may mark the second wanted; the next
forward replay, outside any backward pass, captures it (block/capture.py) and gives it here."""

from .hand_out_plan import choose

__all__ = ["GradSets"]


class GradSets:
    """The buffer sets of one backward: ``[(graph, GradPlan)]``, the first set first.

    Args:
        graph, plan: the first set (the backward graph captured with the forward, its GradPlan).
        recipe: what capturing a second set needs (a BackwardBody), or None: never.
    """

    def __init__(self, graph, plan, recipe=None):
        self.sets = [(graph, plan)]
        self._plans = [plan]  # the plans of self.sets, for choose() at every backward
        self._recipe = recipe
        self._wanted = False
        self._last = 0

    @property
    def wanted(self):
        """True when a backward found its only set adopted and a second one can be captured."""
        return self._wanted

    def next(self):
        """``(graph, plan, adopted)`` for the next backward replay: ``adopted`` lists parameters
        to move out of the chosen buffers first."""
        k, adopted = choose(self._plans, self._last)
        if adopted and len(self.sets) == 1 and self._recipe is not None:
            self._wanted = True
        self._last = k
        graph, plan = self.sets[k]
        return graph, plan, adopted

    def take_recipe(self):
        """The recipe of the second set, once: a failed capture of it leaves one set for good."""
        recipe, self._recipe, self._wanted = self._recipe, None, False
        return recipe

    def add_second(self, graph, plan):
        self.sets.append((graph, plan))
        self._plans.append(plan)

    def plans(self):
        return list(self._plans)

    def release(self):
        """Frees the second set's graph (the first belongs to the backward record)."""
        for graph, _ in self.sets[1:]:
            graph.reset()
        self.sets = self.sets[:1]
        self._plans = self._plans[:1]
        self._recipe = None
