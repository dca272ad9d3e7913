"""What a replay of a captured step checks before it runs, decided once per key at capture.

NOTE [ Step replay checks ]
A step's graph reads and writes fixed addresses and freezes what its Python read, so before every
replay StepBody.blocker asks: did the grad-slot mode change, was a global or closure variable of
the step function rebound, was a parameter the optimizers update replaced or moved, did the
call pass another tensor where the graph reads an adopted one in place (NOTE [ Adopted inputs of
a step ] in step/capture.py), did the grads change between calls (closed mode: a backward or clear
outside the step), was the grad storage the graph adds into released (persistent mode), was a
parameter the step reaches (its Layers' and its optimizers') or a tensor requiring grad that the
capture read from outside them (a closure's, a global's: the capture's op trace names them) frozen or
unfrozen (``stop_gradient``: the graph would keep computing and applying the capture's grads), or did a plain attribute of a
Layer the step called change (NOTE [ Layer attributes a replay freezes ] in guards/layer_attrs.py)? These
answers cost host time on every call, and a replayed step should cost little more than the graph
launch. So what to look at is fixed when the key is captured (``ReplayChecks``): flat tuples of
the tensors and the addresses they must still have, and a bindings check
(``BindingWatch.unchanged_since``), only those the key has. A call where nothing changed walks each
tuple once at C level (``map`` over the tensors, compared as lists of ints or by identity; the addresses and
the ``stop_gradient`` flags in one compiled call each where the compiled reads are in use, ``ptrs_hold`` and
``flags_hold``: NOTE [ Compiled tensor reads ] in native/__init__.py) and builds no dict; when a walk finds any difference, the per-item walk runs and names the first one
exactly as before. Each fast walk compares the same values the per-item walk compares (the same
addresses, the same objects by identity), so it is False exactly when that walk would find
something (tests/step/test_replay_checks.py changes each thing once and expects the same Blocked
as before).
"""

import operator

import paddle

from .. import native
from ..core.body import Action, Blocked
from ..guards.layer_attrs import AttrWatch, attr_message, layers_with_sublayers
from .grad_slots import CLOSED, grad_ptr
from ..guards.host_reads import BindingWatch, short_repr

__all__ = ["ReplayChecks", "binding_message"]

_is_contiguous = paddle.Tensor.is_contiguous
_stop_gradient = operator.attrgetter("stop_gradient")


class ReplayChecks:
    """The replay preconditions of one captured step key (NOTE [ Step replay checks ]).

    Args:
        graphs: the key's StepGraphs, complete (``bindings``, ``params``, ``watched``, ``grad_mode``,
            ``static_inputs``).
        watch: the step function's BindingWatch.
    """

    def __init__(self, graphs, watch):
        self._graphs = graphs
        self._watch = watch
        self._mode = graphs.grad_mode
        self._bindings_unchanged = watch.unchanged_since(graphs.bindings)
        self._params = tuple(p for p, _ in graphs.params)
        self._param_ptrs = [ptr for _, ptr in graphs.params]
        static = graphs.static_inputs
        self._adopted = tuple(static.adopted)
        self._every_input_adopted = len(self._adopted) == len(static.buffers)
        self._adopted_ptrs = [static.buffers[i].data_ptr() for i in self._adopted]
        self._watched = tuple(p for p, _ in graphs.watched)
        self._watched_ptrs = [ptr for _, ptr in graphs.watched]
        # Every parameter the step reaches: its Layers' and its optimizers' (NOTE [ Step replay checks ]).
        layers = layers_with_sublayers(getattr(graphs, "layers", None) or [])
        reached = {id(p): p for _, layer in layers for p in layer.parameters(include_sublayers=False)}
        reached.update((id(p), p) for p in self._params)
        reached.update((id(t), t) for t in getattr(graphs, "read_leaves", ()))  # a closure's tensor too
        self._reached = tuple(reached.values())
        self._frozen = list(map(_stop_gradient, self._reached))
        self._attrs = AttrWatch(layers) if layers else None
        # Only what this key has: a step without optimizers has no parameter or grad to look at.
        checks = [self._bindings] if self._bindings_unchanged is not None else []
        checks += [self._moved] if self._params else []
        checks += [self._adopted_moved] if self._adopted else []
        checks += [self._freezes] if self._reached else []
        checks += [self._attributes] if self._attrs is not None else []
        if graphs.grad_mode == CLOSED:
            checks.append(_grads_between)
        elif self._watched:
            checks.append(self._released)
        self._checks = tuple(checks)

    def blocked(self, mode, between, tensors):
        """None when nothing a replay depends on changed, else the Blocked of the first change.

        Args:
            mode: the wrapper's grad-slot mode now; between: ``[(param, grad address)]`` after the
                last call (closed mode); tensors: the call's tensors.
        """
        if mode != self._mode:
            return Blocked(Action.RECAPTURE, "the step started leaving grads between calls (gradient accumulation)")
        for check in self._checks:
            blocked = check(between, tensors)
            if blocked is not None:
                return blocked
        return None

    def _adopted_moved(self, _, tensors):
        # NOTE [ Adopted inputs of a step ] in step/capture.py; StaticInputs.moved's test, all at once
        picked = tensors if self._every_input_adopted else [tensors[i] for i in self._adopted]
        if native.ptrs_hold(picked, self._adopted_ptrs) and all(map(_is_contiguous, picked)):
            return None
        name = self._graphs.static_inputs.moved(tensors)
        if name is None:
            return None
        return Blocked(Action.RECAPTURE, f"input '{name}' is another tensor than the one the graph reads in place")

    def _freezes(self, *_):
        if native.flags_hold(self._reached, self._frozen):
            return None
        for p, was in zip(self._reached, self._frozen):
            if p.stop_gradient != was:
                change = "frozen (stop_gradient False -> True)" if was is False else \
                    "unfrozen (stop_gradient True -> False)"
                what = "parameter" if hasattr(p, "trainable") else "tensor"  # a closure's tensor is no Parameter
                return Blocked(Action.REWARM, f"{what} {p.name} was {change} since capture", (
                    f"{what} {p.name} was {change} since the step was captured. The graph "
                    "computes and applies the grads the capture computed, so the key warms up and is captured "
                    "again."))
        return None

    def _attributes(self, *_):
        changed = self._attrs.changed()
        if changed is None:
            return None
        reason, warning = attr_message(changed, "the step")
        return Blocked(Action.REWARM, reason, warning.replace("is captured again", "warms up and is captured again"),
                       changed)

    def _bindings(self, *_):
        if self._bindings_unchanged():
            return None
        changed = BindingWatch.changed(self._graphs.bindings, self._watch.snapshot())
        if changed is None:
            return None
        reason = binding_message(changed, "the capture and this call")
        return Blocked(Action.EAGER, f"binding '{changed[0]}' changed since capture", reason)

    def _moved(self, *_):
        if native.ptrs_hold(self._params, self._param_ptrs):
            return None
        for p, ptr in self._graphs.params:
            if p.data_ptr() != ptr:
                return Blocked(Action.RECAPTURE, f"parameter {p.name} was replaced or moved")
        return None

    def _released(self, *_):
        if list(map(grad_ptr, self._watched)) == self._watched_ptrs:
            return None
        for p, ptr in self._graphs.watched:
            if grad_ptr(p) != ptr:
                return Blocked(Action.RECAPTURE_ONCE, f"the grad storage of {p.name} was released or replaced", (
                    f"the grad of {p.name} was released or replaced between calls (clear_grad(set_to_zero="
                    "False) or a backward outside the step), so the graph's grad buffers no longer are the "
                    "parameters' grads; the key is captured again (a second time it runs eagerly). Clear grads "
                    "inside the step function."))
        return None


def _grads_between(between, _=None):
    for p, ptr in between:
        if grad_ptr(p) != ptr:
            return Blocked(Action.EAGER, "grads changed between calls", (
                f"the grad of {p.name} changed between two calls of the step (a backward or a clear outside "
                "it). The graph assumes each step starts from cleared grads, so this call runs eagerly. Run "
                "backward and clear_grad inside the step function."))
    return None


def binding_message(changed, between):
    """The message for ``changed`` (``(name, old, new)`` from BindingWatch.changed) rebound ``between``."""
    name, old, new = changed
    return (
        f"autocudagraph_step: the step function reads '{name}', which was rebound between {between} "
        f"({short_repr(old)} -> {short_repr(new)}). A graph replays what the capture saw, so the new value would "
        "be ignored. Pass it as an argument (a Python value becomes part of the key; a tensor is copied in), or "
        "keep it in a tensor updated in place."
    )
