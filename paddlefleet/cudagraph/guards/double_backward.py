"""``paddle.grad(..., create_graph=True)`` inside a graphed function: a double backward, refused
by name.

NOTE [ Double backward inside a graphed function ]
``paddle.grad(u, x, create_graph=True)`` in a function returns grads that themselves require
grad: the function's outputs then depend on a backward pass recorded inside the forward, and
the caller's backward differentiates that backward again. A block's backward graph is captured
from its outputs to the call's arguments and the parameters of its Layers, and the grad nodes the
inner backward made are leaves of neither kind (the backward capture could only name them as
"tensors that are neither arguments nor parameters", whose fix does not apply). A forward capture
(cuda and simulate alike) refuses such a call where it happens, naming ``create_graph`` and the
user's line, and the key runs eagerly (eager's results). A ``paddle.grad`` with
``create_graph=False``, or whose grads need no grad, is captured as any other op.
"""

import contextlib
import threading

from paddle.base import core

from .paddle_patches import Patches
from .refusals import DOUBLE_BACKWARD

__all__ = ["refuse_create_graph", "own_grad", "in_own_grad"]

#: per thread: how deep the package's own paddle.grad calls are nested (own_grad)
_local = threading.local()


def in_own_grad():
    """True while the package itself runs paddle.grad in this thread (own_grad)."""
    return getattr(_local, "own_grads", 0) > 0


@contextlib.contextmanager
def own_grad():
    """Marks a paddle.grad the package runs itself (a backward body, a probe, a verification):
    NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py refuses only the caller's."""
    _local.own_grads = getattr(_local, "own_grads", 0) + 1
    try:
        yield
    finally:
        _local.own_grads -= 1


_CREATE_GRAPH = 4  # create_graph's position in core.eager.run_partial_grad (Paddle 2.6 and 3.x)


def _error():
    return DOUBLE_BACKWARD.error(
        "autocudagraph: paddle.grad(..., create_graph=True) was called during capture, and the grads it returned "
        "require grad (a double backward: the caller's backward would differentiate this backward again). A "
        "block's backward graph cannot replay a backward recorded inside its forward, so this key runs eagerly. "
        "Call paddle.grad with create_graph=True outside the graphed function and graph the parts before and "
        "after it, or return None from dispatch_key_fn for such calls."
    )


@contextlib.contextmanager
def refuse_create_graph():
    """Raises CaptureError from a paddle.grad with create_graph=True whose grads require grad
    (NOTE [ Double backward inside a graphed function ]) until the block exits."""
    original = core.eager.run_partial_grad

    def run_partial_grad(*args, **kwargs):
        grads = original(*args, **kwargs)
        create_graph = kwargs.get("create_graph", args[_CREATE_GRAPH] if len(args) > _CREATE_GRAPH else False)
        if create_graph and not in_own_grad() and any(g is not None and not g.stop_gradient for g in grads or ()):
            raise _error()
        return grads

    with Patches() as patches:  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        patches.set(core.eager, "run_partial_grad", run_partial_grad)
        yield
