"""The whole-step transformer check, shared by the tests, the demo and the
GPU tools: a pre-LN transformer block (attention, MLP, LayerNorm, dropout) trained with AdamW,
global-norm clipping, a warmup + cosine learning rate, gradient accumulation over micro-batch
phases and a GraphGradScaler, once eagerly and once through autocudagraph_step. Both runs start
from the same parameters, data and seeds; every loss, and after every optimizer step every
parameter, optimizer state tensor, the learning rate and the scaler's state, must be equal bit
for bit::

    from paddlefleet.cudagraph.demo import transformer_steps

    result = transformer_steps.compare_transformer_steps(steps=30, accumulate=2, backend="simulate")
    assert result.equal, result.first_mismatch
"""

import dataclasses
from typing import Any, Dict, List, Optional

import numpy as np
import paddle
import paddle.nn.functional as F

from .transformer_blocks import transformer_batches, transformer_block
from ..step.grad_scaler import GraphGradScaler
from ..step.graphed_step import autocudagraph_step

__all__ = ["StepRun", "StepComparison", "train_transformer_steps", "compare_transformer_steps", "snapshot"]


@dataclasses.dataclass
class StepRun:
    """One training run.

    Attributes:
        losses: every micro-batch's loss (numpy).
        states: after every optimizer step, ``{name: numpy array}`` of every parameter, optimizer
            accumulator, the learning-rate tensor, ``get_lr()`` and the scaler's tensors.
        stats, explain: the wrapper's stats() and explain() (None for the eager run).
    """

    losses: List[np.ndarray]
    states: List[Dict[str, np.ndarray]]
    stats: Optional[Dict[str, Any]] = None
    explain: Optional[str] = None


@dataclasses.dataclass
class StepComparison:
    eager: StepRun
    graphed: StepRun
    equal: bool
    first_mismatch: Optional[str]


def snapshot(model, opt, scaler=None):
    """``{name: numpy}`` of the training state: parameters, optimizer accumulators (moments, beta
    powers, velocities, master weights), the learning rate (tensor and get_lr()) and the scaler."""
    out = {f"param {n}": p.numpy() for n, p in model.named_parameters()}
    names = {p.name: n for n, p in model.named_parameters()}  # Paddle's names differ between two models
    for acc, per_param in opt._accumulators.items():
        for pname, t in per_param.items():
            out[f"{acc} of {names.get(pname, pname)}"] = t.numpy()
    for pname, t in getattr(opt, "_master_weights", {}).items():
        out[f"master weight of {names.get(pname, pname)}"] = t.numpy()
    lr = opt._global_learning_rate()
    out["lr tensor"] = lr.numpy() if lr is not None else np.array([])
    out["get_lr"] = np.array(opt.get_lr(), dtype=np.float64)
    if scaler is not None:
        for name, t in zip(("scale", "good steps", "bad steps"), scaler.state_tensors()):
            out[f"scaler {name}"] = t.numpy()
    return out


def _setup(seed, lr, warmup, steps, d_model):
    model = transformer_block(seed=seed, d_model=d_model, n_heads=4, d_ff=2 * d_model, dropout=0.1,
                              recompute_mlp=False)
    cosine = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=lr, T_max=steps)
    sched = paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=warmup, start_lr=lr / 10, end_lr=lr)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), weight_decay=0.01,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    scaler = GraphGradScaler(init_loss_scaling=2.0**10, incr_every_n_steps=4, decr_every_n_nan_or_inf=1)
    return model, sched, opt, scaler


def train_transformer_steps(steps=30, accumulate=2, backend=None, graphed=True, seed=0, lr=1e-3, inf_at=(7,),
                            d_model=16, batch=2, seq=4, warmup_steps=2):
    """Trains a fresh block; ``graphed`` runs the step through autocudagraph_step on ``backend``.

    ``inf_at``: optimizer steps whose last micro-batch carries an inf (the scaler must skip them).
    """
    model, sched, opt, scaler = _setup(seed, lr, warmup=max(steps // 5, 1), steps=steps, d_model=d_model)
    data = transformer_batches(steps * accumulate, batch=batch, seq=seq, d_model=d_model, seed=seed + 1)

    def train_step(x, target, apply):
        loss = F.mse_loss(model(x), target)
        scaler.scale(loss / accumulate).backward()
        if apply:
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
        return loss

    step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=warmup_steps, backend=backend) if graphed \
        else train_step
    paddle.seed(seed + 2)
    losses, states = [], []
    for s in range(steps):
        for micro in range(accumulate):
            x, target = data[s * accumulate + micro]
            if s in inf_at and micro == accumulate - 1:
                x = x * float("inf")
            losses.append(step(x, target, micro == accumulate - 1).numpy())
        states.append(snapshot(model, opt, scaler))
        sched.step()
    if not graphed:
        return StepRun(losses, states)
    return StepRun(losses, states, step.stats(), step.explain())


def first_mismatch(eager, graphed):
    """None, or what differs first between two runs (bit for bit)."""
    for i, (a, b) in enumerate(zip(eager.losses, graphed.losses)):
        if a.tobytes() != b.tobytes():
            return f"loss of call {i}: eager {a!r}, graphed {b!r}"
    for k, (a, b) in enumerate(zip(eager.states, graphed.states)):
        for name, value in a.items():
            other = b.get(name)
            if other is None or value.dtype != other.dtype or value.tobytes() != other.tobytes():
                return f"{name} after optimizer step {k}"
    if len(eager.losses) != len(graphed.losses) or len(eager.states) != len(graphed.states):
        return "different numbers of steps"
    return None


def compare_transformer_steps(steps=30, accumulate=2, backend="simulate", **kwargs):
    """train_transformer_steps eagerly and graphed, compared bit for bit."""
    eager = train_transformer_steps(steps, accumulate, graphed=False, **kwargs)
    graphed = train_transformer_steps(steps, accumulate, backend=backend, graphed=True, **kwargs)
    mismatch = first_mismatch(eager, graphed)
    return StepComparison(eager, graphed, mismatch is None, mismatch)
