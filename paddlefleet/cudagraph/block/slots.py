"""Slots: several forwards of one key in flight, each in its own static buffers and graphs.

NOTE [ Slots ]
A forward replay leaves its saved activations in the static buffers of its graphs until its
backward replay reads them (NOTE [ One forward in flight ] in block/bridge.py). Pipeline
parallel runs the forwards of several micro-batches through a layer before their backwards
(GPipe, 1F1B, interleaved), so one set of graphs would serve one micro-batch in N. A key
therefore holds up to ``max_inflight`` *slots*: each slot is one BlockGraphs (its own static
buffers, pool, forward and backward graphs, grad plan), captured from a call of that key.

* A call takes the first slot whose backward is not pending. When every slot has a pending
  backward, a new slot is captured from this call (no warmup: the key is warm), until the key
  holds ``max_inflight`` slots; past that the call runs eagerly with the reason.
* Each backward replays the graphs of its own forward: the bridge's PyLayer context holds the
  slot it replayed, so backwards match their forwards in whatever order autograd runs them.
* Everything per capture is per slot: grad plans and their second buffer sets (NOTE [ Two grad
  buffer sets ] in grads/hand_out_plan.py), stale-output tracking, the RNG handling of NOTE
  [ RNG across capture ] in block/capture.py (a slot's capture consumes random numbers as the
  eager call it replaces, and each later replay draws as eager does at that point of the
  schedule, whichever slot serves it). With accumulate_in_graph, slots in flight together count
  as sharing the key's parameters (NOTE [ Shared parameters leave the graph ] in
  grads/accumulate.py): the key is captured again once, those grads going through autograd.
* Releasing the key (reset, re-capture, eviction, fallback) frees the slots whose backward is
  not pending; a pending slot stays alive with its autograd graph, so that backward still
  replays what its forward saved, and goes with it.

NOTE [ Outputs that need grad, and no backward ]
A call in grad mode whose outputs need grad (evaluation without ``paddle.no_grad()``) keeps its
forward waiting for a backward that never comes: while its outputs live (a loss summed over the
evaluation, outputs kept in a list) every slot stays pending, and new slots would be captured for
nothing (each with its own static buffers and pool). What tells such calls apart from pipeline
micro-batches, whose backward comes: forwards whose autograd graph was freed before their backward
ran. A slot's forwards run one at a time and a backward runs only for the latest, so the forwards
of a slot after the one whose backward ran last (``answered``, a generation) got none; all but a
pending one were freed without it. When every slot is pending and some slot has such a forward, no
slot is captured: the call runs eagerly, and the warning says that the outputs needed grad and no
backward came, and suggests ``paddle.no_grad()`` (a no_grad call gets a forward-only graph that
saves nothing and never waits). Each slot's next backward clears its count, so pipeline training
after such an evaluation captures the slots it needs from its second step on. Past the cap, the
warning leads with ``no_grad`` while no backward of the key ever ran.

The Slots object stands where the entry keeps a key's graphs: it answers the entry's questions
(nbytes, backward_pending, release, describe, grad_copies, layers) for all slots together; a slot's
own record is read through the slot (``entry.graphs.current.static_inputs``), never answered for
whichever slot served the latest call.
"""

from ..core.body import Action, Blocked
from .graphs import hand_out_text

__all__ = ["Slots"]

_NO_BACKWARD_REASON = "outputs needed grad but no backward came for earlier calls, and every slot waits for one"
_NO_BACKWARD = (
    "{freed} earlier call(s) returned outputs that needed grad, but no backward came for them (their outputs were "
    "freed without one), and all {slots} slot(s) of the key wait for a backward; this call runs eagerly rather than "
    "capture another slot for a backward that may never come. If these calls are evaluation or inference, run them "
    "under paddle.no_grad() (after model.eval()): such calls get a forward-only graph that saves no activations and "
    "never waits for a backward.")
_PAST_CAP = (
    "called again with the same key before the backward of the previous call ran, and all {cap} slot(s) of the key "
    "wait for their backward (max_inflight={cap}); this call runs eagerly so that no saved activations are "
    "overwritten. ")
_EVALUATION = (
    "No backward has come for any call of this key yet: if these calls are evaluation or inference, run them under "
    "paddle.no_grad() (after model.eval()), which saves no activations and needs no slots; if they are pipeline "
    "micro-batches, raise max_inflight to the number of forwards your schedule has in flight.")
_PIPELINE = (
    "Raise max_inflight to the number of forwards your schedule has in flight (pipeline micro-batches), or run "
    "backward between calls.")


class Slots:
    """The slots of one key.

    Args:
        first: the BlockGraphs of the key's first capture.
        cap: the most slots this key may hold (``max_inflight``).
    """

    def __init__(self, first, cap):
        self.all = [first]
        self.current = first
        self.cap = cap
        self.refused = None  # why no further slot is made (a failed slot capture, max_bytes)

    def __getattr__(self, name):
        # Only for names Slots does not define: a slot's own record is read through the slot, never
        # answered silently for whichever slot served the latest call.
        raise AttributeError(
            f"'Slots' object has no attribute {name!r}: a key's graphs are its slots; read "
            f"graphs.current.{name} (the slot serving the latest call) or each of graphs.all")

    # ------------------------------------------------------------------ which slot a call gets
    def select(self):
        """Makes the first slot without a pending backward current; False when there is none."""
        for graphs in self.all:
            if not graphs.backward_pending():
                self.current = graphs
                return True
        return False

    def unanswered(self):
        """``(answered, freed)``: whether a backward of any slot ran, and the forwards freed without their
        backward since each slot's latest backward (NOTE [ Outputs that need grad, and no backward ])."""
        answered = any(graphs.answered for graphs in self.all)
        freed = sum(graphs.generation - graphs.answered - graphs.backward_pending() for graphs in self.all)
        return answered, freed

    def blocked(self):
        """Why a call finds no free slot: a new slot to capture, or eager past the cap or when earlier
        forwards got no backward (NOTE [ Outputs that need grad, and no backward ])."""
        cap = self.cap
        if self.refused is not None:
            return Blocked(Action.EAGER, f"every slot has a pending backward and no further slot is made: {self.refused}")
        answered, freed = self.unanswered()
        if freed:
            return Blocked(Action.EAGER, _NO_BACKWARD_REASON, _NO_BACKWARD.format(freed=freed, slots=len(self.all)))
        if len(self.all) < cap:
            return Blocked(Action.NEW_SLOT, f"every slot has a pending backward ({len(self.all)} of max_inflight={cap})")
        return Blocked(Action.EAGER, f"all {cap} slots have a pending backward (max_inflight={cap})",
                       _PAST_CAP.format(cap=cap) + (_EVALUATION if not answered else _PIPELINE))

    def add(self, graphs):
        """A new slot, current from now on."""
        self.all.append(graphs)
        self.current = graphs

    def refuse(self, reason):
        """No further slot: calls that find every slot pending run eagerly with ``reason``."""
        self.refused = reason

    # ------------------------------------------------------------------ what the entry asks
    @property
    def layers(self):
        return self.current.layers

    def slot_bytes(self):
        """Bytes of static buffers per slot (pool internals, e.g. saved activations, not included)."""
        return [graphs.nbytes() for graphs in self.all]

    def nbytes(self):
        return sum(self.slot_bytes())

    def footprint(self):  # NOTE [ What a key holds ] in core/memory.py: every slot
        return sum((graphs.footprint() for graphs in self.all[1:]), self.all[0].footprint()) if self.all else None

    def backward_pending(self):
        return any(graphs.backward_pending() for graphs in self.all)

    def grad_copies(self):
        return sum(graphs.grad_copies() for graphs in self.all)

    def plans(self):
        return [plan for graphs in self.all for plan in graphs.plans()]

    def describe(self):
        text = self.current.describe()
        first = self.all[0].backward
        if len(self.all) > 1 and first is not None and first.grad_plan is not None and first.accumulators is None:
            copies = sum(p.copies for p in self.plans())
            rescues = sum(p.rescues for p in self.plans())
            text = hand_out_text(first.grad_plan.policy, copies, rescues, len(self.plans()), len(self.all))
        linked = sum(graphs.links.replays for graphs in self.all if graphs.links is not None)
        if linked:  # NOTE [ Link graphs ] in chains/link_graphs.py
            text += f"; {linked} output grad(s) from the next chained call copied in by a link graph"
        return text

    def pool_words(self):
        """explain()'s words on the pool the key's forward shares with other keys' (NOTE [ Keys sharing a
        forward pool ] in backends/shared_pool.py), or ""."""
        shared = self.all[0].shared_pool
        if shared is None:
            return ""
        others = len(shared.graphs) - 1
        return (f"its forward graph shares one memory pool with {others} other key{'' if others == 1 else 's'}' "
                "forward graphs, checked before every replay")

    def release(self):
        """Frees every slot whose backward is not pending (NOTE [ Slots ])."""
        for graphs in self.all:
            if not graphs.backward_pending():
                graphs.release()
        self.all = []
        self.current = None
