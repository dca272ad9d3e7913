"""Whether Paddle's saved-tensors hooks (``paddle.autograd.saved_tensors_hooks``) are registered now.

NOTE [ Saved-tensors hooks ]
``paddle.autograd.saved_tensors_hooks(pack, unpack)`` replaces every tensor autograd saves with
``pack(t)`` and gets it back with ``unpack(...)`` in the backward. Non-reentrant recompute
(``recompute(fn, ..., use_reentrant=False)``) is built on it: its pack keeps a placeholder, and the
first unpack re-runs ``fn`` under a second pair of hooks that hands the re-run's saved tensors to the
placeholders *by position*; that inner unpack raises "An unexpected backward called on a tensor!".
A graphed call made under such hooks cannot be right:

1. A capture runs its own backward (``paddle.grad``) through tensors the pack hook replaced. In
   recompute's forward, the unpack then re-runs the whole recomputed function inside the capture;
   in recompute's backward re-run (where the first capture usually happens, as the call after the
   warmup) the inner unpack raises, and Paddle then leaves grad mode off (measured on 2.6.2 and
   3.3.1: ``paddle.is_grad_enabled()`` is False after an unpack hook raised inside
   ``paddle.grad``), so the ``backward()`` retry captured a forward without grads: outputs that
   need no grad, the input's grad None and parameter grads 0/None from then on.
2. A replay saves no tensor through autograd, and a call that runs eagerly saves several: a replay
   in recompute's forward and an eager call in its re-run (or the reverse) would hand the backward
   tensors saved for other ops.

So every call made while the hooks are registered runs eagerly (core/lifecycle.py, one warning; the
reason in ``explain()``), in the forward and in recompute's re-run alike, which is exactly eager.

Paddle keeps one pair of hooks per process and has no getter (``core.eager`` offers only
``register_saved_tensors_hooks`` and ``reset_saved_tensors_hooks``; ``saved_tensors_hooks`` calls
the first on enter and the second on exit, also when nested). ``install()`` wraps those two functions
when the first wrapper is made (NOTE [ Paddle patches ] in guards/paddle_patches.py) and mirrors that
state from then on. Hooks registered before that are not seen: make the first wrapper outside any
``saved_tensors_hooks`` block (wrappers are made when the model is set up, before training runs a
recompute, which is where these hooks are registered).
"""

import threading

from paddle.base import core

from .paddle_patches import install_for_process

__all__ = ["active", "REASON", "warning"]

_STATE = {"registered": False}
_LOCK = threading.Lock()

REASON = "called under paddle.autograd.saved_tensors_hooks (recompute with use_reentrant=False, activation offload)"


def warning():
    """The one warning a wrapper gives for calls under saved-tensors hooks (after its name)."""
    return (
        "called while paddle.autograd.saved_tensors_hooks are registered "
        "(recompute(..., use_reentrant=False), activation offload). A graph can neither run its own "
        "backward through the tensors those hooks replace nor save the tensors they expect, so these "
        "calls run eagerly (correct, without the speed-up). Graph the blocks inside the recompute "
        "instead of around it, or use recompute's default use_reentrant=True."
    )


def active():
    """True while Paddle's saved-tensors hooks are registered (see NOTE [ Saved-tensors hooks ])."""
    return _STATE["registered"]


def registration():
    """The dict whose ``"registered"`` active() reads (a compiled check reads it too: NOTE [ The front door ] in
    core/front.py)."""
    return _STATE


def _wrap(name, registered):
    original = getattr(core.eager, name)
    if getattr(original, "_paddlefleet_saved_hooks", False):
        return

    def tracked(*args, **kwargs):
        result = original(*args, **kwargs)
        _STATE["registered"] = registered
        return result

    tracked._paddlefleet_saved_hooks = True
    tracked.__wrapped__ = original
    install_for_process(core.eager, name, tracked)  # NOTE [ Paddle patches ] in guards/paddle_patches.py


def install():
    """Wraps Paddle's register/reset functions once; a Paddle without them has no such hooks."""
    eager = getattr(core, "eager", None)
    with _LOCK:
        if eager is None or not hasattr(eager, "register_saved_tensors_hooks"):
            return
        _wrap("register_saved_tensors_hooks", True)
        _wrap("reset_saved_tensors_hooks", False)
