"""The real models the tests, tools/real_models_bench.py and the real-models report share: a tiny
PaddleFormers LLaMA (optional: ``pip install --no-deps -r requirements-real-models.txt``), Paddle's
vision models, their batches and eager training loops."""

import dataclasses
import functools

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step

from .common import bitwise_failures
from .differential import Trainee

__all__ = ["state_of", "graph_all", "paddleformers_skip_reason", "TINY_LLAMA", "tiny_llama", "token_batches",
           "train_lm", "llama_step_twins", "Rows", "vision_model", "stages", "train_vision", "image_batches",
           "VisionRun", "vision_run"]


def state_of(model):
    """Every parameter and buffer (BatchNorm statistics included), as numpy, by name."""
    return {k: v.numpy() for k, v in model.state_dict().items()}


def graph_all(layers, backend, **options):
    for layer in layers:
        autocudagraph(layer, backend=backend, **options)
    return layers


def paddleformers_skip_reason():
    try:
        import paddleformers.transformers  # noqa: F401
        from paddleformers.transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    except Exception as err:  # not installed, or it does not import with this Paddle
        return (f"PaddleFormers does not import here ({type(err).__name__}: {str(err).splitlines()[0][:160]}); "
                "install requirements-real-models.txt (docs/guides/recipes.md records the last run)")
    return None


TINY_LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, fuse_rms_norm=False, use_cache=False,
)


def tiny_llama(**overrides):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**dict(TINY_LLAMA, **overrides)))


def token_batches(n, seed=0, shape=(2, 8), vocab=64):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.randint(0, vocab, shape), dtype="int64") for _ in range(n)]


def train_lm(model, batches, seed=11, **call):
    """AdamW steps on random token ids; the loss of each step, then every parameter."""
    paddle.seed(seed)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids, **call)[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.numpy())
    return losses, state_of(model)


def _seeded(step, seeds):
    """``step`` after ``paddle.seed(next(seeds))``: the eager and the graphed twin draw the same dropout
    masks although their steps interleave on one generator."""

    def run(*args):
        paddle.seed(next(seeds))
        return step(*args)

    return run


def llama_step_twins(backend):
    """The whole training step of a tiny LLaMA with attention dropout, global-norm clipping, AdamW with
    weight decay and a cosine LR schedule, for ``testkit.differential.differential_run``: returns
    ``(build, graph, after_step, wrappers)``; ``wrappers`` gets the graphed step's wrapper."""
    wrappers = []

    def build():
        paddle.seed(5)
        model = tiny_llama(attention_dropout=0.1)
        sched = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=1e-3, T_max=20)
        opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), weight_decay=0.01,
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))

        def step(ids):
            loss = model(ids, labels=ids)[0]
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        trainee = Trainee(_seeded(step, iter(range(100, 200))), {"model": model, "opt": opt, "sched": sched})
        trainee.plain_step, trainee.seeds = step, iter(range(100, 200))
        return trainee

    def graph(trainee):
        wrappers.append(autocudagraph_step(trainee.plain_step, optimizers=[trainee.objects["opt"]], backend=backend))
        return _seeded(wrappers[0], trainee.seeds)

    def after_step(i, eager, graphed):
        for trainee in (eager, graphed):
            trainee.objects["sched"].step()

    return build, graph, after_step, wrappers


class Rows(paddle.io.Dataset):
    """Token rows for PaddleFormers' Trainer: ``{"input_ids", "labels"}`` of ``seq`` ids each."""

    def __init__(self, n=32, seq=8):
        rs = np.random.RandomState(0)
        self.rows = [rs.randint(0, 64, (seq,)).astype("int64") for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def vision_model(name):
    factory = getattr(paddle.vision.models, name)
    return factory(num_classes=10)


def stages(name, model):
    """The residual stages a user graphs: ResNet's layer1..layer4, MobileNetV2's inverted residuals."""
    if name.startswith("resnet"):
        return [model.layer1, model.layer2, model.layer3, model.layer4]
    return [block for block in model.features if type(block).__name__ == "InvertedResidual"]


def train_vision(model, images, labels, seed=3, eval_images=()):
    paddle.seed(seed)
    opt = paddle.optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=model.parameters())
    losses = []
    model.train()
    for x, y in zip(images, labels):
        loss = paddle.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.numpy())
    model.eval()
    with paddle.no_grad():
        evals = [model(x).numpy() for x in eval_images]
    return losses, evals, state_of(model)


def image_batches(n, seed=0, size=32, batch=4):
    # Batch 4, not 2: two identical eager trainings of mobilenet_v2 with batch 2 at 32x32 already
    # differ from their second step on, in one process, on Paddle 2.6.2 and 3.3.1 (CPU);
    # docs/guides/recipes.md has the measurement.
    rs = np.random.RandomState(seed)
    xs = [paddle.to_tensor(rs.randn(batch, 3, size, size).astype("float32")) for _ in range(n)]
    ys = [paddle.to_tensor(rs.randint(0, 10, (batch, 1)), dtype="int64") for _ in range(n)]
    return xs, ys


@dataclasses.dataclass(frozen=True)
class VisionRun:
    """What ``vision_run`` saw: each wrapper's stats() and explain(), and the graphed run against the eager one."""

    stats: tuple
    explains: tuple
    compared: int  # leaves compared bit for bit
    failures: tuple  # bitwise_failures' messages: empty when every leaf matched


@functools.lru_cache(maxsize=None)
def vision_run(name, backend, whole=False, steps=4):
    """Trains paddle.vision ``name`` graphed (each of its ``stages``, or the whole model; warmup_steps=1) and its
    eager twin from the same state and seed: ``steps`` Momentum steps (BatchNorm train), then 3 eval calls;
    compares losses, eval outputs and every parameter and buffer. Cached: the per-stage tests of
    tests/integration/test_real_models.py and the rows of docs/reports/real_models.md read one run."""
    paddle.seed(1)
    eager = vision_model(name)
    graphed = vision_model(name)
    graphed.set_state_dict(eager.state_dict())
    wrapped = [autocudagraph(graphed, backend=backend, warmup_steps=1)] if whole else \
        graph_all(stages(name, graphed), backend, warmup_steps=1)
    xs, ys = image_batches(steps)
    evals = image_batches(3, seed=1)[0]
    want = train_vision(eager, xs, ys, eval_images=evals)
    got = train_vision(graphed, xs, ys, eval_images=evals)
    compared, failures = bitwise_failures(got, want)
    return VisionRun(tuple(dict(layer.forward.stats()) for layer in wrapped),
                     tuple(layer.forward.explain() for layer in wrapped), compared, tuple(failures))
