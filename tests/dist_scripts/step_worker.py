"""One rank of the two-process whole-step checks that tests/step/test_train_step.py launches.

Launched by ``python -m paddle.distributed.launch --nproc_per_node 2`` (gloo on the CPU). Each
case trains the same model twice in this process - an eager step function, then the same step
through autocudagraph_step on the simulated backend, the DataParallel all-reduce inside the
step - from the same parameters, data and RNG state, and compares every loss and, after every
optimizer step, every parameter and optimizer state tensor and the learning rate, bit for bit.
Each case prints one line ``RESULT {json}``; the exit status is 1 when a case failed.
"""

import contextlib
import hashlib
import os
import sys

import numpy.random  # noqa: F401  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise, docs/guides/compat.md)
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed import fleet

sys.path.insert(0, os.environ.get("PADDLEFLEET_ROOT", os.getcwd()))
from job import run_cases  # noqa: E402  (this script's folder is on sys.path)
from paddlefleet.cudagraph import GraphGradScaler, autocudagraph_step  # noqa: E402
from paddlefleet.cudagraph.demo.transformer_steps import first_mismatch, snapshot, StepRun  # noqa: E402

STEPS = 6
RANK = 0
FLEET_UNAVAILABLE = None  # why fleet.init could not run here, or None


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(8, 16)
        self.drop = paddle.nn.Dropout(0.1)
        self.norm = paddle.nn.LayerNorm(16)
        self.fc2 = paddle.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.norm(self.drop(F.gelu(self.fc1(x)))))


def rank_data(seed, shape):
    """Different data on each rank, the same for the eager and the graphed run."""
    return paddle.to_tensor(np.random.RandomState(seed + 1000 * RANK).randn(*shape).astype("float32"))


def train(wrap, graphed, micro):
    """Trains wrap(Net()) for STEPS optimizer steps of ``micro`` micro-batches each."""
    paddle.seed(1234 + RANK)  # different init per rank: DataParallel broadcasts rank 0's
    model = Net()
    dp, opt, sched = wrap(model)
    scaler = GraphGradScaler(init_loss_scaling=256.0, incr_every_n_steps=2)

    def train_step(x, target, apply):
        # Micro-batches before the last do not all-reduce (no_sync), as in eager accumulation.
        with contextlib.nullcontext() if apply else dp.no_sync():
            loss = F.mse_loss(dp(x), target)
            scaler.scale(loss / micro).backward()
        if apply:
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
        return loss

    step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=2, backend="simulate") if graphed \
        else train_step
    paddle.seed(99)  # the dropout stream, the same in both runs on this rank
    losses, states = [], []
    for s in range(STEPS):
        for k in range(micro):
            x = rank_data(10 * s + k, [4, 8])
            target = rank_data(100 + 10 * s + k, [4, 1])
            losses.append(step(x, target, k == micro - 1).numpy())
        states.append(snapshot(model, opt, scaler))
        sched.step()
    return StepRun(losses, states, step.stats() if graphed else None)


def paddle_dp(model):
    dp = paddle.DataParallel(model)
    sched = paddle.optimizer.lr.StepDecay(1e-2, step_size=2, gamma=0.5)
    opt = paddle.optimizer.AdamW(sched, parameters=dp.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    return dp, opt, sched


def fleet_dp(model):
    dp = fleet.distributed_model(model)
    sched = paddle.optimizer.lr.StepDecay(1e-2, step_size=2, gamma=0.5)
    opt = fleet.distributed_optimizer(paddle.optimizer.AdamW(sched, parameters=dp.parameters()))
    return dp, opt, sched


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def compare(wrap, micro, captures, replays):
    eager = train(wrap, graphed=False, micro=micro)
    graphed = train(wrap, graphed=True, micro=micro)
    mismatch = first_mismatch(eager, graphed)
    if mismatch is not None:
        raise AssertionError(f"graphed run differs from eager: {mismatch}")
    s = graphed.stats
    if (s["captures"], s["replays"], s["eager_calls"]) != (captures, replays, 0):
        raise AssertionError(f"unexpected phases: {s}")
    last = graphed.states[-1]
    return {"params": digest(v for k, v in sorted(last.items()) if k.startswith("param")),
            "loss": digest(graphed.losses), "captures": s["captures"], "replays": s["replays"]}


def case_dp_whole_step():
    # One key: 2 warmup steps, the capture, STEPS - 3 replays.
    return compare(paddle_dp, micro=1, captures=1, replays=STEPS - 3)


def case_dp_whole_step_accumulation():
    # Two keys (apply=False under no_sync, apply=True with the all-reduce), 2 warmups each.
    return compare(paddle_dp, micro=2, captures=2, replays=2 * (STEPS - 3))


def case_fleet_whole_step():
    return compare(fleet_dp, micro=1, captures=1, replays=STEPS - 3)


CASES = [case_dp_whole_step, case_dp_whole_step_accumulation, case_fleet_whole_step]
NEEDS_FLEET = {"fleet_whole_step"}


def main():
    global RANK, FLEET_UNAVAILABLE
    try:
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1}
    except Exception as err:  # Paddle 2.6.2 with protobuf 7: DistributedStrategy cannot read its fields
        FLEET_UNAVAILABLE = f"fleet.DistributedStrategy fails here: {type(err).__name__}: {str(err)[:160]}"
        dist.init_parallel_env()
    else:
        fleet.init(is_collective=True, strategy=strategy)
    RANK = dist.get_rank()
    skip = (lambda name: FLEET_UNAVAILABLE if name in NEEDS_FLEET else None) if FLEET_UNAVAILABLE else None
    sys.exit(run_cases(CASES, RANK, skip=skip))

if __name__ == "__main__":
    main()
