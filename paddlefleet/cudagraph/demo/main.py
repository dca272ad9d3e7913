"""The demo: train a small model eagerly and graphed from the same seed, side by side - graphed
block by block (autocudagraph) and as a whole training step (autocudagraph_step).

Run with ``python -m paddlefleet.cudagraph demo``. On a machine without a GPU (or without a
CUDA build of Paddle) the graphed run uses the simulated backend and says so.
"""

import sys
import time

import numpy as np
import paddle

from ..api import autocudagraph
from ..backends import cuda_available
from .transformer_blocks import MLP, compare_transformer
from .transformer_steps import compare_transformer_steps

__all__ = ["Block", "DemoModel", "train", "run_demo", "MIN_STEPS"]

#: The fewest steps whose graphed runs replay: the whole-step section keys its two micro-batch
#: phases apart, and each key runs 2 warmup steps and a capture before its first replay
#: (accumulation 2: 4 steps = 8 calls = 4 warmup + 2 captures + 2 replays).
MIN_STEPS = 4


class Block(MLP):
    """The MLP (Linear -> GELU -> Linear -> Dropout), residual, then LayerNorm."""

    def __init__(self, width, hidden, dropout):
        super().__init__(width, hidden, dropout)
        self.norm = paddle.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + super().forward(x))


class DemoModel(paddle.nn.Layer):
    def __init__(self, width=64, hidden=256, depth=4, dropout=0.1):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(width, hidden, dropout) for _ in range(depth)])
        self.head = paddle.nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sync():
    if paddle.device.get_device().startswith("gpu"):
        paddle.device.synchronize()


def train(graphed, backend, steps=20, seed=7, batch=32, width=64, device="cpu"):
    """Trains DemoModel for ``steps`` AdamW steps; returns (losses, seconds per step, model)."""
    paddle.set_device(device)
    paddle.seed(seed)
    model = DemoModel(width=width)
    if graphed:
        for block in model.blocks:
            autocudagraph(block, warmup_steps=1, backend=backend)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    rng = np.random.RandomState(seed)
    data = [
        (paddle.to_tensor(rng.randn(batch, width).astype("float32")), paddle.to_tensor(rng.randn(batch, 1).astype("float32")))
        for _ in range(steps)
    ]
    losses, times = [], []
    for x, target in data:
        _sync()
        start = time.perf_counter()
        loss = paddle.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.clear_grad()
        _sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.numpy())
    return losses, times, model


def check_steps(steps):
    """Raises ValueError unless ``steps`` lets every graphed run of the demo replay."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < MIN_STEPS:
        raise ValueError(
            f"the demo needs --steps >= {MIN_STEPS}, got {steps!r}: a graphed run compares replays with eager, and "
            f"the whole-step section replays only from its 4th step (each of its two micro-batch keys runs 2 "
            "warmup steps and a capture first)."
        )


def run_demo(steps=20, out=None):
    """Prints the side-by-side table and the stats; returns 0 when every step matched bitwise
    and every graphed run replayed.

    Raises:
        ValueError: for fewer than MIN_STEPS steps (no replay to compare).
    """
    check_steps(steps)
    previous = paddle.get_device()
    try:
        return _run_demo(steps, out or sys.stdout)
    finally:
        paddle.set_device(previous)


def _run_demo(steps, out):
    on_gpu = cuda_available() and paddle.device.cuda.device_count() > 0
    backend = "cuda" if on_gpu else "simulate"
    device = "gpu" if on_gpu else "cpu"
    if on_gpu:
        out.write("Running on the GPU with the cuda backend.\n")
    else:
        out.write(
            "No GPU with a CUDA build of Paddle here: the graphed run uses the simulated backend (CPU, "
            "same static-buffer semantics). No timings: the simulated backend re-runs the Python of every call "
            "to check it, so a graphed step is slower there than eager; on a GPU the table shows ms per step.\n"
        )
    out.write(
        f"Model: DemoModel, 4 residual MLP blocks (Linear 64->256, GELU, Linear 256->64, dropout 0.1, LayerNorm) "
        f"and a linear head, trained {steps} AdamW steps on random regression data (batch 32, MSE loss), eagerly "
        "and with each block graphed by autocudagraph.\n"
    )
    eager_losses, eager_times, eager_model = train(False, backend, steps=steps, device=device)
    graph_losses, graph_times, graph_model = train(True, backend, steps=steps, device=device)
    timed = f"  {'eager ms':>9}  {'graphed ms':>10}" if on_gpu else ""  # CPU times mislead (see above)
    out.write(f"{'step':>4}  {'eager loss':>14}  {'graphed loss':>14}  {'bitwise':>7}{timed}\n")
    all_equal = True
    for i, (le, lg, te, tg) in enumerate(zip(eager_losses, graph_losses, eager_times, graph_times)):
        equal = np.array_equal(le, lg)
        all_equal &= equal
        timed = f"  {te * 1e3:>9.2f}  {tg * 1e3:>10.2f}" if on_gpu else ""
        out.write(f"{i:>4}  {float(le):>14.8f}  {float(lg):>14.8f}  {str(equal):>7}{timed}\n")
    params_equal = all(
        np.array_equal(a.numpy(), b.numpy()) for a, b in zip(eager_model.parameters(), graph_model.parameters())
    )
    all_equal &= params_equal
    out.write(f"final parameters bitwise equal: {params_equal}\n")
    replays = {}
    for i, block in enumerate(graph_model.blocks):
        s = block.forward.stats()
        replays[f"block {i}"] = s["replays"]
        out.write(
            f"block {i}: warmup_calls={s['warmup_calls']} captures={s['captures']} replays={s['replays']} "
            f"eager_calls={s['eager_calls']} graphs={s['graphs']}\n"
        )
    equal, replays["transformer block"] = _transformer_section(backend, device, steps, out)
    all_equal &= equal
    equal, replays["whole step"] = _whole_step_section(backend, device, steps, out)
    all_equal &= equal
    return _result(all_equal, replays, out)


def _result(all_equal, replays, out):
    """The last line: a claim only where replays ran and matched."""
    idle = [name for name, n in replays.items() if n == 0]
    if not all_equal:
        out.write("RESULT: MISMATCH against eager\n")
        return 1
    if idle:
        out.write(f"RESULT: NOT CHECKED: {', '.join(idle)} never replayed, so nothing graphed was compared\n")
        return 1
    out.write(f"RESULT: every step bitwise equal to eager ({sum(replays.values())} replays compared)\n")
    return 0


def _transformer_section(backend, device, steps, out):
    """The end-to-end check: a transformer block (attention + MLP + LayerNorm + dropout, the MLP
    under recompute) trained with AdamW and gradient accumulation 2, eager vs graphed."""
    paddle.set_device(device)
    result = compare_transformer(steps=steps, accumulate=2, backend=backend)
    out.write(
        f"\ntransformer block (attention + MLP under recompute + LayerNorm + dropout), AdamW, gradient "
        f"accumulation 2, {steps} steps: {len(result.eager.losses)} micro-batch losses and "
        f"{len(result.eager.params)} final parameters bitwise equal: " + _outcome(result, "graphed block")
    )
    return result.equal, result.graphed.stats["replays"]


def _whole_step_section(backend, device, steps, out):
    """The same kind of transformer block trained through autocudagraph_step: forward, backward,
    global-norm clipping, AdamW with warmup + cosine learning rate and GraphGradScaler (with an
    overflow step it must skip) in one graph per micro-batch phase of accumulation 2."""
    paddle.set_device(device)
    result = compare_transformer_steps(steps=steps, accumulate=2, backend=backend, inf_at=(min(3, steps - 1),))
    out.write(
        f"\nwhole step (autocudagraph_step): transformer block + clipping + AdamW (warmup + cosine LR) + "
        f"GraphGradScaler, accumulation 2, {steps} steps: every loss, parameter, optimizer state, the LR and the "
        f"loss scale bitwise equal: " + _outcome(result, "whole-step graphs")
    )
    return result.equal, result.graphed.stats["replays"]


def _outcome(result, what):
    """``True``, or ``False (first mismatch: ...)``, then a line of the graphed run's counters."""
    s = result.graphed.stats
    verdict = f"{result.equal}" + (f" (first mismatch: {result.first_mismatch})" if not result.equal else "")
    return (f"{verdict}\n  {what}: warmup_calls={s['warmup_calls']} captures={s['captures']} "
            f"replays={s['replays']} eager_calls={s['eager_calls']}\n")
