"""Parameter grads grouped by shape: one copy per group instead of one per parameter.

NOTE [ Grad groups ]
Handing a parameter grad back costs one device copy (clone_param_grads=True) or one view, and
each is a separate host call (~12 us per copy measured on an H100 host with Paddle 2.6.2; a
16-layer MLP spent more host time cloning grads than replaying its graphs). Parameters whose
grads share shape, dtype and place are therefore *stacked*: the backward graph itself copies
each grad into a slice of one static stack (device copies recorded in the graph, no host cost
at replay), and the bridge hands out one copy of the stack, split into per-parameter views by a
single ``unbind`` (a strided view kernel, no copy). Used only where ``unbind`` really returns
views on the grads' place (checked once per place and dtype outside any capture), and only for
grads of at most GROUP_MAX_BYTES: the stack costs one more device copy per grad, which for
large grads outweighs the host time saved (measured on an H100: 8 grads of 64 MiB made a
compute-bound step 2.2x the raw replay instead of 1.7x).

NOTE [ Stacking grads as they arrive ]
Copied into its stack after ``paddle.grad`` returned, every stacked grad lives twice at the end
of the backward capture: as computed and stacked, and a graph's pool keeps its peak (on the
24-layer, 1024-wide benchmark model, the q, k, v and o projections' grads of every layer).
paddle.grad runs no hook of a leaf (its accumulation node is copied without them, measured on
2.6.2 and 3.3.1), so the grads are caught one node earlier: where Paddle has node post hooks
(``GradNodeBase._register_post_hook``, 3.x), ``Stacking`` hooks the one node whose output is a
stacked parameter's grad, copies that output into the parameter's slice of a stack allocated
before the backward and passes the slice on, so the grad as computed dies at once and later
grads reuse its memory: the pool holds the stack and about one grad. Only where every grouped
parameter takes its grad from exactly one edge of such a node, of a kind whose grad slots each
hold one tensor (a node with a list slot fails in Paddle once any post hook is registered on
it), and only where the hook sees as many outputs as the node has edges (an embedding's index
slot has none); a grad the hook did not place (a reentrant recompute added to it) is copied
afterwards, as before. Elsewhere, and on Paddle without node post hooks (2.6), grads are copied
after paddle.grad, those the hand-out copies only
(NOTE [ Stacks after paddle.grad only for copied grads ]). The hand-out (one ``unbind`` per stack,
its views reused while untouched: NOTE [ Reused aliases ] in grads/hand_out_plan.py) is the same
either way.

NOTE [ Stacks after paddle.grad only for copied grads ]
A stack made after paddle.grad holds every stacked grad twice in the backward graph's pool (as computed, and
stacked) and costs one more device copy per grad inside the graph; what it saves is host work of the
hand-out. For grads handed out as copies (``clone_param_grads=True``, or "auto" with a hook that may keep
its grad) that is one device copy of the stack instead of one per grad (a copy costs several us of host
time); for aliases it is one ``unbind`` per stack instead of one view per grad, and the views of a
backward are reused by the next one in a loop that zeroes or accumulates its grads. Measured on an H200
with Paddle 2.6.2 (tools/probes/stacks_probe.py, docs/reports/stacks_probe.md): aliases handed out one by
one run as fast as stacked ones or faster in both timing modes, in loops that free and that accumulate
grads (no stack copies in the graph), and the graphs' pools hold the grads once. So after paddle.grad
only the grads the hand-out copies (decided at capture from the policy and the hooks then) are stacked;
stacks made as grads arrive cost neither and take every same-shape grad. Where hooks change after the
capture, the hand-out stays correct either way (a copy per grad, or a stack handed out as views).
"""

import paddle

from paddle import _C_ops

from ..core.grad_nodes import grad_node
from ..io.static_inputs import nbytes

__all__ = ["GROUP_MAX_BYTES", "Stacking", "probe", "plan_groups", "stack_grads", "stacked_after_backward",
           "stacks_as_grads_arrive", "unstack"]

#: Largest grad (bytes) that is stacked; ~3 us of device copy on an H100 against ~12 us of host
#: time for a separate copy call.
GROUP_MAX_BYTES = 4 << 20

_UNBIND = getattr(_C_ops, "unbind", None)
_EMPTY = getattr(_C_ops, "empty", None)


_VIEWS = {}


def _unbind_views(place_str, dtype, place):
    """True when unbind returns views (not copies) for this place and dtype; cached by the place's
    string (Paddle 2.6's Place objects compare by identity, so they cannot be the cache key)."""
    key = (place_str, dtype)
    if key not in _VIEWS:
        _VIEWS[key] = _probe_unbind(dtype, place)
    return _VIEWS[key]


def _probe_unbind(dtype, place):
    if _UNBIND is None or _EMPTY is None:
        return False
    try:
        probe = _EMPTY([2, 3], dtype, place)
        parts = _UNBIND(probe, 0)
        return parts[0].data_ptr() == probe.data_ptr() and parts[1].data_ptr() == probe.data_ptr() + 3 * probe.element_size()
    except Exception:  # no stride kernel for this place: no grouping
        return False


def probe(tensors):
    """Runs the unbind check for the places and dtypes of ``tensors`` (call it outside captures)."""
    for t in tensors:
        _unbind_views(str(t.place), t.dtype, t.place)


def stacked_after_backward(copied):
    """Indices of the parameters whose grads may be stacked after paddle.grad: those handed out as copies
    (``copied``, per parameter; NOTE [ Stacks after paddle.grad only for copied grads ])."""
    return [i for i, c in enumerate(copied) if c]


def plan_groups(grads, candidates):
    """Index lists (two or more each) of the ``candidates`` whose grads share shape, dtype and
    place and can be stacked; grads that are None stay out."""
    by_kind = {}
    for i in candidates:
        g = grads[i]
        if g is None or nbytes(g) > GROUP_MAX_BYTES:
            continue
        by_kind.setdefault((tuple(g.shape), g.dtype, str(g.place)), []).append(i)
    groups = []
    for (shape, dtype, place_str), idxs in by_kind.items():
        if len(idxs) >= 2 and _unbind_views(place_str, dtype, grads[idxs[0]].place):
            groups.append(idxs)
    return groups


def stack_grads(grads, groups):
    """One stack per group holding its grads (device copies; inside a capture they are recorded)."""
    stacks = []
    for idxs in groups:
        first = grads[idxs[0]]
        stack = _EMPTY([len(idxs)] + list(first.shape), first.dtype, first.place)
        for part, i in zip(_UNBIND(stack, 0), idxs):
            part.copy_(grads[i], False)
        stack.stop_gradient = True
        stacks.append(stack)
    return stacks


def unstack(stack):
    """Per-parameter views of a stack (one host call)."""
    return _UNBIND(stack, 0)


#: Grad nodes whose grad slots each hold one tensor (checked on 3.3.1): a post hook on them works.
_ONE_TENSOR_SLOTS = frozenset({"MatmulGradNode", "AddGradNode", "MultiplyGradNode", "EmbeddingGradNode",
                               "LayerNormGradNode", "Conv2dGradNodeFinal"})


def _edges(outputs, leaves, candidates):
    """``{leaf index: [(grad node, output index)]}``: the edges of the autograd graph of ``outputs``
    into the accumulation nodes of ``leaves[i]`` for ``i`` in ``candidates``."""
    wanted = {}
    for i in candidates:
        node = grad_node(leaves[i])
        if node is not None:
            wanted[node.node_ptr()] = i
    edges, seen = {}, set()
    todo = [node for node in map(grad_node, outputs) if node is not None]
    while todo:
        node = todo.pop()
        if node.node_ptr() in seen:
            continue
        seen.add(node.node_ptr())
        for k, nxt in enumerate(node.next_functions):
            if nxt is None:
                continue
            i = wanted.get(nxt.node_ptr())
            if i is None:
                todo.append(nxt)
            else:
                edges.setdefault(i, []).append((node, k))
    return edges


def stacks_as_grads_arrive():
    """Whether this Paddle has node post hooks (NOTE [ Stacking grads as they arrive ])."""
    base = getattr(getattr(paddle, "base", None), "libpaddle", None)
    return hasattr(getattr(base, "GradNodeBase", None), "_register_post_hook")


class Stacking:
    """Same-shape parameter grads stacked as the backward makes them (NOTE [ Stacking grads as they
    arrive ]): ``groups`` (leaf indices per stack), planned once by ``plan``. A backward body calls
    ``begin`` before paddle.grad (the stacks, allocated there, and the hooks on the nodes of this
    run's autograd graph), ``end`` after it (the hooks removed) and ``finish`` with the grads."""

    def __init__(self, groups):
        self.groups = groups
        self._slots = {}  # leaf index -> its slice of a stack, while a body runs
        self._removers = []

    @classmethod
    def plan(cls, outputs, leaves, candidates):
        """The Stacking of a backward body, or None where its grads are stacked after paddle.grad."""
        groups = plan_groups(leaves, candidates)
        grouped = [i for idxs in groups for i in idxs]
        if not grouped or not stacks_as_grads_arrive():
            return None
        return cls(groups) if _hookable(_edges(outputs, leaves, grouped), grouped) else None

    def begin(self, outputs, leaves):
        """Allocates the stacks (inside a capture: in its pool) and hooks the nodes that make the
        grouped grads in the autograd graph of ``outputs``; returns the stacks."""
        stacks = []
        for idxs in self.groups:
            first = leaves[idxs[0]]
            stack = _EMPTY([len(idxs)] + list(first.shape), first.dtype, first.place)
            stack.stop_gradient = True
            self._slots.update(zip(idxs, _UNBIND(stack, 0)))
            stacks.append(stack)
        grouped = list(self._slots)
        edges = _edges(outputs, leaves, grouped)
        if _hookable(edges, grouped):  # else finish() copies them all
            by_node = {}
            for i in grouped:
                [(node, k)] = edges[i]
                by_node.setdefault(node.node_ptr(), (node, []))[1].append((k, i))
            for node, pairs in by_node.values():
                self._removers.append(node._register_post_hook(self._hook(pairs, len(node.next_functions))))
        return stacks

    def _hook(self, pairs, width):
        slots = self._slots

        def post(outs, ins):
            if len(outs) != width:  # a slot without edges: the output indices are not the edges'
                return outs
            outs = list(outs)
            for k, i in pairs:
                slot, g = slots.get(i), outs[k]
                if slot is not None and isinstance(g, paddle.Tensor) and g._is_initialized() and (
                        g.shape == slot.shape and g.dtype == slot.dtype):
                    slot.copy_(g, False)
                    outs[k] = slot
            return outs

        return post

    def end(self):
        for remover in self._removers:
            remover.remove()
        self._removers = []
        self._slots.clear()

    def finish(self, grads, stacks):
        """The stacks holding ``grads``: each grad the hooks did not place is copied into its slice (None
        stays None); a group with a grad of another shape or dtype than its parameter (master grads) gets
        a stack made from its grads, as stack_grads makes it."""
        done = []
        for idxs, stack in zip(self.groups, stacks):
            present = [grads[i] for i in idxs if grads[i] is not None]
            if any(g.shape != list(stack.shape[1:]) or g.dtype != stack.dtype for g in present):
                first = present[0]
                [stack] = stack_grads([g if g is not None else _EMPTY(first.shape, first.dtype, first.place)
                                       for g in (grads[i] for i in idxs)], [list(range(len(idxs)))])
            else:
                for part, i in zip(_UNBIND(stack, 0), idxs):
                    g = grads[i]
                    if g is not None and g.data_ptr() != part.data_ptr():
                        part.copy_(g, False)
            done.append(stack)
        return done


def _hookable(edges, grouped):
    """Whether each grouped leaf takes its grad from exactly one edge, of a node a post hook works on."""
    return all(len(edges.get(i, ())) == 1 and edges[i][0][0].name() in _ONE_TENSOR_SLOTS for i in grouped)
