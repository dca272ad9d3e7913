"""Which parameters hand their grads to gradient hooks that may keep them.

NOTE [ Grad consumers ]
Under ``clone_param_grads="auto"`` (the default) the bridge hands autograd an alias of a static
grad buffer, which the next backward replay of the same key overwrites. That is safe for every
consumer that is done with the grad when the backward ends: autograd adding it into an existing
``p.grad``, DataParallel's reducer (it reads ``p.grad`` after accumulation), Fleet's main_grad
hook (it adds the grad into ``main_grad`` and frees the tensor it was handed: an alias, so the
static buffer survives). Two consumers may keep it:

* autograd itself, which adopts the tensor as ``p.grad`` when ``p.grad`` is None or "fake
  empty" (NOTE [ Paddle .grad handles ] in grads/handles.py); GradPlan handles that case;
* a gradient hook that stores the tensor it gets (e.g. for logging). Paddle does not list a
  tensor's hooks, so this module records them: from the first wrapper on (NOTE [ Paddle patches ]
  in guards/paddle_patches.py) it wraps ``Tensor._register_grad_hook`` (which
  ``Tensor.register_hook`` calls) and ``Tensor._remove_grad_hook``. A parameter with a hook that
  may keep its grad gets a copy.

Hooks known to keep nothing (Fleet's ``MixPrecisionLayer`` main_grad hook) do not force a copy.
Hooks registered before the first wrapper went past the wrappers, but Paddle counts them: a
tensor's hook ids are its grad node's registration count (0, 1, 2, ... on both Paddles, measured
on 2.6.2 and 3.3.1; removal does not reuse an id). The first time a parameter's hooks are asked
about, the registry registers a no-op hook with Paddle's own method and removes it at once: an
id other than the number of registrations it saw on that tensor means hooks it never saw (or saw
removed), so that parameter counts as "hooks unknown" and gets copies. A model built before its
first wrapper, whose parameters have no hooks, therefore keeps its aliases. The wrappers call
Paddle's own methods first and only record; registering and removing hooks is otherwise unchanged,
except that a hook registered on an output of a graphed call is registered wrapped (NOTE [ Hooks on
graphed outputs ] in grads/handles.py).
"""

import weakref

import paddle

from ..guards.paddle_patches import install_for_process
from .handles import routed

__all__ = ["install", "may_keep", "generation", "describe", "set_taker"]

#: Hooks that read their grad (or free it) and keep nothing: ``(module, qualname)``.
_KEEP_NOTHING = frozenset({
    ("paddle.distributed.fleet.utils.mix_precision_utils", "MixPrecisionLayer._update_main_grad_hook.<locals>.param_hook"),
    # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py: notes that a grad arrived.
    ("paddlefleet.cudagraph.grads.accumulate", "_eager_use_hook.<locals>.hook"),
    # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py: note when a backward starts and ends.
    ("paddlefleet.cudagraph.core.host_cost", "_start_hook.<locals>.hook"),
    ("paddlefleet.cudagraph.core.host_cost", "_end_hook.<locals>.hook"),
})


class _Record:
    """What the registry knows of one tensor's hooks."""

    __slots__ = ("ref", "hooks", "next_id", "unseen")

    def __init__(self, ref):
        self.ref = ref
        self.hooks = {}  # hook id -> may keep its grad
        self.next_id = 0  # the id Paddle gives the next hook when every registration was seen
        self.unseen = None  # None: not probed yet; True: Paddle counts hooks the registry never saw


# id(tensor) -> _Record; Paddle's register/remove once the wrappers are installed; the hook taker.
_tensors = {}
_state = {"generation": 0, "paddle": None, "taker": None}


def _bump():
    _state["generation"] += 1


def generation():
    """Changes whenever a hook is registered or removed, so that callers can cache may_keep()."""
    return _state["generation"]


def _keeps(hook):
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) not in _KEEP_NOTHING


def _forget(key):
    _tensors.pop(key, None)
    _bump()


def _record_of(tensor, create=True):
    key = id(tensor)
    rec = _tensors.get(key)
    if rec is not None and rec.ref() is tensor:
        return rec
    if not create:
        return None
    rec = _tensors[key] = _Record(weakref.ref(tensor, lambda _, key=key: _forget(key)))
    return rec


def _noop(grad):
    return None


def _probe(tensor, rec):
    """Asks Paddle how many hooks ``tensor`` had registered (NOTE [ Grad consumers ])."""
    register, remove = _state["paddle"] or (paddle.Tensor._register_grad_hook, paddle.Tensor._remove_grad_hook)
    hook_id = register(tensor, _noop)
    remove(tensor, hook_id)
    rec.unseen = hook_id != rec.next_id
    rec.next_id = hook_id + 1


def set_taker(take, drop):
    """Lets ``take`` answer a hook registration first (and ``drop`` its removal): a hook it takes
    is never registered with Paddle (NOTE [ Hooks on a chain's outputs ] in chains/outputs.py)."""
    _state["taker"] = (take, drop)


def install():
    """Wraps Paddle's hook registration once per process (NOTE [ Grad consumers ])."""
    if _state["paddle"] is not None:
        return
    register = paddle.Tensor._register_grad_hook
    remove = paddle.Tensor._remove_grad_hook
    _state["paddle"] = (register, remove)

    def _register_grad_hook(self, hook):
        taker = _state["taker"]
        taken = taker[0](self, hook) if taker else None
        if taken is not None:  # NOTE [ Hooks on a chain's outputs ] in chains/outputs.py
            return taken
        hook_id = register(self, routed(self, hook))  # NOTE [ Hooks on graphed outputs ] in grads/handles.py
        rec = _record_of(self)
        rec.hooks[hook_id] = _keeps(hook)
        if rec.unseen is None and hook_id != rec.next_id:
            rec.unseen = True  # hooks registered before install(): Paddle counted them
        rec.next_id = hook_id + 1
        _bump()
        return hook_id

    def _remove_grad_hook(self, hook_id):
        taker = _state["taker"]
        taken = taker[1](self, hook_id) if taker else None
        if taken is not None:
            return taken
        result = remove(self, hook_id)
        rec = _record_of(self, create=False)
        if rec is not None:
            rec.hooks.pop(hook_id, None)
            _bump()
        return result

    _register_grad_hook.__doc__ = getattr(register, "__doc__", None)
    _remove_grad_hook.__doc__ = getattr(remove, "__doc__", None)
    install_for_process(paddle.Tensor, "_register_grad_hook", _register_grad_hook)  # NOTE [ Paddle patches ]
    install_for_process(paddle.Tensor, "_remove_grad_hook", _remove_grad_hook)


def _known(p):
    """``p``'s record, probed once (NOTE [ Grad consumers ])."""
    rec = _record_of(p)
    if rec.unseen is None:
        _probe(p, rec)
    return rec


def may_keep(p):
    """True when a gradient hook of ``p`` may keep the grad it is handed (or its hooks are
    unknown): its handed-out grad must then be a copy."""
    rec = _known(p)
    return rec.unseen or any(rec.hooks.values())


def describe(p):
    """Why ``p``'s grad is copied under "auto", or None."""
    rec = _known(p)
    if rec.unseen:
        return ("Paddle counts gradient hooks registered on it before the first autocudagraph wrapper existed, "
                "which the registry did not see (hooks unknown)")
    if any(rec.hooks.values()):
        return "a gradient hook that may keep its grad is registered"
    return None
