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

from .. import native
from . import hook_registry
from .stacks import unstack
from .handles import alias, copy, rescue_grad

__all__ = ["GradPlan", "POLICIES", "choose"]

#: Values of clone_param_grads.
POLICIES = (True, False, "auto")

# How a stack is handed out, per hook generation (NOTE [ A precomputed hand-out ]).
_VIEWS, _COPY_ALL, _COPY_SOME = "views", "copy all", "copy some"


class GradPlan:
    """Per bridge input: which static grad it gets and whether it is copied.

    Args:
        static_grads: one static grad (or None) per leaf of the backward body: the inputs that
            need grad, then the parameters; grouped ones are views of their stack.
        input_needs_grad: per call tensor, whether it is such a leaf.
        params: the parameters whose grads follow the inputs'.
        policy: clone_param_grads, fixed at capture (NOTE [ Policies fixed at capture ]).
        groups: ``(stack, leaf indices)`` per stack of same-shape parameter grads.

    NOTE [ A precomputed hand-out ]
    The hand-out runs in every backward: where each grad goes in the tuple autograd gets, the
    static tensor and shape it aliases or copies, and the addresses the adopted-grad check compares
    are laid out once here; which grads are copies is worked out once per hook generation (the
    "auto" policy reads the hooks: NOTE [ Grad consumers ] in hook_registry.py). Copies are new
    tensors every backward; aliases are reused (NOTE [ Reused aliases ]).

    NOTE [ Reused aliases ]
    An alias handed out is a view of a static grad (one ``unbind`` per stack, one view per single
    grad), and making those views costs host time in every backward (about 0.6 us a view on a CPU,
    1.2 on an H200 host, 1.5-4.6 for a single grad's view), so the views of a backward are kept (per
    stack, and those of the single grads together: one check for all) and handed out again by the
    next backward of this buffer set, all only while each is exactly what a fresh view would be: its
    storage at the same address (``clear_gradient(False)`` or ``p.grad = None`` on a parameter that
    adopted it empties it; moving an adopted grad out, rescue_grad, re-points it) and its in-place
    version unchanged (Paddle counts every in-place op on a tensor, ``reshape_`` and
    ``paddle.assign(..., output=)`` among them, on a counter the views of a stack share;
    ``clear_gradient(True)`` zeroes without counting and changes no metadata). Otherwise the views
    (of that stack, or of every single grad) are made again. The values need no check: the replay
    that precedes every hand-out writes the storage, and no view is handed out while a ``p.grad``
    lives in its storage (the buffer set a replay writes holds no adopted grad: NOTE [ Two grad
    buffer sets ]).
    A reused view's object is the one autograd may have adopted before as some ``p.grad`` and
    re-pointed since (clear_gradient(True), then the next backward's grad): handles a user kept see
    the same storage either way, as with a fresh view.

    NOTE [ Freed aliases re-pointed ]
    A loop that frees its grads (``clear_gradient(False)``, ``clear_grad(set_to_zero=False)``) empties every view
    autograd adopted, so the next backward cannot reuse them, and making views again costs a Paddle op per view.
    A freed view can be filled again for a few attribute reads instead: ``source._share_buffer_to(view)`` points
    it at its static grad's storage again (its shape, strides and dtype are its own, kept while it was empty,
    and only where its in-place version is the one it was handed out with: a ``reshape_`` or
    ``paddle.assign(..., output=)`` while it was ``p.grad`` changed them; ``source`` is a view of the same
    static grad, never handed out, which gives the offset). Where a
    parameter's grad slot still holds that view (freed, and no backward adopted another grad since), this
    would turn ``p.grad`` back on (and the next accumulation would add the grad to itself), so the views
    re-pointed are those of the hand-out before the last, whose slots the last hand-out's views replaced,
    and each is proven free by ``p.grad`` reading None after it is re-pointed; otherwise the views are
    emptied again (``_clear_data``: the static grad keeps its storage) and made anew. So a freeing loop
    alternates two sets of view objects. The one thing this changes against a fresh view: a handle to a
    freed grad the user kept (``g = p.grad`` before the free), which eager leaves empty for good (reading it
    raises), reads the static grad again two backwards later.
    """

    def __init__(self, static_grads, input_needs_grad, params, policy, groups=()):
        self.static_grads = list(static_grads)
        self.params = list(params)
        self.policy = policy
        slots, leaf = [], 0
        for needs in input_needs_grad:
            slots.append(leaf if needs and self.static_grads[leaf] is not None else None)
            leaf += needs
        n = self._inputs = len(slots)
        first_param_leaf = leaf
        for _ in self.params:
            slots.append(leaf if self.static_grads[leaf] is not None else None)
            leaf += 1
        self.slots = slots
        # (stack, parameter indices) per stack.
        self.groups = [(stack, [i - first_param_leaf for i in idxs]) for stack, idxs in groups]
        self._generation = self._auto = None
        self._lay_out(n)
        #: Copies of parameter grads made: handed out, and rescued (adopted grads moved out
        #: before a replay). Input grads are always copies and not counted.
        self.copies = 0
        self.rescues = 0
        #: Per stack, then for the single grads together: the views handed out last, their addresses and the
        #: in-place versions they were made with, or None (NOTE [ Reused aliases ]).
        self._kept = [None] * (len(self._stacks) + (1 if self._singles else 0))
        #: Where the first of those views lies when it is a view (not a copy): its stack's, its static grad's address.
        self._bases = [stack.data_ptr() for stack, _, _, _ in self._stacks] + (
            [self._singles[0][2].data_ptr()] if self._singles else [])
        #: Per hand-out slot, the views handed out the time before the last, once the last ones were replaced, and
        #: the parameters they are the grads of; views never handed out to re-point them from, made when first
        #: needed (NOTE [ Freed aliases re-pointed ]).
        self._spare = [None] * len(self._kept)
        self._owners = [[self.params[i] for i in idxs] for _, idxs, _, _ in self._stacks] + (
            [[self.params[i] for _, i, _, _ in self._singles]] if self._singles else [])
        self._sources = [None] * len(self._kept)
        #: Views made (stacks unbound, single grads viewed), reused, and re-pointed, counted for tests and reports.
        self.views_made = self.views_reused = self.views_repointed = 0

    def _lay_out(self, n):
        """The per-backward work of hand_out() and adopted(), decided once (NOTE [ A precomputed hand-out ])."""
        static, slots = self.static_grads, self.slots
        self._width = len(slots)
        self._input_grads = tuple((pos, static[slot]) for pos, slot in enumerate(slots[:n]) if slot is not None)
        grouped = {i for _, idxs in self.groups for i in idxs}
        self._singles = tuple((n + i, i, static[slots[n + i]], list(static[slots[n + i]].shape))
                              for i in range(len(self.params)) if i not in grouped and slots[n + i] is not None)
        stacks = []
        for stack, idxs in self.groups:
            positions = [n + i if slots[n + i] is not None else None for i in idxs]
            start = positions[0]
            contiguous = start is not None and positions == list(range(start, start + len(idxs)))
            stacks.append((stack, idxs, positions, start if contiguous else None))
        self._stacks = tuple(stacks)
        # Addresses of the parameters' static grads: adopted() compares p.grad's with them. The
        # static grad tensors are never handed out themselves, so nothing re-points them.
        self._watched = tuple((i, p, static[slots[n + i]].data_ptr()) for i, p in enumerate(self.params)
                              if slots[n + i] is not None)
        fixed = self.policy != "auto"
        self._fixed = self._decide([bool(self.policy)] * len(self.params)) if fixed else None
        if not fixed:  # asks Paddle about hooks the registry never saw now, at capture (NOTE [ Grad consumers ])
            self._decided()

    def _decide(self, copies):
        """``(copies, copies per hand-out, how each stack is handed out)`` for per-parameter copy flags."""
        counted = sum(copies[i] for _, i, _, _ in self._singles)
        modes = []
        for _, idxs, _, _ in self._stacks:
            wanted = [copies[i] for i in idxs]
            counted += sum(wanted)
            modes.append(_COPY_ALL if all(wanted) else (_COPY_SOME if any(wanted) else _VIEWS))
        return copies, counted, tuple(modes)

    def _decided(self):
        """_decide() of the current copy flags: fixed by the policy, or read from the hooks once per
        hook generation ("auto")."""
        if self._fixed is not None:
            return self._fixed
        generation = hook_registry.generation()
        if self._generation != generation:
            self._auto = self._decide([hook_registry.may_keep(p) for p in self.params])
            self._generation = generation
        return self._auto

    def param_copies(self):
        """Per parameter, whether its handed-out grad is a copy (NOTE [ Grad hand-out ])."""
        return self._decided()[0]

    def input_grad(self, i):
        """The static grad buffer of call tensor ``i`` (overwritten by the next backward replay), or
        None where it gets no grad."""
        slot = self.slots[i]
        return None if slot is None else self.static_grads[slot]

    def adopted(self):
        """Indices of the parameters whose ``p.grad`` lives in this plan's static buffers."""
        if self.policy is True:
            return []
        copies = self.param_copies()
        found = []
        for i, p, ptr in self._watched:
            if not copies[i]:
                g = p.grad
                if g is not None and g.data_ptr() == ptr:
                    found.append(i)
        return found

    def before_replay(self, adopted):
        """Moves the adopted ``p.grad`` of parameters ``adopted`` out of the static buffers (one
        copy each) before the replay writes them."""
        for i in adopted:
            rescue_grad(self.params[i], self.static_grads[self.slots[self._inputs + i]])
        self.rescues += len(adopted)

    def hand_out(self, inputs=True):
        """The grads to return from the bridge's backward, one per bridge input: copies of the
        input grads (``inputs`` False: None, the caller reads them from input_grad()); per parameter
        a copy or a fresh alias of its static grad (NOTE [ Grad hand-out ])."""
        out = [None] * self._width
        if inputs:
            for pos, t in self._input_grads:
                out[pos] = copy(t)
        copies, counted, modes = self._decided()
        if self._singles:  # their views kept together, after the stacks' (one check for all)
            views = self._reused(len(self._stacks), self._single_views)
            for (pos, i, t, _), view in zip(self._singles, views):
                out[pos] = copy(t) if copies[i] else view
        # Stacks: one copy (or none) and one unbind per stack instead of one call per parameter.
        for k, ((stack, idxs, positions, start), mode) in enumerate(zip(self._stacks, modes)):
            views = unstack(copy(stack)) if mode is _COPY_ALL else self._reused(k, unstack, stack)
            if mode is _COPY_SOME:
                views = [copy(v) if copies[i] else v for v, i in zip(views, idxs)]
            if start is not None:
                out[start:start + len(idxs)] = views
            else:
                for pos, view in zip(positions, views):
                    if pos is not None:
                        out[pos] = view
        self.copies += counted
        return tuple(out)

    def _reused(self, k, make, *of):
        """The views ``make(*of)`` gives for hand-out slot ``k`` (each stack, then the single grads together): those
        of the last hand-out while each is unchanged, else made again and kept where they are views (a Paddle
        without views gives copies of single grads, never kept). Their addresses are those of the static grads,
        which never move: read from the first views made."""
        kept = self._kept[k]
        if kept is not None and _unchanged(kept):
            self.views_reused += 1
            return kept[0]
        views = None if kept is None else self._repointed(k, make, of)
        if views is None:
            views = make(*of)
            self.views_made += 1
        if kept is not None:  # views before: these are too, at the same addresses
            self._kept[k] = (views, kept[1], _versions(views))
            self._spare[k] = (kept[0], kept[2])
        elif views[0].data_ptr() == self._bases[k]:
            self._kept[k] = (views, [v.data_ptr() for v in views], _versions(views))
        return views

    def _repointed(self, k, make, of):
        """The views handed out for slot ``k`` the time before the last, re-pointed at their static grads, where each
        was freed and no parameter's grad lives in it; else None (NOTE [ Freed aliases re-pointed ])."""
        if self._spare[k] is None:
            return None
        spare, versions = self._spare[k]
        compiled = native.reads  # NOTE [ Compiled tensor reads ] in native/__init__.py: None where it cannot tell
        freed = None if compiled is None else compiled.freed_unchanged(spare, versions)
        if freed is False:
            return None
        for v, version in () if freed else zip(spare, versions):
            # Not freed (a copy was handed out instead, or it was never adopted), or changed in place while it was
            # p.grad (a reshape_ or paddle.assign(..., output=) left it in another shape).
            if v._is_initialized() or v._inplace_version() != version:
                return None
        sources = self._sources[k]
        if sources is None:
            sources = self._sources[k] = make(*of)
        for n, (source, v, p) in enumerate(zip(sources, spare, self._owners[k])):
            source._share_buffer_to(v)
            if p.grad is not None:  # p's grad is this very view, freed and not replaced since: put back as it was
                for u in spare[:n + 1]:  # (the views made instead become the next spare: _reused)
                    u._clear_data()
                return None
        self.views_repointed += 1
        return spare

    def _single_views(self):
        """A view of each single grad (copies where the hooks want them are made by hand_out, over these)."""
        return [alias(t, shape) for _, _, t, shape in self._singles]

    def forget_views(self):
        """Drops the kept views: the next hand-out makes them again (tools time that)."""
        self._kept = [None] * len(self._kept)
        self._spare = [None] * len(self._spare)


def _versions(views):
    """The in-place version of each view (NOTE [ Compiled tensor reads ] in native/__init__.py)."""
    compiled = native.reads
    found = None if compiled is None else compiled.versions(views)
    return [v._inplace_version() for v in views] if found is None else found


def _unchanged(kept):
    """Whether every view of ``kept`` = ``(views, their addresses, the in-place versions they were made with)`` still
    has its address and version (NOTE [ Reused aliases ]: the views of a stack share one counter)."""
    compiled = native.reads  # NOTE [ Compiled tensor reads ] in native/__init__.py: None where it cannot tell
    same = None if compiled is None else compiled.unchanged(*kept)
    if same is not None:
        return same
    views, ptrs, versions = kept
    for v, ptr, version in zip(views, ptrs, versions):
        if v.data_ptr() != ptr or v._inplace_version() != version:
            return False
    return True


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
    if len(plans) == 1:
        return 0, plans[0].adopted()
    order = ((last + 1) % len(plans), last % len(plans))
    adopted = None
    for k in order:
        adopted = plans[k].adopted()
        if not adopted:
            return k, adopted
    return order[-1], adopted
