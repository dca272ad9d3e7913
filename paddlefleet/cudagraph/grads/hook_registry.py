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
  tensor's hooks, so this module records them: importing paddlefleet.cudagraph wraps
  ``Tensor._register_grad_hook`` (which ``Tensor.register_hook`` calls) and
  ``Tensor._remove_grad_hook``. A parameter with a hook that may keep its grad gets a copy.

Hooks known to keep nothing (Fleet's ``MixPrecisionLayer`` main_grad hook) do not force a copy.
Hooks registered before the import were not seen: the parameters of every Layer that exists at
import time are therefore treated as "hooks unknown" and get copies (import paddlefleet.cudagraph
before building the model to avoid that). The wrappers call Paddle's own methods first and only
record; registering and removing hooks is otherwise unchanged, except that a hook registered on an
output of a graphed call is registered wrapped (NOTE [ Hooks on graphed outputs ] in grads/handles.py).
"""

import gc
import weakref

import paddle

from ..backends.paddle_patches import install_for_process
from .handles import routed

__all__ = ["install", "may_keep", "generation", "describe", "set_taker"]

#: Hooks that read their grad (or free it) and keep nothing: ``(module, qualname)``.
_KEEP_NOTHING = {
    ("paddle.distributed.fleet.utils.mix_precision_utils", "MixPrecisionLayer._update_main_grad_hook.<locals>.param_hook"),
    # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py: notes that a grad arrived.
    ("paddlefleet.cudagraph.grads.accumulate", "_eager_use_hook.<locals>.hook"),
}

# id(tensor) -> (weakref to the tensor, {hook_id: may_keep})
_hooks = {}
# id(tensor) -> weakref: parameters that existed before install() (their hooks are unknown).
_unknown = {}
_state = {"generation": 0, "installed": False}


def _bump():
    _state["generation"] += 1


def generation():
    """Changes whenever a hook is registered or removed, so that callers can cache may_keep()."""
    return _state["generation"]


def _keeps(hook):
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) not in _KEEP_NOTHING


def _forget(table, key):
    table.pop(key, None)
    _bump()


def _record(tensor, hook_id, hook):
    key = id(tensor)
    rec = _hooks.get(key)
    if rec is None or rec[0]() is not tensor:
        rec = (weakref.ref(tensor, lambda _, key=key: _forget(_hooks, key)), {})
        _hooks[key] = rec
    rec[1][hook_id] = _keeps(hook)
    _bump()


def _unrecord(tensor, hook_id):
    rec = _hooks.get(id(tensor))
    if rec is not None and rec[0]() is tensor:
        rec[1].pop(hook_id, None)
        _bump()


_taker = []  # (take(tensor, hook) -> hook id or None, drop(tensor, hook id) -> True or None)


def set_taker(take, drop):
    """Lets ``take`` answer a hook registration first (and ``drop`` its removal): a hook it takes
    is never registered with Paddle (NOTE [ Hooks on a chain's outputs ] in block/chain_outputs.py)."""
    _taker[:] = [take, drop]


def install():
    """Wraps Paddle's hook registration once per process and marks the parameters of the Layers
    that already exist as "hooks unknown" (NOTE [ Grad consumers ])."""
    if _state["installed"]:
        return
    _state["installed"] = True
    register = paddle.Tensor._register_grad_hook
    remove = paddle.Tensor._remove_grad_hook

    def _register_grad_hook(self, hook):
        taken = _taker[0](self, hook) if _taker else None
        if taken is not None:  # NOTE [ Hooks on a chain's outputs ] in block/chain_outputs.py
            return taken
        hook_id = register(self, routed(self, hook))  # NOTE [ Hooks on graphed outputs ] in grads/handles.py
        _record(self, hook_id, hook)
        return hook_id

    def _remove_grad_hook(self, hook_id):
        taken = _taker[1](self, hook_id) if _taker else None
        if taken is not None:
            return taken
        result = remove(self, hook_id)
        _unrecord(self, hook_id)
        return result

    _register_grad_hook.__doc__ = getattr(register, "__doc__", None)
    _remove_grad_hook.__doc__ = getattr(remove, "__doc__", None)
    install_for_process(paddle.Tensor, "_register_grad_hook", _register_grad_hook)  # NOTE [ Paddle patches ]
    install_for_process(paddle.Tensor, "_remove_grad_hook", _remove_grad_hook)
    for obj in gc.get_objects():
        if isinstance(obj, paddle.nn.Layer):
            for p in obj.parameters(include_sublayers=False):
                key = id(p)
                _unknown[key] = weakref.ref(p, lambda _, key=key: _forget(_unknown, key))


def may_keep(p):
    """True when a gradient hook of ``p`` may keep the grad it is handed (or its hooks are
    unknown): its handed-out grad must then be a copy."""
    ref = _unknown.get(id(p))
    if ref is not None and ref() is p:
        return True
    rec = _hooks.get(id(p))
    return rec is not None and rec[0]() is p and any(rec[1].values())


def describe(p):
    """Why ``p``'s grad is copied under "auto", or None."""
    ref = _unknown.get(id(p))
    if ref is not None and ref() is p:
        return "its Layer existed before paddlefleet.cudagraph was imported (hooks unknown)"
    rec = _hooks.get(id(p))
    if rec is not None and rec[0]() is p and any(rec[1].values()):
        return "a gradient hook that may keep its grad is registered"
    return None
