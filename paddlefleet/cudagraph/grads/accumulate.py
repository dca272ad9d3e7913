"""In-graph grad accumulation (``accumulate_in_graph=True``): the backward graph adds each
parameter's grad into a persistent accumulator, and those parameters leave the autograd bridge.

NOTE [ Accumulation inside the graph ]
The accumulator of a parameter is ``p.main_grad`` where Fleet keeps one (the attribute exists, as
``MixPrecisionLayer`` sets it), else ``p.grad``. Missing accumulators are made before the capture,
filled with -0.0: ``-0.0 + g`` is ``g`` bit for bit (also for ``g == -0.0``), so the first
accumulation equals eager's "first grad is assigned" (and Fleet's hook's ``cast`` of its first
grad). The captured backward then runs ``acc.add_(g)`` - the op Fleet's main_grad hook runs - for
each parameter, and the bridge neither takes nor returns these parameters: no per-parameter
autograd work on the host at all.

What the user must keep:
* accumulators are zeroed in place between optimizer steps (``optimizer.clear_grad()`` with its
  default ``set_to_zero=True``, ``MixPrecisionOptimizer.clear_grad()``, ``main_grad.zero_()``),
  never freed or rebound (``clear_grad(set_to_zero=False)``, ``p.main_grad = None``, ``p.grad =
  ...``). A freed or rebound accumulator is detected before every replay: before a forward replay
  the key is captured again (with fresh accumulators, and a warning), before a backward replay a
  CudaGraphError is raised. The graph never writes into freed memory.
* the parameters' gradient hooks no longer run for grads of these calls (user hooks,
  ``register_hook``, Fleet's main_grad hook - its work is what the graph does, DataParallel's
  reducer). Graphing under ``paddle.DataParallel`` / ``fleet.distributed_model`` with pure data
  parallelism is therefore refused at capture; Fleet's hybrid-parallel optimizers, which
  all-reduce ``main_grad`` themselves in ``step()``, are fine.
* with ``p.grad`` as accumulator, ``p.grad`` exists (zeros, or -0.0 before the first backward)
  from the capture on, as after ``clear_grad(set_to_zero=True)``. Paddle's "fake empty" flag of a
  cleared grad is reset after each backward replay (``Tensor._unset_fake_empty``), so eager
  backward passes through the same parameter outside the graph add to what the graph accumulated.
"""

import gc

import numpy as np
import paddle

from ..errors import CaptureError, CudaGraphError

__all__ = ["Accumulators"]


def _neg_zeros(p, dtype):
    """A tensor of -0.0 like ``p`` (made on the host and copied: no fill kernel on the device)."""
    value = np.full(p.shape, -0.0, dtype="float32")
    t = paddle.to_tensor(value, place=p.place)
    if t.dtype != dtype:
        t = t.astype(dtype)
    t.stop_gradient = True
    return t


def _data_parallel_of(params):
    """The name of a DataParallel wrapper whose reducer manages one of ``params``, or None."""
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, paddle.DataParallel):
            if any(id(p) in ids for p in obj.parameters()):
                return type(obj).__name__
    return None


class Accumulators:
    """The accumulator of each in-graph parameter, made or checked before a capture.

    Args:
        params: the trainable parameters of the call (all leave the bridge).
    """

    def __init__(self, params):
        wrapper = _data_parallel_of(params)
        if wrapper is not None:
            raise CaptureError(
                f"autocudagraph: accumulate_in_graph=True with parameters managed by {wrapper}: their grads "
                "would be added inside the graph and never reach the data-parallel reducer's hooks, so they "
                "would not be all-reduced. Use accumulate_in_graph=False (the default) under DataParallel, or "
                "all-reduce main_grad in the optimizer (Fleet's hybrid-parallel optimizer does)."
            )
        self.params = list(params)
        self.main = [hasattr(p, "main_grad") for p in self.params]
        self.tensors = []
        self._made = []  # (param, main) of the accumulators made here
        for p, main in zip(self.params, self.main):
            if main:
                if p.main_grad is None or not p.main_grad._is_initialized():
                    p.main_grad = _neg_zeros(p, paddle.float32)
                    self._made.append((p, main))
                self.tensors.append(p.main_grad)
            else:
                g = p.grad
                if g is None or not g._is_initialized():
                    p.grad_ = _neg_zeros(p, p.dtype)
                    self._made.append((p, main))
                    g = p.grad
                self.tensors.append(g)
        self._ptrs = [t.data_ptr() for t in self.tensors]

    def undo(self):
        """Takes back the accumulators made here (a capture that failed leaves no trace)."""
        for p, main in self._made:
            if main:
                p.main_grad = None
            else:
                p.clear_gradient(False)
        self._made = []

    def add(self, grads):
        """Inside the backward body: ``acc.add_(g)`` for every parameter with a grad."""
        with paddle.no_grad():
            for acc, g in zip(self.tensors, grads):
                if g is not None:
                    acc.add_(g)

    def moved(self):
        """Why an accumulator can no longer be written (freed, rebound, moved), or None."""
        for p, main, acc, ptr in zip(self.params, self.main, self.tensors, self._ptrs):
            current = p.main_grad if main else p.grad
            if current is None or not current._is_initialized() or current.data_ptr() != ptr or (
                    main and current is not acc):
                what = "main_grad" if main else "grad"
                return f"the {what} of parameter '{p.name}' was freed or rebound"
        return None

    def check_before_backward(self):
        """Raises CudaGraphError instead of replaying into a freed accumulator."""
        moved = self.moved()
        if moved is not None:
            raise CudaGraphError(
                f"autocudagraph: {moved} between the forward and the backward of a graphed call with "
                "accumulate_in_graph=True; the backward graph adds into that memory. Zero accumulators in "
                "place (optimizer.clear_grad() with set_to_zero=True, main_grad.zero_()) instead of freeing "
                "or rebinding them."
            )

    def after_backward(self):
        """Resets Paddle's "fake empty" flag of cleared grads (NOTE [ Accumulation inside the graph ])."""
        for p, main in zip(self.params, self.main):
            if not main:
                p._unset_fake_empty()

    def snapshot(self):
        """Copies of the accumulators, for restore()."""
        with paddle.no_grad():
            return [t.clone() for t in self.tensors]

    def restore(self, saved):
        with paddle.no_grad():
            for t, value in zip(self.tensors, saved):
                t.copy_(value, False)
