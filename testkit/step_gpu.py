"""A whole training step that a GPU without Paddle's own kernels can run (NOTE [ Kernel-less GPUs ]
in testkit/common.py): forward and backward of a matmul-only MLP, an SGD update made of cuBLAS matmuls
and copies, grads released. Called by tools/step_gpu_check.py on a GPU and by the test suite on
the simulated backend.

NOTE [ SGD from matmuls ]
``W - lr * G`` needs an elementwise kernel, which Paddle 2.6.2 lacks on Hopper. Stacked, it is one
matrix product: ``[I, -lr*I] @ [W; G]``. Each parameter of shape ``[n, m]`` gets a ``[2n, m]``
buffer whose halves are views (``Tensor._slice``, no copy; Paddle 2.6.2 and 3.3.1) that W and G
are copied into, and a ``[n, 2n]`` matrix holding the learning rate; the product is copied back
into W. Copies and a gemm: nothing else runs. The learning rate lives in a device tensor, so a
new one is written into it between steps (``set_lr``), never frozen into the graph.
"""

import time

import numpy as np
import paddle

from paddlefleet.cudagraph.step.graphed_step import autocudagraph_step
from testkit.common import MatMLP, build, host_tensor, normal

__all__ = ["MatmulSGD", "MatmulStep", "whole_step_check", "EmaMatmulStep", "refused_capture_check"]


class MatmulSGD:
    """SGD on 2-D parameters from matmuls and copies (NOTE [ SGD from matmuls ]); parameters without a grad
    are left alone."""

    def __init__(self, params, lr):
        self.params = list(params)
        self._stacked = [host_tensor(np.zeros((2 * p.shape[0], p.shape[1]), "float32")) for p in self.params]
        self._update = [host_tensor(np.zeros((p.shape[0], 2 * p.shape[0]), "float32")) for p in self.params]
        self.set_lr(lr)

    def set_lr(self, lr):
        """Writes ``[I, -lr*I]`` into the device tensors (host-to-device copies, outside any graph)."""
        self.lr = float(lr)
        for p, u in zip(self.params, self._update):
            n = p.shape[0]
            u.copy_(host_tensor(np.hstack([np.eye(n), -self.lr * np.eye(n)])), False)

    def step(self):
        with paddle.no_grad():
            for p, stacked, update in zip(self.params, self._stacked, self._update):
                if p.grad is None:  # a frozen parameter, or one the step did not reach: left alone, as Paddle's optimizers do
                    continue
                n = p.shape[0]
                stacked._slice(0, n).copy_(p, False)
                stacked._slice(n, 2 * n).copy_(p.grad, False)
                p.copy_(paddle.matmul(update, stacked), False)

    def clear_grad(self):
        for p in self.params:
            p.clear_gradient(False)  # release: zeroing would need a fill kernel


class MatmulStep:
    """The step function: ``y = mlp(x)``, ``y.backward(dy)``, the update (or none), grads released."""

    def __init__(self, model, lr=None):
        self.model = model
        self.params = list(model.parameters())  # made once: Layer.parameters() costs host time per call
        self.opt = MatmulSGD(self.params, lr) if lr is not None else None

    def __call__(self, x, dy):
        y = self.model(x)
        y.backward(dy)
        if self.opt is not None:
            self.opt.step()
            self.opt.clear_grad()
        else:
            for p in self.params:
                p.clear_gradient(False)
        return y


class EmaMatmulStep(MatmulStep):
    """MatmulStep with an EMA of the parameters kept outside any optimizer (``ema = a*ema +
    (1-a)*w``, one matmul per parameter as NOTE [ SGD from matmuls ]) and an input first
    multiplied by the identity with ``transpose_y=flip[0]``: a host value the loop can change
    right before the capture call, which the capture then refuses (the op trace differs from the
    last warmup step's) after the whole step ran on the simulated backend."""

    def __init__(self, model, lr, width, decay=0.9):
        super().__init__(model, lr)
        self.flip = [False]
        self.eye = host_tensor(np.eye(width))
        self.ema = [host_tensor(p.numpy()) for p in model.parameters()]
        self._ema_stacked = [host_tensor(np.zeros((2 * p.shape[0], p.shape[1]))) for p in model.parameters()]
        self._ema_mix = [host_tensor(np.hstack([decay * np.eye(p.shape[0]), (1 - decay) * np.eye(p.shape[0])]))
                         for p in model.parameters()]

    def __call__(self, x, dy):
        y = super().__call__(paddle.matmul(x, self.eye, transpose_y=self.flip[0]), dy)
        with paddle.no_grad():
            for p, e, stacked, mix in zip(self.model.parameters(), self.ema, self._ema_stacked, self._ema_mix):
                n = p.shape[0]
                stacked._slice(0, n).copy_(e, False)
                stacked._slice(n, 2 * n).copy_(p, False)
                e.copy_(paddle.matmul(mix, stacked), False)
        return y


def refused_capture_check(width=256, layers=4, batch=16, steps=8, lr=1e-3, backend="cuda"):
    """A whole step whose capture is refused after it ran (a host value changed at the capture
    call), with the matmul SGD update and an EMA outside any optimizer: every step's output,
    parameter and EMA tensor must equal eager's bit for bit (the refused capture wrote nothing
    that the eager re-run writes again). Returns ``{"equal", "first_mismatch", "stats"}``."""
    draw = normal(11)
    xs = [host_tensor(draw(batch, width)) for _ in range(4)]
    dys = [host_tensor(draw(batch, width, scale=1e-2)) for _ in range(4)]
    eager, body = [EmaMatmulStep(build(lambda: MatMLP([width] * (layers + 1)), 1), lr, width) for _ in range(2)]
    graphed = autocudagraph_step(body, optimizers=[], warmup_steps=2, backend=backend)
    mismatch = None
    for i in range(steps):
        for twin in (eager, body):
            twin.flip[0] = i >= 2  # changes at the capture call (the third)
        x, dy = xs[i % 4], dys[i % 4]
        pairs = [(eager(x, dy), graphed(x, dy))]
        pairs += list(zip(eager.model.parameters(), body.model.parameters())) + list(zip(eager.ema, body.ema))
        for k, (a, b) in enumerate(pairs):
            if mismatch is None and a.numpy().tobytes() != b.numpy().tobytes():
                mismatch = f"{'output' if k == 0 else f'state tensor {k}'} after step {i}"
    return {"equal": mismatch is None, "first_mismatch": mismatch, "stats": dict(graphed.stats())}


def _sync(backend):
    if backend == "cuda":
        paddle.device.cuda.synchronize()


def whole_step_check(width=512, layers=16, batch=16, steps=20, lr=1e-3, backend="cuda", timed_steps=200):
    """Trains a MatMLP eagerly and through autocudagraph_step, with the matmul SGD update and
    without one; returns ``{case: {"equal": bool, "first_mismatch", "stats", "eager_us",
    "graphed_us"}}`` (per-step times in throughput mode: ``timed_steps`` steps, then one sync).

    Every step's output and every parameter after every step are compared bit for bit."""
    draw = normal(7)
    xs = [host_tensor(draw(batch, width)) for _ in range(4)]
    dys = [host_tensor(draw(batch, width, scale=1e-2)) for _ in range(4)]
    out = {}
    for case, rate in (("forward_backward", None), ("matmul_sgd", lr)):
        eager = MatmulStep(build(lambda: MatMLP([width] * (layers + 1)), 1), rate)
        body = MatmulStep(build(lambda: MatMLP([width] * (layers + 1)), 1), rate)
        graphed = autocudagraph_step(body, optimizers=[], warmup_steps=2, backend=backend)
        mismatch = None
        for i in range(steps):
            x, dy = xs[i % 4], dys[i % 4]
            a, b = eager(x, dy).numpy(), graphed(x, dy).numpy()
            if mismatch is None and a.tobytes() != b.tobytes():
                mismatch = f"output of step {i}"
            for k, (p, q) in enumerate(zip(eager.model.parameters(), body.model.parameters())):
                if mismatch is None and p.numpy().tobytes() != q.numpy().tobytes():
                    mismatch = f"parameter {k} after step {i}"
        out[case] = {"equal": mismatch is None, "first_mismatch": mismatch, "stats": dict(graphed.stats()),
                     "eager_us": _per_step_us(eager, xs[0], dys[0], timed_steps, backend),
                     "graphed_us": _per_step_us(graphed, xs[0], dys[0], timed_steps, backend)}
    return out


def _per_step_us(step, x, dy, n, backend):
    step(x, dy)
    _sync(backend)
    start = time.perf_counter()
    for _ in range(n):
        step(x, dy)
    _sync(backend)
    return (time.perf_counter() - start) / n * 1e6
