"""Recompute around graphed Layers, and what verify_replays checks of grads.

NOTE [ Saved-tensors hooks ] in paddlefleet/cudagraph/saved_hooks.py has the root cause: calls
made under ``paddle.autograd.saved_tensors_hooks`` (non-reentrant recompute) run eagerly.
Every result is compared with the same eager run bit for bit.
"""

import warnings

import numpy as np
import paddle
from paddle.distributed.fleet.utils import recompute

from paddlefleet.cudagraph import is_capturing
from paddlefleet.cudagraph.guards import saved_hooks

from testkit.harness import BackendCase, clone_leaf, for_each_backend, grads_of, params_of, twin_layers


class Block(paddle.nn.Layer):
    def __init__(self, p=0.0):
        super().__init__()
        self.a = paddle.nn.Linear(8, 16)
        self.b = paddle.nn.Linear(16, 8)
        self.drop = paddle.nn.Dropout(p)

    def forward(self, x):
        return self.b(self.drop(paddle.tanh(self.a(x))))


def batches(n, seed=0):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.randn(4, 8).astype("float32")) for _ in range(n)]


def train(model, call, xs, seed=7):
    """AdamW steps; per step the loss, the input's grad and every parameter grad; then parameters."""
    paddle.seed(seed)
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
    log = []
    for x in xs:
        x = clone_leaf(x, stop_gradient=False)
        loss = call(x).square().mean()
        loss.backward()
        log.append([loss, x.grad, grads_of(model)])
        opt.step()
        opt.clear_grad()
    return log + [params_of(model)]


def non_reentrant_rng_reason():
    """None when Paddle's non-reentrant recompute can preserve the RNG state on this device."""
    x = paddle.ones([2])
    x.stop_gradient = False
    try:
        recompute(lambda t: t * 2, x, use_reentrant=False, preserve_rng_state=True).sum().backward()
    except RuntimeError as err:  # Paddle 2.6.2 on CPU: "Recompute with RNG perserve is not support ..."
        return f"Paddle {paddle.__version__}'s non-reentrant recompute cannot preserve RNG here: {err}"
    return None


@for_each_backend
class NonReentrantRecomputeTest(BackendCase):
    def test_non_reentrant_recompute_around_a_graphed_layer_trains_like_eager(self):
        eager, graphed = twin_layers(Block)
        self.graphed(graphed, warmup_steps=1, verify_replays=5)
        xs = batches(6)
        kw = {"use_reentrant": False, "preserve_rng_state": False}
        want = train(eager, lambda x: recompute(eager, x, **kw), xs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with graphed.forward.counters.expect(captures=0, replays=0, warmup_calls=0, eager_calls=12):
                got = train(graphed, lambda x: recompute(graphed, x, **kw), xs)
        self.assertBitwise(got, want)
        # Forward and backward re-run alike: 6 + 6 eager calls, each with the reason.
        self.assertEqual(graphed.forward.counters.eager_reasons[saved_hooks.REASON], 12)
        self.assertIn(saved_hooks.REASON, graphed.forward.explain())
        self.assertEqual(sum("saved_tensors_hooks are registered" in str(w.message) for w in caught), 1)

    def test_non_reentrant_recompute_with_dropout_trains_like_eager(self):
        reason = non_reentrant_rng_reason()
        if reason:
            self.skipTest(reason)
        eager, graphed = twin_layers(lambda: Block(p=0.3))
        self.graphed(graphed, warmup_steps=1)
        xs = batches(5)
        want = train(eager, lambda x: recompute(eager, x, use_reentrant=False), xs)
        got = train(graphed, lambda x: recompute(graphed, x, use_reentrant=False), xs)
        self.assertBitwise(got, want)
        self.assertEqual(graphed.forward.stats()["captures"], 0)

    def test_graphed_block_inside_a_non_reentrant_recompute_runs_eagerly(self):
        eager, graphed = twin_layers(Block)
        self.graphed(graphed, warmup_steps=1)

        def body(model):
            return lambda x: paddle.nn.functional.gelu(model(x)) + x

        kw = {"use_reentrant": False, "preserve_rng_state": False}
        xs = batches(5)
        want = train(eager, lambda x: recompute(body(eager), x, **kw), xs)
        got = train(graphed, lambda x: recompute(body(graphed), x, **kw), xs)
        self.assertBitwise(got, want)
        self.assertEqual(graphed.forward.stats()["captures"], 0)

    def test_the_same_layer_graphs_again_outside_the_recompute(self):
        eager, graphed = twin_layers(Block)
        self.graphed(graphed, warmup_steps=1)
        kw = {"use_reentrant": False, "preserve_rng_state": False}
        xs = batches(6)

        def step(model):
            return lambda x: model(recompute(model, x, **kw))

        want = train(eager, step(eager), xs)
        # The outer call (no hooks) warms up, captures and replays as always; the inner one is eager.
        with graphed.forward.counters.expect(captures=1, replays=4, warmup_calls=1, eager_calls=12):
            got = train(graphed, step(graphed), xs)
        self.assertBitwise(got, want)
        self.assertFalse(saved_hooks.active())


@for_each_backend
class ReentrantRecomputeTest(BackendCase):
    """Reentrant recompute (the default) around graphed callables."""

    def test_reentrant_recompute_around_a_graphed_function_trains_like_eager(self):
        eager, graphed = twin_layers(Block)
        graphed_fn = self.graphed(lambda x, layer: layer(x), warmup_steps=1)
        xs = batches(6)
        want = train(eager, lambda x: recompute(lambda h: eager(h), x), xs)
        got = train(graphed, lambda x: recompute(graphed_fn, x, graphed), xs)
        self.assertBitwise(got, want)
        # Forward under no_grad (its own key) and backward's re-run with grad: two keys, both graphed.
        stats = graphed_fn.stats()
        self.assertEqual((stats["keys"], stats["captures"]), (2, 2))
        self.assertEqual(stats["replays"], 8)

    def test_reentrant_recompute_around_a_graphed_layer_trains_like_eager(self):
        eager, graphed = twin_layers(Block)
        self.graphed(graphed, warmup_steps=1)
        xs = batches(6)
        want = train(eager, lambda x: recompute(eager, x), xs)
        got = train(graphed, lambda x: recompute(graphed, x), xs)
        self.assertBitwise(got, want)
        self.assertEqual(graphed.forward.stats()["captures"], 2)


@for_each_backend
class CaptureGradModeTest(BackendCase):
    def test_a_failed_capture_leaves_the_calls_grad_mode(self):
        # An unpack hook that raises inside the captured backward: Paddle then leaves grad mode
        # off (NOTE [ Saved-tensors hooks ]). The backward() retry and the eager run that replaces
        # the failed capture must still compute with grad, as the call asked.
        def refuse(_):
            raise ValueError("this unpack hook refuses")

        def fn(x, w):
            with paddle.autograd.saved_tensors_hooks(lambda t: t, refuse):
                return paddle.tanh(paddle.matmul(x, w))

        graphed = self.graphed(fn, warmup_steps=1)
        x = paddle.ones([2, 3])
        w = paddle.ones([3, 3])
        w.stop_gradient = False
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            graphed(x, w)
            y = graphed(x, w)
        self.assertTrue(paddle.is_grad_enabled())
        self.assertFalse(y.stop_gradient)
        self.assertEqual(graphed.stats()["captures"], 0)
        self.assertIn("capture failed", graphed.explain())


@for_each_backend
class VerifyGradsTest(BackendCase):
    def test_verify_replays_catches_outputs_that_lost_their_grads(self):
        # Graph-unsafe code: the output is cut from autograd while capturing, so the graph has
        # no backward and every replay's output needs no grad. Eager's does: verify must see it.
        def fn(x, w):
            y = paddle.matmul(x, w)
            return y.detach() if is_capturing() else y

        graphed = self.graphed(fn, warmup_steps=1, verify_replays=3)
        x = paddle.ones([2, 3])
        w = paddle.full([3, 3], 0.5)
        w.stop_gradient = False
        ws = clone_leaf(w)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed(x, w).sum().backward()
            graphed(x, w).sum().backward()
            graphed(x, w).sum().backward()
        fn(x, ws).sum().backward()
        fn(x, ws).sum().backward()
        fn(x, ws).sum().backward()
        self.assertEqual(graphed.stats()["verify_mismatches"], 1)
        self.assertIn("requires grad in eager but not in the graph", graphed.explain())
        self.assertTrue(any("does not reproduce eager" in str(w_.message) for w_ in caught))
        self.assertBitwise(w.grad, ws.grad)
