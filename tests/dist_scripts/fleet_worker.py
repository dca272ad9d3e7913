"""One rank of the two-process Fleet checks that tests/integration/test_distributed.py launches.

Launched by ``python -m paddle.distributed.launch --nproc_per_node 2`` (gloo on the CPU).
Every case trains the same model twice in this process - eagerly, then with blocks graphed by
autocudagraph on the simulated backend - from the same parameters, data and RNG state, and
compares outputs, grads and parameters bit for bit. Each case prints one line
``RESULT {json}``; the test reads them from both ranks' logs. The exit status is 1 when a case
failed.

Fleet is initialised once (data parallel degree 2). The tensor-parallel case hands the world
group to the layers as their model-parallel group, so all cases share one launch.
"""

import contextlib
import hashlib
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, get_rng_state_tracker
from paddle.distributed.fleet.utils import recompute
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

sys.path.insert(0, os.environ.get("PADDLEFLEET_ROOT", os.getcwd()))
from job import run_cases  # noqa: E402  (this script's folder is on sys.path)
from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from paddlefleet.cudagraph.guards.rng import generator_state_indices  # noqa: E402

STEPS = 4
RANK = 0


class Mismatch(AssertionError):
    pass


def check_same(what, actual, expected):
    """Raises Mismatch naming ``what`` unless the two (nested) values are equal bit for bit."""
    if isinstance(expected, dict):
        if sorted(actual) != sorted(expected):
            raise Mismatch(f"{what}: keys {sorted(actual)} != {sorted(expected)}")
        for k in expected:
            check_same(f"{what}[{k}]", actual[k], expected[k])
        return
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise Mismatch(f"{what}: length {len(actual)} != {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            check_same(f"{what}[{i}]", a, e)
        return
    if expected is None or actual is None:
        if actual is not expected:
            raise Mismatch(f"{what}: {actual!r} vs {expected!r}")
        return
    a, e = np.asarray(actual), np.asarray(expected)
    if a.dtype != e.dtype or a.shape != e.shape or a.tobytes() != e.tobytes():
        raise Mismatch(f"{what}: not bitwise equal; max |diff| {np.max(np.abs(a.astype('float64') - e)):.3g}")


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def grads(layer):
    return {n: None if p.grad is None else p.grad.numpy() for n, p in layer.named_parameters()}


def params(layer):
    return {n: p.numpy() for n, p in layer.named_parameters()}


def rank_data(seed, shape):
    """Different data on each rank, the same for the eager and the graphed run."""
    return np.random.RandomState(seed + 1000 * RANK).randn(*shape).astype("float32")


# ---------------------------------------------------------------- data parallel
class Block(paddle.nn.Layer):
    def __init__(self, d=16, h=32, dropout=0.0):
        super().__init__()
        self.fc1 = paddle.nn.Linear(d, h)
        self.fc2 = paddle.nn.Linear(h, d)
        self.drop = paddle.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(paddle.nn.functional.gelu(self.fc1(x))))


class GraphedMethodBlock(Block):
    @autocudagraph(backend="simulate", warmup_steps=1)
    def forward(self, x):
        return Block.forward(self, x)


class Net(paddle.nn.Layer):
    def __init__(self, block_cls=Block, graph_blocks=False, dropout=0.0, **graph_options):
        super().__init__()
        self.embed = paddle.nn.Linear(8, 16)
        self.blocks = paddle.nn.LayerList([block_cls(dropout=dropout) for _ in range(2)])
        self.norm = paddle.nn.LayerNorm(16)
        self.head = paddle.nn.Linear(16, 1)
        if graph_blocks:
            for block in self.blocks:
                autocudagraph(block, backend="simulate", warmup_steps=1, **graph_options)

    def forward(self, x, skip=()):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = block(x)
        return self.head(self.norm(x))


def train_dp(make_model, wrap, steps=STEPS, skip_at=lambda step: (), micro=1):
    """Trains wrap(model) with AdamW on this rank's data, ``micro`` micro-batches per step (all
    but the last under ``no_sync()``); returns per-step values and the model."""
    paddle.seed(1234 + RANK)  # different init per rank: the wrapper must broadcast rank 0's
    model = make_model()
    dp, opt = wrap(model)
    losses, step_grads = [], []
    for step in range(steps):
        for k in range(micro):
            x = paddle.to_tensor(rank_data(10 * step + k, [4, 8]))
            target = paddle.to_tensor(rank_data(100 + 10 * step + k, [4, 1]))
            with dp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                loss = paddle.nn.functional.mse_loss(dp(x, skip=skip_at(step)), target)
                loss.backward()
            losses.append(loss.numpy())
        step_grads.append(grads(model))
        opt.step()
        opt.clear_grad()
    return {"losses": losses, "grads": step_grads, "params": params(model)}, model


def paddle_dp(find_unused=False):
    def wrap(model):
        dp = paddle.DataParallel(model, find_unused_parameters=find_unused)
        return dp, paddle.optimizer.AdamW(1e-2, parameters=dp.parameters())

    return wrap


def fleet_dp(model):
    dp = fleet.distributed_model(model)
    if not isinstance(dp, paddle.DataParallel):
        raise AssertionError(f"fleet.distributed_model returned {type(dp).__name__}, expected DataParallel")
    return dp, fleet.distributed_optimizer(paddle.optimizer.AdamW(1e-2, parameters=dp.parameters()))


class RecomputedNet(Net):
    """Net whose blocks run under Paddle's default (reentrant) recompute."""

    def forward(self, x, skip=()):
        x = self.embed(x)
        for block in self.blocks:
            x = recompute(block, x)
        return self.head(self.norm(x))


def train_dp_recompute(make_model):
    """The recipe of docs/guides/distributed.md for data parallel with reentrant recompute: forward and
    backward under ``no_sync()``, then one ``fused_allreduce_gradients`` before the update (without them,
    recompute's inner backward fires the reducer's hooks a second time: "has been ready before")."""
    paddle.seed(1234 + RANK)
    model = make_model()
    dp = paddle.DataParallel(model)
    opt = paddle.optimizer.AdamW(1e-2, parameters=dp.parameters())
    losses, step_grads = [], []
    for step in range(STEPS):
        x = paddle.to_tensor(rank_data(10 * step, [4, 8]))
        x.stop_gradient = False  # reentrant recompute needs an input that requires grad
        target = paddle.to_tensor(rank_data(100 + 10 * step, [4, 1]))
        with dp.no_sync():
            loss = paddle.nn.functional.mse_loss(dp(x), target)
            loss.backward()
        fused_allreduce_gradients(list(dp.parameters()), None)
        losses.append(loss.numpy())
        step_grads.append(grads(model))
        opt.step()
        opt.clear_grad()
    return {"losses": losses, "grads": step_grads, "params": params(model)}, model


def case_dp_reentrant_recompute():
    eager, _ = train_dp_recompute(lambda: RecomputedNet())
    graphed, model = train_dp_recompute(lambda: RecomputedNet(graph_blocks=True))
    compare_runs(eager, graphed)
    stats = graph_stats(model)
    # Per block and step: recompute's forward under no_grad, then its backward re-run with grads: two keys.
    got = [(s["keys"], s["captures"], s["replays"], s["eager_calls"]) for s in stats]
    if got != [(2, 2, 2 * STEPS - 4, 0)] * len(stats):
        raise AssertionError(f"(keys, captures, replays, eager calls) per graphed block {got}: {stats}")
    return summary(graphed)


def graph_stats(model):
    return [block.forward.stats() for block in model.blocks]


def compare_runs(eager, graphed):
    for step, (a, e) in enumerate(zip(graphed["losses"], eager["losses"])):
        check_same(f"loss step {step}", a, e)
    for step, (a, e) in enumerate(zip(graphed["grads"], eager["grads"])):
        check_same(f"grads step {step}", a, e)
    check_same("final params", graphed["params"], eager["params"])


def expect_stats(stats, captures, replays):
    got = [(s["captures"], s["replays"], s["eager_calls"]) for s in stats]
    want = [(captures, replays, 0)] * len(stats)
    if got != want:
        raise AssertionError(f"(captures, replays, fallbacks) per graphed block {got} != {want}: {stats}")


def summary(run):
    """What the test compares across ranks: grads must be averaged, params broadcast."""
    return {
        "grads": digest(g for step in run["grads"] for g in step.values() if g is not None),
        "params": digest(run["params"].values()),
        "loss": digest(run["losses"]),
    }


def case_dp_paddle():
    eager, _ = train_dp(lambda: Net(), paddle_dp())
    graphed, model = train_dp(lambda: Net(graph_blocks=True), paddle_dp())
    compare_runs(eager, graphed)
    expect_stats(graph_stats(model), captures=1, replays=STEPS - 2)
    return summary(graphed)


def case_dp_fleet_decorated_method_with_dropout():
    eager, _ = train_dp(lambda: Net(dropout=0.1), fleet_dp)
    graphed, model = train_dp(lambda: Net(GraphedMethodBlock, dropout=0.1), fleet_dp)
    compare_runs(eager, graphed)
    expect_stats(graph_stats(model), captures=1, replays=STEPS - 2)
    return summary(graphed)


def case_dp_unused_block():
    # find_unused_parameters=True; block 1 (and its graph) is skipped on odd steps.
    skip = lambda step: (1,) if step % 2 else ()  # noqa: E731
    steps = STEPS + 2
    eager, _ = train_dp(lambda: Net(), paddle_dp(find_unused=True), steps, skip)
    graphed, model = train_dp(lambda: Net(graph_blocks=True), paddle_dp(find_unused=True), steps, skip)
    compare_runs(eager, graphed)
    stats = graph_stats(model)
    expect_stats(stats[:1], captures=1, replays=steps - 2)
    expect_stats(stats[1:], captures=1, replays=steps // 2 - 2)
    return summary(graphed)


# ---------------------------------------------------------------- collectives in a graph
def all_reduce_sum(x, group=None):
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)  # ReduceOp.AVG fails on gloo
    return x


class ReduceFromParallel(PyLayer):
    """Row-parallel output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CopyToParallel(PyLayer):
    """Column-parallel input: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad.clone(), ctx.group)


def parallel_mlp(x, w1_shard, w2_shard):
    """A Megatron MLP from plain tensors: column-parallel w1, row-parallel w2."""
    h = paddle.nn.functional.gelu(paddle.matmul(CopyToParallel.apply(x), w1_shard))
    return ReduceFromParallel.apply(paddle.matmul(h, w2_shard))


def case_dp_accumulation_default_grad_policy():
    # Two micro-batches per step (the first under no_sync): the default clone_param_grads="auto"
    # hands out aliases, p.grad adopts them, the reducer reads p.grad (NOTE [ Grad consumers ]).
    eager, _ = train_dp(lambda: Net(), paddle_dp(), micro=2)
    graphed, model = train_dp(lambda: Net(graph_blocks=True), paddle_dp(), micro=2)
    compare_runs(eager, graphed)
    expect_stats(graph_stats(model), captures=1, replays=2 * STEPS - 2)
    copies = [s["grad_copies"] for s in graph_stats(model)]
    if any(c > 4 for c in copies):  # at most the one-time moves of each block's 4 parameters
        raise AssertionError(f"needless grad copies under DataParallel: {copies}")
    return summary(graphed)


def case_dp_refuses_accumulation_in_graph():
    # accumulate_in_graph would skip the reducer's hooks: refused at capture, eager and correct.
    eager, _ = train_dp(lambda: Net(), paddle_dp())
    graphed, model = train_dp(lambda: Net(graph_blocks=True, accumulate_in_graph=True), paddle_dp())
    compare_runs(eager, graphed)
    for block in model.blocks:
        stats = block.forward.stats()
        if stats["captures"] != 0 or "would not be all-reduced" not in block.forward.explain():
            raise AssertionError(f"accumulate_in_graph under DataParallel was not refused: {stats}")
    return summary(graphed)


def case_all_reduce_in_graphed_function():
    graphed = autocudagraph(parallel_mlp, backend="simulate", warmup_steps=1)
    paddle.seed(7 + RANK)  # each rank holds its own shards
    shards = [paddle.randn([8, 16]), paddle.randn([16, 8])]
    for w in shards:
        w.stop_gradient = False
    ref = [w.detach().clone() for w in shards]
    for w in ref:
        w.stop_gradient = False
    outs = []
    for step in range(STEPS):
        x = paddle.to_tensor(np.random.RandomState(step).randn(4, 8).astype("float32"))  # replicated
        x.stop_gradient = False
        x_ref = x.detach().clone()
        x_ref.stop_gradient = False
        y, y_ref = graphed(x, *shards), parallel_mlp(x_ref, *ref)
        check_same(f"output step {step}", y.numpy(), y_ref.numpy())
        dy = paddle.to_tensor(np.random.RandomState(50 + step).randn(4, 8).astype("float32"))
        y.backward(dy)
        y_ref.backward(dy)
        check_same(f"x.grad step {step}", x.grad.numpy(), x_ref.grad.numpy())
        check_same(f"shard grads step {step}", [w.grad.numpy() for w in shards], [w.grad.numpy() for w in ref])
        outs += [y.numpy(), x.grad.numpy()]
    s = graphed.stats()
    if (s["captures"], s["replays"], s["eager_calls"]) != (1, STEPS - 2, 0):
        raise AssertionError(f"unexpected phases: {s}")
    # The all-reduced output and input grad are replicated: the test checks both ranks agree.
    return {"replicated": digest(outs)}


def case_all_reduce_no_grad_in_place():
    def reduce_scaled(x, scale):
        y = x * scale
        dist.all_reduce(y)  # in place, inside the graph
        return y + 1.0

    graphed = autocudagraph(reduce_scaled, backend="simulate", warmup_steps=1)
    outs = []
    with paddle.no_grad():
        for step in range(STEPS):
            x = paddle.to_tensor(rank_data(200 + step, [3, 5]))
            y, y_ref = graphed(x, 0.5), reduce_scaled(x, 0.5)
            check_same(f"output step {step}", y.numpy(), y_ref.numpy())
            outs.append(y.numpy())
    s = graphed.stats()
    if (s["captures"], s["replays"]) != (1, STEPS - 2):
        raise AssertionError(f"unexpected phases: {s}")
    return {"replicated": digest(outs)}


# ---------------------------------------------------------------- tensor parallel
class RowParallel(paddle.nn.Layer):
    """A row-parallel linear made of a PyLayer all-reduce: Paddle's RowParallelLinear does
    not run on the CPU (gloo refuses its all_reduce; see docs/guides/distributed.md)."""

    def __init__(self, in_features, out_features, group):
        super().__init__()
        self.group = group
        self.weight = self.create_parameter([in_features // group.nranks, out_features])
        self.bias = self.create_parameter([out_features], is_bias=True)

    def forward(self, x):
        return ReduceFromParallel.apply(paddle.matmul(x, self.weight), self.group) + self.bias


class TensorParallelMLP(paddle.nn.Layer):
    def __init__(self, group, d=8, h=16):
        super().__init__()
        self.up = ColumnParallelLinear(d, h, has_bias=True, gather_output=False, mp_group=group)
        self.down = RowParallel(h, d, group)

    def forward(self, x):
        h = paddle.nn.functional.gelu(self.up(x))
        with get_rng_state_tracker().rng_state("model_parallel_rng"):
            h = paddle.nn.functional.dropout(h, p=0.25)  # masks differ per rank, as they should
        return x + self.down(h)


def rng_state():
    return paddle.get_rng_state(), get_rng_state_tracker().get_states_tracker()


def set_rng_state(state):
    paddle.set_rng_state(state[0])
    # A fresh dict: Paddle 2.6's set_states_tracker adopts the dict (later rng_state blocks
    # write into it, so ``state`` would not be restorable twice); 3.x copies out of it.
    get_rng_state_tracker().set_states_tracker(dict(state[1]))


def next_draws():
    """What the default and the model-parallel generators draw next (their states are opaque)."""
    state = rng_state()
    default = paddle.rand([4]).numpy()
    with get_rng_state_tracker().rng_state("model_parallel_rng"):
        tracked = paddle.rand([4]).numpy()
    set_rng_state(state)
    return [default, tracked]


def case_tensor_parallel_layers():
    group = dist.new_group([0, 1])
    tracker = get_rng_state_tracker()
    if "model_parallel_rng" not in tracker.get_states_tracker():
        tracker.add("model_parallel_rng", 2024 + RANK)  # fleet.init adds it when mp_degree > 1
    paddle.seed(99)
    eager = TensorParallelMLP(group)
    graphed = TensorParallelMLP(group)
    graphed.set_state_dict(eager.state_dict())
    if eager.up.weight.shape != [8, 8] or not eager.up.is_mp:
        raise AssertionError(f"ColumnParallelLinear did not split: weight {eager.up.weight.shape}")
    autocudagraph(graphed, backend="simulate", warmup_steps=1)
    start = rng_state()
    runs = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        set_rng_state(start)
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        outs, step_grads = [], []
        for step in range(STEPS):
            x = paddle.to_tensor(np.random.RandomState(step).randn(4, 8).astype("float32"))
            x.stop_gradient = False
            y = model(x)
            (y * y).mean().backward()
            outs.append([y.numpy(), x.grad.numpy()])
            step_grads.append(grads(model))
            opt.step()
            opt.clear_grad()
        runs[name] = {"outs": outs, "grads": step_grads, "params": params(model), "rng": next_draws()}
    a, e = runs["graphed"], runs["eager"]
    check_same("outputs and x.grad", a["outs"], e["outs"])
    check_same("grads", a["grads"], e["grads"])
    check_same("final params", a["params"], e["params"])
    check_same("next draws of the default and model_parallel_rng generators", a["rng"], e["rng"])
    s = graphed.forward.stats()
    # A tracker block inside a graphed function is captured only where generators keep states by
    # index (3.x); on 2.6 it is refused on every backend (NOTE [ Random draws seen from generator
    # state ] in guards/rng.py) and every call is eager's.
    if generator_state_indices():
        phases_ok = (s["captures"], s["replays"], s["eager_calls"]) == (1, STEPS - 2, 0)
    else:
        phases_ok = s["captures"] == 0 and any("generator state indices" in r for r in s["eager_reasons"])
    if not phases_ok:
        raise AssertionError(f"unexpected phases: {s}")
    return {"replicated": digest(o for step in a["outs"] for o in step), "shard": digest([a["params"]["up.weight"]])}


CASES = [
    case_dp_paddle,
    case_dp_accumulation_default_grad_policy,
    case_dp_refuses_accumulation_in_graph,
    case_dp_fleet_decorated_method_with_dropout,
    case_dp_unused_block,
    case_dp_reentrant_recompute,
    case_all_reduce_in_graphed_function,
    case_all_reduce_no_grad_in_place,
    case_tensor_parallel_layers,
]


# Cases that need fleet.init (fleet.distributed_model, ColumnParallelLinear reading the strategy).
NEEDS_FLEET = {"dp_fleet_decorated_method_with_dropout", "tensor_parallel_layers"}


def fleet_unusable():
    """None where Fleet's DistributedStrategy can read its configs, else why not.

    Paddle 2.6's strategy getters (hybrid_configs, which fleet.init reads too) use protobuf's
    FieldDescriptor.label, which protobuf 7 removed: with protobuf >= 7 fleet.init fails.
    """
    try:
        fleet.DistributedStrategy().hybrid_configs  # noqa: B018 - the read is the probe
    except AttributeError as err:
        return (f"Fleet cannot read its DistributedStrategy on this Paddle with this protobuf ({err}); "
                "Paddle 2.6 needs protobuf<7 (docs/guides/compat.md)")
    return None


def init():
    """Fleet (data parallel degree 2) where its strategy works here, else the plain parallel env:
    returns (this rank, why Fleet is unusable or None)."""
    global RANK
    no_fleet = fleet_unusable()
    if no_fleet is None:
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {
            "dp_degree": 2,
            "mp_degree": 1,
            "pp_degree": 1,
            # The only tensor-parallel configuration that runs on the CPU (docs/guides/distributed.md).
            "mp_configs": {"mp_async_allreduce": True, "mp_skip_c_identity": True},
        }
        fleet.init(is_collective=True, strategy=strategy)
    else:
        dist.init_parallel_env()  # paddle.DataParallel and the collectives need no Fleet
    RANK = dist.get_rank()
    return RANK, no_fleet


def main():
    _, no_fleet = init()
    only = set(sys.argv[1:])
    skip = (lambda name: no_fleet if name in NEEDS_FLEET else None) if no_fleet is not None else None
    sys.exit(run_cases(CASES, RANK, only, skip))

if __name__ == "__main__":
    main()
