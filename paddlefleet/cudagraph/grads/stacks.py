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
"""

from paddle import _C_ops

from ..io.static_inputs import nbytes

__all__ = ["GROUP_MAX_BYTES", "probe", "plan_groups", "stack_grads", "unstack"]

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
