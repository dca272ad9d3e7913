"""Training correctness: graphed training is indistinguishable from eager training.

Gradient accumulation and grad lifetime, warmup/capture leaving no trace, the clone policies,
dropout RNG (default generator and Fleet's tracker), AMP keying, recompute, parameters that
change, train/eval. Every graphed result is compared with eager bit for bit, and the phases are
pinned with the counters so a test cannot pass by running everything eagerly.
"""

import contextlib
import dataclasses
import types
import unittest
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.amp import grad_scaler
from paddle.amp.auto_cast import amp_global_state, amp_initialize
from paddle.base import core
from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
from paddle.distributed.fleet.utils import recompute
from parameterized import parameterized

from paddlefleet.cudagraph.core import state
from paddlefleet.cudagraph.guards import rng
from paddlefleet.cudagraph.errors import CaptureError

from testkit.harness import (
    add_tracker_state,
    BackendCase,
    clear_grads,
    clone_leaf,
    for_each_backend,
    grads_of,
    params_of,
    twin_layers,
)

TRACKER_STATE = "cg_training_test"
TRACKER_SEED = 90210


# ---------------------------------------------------------------------------- models and data
class MLP(paddle.nn.Layer):
    """Linear -> [BatchNorm] -> GELU -> [Dropout] -> Linear; [dropout under the tracker]."""

    def __init__(self, width=8, hidden=16, p=0.0, norm=False, tracked_p=0.0):
        super().__init__()
        self.fc1 = paddle.nn.Linear(width, hidden)
        self.fc2 = paddle.nn.Linear(hidden, width)
        self.norm = paddle.nn.BatchNorm1D(hidden) if norm else None
        self.drop = paddle.nn.Dropout(p) if p else None
        self.tracked_p = tracked_p

    def forward(self, x):
        h = self.fc1(x)
        if self.norm is not None:
            h = self.norm(h)
        h = F.gelu(h)
        if self.drop is not None:
            h = self.drop(h)
        if self.tracked_p:
            with get_rng_state_tracker().rng_state(TRACKER_STATE):
                h = F.dropout(h, self.tracked_p, training=self.training)
        return self.fc2(h)


class RecomputedMLP(MLP):
    """The MLP body runs under fleet's recompute (reentrant: its backward calls backward())."""

    def forward(self, x):
        return recompute(super().forward, x)


class CastingScale(paddle.nn.Layer):
    """Elementwise layer that casts its parameters to the input dtype (runs in bf16 on CPU)."""

    def __init__(self, width=8):
        super().__init__()
        self.w = self.create_parameter([width])
        self.b = self.create_parameter([width], is_bias=True)

    def forward(self, x):
        return paddle.tanh(x * self.w.astype(x.dtype) + self.b.astype(x.dtype))


def batches(n, shape=(4, 8), seed=7):
    """``n`` float32 tensors from numpy (the Paddle generators are left alone)."""
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.standard_normal(shape).astype("float32")) for _ in range(n)]


def state_of(layer):
    """Every parameter and buffer (BatchNorm's running statistics are non-trainable parameters)."""
    return {n: t.numpy() for n, t in layer.state_dict().items()}


def rng_draws(tracker=True):
    """Draws from the default generator (and the tracker state): equal draws, equal states.
    Consumes them, so call it at the same points of the eager and the graphed run."""
    out = [paddle.rand([4]).numpy()]
    if tracker:
        with get_rng_state_tracker().rng_state(TRACKER_STATE):
            out.append(paddle.rand([4]).numpy())
    return out


def mse(y):
    return (y * y).mean()


@contextlib.contextmanager
def gpu_amp_state(level, dtype):
    """The state ``paddle.amp.auto_cast(level=..., dtype=...)`` sets on a GPU.

    On a CPU build auto_cast only warns and sets nothing, and no op casts even under this
    state (measured on Paddle 3.3.1), so only the keying and the replay under the state can be
    tested here; the numerics of a real cast are a GPU matter.
    """
    tracer = paddle.base.framework._dygraph_tracer()
    glob = amp_global_state()
    saved = (tracer._amp_level, tracer._amp_dtype, glob.amp_dtype)
    try:
        tracer._amp_level = {"O1": core.AmpLevel.O1, "O2": core.AmpLevel.O2}[level]
        tracer._amp_dtype = dtype
        glob.amp_dtype = dtype
        yield
    finally:
        tracer._amp_level, tracer._amp_dtype, glob.amp_dtype = saved


def enabled_grad_scaler(**kwargs):
    """A GradScaler that scales on the CPU (its constructor disables itself off-GPU)."""
    place = types.SimpleNamespace(
        is_gpu_place=lambda: True, is_xpu_place=lambda: False, is_custom_place=lambda: False
    )
    real = grad_scaler._dygraph_tracer
    grad_scaler._dygraph_tracer = lambda: types.SimpleNamespace(_expected_place=place)
    try:
        return paddle.amp.GradScaler(**kwargs)
    finally:
        grad_scaler._dygraph_tracer = real


class TrackerCase(BackendCase):
    """Adds a named state to Fleet's RNG tracker for the test and removes it afterwards."""

    def setUp(self):
        super().setUp()
        self._tracker_start = add_tracker_state(self, TRACKER_STATE, TRACKER_SEED)

    def tracker_blocks_captured(self):
        """Whether a tracker rng_state block inside a graphed function is captured here: not with a
        Paddle without generator state indices, on any backend (NOTE [ Random draws seen from
        generator state ] in guards/rng.py), where the key runs eagerly instead."""
        return rng.generator_state_indices()

    def reseed(self, seed=11):
        """Same starting point for the default generator and the tracker state."""
        paddle.seed(seed)
        # A fresh dict every time: Paddle 2.6's set_states_tracker adopts the dict it is given
        # (later rng_state blocks write into it), 3.x copies the states out of it.
        get_rng_state_tracker().set_states_tracker(dict(self._tracker_start))


# ---------------------------------------------------------------------------- item 1
@for_each_backend
class GradAccumulationTest(BackendCase):
    def _train(self, model, xs, micro, steps, set_to_zero, log_input_grads=True):
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
        log = []
        for s in range(steps):
            for k in range(micro):
                x = clone_leaf(xs[s * micro + k], stop_gradient=False)
                loss = mse(model(x))
                loss.backward()
                log.append(loss)
                if log_input_grads:
                    log.append(x.grad)
            log.append(grads_of(model))
            opt.step()
            opt.clear_grad(set_to_zero=set_to_zero)
        log.append(params_of(model))
        return log

    @parameterized.expand(
        [
            (f"{micro}_micro_from_{start}_clone_{clone}", micro, start, clone)
            for micro in (1, 2, 3, 4)
            for start in ("zero", "none")
            for clone in (True, False, "auto")
        ]
    )
    def test_accumulation_matches_eager(self, _, micro, start, clone):
        steps = 3
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, clone_param_grads=clone)
        if start == "zero":  # p.grad allocated and zero before the first micro-batch
            for layer in (eager, graphed):
                for p in layer.parameters():
                    p.grad = paddle.zeros_like(p)
        xs = batches(steps * micro)
        want = self._train(eager, xs, micro, steps, set_to_zero=start == "zero")
        got = self._train(graphed, xs, micro, steps, set_to_zero=start == "zero")
        self.assertBitwise(got, want, "losses, input grads, param grads per step, final params")
        stats = graphed.forward.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (1, steps * micro - 2))

    @parameterized.expand([("clone", True), ("no_clone", False), ("auto", "auto")])
    def test_first_micro_batch_from_none_grad_survives_next_replay(self, _, clone):
        # The first micro-batch after clear_grad(set_to_zero=False) fills p.grad from None; a
        # second micro-batch with zero loss must leave it unchanged. If p.grad aliased the
        # static grad buffer, the zero-loss replay would overwrite it with zeros.
        layer = self.graphed(MLP(), clone_param_grads=clone, warmup_steps=0)
        x1, x2 = batches(2)
        mse(layer(x1)).backward()  # capture
        clear_grads(layer, set_to_zero=False)
        with layer.forward.counters.expect(replays=2, captures=0):
            mse(layer(x1)).backward()
            first = grads_of(layer)
            (mse(layer(x2)) * 0.0).backward()
        self.assertBitwise(grads_of(layer), first, "grads after a zero-loss micro-batch")

    def test_grads_across_optimizer_steps_with_sgd_and_set_to_zero_default(self):
        eager, graphed = twin_layers(lambda: MLP(p=0.25))
        self.graphed(graphed)
        xs = batches(6)

        def run(model):
            paddle.seed(3)
            opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
            log = []
            for x in xs:
                mse(model(x)).backward()
                log.append(grads_of(model))
                opt.step()
                opt.clear_grad()
            return log + [params_of(model)]

        self.assertBitwise(run(graphed), run(eager))
        self.assertEqual(graphed.forward.stats()["replays"], 4)


# ---------------------------------------------------------------------------- item 2
@for_each_backend
class NoTraceTest(TrackerCase):
    def _steps(self, model, xs):
        """Per call: loss, param grads (accumulating, never cleared), input grad, buffers, RNG."""
        self.reseed()
        log = []
        for x in xs:
            x = clone_leaf(x, stop_gradient=False)
            loss = mse(model(x))
            loss.backward()
            log.append([loss, grads_of(model), x.grad, state_of(model), rng_draws()])
        return log

    def test_warmup_and_capture_leave_no_trace(self):
        # BatchNorm running statistics, dropout on the default generator and on the tracker,
        # grads that keep accumulating: the capture call must look exactly like an eager call.
        factory = lambda: MLP(p=0.5, norm=True, tracked_p=0.5)  # noqa: E731
        eager, graphed = twin_layers(factory)
        self.graphed(graphed, warmup_steps=2)
        xs = batches(5)
        want = self._steps(eager, xs)
        phases = dict(captures=1, replays=2) if self.tracker_blocks_captured() else dict(captures=0, replays=0)
        with graphed.forward.counters.expect(warmup_calls=2, **phases):
            got = self._steps(graphed, xs)
        self.assertBitwise(got, want)

    def test_plain_function_input_grads_and_rng_untouched_by_capture(self):
        w_e = paddle.create_parameter([8, 8], "float32")
        w_g = clone_leaf(w_e)

        def body(x, w):
            return F.dropout(paddle.matmul(x, w), 0.5)

        graphed = self.graphed(body, warmup_steps=1)
        xs = batches(4)

        def run(fn, w):
            self.reseed()
            log = []
            for x in xs:
                x = clone_leaf(x, stop_gradient=False)
                mse(fn(x, w)).backward()
                log.append([x.grad, w.grad, rng_draws()])
            return log

        want = run(body, w_e)
        got = run(graphed, w_g)
        self.assertBitwise(got, want)
        self.assertEqual(graphed.stats()["captures"], 1)

    def test_grad_handles_taken_before_a_graphed_backward_stay_valid(self):
        # Optimizers, reducers and users keep handles on p.grad; the captured backward (and the
        # simulated replay) must neither free them nor move p.grad, as eager does not.
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, warmup_steps=1)
        xs = batches(4)

        def run(model):
            mse(model(xs[0])).backward()
            handles = {n: p.grad for n, p in model.named_parameters()}
            ptrs = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
            for x in xs[1:]:
                mse(model(x)).backward()
            for n, p in model.named_parameters():
                self.assertEqual(p.grad.data_ptr(), ptrs[n], f"{n}: p.grad moved")
                self.assertTrue(handles[n]._is_initialized(), f"{n}: a handle on p.grad was freed")
            return {n: h.numpy() for n, h in handles.items()}

        self.assertBitwise(run(graphed), run(eager), "grads seen through earlier handles")
        self.assertEqual(graphed.forward.stats()["replays"], 2)


# ---------------------------------------------------------------------------- items 3 and 4
@for_each_backend
class ClonePolicyTest(BackendCase):
    def _hooked(self, layer):
        """Keeps every grad tensor that autograd hands fc1.weight's hook after a backward."""
        seen = []
        layer.fc1.weight.register_hook(seen.append)
        return seen

    def test_param_grads_are_cloned_by_default(self):
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, warmup_steps=0)
        xs = batches(4)
        kept_e, kept_g = self._hooked(eager), self._hooked(graphed)
        for model in (eager, graphed):
            for x in xs:
                mse(model(x)).backward()
        # A hook that keeps the grad tensor sees the values of its own backward forever.
        self.assertBitwise([g.numpy() for g in kept_g], [g.numpy() for g in kept_e])
        self.assertEqual(graphed.forward.stats()["replays"], 3)

    def test_param_hooks_do_not_run_during_capture(self):
        # The capture's backward body takes grads with paddle.grad, which runs no parameter
        # hook; run by backward(), the hooks' kernels would be recorded into the backward graph
        # on CUDA (a main_grad hook would add twice per replay). NOTE [ Backward body ].
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, warmup_steps=0)
        calls = {"eager": 0, "graphed": 0}
        eager.fc1.weight.register_hook(lambda g: calls.__setitem__("eager", calls["eager"] + 1))
        graphed.fc1.weight.register_hook(lambda g: calls.__setitem__("graphed", calls["graphed"] + 1))
        for x in batches(3):
            mse(eager(x)).backward()
            mse(graphed(x)).backward()
        self.assertEqual(calls["graphed"], calls["eager"])

    def test_no_clone_param_grads_are_overwritten_by_a_later_backward_replay(self):
        # The documented cost of clone_param_grads=False: a grad kept past later backward replays
        # (here by a hook) shows a later replay's values once its buffer set is written again
        # (NOTE [ Two grad buffer sets ]). p.grad itself stays correct.
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, warmup_steps=0, clone_param_grads=False)
        xs = batches(5)
        kept_e, kept_g = self._hooked(eager), self._hooked(graphed)
        for model in (eager, graphed):
            for x in xs:  # the graphed model: the capture call, then 4 replays
                mse(model(x)).backward()
        kept_g = [g.numpy() for g in kept_g]
        kept_e = [g.numpy() for g in kept_e]
        overwritten = [(i, j) for i in range(1, 5) for j in range(i + 1, 5)
                       if np.array_equal(kept_g[i], kept_e[j]) and not np.array_equal(kept_e[i], kept_e[j])]
        self.assertTrue(overwritten, "no kept grad shows a later replay's values")
        self.assertBitwise(grads_of(graphed), grads_of(eager), "p.grad")

    def _aliases_static_buffer(self, wrapper, t):
        ptrs = {g.data_ptr() for e in wrapper.entries().values() if e.graphs
                for plan in e.graphs.plans() for g in plan.static_grads if g is not None}
        return t.data_ptr() in ptrs

    def test_clone_param_grads_is_fixed_at_capture(self):
        layer = MLP()
        self.graphed(layer, warmup_steps=0, clone_param_grads=False)
        kept = self._hooked(layer)
        x1, x2, x3 = batches(3)
        mse(layer(x1)).backward()  # captured with clone_param_grads=False
        wrapper = layer.forward
        wrapper._options = dataclasses.replace(wrapper.options, clone_param_grads=True)
        for x in (x2, x3):
            mse(layer(x)).backward()
            # Still the capture-time policy: what the replay handed out is a static buffer.
            self.assertTrue(self._aliases_static_buffer(wrapper, kept[-1]))
        # A key captured after the change gets the new policy: its grads are copies.
        for x in batches(3, shape=(6, 8), seed=9):
            mse(layer(x)).backward()
            self.assertFalse(self._aliases_static_buffer(wrapper, kept[-1]))
        self.assertEqual(wrapper.stats()["captures"], 2)

    def test_outputs_are_cloned_by_default(self):
        graphed = self.graphed(paddle.nn.Linear(8, 8), warmup_steps=0)
        eager = paddle.nn.Linear(8, 8)
        eager.set_state_dict(graphed.state_dict())
        xs = batches(3)
        with paddle.no_grad():
            outs = [graphed(x) for x in xs]
            want = [eager(x) for x in xs]
        self.assertBitwise(outs, want, "outputs kept across replays")
        self.assertEqual(graphed.forward.stats()["replays"], 2)

    def test_static_outputs_are_overwritten_by_the_next_replay(self):
        graphed = self.graphed(paddle.nn.Linear(8, 8), warmup_steps=0, clone_outputs=False)
        xs = batches(3)
        with paddle.no_grad():
            first = graphed(xs[0])  # capture
            second = graphed(xs[1])  # replay: writes into the same buffer
            self.assertEqual(first.data_ptr(), second.data_ptr())
            self.assertBitwise(first, second)
            expected_third = graphed.forward.__wrapped__(graphed, xs[2])
            graphed(xs[2])
        self.assertBitwise(first, expected_third, "an output held across a replay")

    def test_static_outputs_in_training_are_overwritten_too(self):
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, warmup_steps=0, clone_outputs=False)
        xs = batches(3)
        outs = []
        for x in xs:
            y = graphed(x)
            mse(y).backward()
            outs.append(y)
        ref = eager(xs[2])
        self.assertBitwise(outs[0], ref, "first output after the third replay")
        self.assertBitwise(grads_of(graphed), self._grads_eager(eager, xs), "grads are unaffected")

    @staticmethod
    def _grads_eager(layer, xs):
        clear_grads(layer, set_to_zero=False)
        for x in xs:
            mse(layer(x)).backward()
        return grads_of(layer)

    @parameterized.expand(
        [
            ("clone_param_grads_int", {"clone_param_grads": 1}, TypeError, "clone_param_grads must be True, False or .auto., got 1 .int."),
            ("clone_outputs_str", {"clone_outputs": "no"}, TypeError, "clone_outputs=False returns static buffers"),
            ("clone_param_grads_none", {"clone_param_grads": None}, TypeError, "clone_param_grads must be True, False or .auto., got None"),
        ]
    )
    def test_bad_clone_options_fail_at_decoration(self, _, options, error, text):
        with self.assertRaisesRegex(error, text):
            self.graphed(MLP(), **options)


# ---------------------------------------------------------------------------- item 5
@for_each_backend
class DropoutRngTest(TrackerCase):
    def test_masks_differ_per_replay_and_match_eager(self):
        def drop(x):
            return F.dropout(x, 0.5)

        graphed = self.graphed(drop, warmup_steps=1)
        ones = paddle.ones([4096])

        def run(fn):
            self.reseed(5)
            return [fn(ones).numpy() for _ in range(6)] + [rng_draws(tracker=False)]

        want = run(drop)
        with graphed.counters.expect(warmup_calls=1, captures=1, replays=4):
            got = run(graphed)
        self.assertBitwise(got, want, "masks and the generator afterwards")
        masks = [m != 0 for m in got[:-1]]
        for i in range(len(masks)):
            self.assertTrue(0.45 < masks[i].mean() < 0.55, f"keep rate {masks[i].mean()}")
            for j in range(i):
                self.assertFalse(np.array_equal(masks[i], masks[j]), f"calls {j} and {i} share a mask")

    def test_tracker_rng_state_blocks_match_eager(self):
        # Dropout on the default generator and inside rng_state(name): both streams advance per
        # replay as eager advances them, and both are restored after capture.
        eager, graphed = twin_layers(lambda: MLP(p=0.3, tracked_p=0.5))
        self.graphed(graphed, warmup_steps=1)
        xs = batches(5)

        def run(model):
            self.reseed()
            opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
            log = []
            for x in xs:
                loss = mse(model(x))
                loss.backward()
                log.append([loss, grads_of(model)])
                opt.step()
                opt.clear_grad()
            return log + [params_of(model), rng_draws()]

        want = run(eager)
        phases = dict(captures=1, replays=3) if self.tracker_blocks_captured() else dict(captures=0, replays=0)
        with graphed.forward.counters.expect(**phases):
            got = run(graphed)
        self.assertBitwise(got, want)

    def test_call_inside_a_tracker_block_matches_eager(self):
        graphed_fn = self.graphed(lambda x: F.dropout(x, 0.5), warmup_steps=1)

        def run(fn):
            self.reseed()
            out = []
            for _ in range(4):
                with get_rng_state_tracker().rng_state(TRACKER_STATE):
                    out.append(fn(paddle.ones([256])))
            return out + [rng_draws()]

        want = run(lambda x: F.dropout(x, 0.5))
        got = run(graphed_fn)
        self.assertBitwise(got, want)
        self.assertEqual(graphed_fn.stats()["replays"], 2)


class DrawGuardTest(unittest.TestCase):
    """Which random draws rng.DrawGuard refuses in a recording capture (NOTE [ Random draws seen
    from generator state ]); the lifecycle's use of it is in test_footguns.py."""

    def setUp(self):
        add_tracker_state(self, TRACKER_STATE, TRACKER_SEED)
        paddle.seed(11)

    def problem(self, body, state_indices, enabled=True, backward=False):
        guard = rng.DrawGuard(enabled=enabled, backward=backward, state_indices=state_indices)
        with guard:
            body()
        return None if guard.problem is None else guard.problem[:2]

    @staticmethod
    def tracked_dropout():
        with get_rng_state_tracker().rng_state(TRACKER_STATE):
            F.dropout(paddle.ones([8]), 0.5)

    def test_tracker_dropout_inside_is_refused_only_without_state_indices(self):
        self.assertEqual(self.problem(self.tracked_dropout, state_indices=False), ("foreign state", "dropout"))
        self.assertIsNone(self.problem(self.tracked_dropout, state_indices=True))

    def test_capture_that_starts_inside_the_tracker_block_is_not_refused(self):
        with get_rng_state_tracker().rng_state(TRACKER_STATE):
            self.assertIsNone(self.problem(lambda: F.dropout(paddle.ones([8]), 0.5), state_indices=False))

    def test_default_dropout_after_a_tracker_block_without_draws_is_not_refused(self):
        def body():
            with get_rng_state_tracker().rng_state(TRACKER_STATE):
                pass
            F.dropout(paddle.ones([8]), 0.5)

        self.assertIsNone(self.problem(body, state_indices=False))

    def test_kernels_without_a_replay_reseed_are_refused_everywhere(self):
        for indices in (True, False):
            self.assertEqual(self.problem(lambda: paddle.rand([3]), indices), ("frozen", "uniform"))
            self.assertEqual(self.problem(lambda: paddle.randn([3]), indices), ("frozen", "gaussian"))
            self.assertIsNone(self.problem(lambda: paddle.rand([3]), indices, enabled=False))

    def test_every_random_function_is_refused_without_a_list_of_names(self):
        for name, draw in random_draws():
            with self.subTest(name):
                problem = self.problem(draw, generator_state_indices_or_not())
                self.assertIsNotNone(problem, name)
                self.assertIn(problem[0], ("frozen", "outside"), problem)

    def test_ops_that_draw_nothing_pass(self):
        def body():
            x = paddle.ones([4, 4])
            paddle.matmul(x, x).sum()
            F.dropout(x, 0.0)

        self.assertIsNone(self.problem(body, generator_state_indices_or_not()))

    def test_a_seed_inside_the_capture_is_refused(self):
        problem = self.problem(lambda: (paddle.seed(3), paddle.ones([2]) * 2), generator_state_indices_or_not())
        self.assertEqual(problem[0], "outside")

    def test_a_backward_draw_after_a_rewind_is_refused_whatever_the_kernel(self):
        def body():
            saved = paddle.get_rng_state()
            paddle.set_rng_state(saved)
            F.dropout(paddle.ones([8]), 0.5)

        self.assertEqual(self.problem(body, generator_state_indices_or_not(), backward=True),
                         ("after rewind", "dropout"))
        self.assertIsNone(self.problem(body, generator_state_indices_or_not(), backward=False))

    def test_a_forward_drawing_again_from_a_state_it_set_back_is_refused(self):
        """R-Drop: a replay re-seeds the second dropout with a new offset instead of the state set
        back, so its mask would differ from the first where eager's are equal."""
        def body():
            saved = paddle.get_rng_state()
            F.dropout(paddle.ones([8]), 0.5)
            paddle.set_rng_state(saved)
            F.dropout(paddle.ones([8]), 0.5)

        self.assertEqual(self.problem(body, generator_state_indices_or_not()), ("after rewind", "dropout"))

    def test_the_refusal_names_the_kernel_and_the_users_line(self):
        guard = rng.DrawGuard(state_indices=True)
        with guard:
            paddle.poisson(paddle.ones([3]))
        with self.assertRaisesRegex(CaptureError, r"random kernel 'poisson' \(at .*test_training.py:\d+\)"):
            guard.check()

    def test_ops_are_restored_and_draws_unchanged(self):
        originals = {n: getattr(paddle._C_ops, n) for n in ("dropout", "uniform", "matmul")}
        setters = (paddle.set_rng_state, paddle.set_cuda_rng_state)
        paddle.seed(5)
        self.problem(self.tracked_dropout, state_indices=False)
        self.problem(lambda: paddle.poisson(paddle.ones([3])), state_indices=False)
        guarded = paddle.rand([4]).numpy()
        paddle.seed(5)
        self.tracked_dropout()
        paddle.poisson(paddle.ones([3]))
        np.testing.assert_array_equal(guarded, paddle.rand([4]).numpy(), strict=True)
        for name, fn in originals.items():
            self.assertIs(getattr(paddle._C_ops, name), fn)
        self.assertEqual((paddle.set_rng_state, paddle.set_cuda_rng_state), setters)


def generator_state_indices_or_not():
    return rng.generator_state_indices()


def random_draws():
    """``[(name, function)]``: Paddle's random functions a CUDA graph would freeze, those this
    Paddle has (none of them is dropout)."""
    ones = lambda: paddle.ones([4, 3])  # noqa: E731
    candidates = [
        ("paddle.rand", lambda: paddle.rand([3])),
        ("paddle.randn", lambda: paddle.randn([3])),
        ("paddle.randint", lambda: paddle.randint(0, 5, [3])),
        ("paddle.randperm", lambda: paddle.randperm(5)),
        ("paddle.bernoulli", lambda: paddle.bernoulli(paddle.full([3], 0.5))),
        ("paddle.multinomial", lambda: paddle.multinomial(paddle.full([3], 0.3))),
        ("paddle.poisson", lambda: paddle.poisson(ones())),
        ("F.gumbel_softmax", lambda: F.gumbel_softmax(ones())),
        ("F.rrelu", lambda: F.rrelu(-ones(), training=True)),
        ("paddle.normal", lambda: paddle.normal(shape=[3])),
        ("Tensor.uniform_", lambda: ones().uniform_()),
        ("Tensor.exponential_", lambda: ones().exponential_()),
        ("paddle.binomial", lambda: paddle.binomial(paddle.full([3], 5, "int64"), paddle.full([3], 0.5))),
        ("paddle.standard_gamma", lambda: paddle.standard_gamma(ones())),
        ("Tensor.random_", lambda: ones().random_()),
        ("Tensor.normal_", lambda: ones().normal_()),
        ("Tensor.bernoulli_", lambda: ones().bernoulli_(0.5)),
        ("Dirichlet.sample", lambda: paddle.distribution.Dirichlet(paddle.full([3], 0.5)).sample()),
    ]
    owners = {"paddle": paddle, "F": F, "Tensor": paddle.Tensor, "Dirichlet": paddle.distribution.Dirichlet}
    found = []
    for name, draw in candidates:
        owner, _, attr = name.partition(".")
        if hasattr(owners[owner], attr):
            found.append((name, draw))
    return found


# ---------------------------------------------------------------------------- item 6
AMP_STATES = [("O1", "float16"), ("O1", "bfloat16"), ("O2", "float16"), ("O2", "bfloat16")]


@for_each_backend
class AmpTest(BackendCase):
    @parameterized.expand([(f"{lvl}_{dt}", lvl, dt) for lvl, dt in AMP_STATES])
    def test_amp_state_keys_the_graph_and_replays_under_it(self, _, level, dtype):
        seen = []

        def body(x, w):
            seen.append(state.amp_state())  # what the traced ops would see
            return paddle.matmul(x, w)

        graphed = self.graphed(body, warmup_steps=1)
        w = paddle.create_parameter([8, 8], "float32")
        x = batches(1)[0]
        plain = state.amp_state()
        with gpu_amp_state(level, dtype):
            amp = state.amp_state()
        self.assertNotEqual(plain, amp, "the AMP state must change the key")

        def call(expect_state):
            before = len(seen)
            mse(graphed(x, w)).backward()
            self.assertTrue(all(s == expect_state for s in seen[before:]), seen[before:])

        with graphed.counters.expect(captures=1, replays=1):
            for _ in range(3):
                call(plain)
        with graphed.counters.expect(captures=1, replays=1, warmup_calls=1):
            with gpu_amp_state(level, dtype):
                for _ in range(3):
                    call(amp)
        with graphed.counters.expect(captures=0, replays=2):  # back: the plain graph again
            call(plain)
            call(plain)
        self.assertEqual(graphed.stats()["graphs"], 2)

    def test_dispatch_key_fn_keys_include_the_amp_state(self):
        graphed = self.graphed(lambda x: x * 2.0, warmup_steps=0, dispatch_key_fn=lambda args: "one")
        x = batches(1)[0]
        with paddle.no_grad():
            graphed(x)
            with gpu_amp_state("O1", "bfloat16"):
                graphed(x)
            graphed(x)
        stats = graphed.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["keys"]), (2, 1, 2))

    @parameterized.expand([("clone", True), ("no_clone", False), ("auto", "auto")])
    def test_grad_scaler_scaled_loss_trains_like_eager(self, _, clone):
        eager, graphed = twin_layers(lambda: MLP(p=0.2))
        self.graphed(graphed, clone_param_grads=clone)
        xs = batches(8)

        def run(model):
            paddle.seed(1)
            opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
            scaler = enabled_grad_scaler(init_loss_scaling=1024.0, incr_every_n_steps=2)
            log = []
            with gpu_amp_state("O1", "float16"):
                for i, x in enumerate(xs):
                    loss = mse(model(x))
                    scaled = scaler.scale(loss)
                    scaled.backward()
                    log.append([loss, scaled])
                    if i % 2 == 1:  # accumulate 2 micro-batches
                        scaler.step(opt)
                        scaler.update()
                        opt.clear_grad()
                log.append(scaler._scale)
            return log + [params_of(model)]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = run(eager)
            got = run(graphed)
        self.assertBitwise(got, want)
        self.assertGreater(float(got[-2].numpy()[0]), 1024.0, "the scaler never scaled")
        self.assertEqual(graphed.forward.stats()["replays"], 6)


# ---------------------------------------------------------------------------- item 7
@for_each_backend
class RecomputeTest(TrackerCase):
    def _train(self, model, xs, call=None):
        call = call or model
        self.reseed()
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
        log = []
        for i, x in enumerate(xs):
            x = clone_leaf(x, stop_gradient=False)
            loss = mse(call(x))
            loss.backward()
            log.append([loss, x.grad])
            if i % 2 == 1:
                log.append(grads_of(model))
                opt.step()
                opt.clear_grad()
        return log + [params_of(model), rng_draws()]

    def assertRefusedAsRewinding(self, wrapper):
        """NOTE [ Recompute under CUDA graphs ] in guards/rng.py: refused on every backend (the simulated
        one would re-run the recompute and get it right, but a GPU replay would not)."""
        stats = wrapper.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (0, 0), wrapper.explain())
        self.assertIn("rewinds the RNG state", wrapper.explain())

    def test_layer_calling_recompute_with_dropout_runs_eagerly_like_eager(self):
        eager, graphed = twin_layers(lambda: RecomputedMLP(p=0.3))
        self.graphed(graphed)
        xs = batches(8)
        want = self._train(eager, xs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = self._train(graphed, xs)
        self.assertBitwise(got, want)
        self.assertRefusedAsRewinding(graphed.forward)

    def test_function_calling_recompute_on_a_layer_runs_eagerly_like_eager(self):
        eager, graphed = twin_layers(lambda: MLP(p=0.3))

        def block(x, layer):
            return recompute(layer, x) + x

        graphed_block = self.graphed(block)
        xs = batches(6)
        want = self._train(eager, xs, call=lambda x: block(x, eager))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = self._train(graphed, xs, call=lambda x: graphed_block(x, graphed))
        self.assertBitwise(got, want)
        self.assertRefusedAsRewinding(graphed_block)

    def test_layer_calling_recompute_without_dropout_is_captured(self):
        eager, graphed = twin_layers(lambda: RecomputedMLP(p=0.0))
        self.graphed(graphed)
        xs = batches(6)
        want = self._train(eager, xs)
        with graphed.forward.counters.expect(captures=1, replays=4):
            got = self._train(graphed, xs)
        self.assertBitwise(got, want)


# ---------------------------------------------------------------------------- item 8
def realloc(layer):
    """What an optimizer that reallocates does: same Parameter objects, new storage."""
    with paddle.no_grad():
        for p in layer.parameters():
            fresh = p.detach().clone()
            fresh._share_buffer_to(p)


@for_each_backend
class ParameterChangeTest(BackendCase):
    def _run(self, model, xs, change_at, change):
        paddle.seed(4)
        opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
        log = []
        for i, x in enumerate(xs):
            if i == change_at:
                change(model)
                opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
            loss = mse(model(x))
            loss.backward()
            log.append([loss, grads_of(model)])
            opt.step()
            opt.clear_grad()
        return log + [params_of(model)]

    def _check(self, change, factory=MLP, xs=None, recaptures=1):
        eager, graphed = twin_layers(factory)
        self.graphed(graphed)
        xs = xs if xs is not None else batches(6)
        want = self._run(eager, xs, 3, change)
        got = self._run(graphed, xs, 3, change)
        self.assertBitwise(got, want)
        stats = graphed.forward.stats()
        # calls 0 warmup, 1 capture, 2 replay, 3 re-capture (not a replay), 4-5 replay
        self.assertEqual(
            (stats["recaptures"], stats["captures"], stats["replays"], stats["graphs"]),
            (recaptures, 1 + recaptures, 3, 1),
        )
        return graphed

    def test_reassigned_parameter_is_recaptured(self):
        def reassign(layer):
            paddle.seed(8)
            layer.fc1.weight = paddle.create_parameter(layer.fc1.weight.shape, "float32")

        self._check(reassign)

    def test_layer_to_that_moves_parameters_is_recaptured(self):
        def round_trip(layer):
            layer.to(dtype="float64")
            layer.to(dtype="float32")

        self._check(round_trip)

    def test_reallocating_optimizer_is_recaptured(self):
        self._check(realloc)

    def test_amp_decorate_cast_is_recaptured(self):
        # paddle.amp.decorate(level='O2') casts the parameters in place with amp_initialize;
        # its place check skips that on a CPU build, so the cast is applied directly here.
        def decorate(layer):
            amp_initialize(models=[layer], dtype="bfloat16", excluded_layers=None)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGD on bf16 parameters warns about accuracy
            graphed = self._check(decorate, factory=CastingScale)
        self.assertEqual(graphed.w.dtype, paddle.bfloat16)

    def test_in_place_updates_keep_replaying(self):
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed)
        xs = batches(6)

        def run(model):
            opt = paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())
            log = []
            for i, x in enumerate(xs):
                if i == 3:
                    model.fc2.bias.set_value(paddle.full(model.fc2.bias.shape, 0.5))
                loss = mse(model(x))
                loss.backward()
                opt.step()
                opt.clear_grad()
                log.append(loss)
            return log + [params_of(model)]

        want = run(eager)
        with graphed.forward.counters.expect(recaptures=0, captures=1, replays=4):
            got = run(graphed)
        self.assertBitwise(got, want)

    def test_failed_recapture_falls_back_and_says_why(self):
        class SyncsWhenAsked(MLP):
            sync = False

            def forward(self, x):
                if self.sync:
                    float(x.sum())  # a host sync: refused while capturing
                return super().forward(x)

        eager, graphed = twin_layers(SyncsWhenAsked)

        def change(layer):
            realloc(layer)
            layer.sync = True

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want = self._run(eager, batches(6), 3, change)
            self.graphed(graphed)
            got = self._run(graphed, batches(6), 3, change)
        self.assertBitwise(got, want)
        stats = graphed.forward.stats()
        self.assertEqual((stats["recaptures"], stats["captures"], stats["replays"]), (1, 1, 1))
        self.assertEqual(stats["eager_reasons"].get("capture failed"), 1)
        self.assertEqual(stats["graphs"], 0)
        self.assertIn("capture failed", graphed.forward.explain())
        self.assertTrue(any("failed:" in str(w.message) and "runs eagerly from now on" in str(w.message) for w in caught))

    def test_repeated_moves_stay_within_one_graph(self):
        eager, graphed = twin_layers(MLP)
        self.graphed(graphed, max_graphs=1)
        xs = batches(6)

        def run(model):
            log = []
            for i, x in enumerate(xs):
                if i >= 2:
                    realloc(model)
                mse(model(x)).backward()
                log.append(grads_of(model))
            return log

        self.assertBitwise(run(graphed), run(eager))
        stats = graphed.forward.stats()
        self.assertEqual((stats["recaptures"], stats["graphs"], stats["eager_calls"]), (4, 1, 0))


# ---------------------------------------------------------------------------- item 9
@for_each_backend
class TrainEvalTest(BackendCase):
    def _calls(self, model, xs, modes):
        # Eval calls run with grads enabled too, so only the training flag tells the keys apart.
        paddle.seed(6)
        log = []
        for x, mode in zip(xs, modes):
            model.train() if mode == "train" else model.eval()
            y = model(x)
            mse(y).backward()
            log.append([y, state_of(model), grads_of(model)])
        return log

    def test_eval_never_replays_the_train_graph(self):
        eager, graphed = twin_layers(lambda: MLP(p=0.5, norm=True))
        self.graphed(graphed)
        modes = ["train"] * 3 + ["eval"] * 3 + ["train"] * 2 + ["eval"]
        xs = batches(len(modes))
        want = self._calls(eager, xs, modes)
        got = self._calls(graphed, xs, modes)
        self.assertBitwise(got, want)
        rows = graphed.forward.report()
        self.assertEqual(len(rows), 2)
        by_mode = {("train" if r["key"]["training"][0] else "eval"): r for r in rows}
        self.assertEqual((by_mode["train"]["captures"], by_mode["train"]["replays"]), (1, 3))
        self.assertEqual((by_mode["eval"]["captures"], by_mode["eval"]["replays"]), (1, 2))

    def test_sublayer_eval_is_a_different_key(self):
        # Only the dropout sublayer switches mode: it was discovered during capture and its
        # training flag is part of the key from then on.
        eager, graphed = twin_layers(lambda: MLP(p=0.5))
        self.graphed(graphed, warmup_steps=0)
        xs = batches(4)

        def run(model):
            paddle.seed(2)
            out = [model(xs[0]), model(xs[1])]
            model.drop.eval()
            out += [model(xs[2]), model(xs[3])]
            model.drop.train()
            return out

        with paddle.no_grad():
            want = run(eager)
            with graphed.forward.counters.expect(captures=2, replays=2):
                got = run(graphed)
        self.assertBitwise(got, want)

    def test_function_using_a_global_layer_keys_its_mode(self):
        layer = MLP(p=0.5)
        eager_layer = MLP(p=0.5)
        eager_layer.set_state_dict(layer.state_dict())

        def make(net):
            def block(x):
                return net(x) * 2.0

            return block

        graphed = self.graphed(make(layer), warmup_steps=1)
        xs = batches(6)

        def run(fn, net):
            paddle.seed(3)
            out = []
            with paddle.no_grad():
                for i, x in enumerate(xs):
                    net.train() if i < 3 else net.eval()
                    out.append(fn(x))
            return out

        want = run(make(eager_layer), eager_layer)
        got = run(graphed, layer)
        self.assertBitwise(got, want)
        self.assertEqual(graphed.stats()["graphs"], 2)


if __name__ == "__main__":
    unittest.main()
