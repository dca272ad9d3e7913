"""``paddle.grad`` through graphed calls.

NOTE [ paddle.grad through a graphed call ]
``paddle.grad(outputs, inputs)`` runs a partial backward: Paddle cuts every edge of a grad node
with several input slots that leads to no requested input, marking that slot stop-gradient for
this run, and a PyLayer's backward must then return None there (a tensor there makes Paddle
raise inside its backward engine). Which edges are cut depends on the whole graph, which a call
would have to walk node by node on every backward to find out (and a grad node read through
``grad_fn`` directly stays alive for good: NOTE [ Reading grad nodes ] in core/grad_nodes.py). So:

* where Paddle keeps one grad edge per tensor of a list argument (3.x; probed once: one_slot()),
  the bridges take all their tensors as ONE list argument, a single slot, with a tensor that
  needs grad first: Paddle cuts no edge of a single slot, takes every grad the bridge returns
  and runs only the nodes on the way to the requested inputs (a parameter's accumulation node
  that was not requested never runs: no ``.grad`` changes). Exact for every paddle.grad;
* Paddle 2.6 keeps one edge per list argument, so there each tensor is its own slot, and during
  a paddle.grad the bridges return None for every leaf (parameter, or leaf argument) that was
  not requested: the leaves' edges are the ones Paddle cuts. An argument made by other ops
  (an activation) keeps its grad; where paddle.grad asks for no tensor below it (the grad of one
  Layer's parameters alone), Paddle raises its ValueError ("should return None at position").

The simulated backend replays a backward by running its captured body again, and that body is
itself a ``paddle.grad`` call; Paddle's partial-grad engine is one object per process, which the
inner call resets under the outer one (measured: a segmentation fault; an error raised inside
the engine instead leaves 2.6's engine broken for later calls). A GPU replay runs no Python. So
while a forward replayed on the simulated backend waits for its backward, a paddle.grad is
refused before Paddle starts it (CudaGraphError naming the fix); on a GPU it runs
(tools/gpu_check.py).
"""

import functools
import gc
import threading
import weakref

import numpy as np
import paddle
from paddle.autograd import PyLayer
from paddle.base import core

from ..backends import in_own_grad
from ..guards.paddle_patches import install_for_process
from ..errors import CudaGraphError

__all__ = ["BridgeArgs", "add_check", "inside_paddle_grad", "install", "note_pending", "one_slot"]

_local = threading.local()  # .requested: ids of the tensors the running paddle.grad asks for
_pending = weakref.WeakSet()  # tokens of forwards replayed on a backend whose backward re-runs Python
_checks = []  # what runs first in the caller's paddle.grad (add_check: the chains' refusal)

SIMULATED = (
    "autocudagraph: paddle.grad while the forward of a graphed call replayed on the simulated backend waits for "
    "its backward: that backward replay runs paddle.grad itself, and Paddle's partial-grad engine cannot run inside "
    "another (NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py). On a GPU this works. Here, use "
    "backward() for these grads, or call the function outside the wrapper for the calls you differentiate with "
    "paddle.grad (wrapped.__wrapped__, or dispatch_key_fn returning None).")


def _cpu(value, grad=False):
    return paddle.to_tensor(np.full([2, 2], value, dtype="float32"), place=paddle.CPUPlace(), stop_gradient=not grad)


class _ListProbe(PyLayer):
    @staticmethod
    def forward(ctx, tensors):
        return paddle.matmul(tensors[0], tensors[1])

    @staticmethod
    def backward(ctx, grad):
        return ([_cpu(3.0), _cpu(5.0)],)


@functools.lru_cache(maxsize=None)
def one_slot():
    """Whether a PyLayer's list argument keeps one grad edge per tensor (probed once, on the CPU)."""
    a, b = _cpu(1.0, grad=True), _cpu(2.0, grad=True)
    try:
        _ListProbe.apply([a, b]).backward(_cpu(1.0))
    except Exception:  # an older list convention
        return False
    return (a.grad is not None and b.grad is not None and float(a.grad.numpy()[0, 0]) == 3.0
            and float(b.grad.numpy()[0, 0]) == 5.0)


class BridgeArgs:
    """How a bridge hands its tensors to PyLayer.apply and its grads back (see the NOTE).

    Args:
        tensors: every tensor the bridge takes, leaves (parameters) first.
        leaves: how many of them (from the first) are leaves for sure.
    """

    __slots__ = ("args", "lead", "ids")

    def __init__(self, tensors, leaves=0):
        lead = 0
        for i, t in enumerate(tensors):  # a tensor that needs grad first
            if not t.stop_gradient:
                lead = i
                break
        if lead:
            tensors[0], tensors[lead] = tensors[lead], tensors[0]
        self.lead = lead
        if one_slot():
            self.args, self.ids = (tensors,), None
        else:
            self.args = tuple(tensors)
            self.ids = [id(t) if i < leaves or t.is_leaf else None for i, t in enumerate(tensors)]

    @classmethod
    def leading(cls, tensors, ids):
        """The BridgeArgs of ``tensors`` whose first needs grad (no swap), decided by the caller:
        ``ids`` as ``self.ids``, None where one_slot() (block/bridge.py's BridgePlan)."""
        args = cls.__new__(cls)
        args.lead = 0
        args.args, args.ids = ((tensors,), None) if ids is None else (tuple(tensors), ids)
        return args

    def grads(self, grads):
        """What the bridge's backward returns for ``grads`` (one per tensor, in the order given)."""
        lead = self.lead
        if lead:
            grads[0], grads[lead] = grads[lead], grads[0]
        if self.ids is None:
            return (grads,)
        requested = getattr(_local, "requested", None)
        if requested is not None:
            grads = [g if i is None or i in requested else None for g, i in zip(grads, self.ids)]
        return tuple(grads)


def inside_paddle_grad():
    """True while a paddle.grad runs in this thread (the caller's or the package's own)."""
    return getattr(_local, "requested", None) is not None


def note_pending(token):
    """A forward replayed on a backend whose backward re-runs Python (simulate) waits for ``token``."""
    _pending.add(token)


def _waiting():
    return any(not token.done for token in list(_pending))


def add_check(check):
    """Has ``check(inputs)`` run first in every paddle.grad the caller runs (not the package's own); it
    may raise."""
    if check not in _checks:
        _checks.append(check)


def install():
    """Wraps ``core.eager.run_partial_grad`` once per process (NOTE [ Paddle patches ] in
    guards/paddle_patches.py); the checks of add_check run first."""
    partial_grad = core.eager.run_partial_grad

    def run_partial_grad(outputs, inputs, *args, **kwargs):
        own = in_own_grad()
        if not own:
            for check in _checks:
                check(inputs)
        if not own and _waiting():
            gc.collect()  # forwards only garbage still holds do not count
            if _waiting():
                raise CudaGraphError(SIMULATED)
        saved = getattr(_local, "requested", None)
        _local.requested = {id(t) for t in inputs or ()}
        try:
            return partial_grad(outputs, inputs, *args, **kwargs)
        finally:
            _local.requested = saved

    install_for_process(core.eager, "run_partial_grad", run_partial_grad)
