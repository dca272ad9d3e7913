"""Example models and training loops, shared by the demo and the tests.

The transformer check: a pre-LayerNorm transformer block (self-attention,
MLP, LayerNorm, dropout in both sub-blocks, the MLP's matmuls under Fleet's ``recompute``) trained with
AdamW and gradient accumulation, once eagerly and once with the whole block graphed. Both runs
start from the same parameters, data and seed, so every loss and every final parameter must be
equal bit for bit::

    from paddlefleet.cudagraph.demo import transformer_blocks

    result = transformer_blocks.compare_transformer(steps=20, accumulate=2, backend="simulate")
    assert result.equal, result.first_mismatch
    result.graphed.stats  # the wrapper's stats(): 1 capture, 38 replays
"""

import dataclasses
import math
from typing import Any, Dict, List, Optional

import numpy as np
import paddle
import paddle.nn.functional as F

__all__ = [
    "MLP",
    "TransformerBlock",
    "TrainResult",
    "Comparison",
    "transformer_block",
    "transformer_batches",
    "train_transformer",
    "compare_transformer",
]


class _Attention(paddle.nn.Layer):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}.")
        self.n_heads = n_heads
        self.qkv = paddle.nn.Linear(d_model, 3 * d_model)
        self.out = paddle.nn.Linear(d_model, d_model)
        self.attn_drop = paddle.nn.Dropout(dropout)
        self.out_drop = paddle.nn.Dropout(dropout)

    def forward(self, x):
        b, s, d = x.shape
        h = self.n_heads
        qkv = self.qkv(x).reshape([b, s, 3, h, d // h]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(d // h))
        probs = self.attn_drop(F.softmax(scores, axis=-1))
        ctx = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, s, d])
        return self.out_drop(self.out(ctx))


class MLP(paddle.nn.Layer):
    """Linear -> GELU -> Linear -> Dropout."""

    def __init__(self, d_model, d_ff, dropout):
        super().__init__()
        self.fc1 = paddle.nn.Linear(d_model, d_ff)
        self.fc2 = paddle.nn.Linear(d_ff, d_model)
        self.drop = paddle.nn.Dropout(dropout)

    def body(self, x):
        """The MLP without its dropout: what the block recomputes."""
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        return self.drop(self.body(x))


class TransformerBlock(paddle.nn.Layer):
    """Pre-LN block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``; the MLP's matmuls run under
    ``paddle.distributed.fleet.utils.recompute`` in training when ``recompute_mlp``, its dropout
    after the recompute: a recomputed dropout cannot be graphed (its backward rewinds the RNG and
    draws again, which a CUDA graph would replay with a new offset), so the block would run eagerly."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64, dropout=0.1, recompute_mlp=True):
        super().__init__()
        self.ln1 = paddle.nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_heads, dropout)
        self.ln2 = paddle.nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff, dropout)
        self.recompute_mlp = recompute_mlp

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.recompute_mlp and self.training:
            from paddle.distributed.fleet.utils import recompute

            return x + self.mlp.drop(recompute(self.mlp.body, h))
        return x + self.mlp(h)


@dataclasses.dataclass
class TrainResult:
    """What one training run produced.

    Attributes:
        losses: the loss of every micro-batch (numpy float32 scalars), in order.
        params: final parameters, ``{name: numpy array}``.
        stats: the graphed block's ``forward.stats()``, or None for an eager run.
    """

    losses: List[np.ndarray]
    params: Dict[str, np.ndarray]
    stats: Optional[Dict[str, Any]] = None


@dataclasses.dataclass
class Comparison:
    """An eager and a graphed run of the same training.

    Attributes:
        eager, graphed: the two TrainResults.
        equal: every loss and every final parameter equal bit for bit.
        first_mismatch: None, or what differs first (e.g. "loss of micro-batch 7").
    """

    eager: TrainResult
    graphed: TrainResult
    equal: bool
    first_mismatch: Optional[str]


def transformer_block(seed=0, **kwargs):
    """A TransformerBlock whose initial parameters depend only on ``seed`` (and the sizes)."""
    paddle.seed(seed)
    return TransformerBlock(**kwargs)


def transformer_batches(n, batch=4, seq=8, d_model=32, seed=1):
    """``n`` pairs ``(x, target)`` of float32 tensors ``[batch, seq, d_model]``, from numpy (the
    Paddle generators are not touched)."""
    rs = np.random.RandomState(seed)
    shape = (batch, seq, d_model)
    return [
        (paddle.to_tensor(rs.standard_normal(shape).astype("float32")),
         paddle.to_tensor(rs.standard_normal(shape).astype("float32")))
        for _ in range(n)
    ]


def train_transformer(steps=20, accumulate=2, graph_options=None, seed=0, lr=1e-3, batch=4, seq=8, **block_kwargs):
    """Trains a fresh TransformerBlock with AdamW and gradient accumulation.

    Each step runs ``accumulate`` micro-batches (forward, ``loss / accumulate`` backward), then
    ``optimizer.step()`` and ``clear_grad()``.

    Args:
        steps: optimizer steps.
        accumulate: micro-batches per step.
        graph_options: None trains eagerly; a dict graphs the block with
            ``autocudagraph(block, **graph_options)`` (e.g. ``{"backend": "simulate"}``).
        seed: seeds the parameters and, before training, the dropout generator.
        lr: AdamW learning rate.
        batch, seq: micro-batch shape (d_model comes from ``block_kwargs``, default 32).
        **block_kwargs: TransformerBlock arguments (d_model, n_heads, d_ff, dropout, recompute_mlp).

    Returns:
        TrainResult.
    """
    block = transformer_block(seed=seed, **block_kwargs)
    if graph_options is not None:
        from ..api import autocudagraph

        autocudagraph(block, **graph_options)
    d_model = block_kwargs.get("d_model", 32)
    data = transformer_batches(steps * accumulate, batch=batch, seq=seq, d_model=d_model, seed=seed + 1)
    opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=block.parameters(), weight_decay=0.01)
    paddle.seed(seed + 2)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            x, target = data[step * accumulate + micro]
            loss = F.mse_loss(block(x), target)
            (loss / accumulate).backward()
            losses.append(loss.numpy())
        opt.step()
        opt.clear_grad()
    params = {name: p.numpy() for name, p in block.named_parameters()}
    stats = block.forward.stats() if graph_options is not None else None
    return TrainResult(losses=losses, params=params, stats=stats)


def _first_mismatch(eager, graphed):
    for i, (a, b) in enumerate(zip(eager.losses, graphed.losses)):
        if not np.array_equal(a, b):
            return f"loss of micro-batch {i}: eager {a!r}, graphed {b!r}"
    for name, a in eager.params.items():
        if not np.array_equal(a, graphed.params[name]):
            return f"final parameter {name}"
    return None


def compare_transformer(steps=20, accumulate=2, backend="simulate", **graph_options):
    """Runs train_transformer eagerly and graphed with the same seeds and compares bitwise.

    Args:
        steps, accumulate: as train_transformer.
        backend: the graphed run's backend ("simulate" on CPU, "cuda" on a GPU).
        **graph_options: further autocudagraph options (e.g. ``clone_param_grads=False``).

    Returns:
        Comparison.
    """
    eager = train_transformer(steps=steps, accumulate=accumulate)
    graphed = train_transformer(steps=steps, accumulate=accumulate, graph_options=dict(graph_options, backend=backend))
    mismatch = _first_mismatch(eager, graphed)
    return Comparison(eager=eager, graphed=graphed, equal=mismatch is None, first_mismatch=mismatch)
