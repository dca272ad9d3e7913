"""Models we did not write: PaddleFormers' LLaMA, Paddle's vision models, Fleet's
main_grad wrappers, and inference and checkpoints after training.

Each test trains (or runs) a graphed model and the same eager model from the same state and seed,
and compares losses, outputs, every parameter, BatchNorm statistics and main_grad bit for bit;
counters pin that the graphs were captured and replayed. Models are tiny so the file runs in CI
time. PaddleFormers is optional (``pip install -r requirements-real-models.txt``): without it those
tests skip, and docs/guides/recipes.md records their last run.
"""

import os
import tempfile
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph

from testkit.harness import RECORD, BackendCase, for_each_backend, twin_layers
from testkit.real_models import (  # noqa: F401  (tools/real_models_bench.py imports them from here)
    TINY_LLAMA, graph_all, image_batches, paddleformers_skip_reason, stages, state_of, tiny_llama, token_batches,
    train_lm, train_vision, vision_model, vision_run,
)


def expect_each(layers, **counts):
    """Asserts every graphed Layer's counters (what each one captured and replayed)."""
    for layer in layers:
        stats = layer.forward.stats()
        got = {k: stats[k] for k in counts}
        if got != counts:
            raise AssertionError(f"{type(layer).__name__}: {got} != {counts}\n{layer.forward.explain()}")


# ---------------------------------------------------------------------------- PaddleFormers
@for_each_backend
class PaddleFormersLlamaTest(BackendCase):
    def setUp(self):
        super().setUp()
        reason = paddleformers_skip_reason()
        if reason:
            self.skipTest(reason)

    def _twins(self, **overrides):
        paddle.seed(5)
        eager = tiny_llama(**overrides)
        graphed = tiny_llama(**overrides)
        graphed.set_state_dict(eager.state_dict())
        return eager, graphed

    def test_decoder_layers_train_like_eager_with_dropout(self):
        eager, graphed = self._twins(attention_dropout=0.1)
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        batches = token_batches(10)
        want = train_lm(eager, batches)
        got = train_lm(graphed, batches)
        self.assertBitwise(got, want)
        expect_each(layers, captures=1, replays=8, warmup_calls=1, eager_calls=0)

    def test_caller_attention_mask_and_position_ids(self):
        # A padding mask (last two tokens of the second row padded) and explicit position ids:
        # the layers get the model's combined float mask and the int64 position ids as inputs.
        eager, graphed = self._twins()
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        mask = paddle.to_tensor([[1] * 8, [1] * 6 + [0] * 2], dtype="int64")
        positions = paddle.to_tensor([list(range(8)), list(range(8))], dtype="int64")
        call = dict(attention_mask=mask, position_ids=positions)
        batches = token_batches(5, seed=3)
        self.assertBitwise(train_lm(graphed, batches, **call), train_lm(eager, batches, **call))
        # The caller passes the same position_ids tensor each step: read in place, never copied.
        expect_each(layers, captures=1, replays=3, warmup_calls=1, eager_calls=0, input_copies_skipped=3)

    def test_decoder_layers_with_the_models_recompute_switch(self):
        overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        eager, graphed = self._twins(attention_dropout=0.1, **overrides)
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        batches = token_batches(10)
        want = train_lm(eager, batches)
        got = train_lm(graphed, batches)
        self.assertBitwise(got, want)
        # recompute's forward runs under no_grad and its backward re-runs with grad: two keys a layer.
        expect_each(layers, captures=2, replays=16, warmup_calls=2)

    def test_the_configs_default_use_cache_does_not_reach_the_layers_through_causal_lm(self):
        # LlamaConfig defaults to use_cache=True; LlamaForCausalLM.forward's own use_cache=False wins.
        from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

        paddle.seed(5)
        config = {k: v for k, v in TINY_LLAMA.items() if k != "use_cache"}
        eager, graphed = LlamaForCausalLM(LlamaConfig(**config)), LlamaForCausalLM(LlamaConfig(**config))
        self.assertIs(eager.config.use_cache, True)
        graphed.set_state_dict(eager.state_dict())
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        batches = token_batches(6, seed=4)
        self.assertBitwise(train_lm(graphed, batches), train_lm(eager, batches))
        expect_each(layers, captures=1, replays=4, warmup_calls=1, eager_calls=0)

    def test_use_cache_runs_eagerly_naming_past_key_values(self):
        eager, graphed = self._twins()
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        batches = token_batches(3)
        want = train_lm(eager, batches, use_cache=True)
        # (not assertWarns: it reads __warningregistry__ of every module, and transformers' lazy
        # modules then import what is not installed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train_lm(graphed, batches, use_cache=True)
        self.assertTrue(any("argument 'past_key_values' is a DynamicCache" in str(w.message) for w in caught))
        self.assertBitwise(got, want)
        expect_each(layers, captures=0, eager_calls=3)
        self.assertIn("Pass use_cache=False and past_key_values=None", layers[0].forward.explain())

    def test_eval_after_training_and_a_checkpoint_round_trip(self):
        eager, graphed = self._twins()
        layers = graph_all(list(graphed.model.layers), self.backend, warmup_steps=1)
        batches = token_batches(6)
        want = train_lm(eager, batches[:3])
        got = train_lm(graphed, batches[:3])
        self.assertBitwise(got, want)
        for model in (eager, graphed):
            model.eval()
        with paddle.no_grad():
            want_logits = [eager(ids)[0].numpy() for ids in batches]
            got_logits = [graphed(ids)[0].numpy() for ids in batches]
        self.assertBitwise(got_logits, want_logits)
        expect_each(layers, captures=2, replays=5)  # train: 1 + 1 replay; eval: 1 + 4 replays
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "llama.pdparams")
            paddle.save(graphed.state_dict(), path)
            self.assertEqual(sorted(paddle.load(path)), sorted(eager.state_dict()))
            graphed.set_state_dict(paddle.load(path))
        for model in (eager, graphed):
            model.train()
        self.assertBitwise(train_lm(graphed, batches[3:]), train_lm(eager, batches[3:]))


class StandInCache:
    """The key/value cache protocol of PaddleFormers and Hugging Face: update + get_seq_length."""

    def __init__(self):
        self.keys = []

    def update(self, k, v, layer_idx):
        self.keys.append(k)
        return paddle.concat(self.keys, axis=0), v

    def get_seq_length(self):
        return sum(k.shape[0] for k in self.keys)


@for_each_backend
class KeyValueCacheArgumentTest(BackendCase):
    """Without PaddleFormers: a cache argument runs eagerly, named, with the fix."""

    def test_a_cache_argument_runs_eagerly_naming_it(self):
        def attend(x, past_key_values=None):
            if past_key_values is not None:
                x, _ = past_key_values.update(x, x, 0)
            return paddle.tanh(x).sum(axis=0)

        graphed = self.graphed(attend, warmup_steps=1)
        x = paddle.ones([2, 4])
        want_cache, got_cache = StandInCache(), StandInCache()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [graphed(x * i, past_key_values=got_cache) for i in range(3)]
        want = [attend(x * i, past_key_values=want_cache) for i in range(3)]
        self.assertBitwise(got, want)
        self.assertEqual(got_cache.get_seq_length(), want_cache.get_seq_length())
        self.assertEqual(graphed.stats()["captures"], 0)
        self.assertEqual(sum("argument 'past_key_values' is a StandInCache" in str(w.message) for w in caught), 1)
        # The same function without a cache graphs as usual.
        with graphed.counters.expect(captures=1, replays=1, warmup_calls=1):
            for i in range(3):
                self.assertBitwise(graphed(x * i), attend(x * i))


class PaddleFormersQwen2Test(BackendCase):
    backend = "simulate"

    def test_qwen2_needs_paddles_paddlefleet(self):
        # PaddleFormers 1.2.0's Qwen2 imports transformers/gpt_provider.py, which raises ImportError
        # unless is_paddlefleet_available() (Paddle's own PaddleFleet) is True. Recorded here; when a
        # PaddleFormers release drops that requirement this test fails and Qwen2 gets its recipe test.
        if paddleformers_skip_reason():
            self.skipTest(paddleformers_skip_reason())
        from paddleformers.utils.import_utils import is_paddlefleet_available

        if is_paddlefleet_available():
            self.skipTest("Paddle's PaddleFleet is installed: Qwen2 imports here")
        with self.assertRaisesRegex(ImportError, "paddlefleet is required for gpt_provider"):
            import paddleformers.transformers.qwen2.modeling  # noqa: F401


# ---------------------------------------------------------------------------- vision
def deterministic_cudnn(case):
    """On a GPU, cuDNN may pick convolution algorithms whose results vary run to run; the eager
    run and the graphed run must each be reproducible to be compared bit for bit."""
    if case.backend != "cuda":
        return
    try:
        old = paddle.get_flags(["FLAGS_cudnn_deterministic"])
    except ValueError:  # a Paddle built without cuDNN has no such flag
        return
    paddle.set_flags({"FLAGS_cudnn_deterministic": True})
    case.addCleanup(paddle.set_flags, old)


@for_each_backend
class VisionModelTest(BackendCase):
    def setUp(self):
        super().setUp()
        deterministic_cudnn(self)

    def _check(self, name, steps=4):
        # One run per model, backend and steps: the rows of docs/reports/real_models.md read the same run (4 steps).
        run = vision_run(name, self.backend, steps=steps)
        RECORD.compared += run.compared
        self.assertEqual(run.failures, (), "the graphed training is not bitwise eager's")
        # train: warmup, capture, steps-2 replays; eval (another key): warmup, capture, 1 replay.
        counts = dict(captures=2, replays=steps - 1, warmup_calls=2, eager_calls=0)
        for stats, explain in zip(run.stats, run.explains):
            self.assertEqual({k: stats[k] for k in counts}, counts, explain)
        self.assertEqual(len(run.stats), 17 if name == "mobilenet_v2" else 4)  # every stage was checked

    def test_resnet18_stages(self):
        self._check("resnet18")

    def test_resnet50_stages(self):
        self._check("resnet50", steps=3)

    def test_mobilenet_v2_inverted_residuals(self):
        self._check("mobilenet_v2")

    def test_resnet18_checkpoint_round_trip_then_more_training(self):
        paddle.seed(1)
        eager, graphed = twin_layers(lambda: vision_model("resnet18"))
        graphed_stages = graph_all(stages("resnet18", graphed), self.backend, warmup_steps=1)
        xs, ys = image_batches(6)
        self.assertBitwise(train_vision(graphed, xs[:3], ys[:3]), train_vision(eager, xs[:3], ys[:3]))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "resnet.pdparams")
            paddle.save(graphed.state_dict(), path)
            saved = paddle.load(path)
            self.assertEqual(sorted(saved), sorted(eager.state_dict()))  # the wrapper adds no entry
            self.assertBitwise({k: v.numpy() for k, v in saved.items()}, state_of(eager))
            # Into the same graphed model (the graphs keep reading the parameters, updated in
            # place) and into a fresh graphed model.
            graphed.set_state_dict(saved)
            paddle.seed(1)
            fresh = vision_model("resnet18")
            fresh.set_state_dict(paddle.load(path))
        fresh_stages = graph_all(stages("resnet18", fresh), self.backend, warmup_steps=1)
        eager_copy = vision_model("resnet18")
        eager_copy.set_state_dict(eager.state_dict())
        want = train_vision(eager, xs[3:], ys[3:])
        self.assertBitwise(train_vision(graphed, xs[3:], ys[3:]), want)
        self.assertBitwise(train_vision(fresh, xs[3:], ys[3:]), train_vision(eager_copy, xs[3:], ys[3:]))
        expect_each(graphed_stages, captures=1, replays=4)
        expect_each(fresh_stages, captures=1, replays=1)


# ---------------------------------------------------------------------------- Fleet main_grad
class Block(paddle.nn.Layer):
    def __init__(self, width=16):
        super().__init__()
        self.fc1 = paddle.nn.Linear(width, 2 * width)
        self.fc2 = paddle.nn.Linear(2 * width, width)
        self.norm = paddle.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc2(paddle.nn.functional.gelu(self.fc1(x))))


def main_grad_model():
    return paddle.nn.Sequential(Block(), Block(), Block(), paddle.nn.Linear(16, 4))


def train_main_grad(inner, batches, accumulate=2):
    """MixPrecisionLayer + MixPrecisionOptimizer, ``accumulate`` micro-batches per step; the loss
    of each micro-batch, every main_grad before each step, then every parameter."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

    model = MixPrecisionLayer(inner, dtype="float16")
    opt = MixPrecisionOptimizer(paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters()))
    log = []
    for i, x in enumerate(batches):
        loss = model(x).square().mean()
        loss.backward()
        log.append(loss.numpy())
        if i % accumulate == accumulate - 1:
            log.append({n: p.main_grad.numpy() for n, p in inner.named_parameters()})
            log.append({n: p.grad is None for n, p in inner.named_parameters()})
            opt.step()
            opt.clear_grad()
    return log, state_of(inner)


@for_each_backend
class FleetMainGradTest(BackendCase):
    def _check(self, **options):
        paddle.seed(2)
        eager, graphed = twin_layers(main_grad_model)
        blocks = graph_all(list(graphed)[:3], self.backend, warmup_steps=1, **options)
        rs = np.random.RandomState(0)
        batches = [paddle.to_tensor(rs.randn(4, 16).astype("float32")) for _ in range(8)]
        want = train_main_grad(eager, batches)
        got = train_main_grad(graphed, batches)
        self.assertBitwise(got, want)
        expect_each(blocks, captures=1, replays=6, eager_calls=0)

    def test_main_grad_with_accumulation(self):
        self._check()

    def test_main_grad_with_clone_param_grads_off(self):
        # The hook calls _clear_data() on the grad it receives: here an alias of the static grad
        # buffer, whose own storage the next replay must still find.
        self._check(clone_param_grads=False)
