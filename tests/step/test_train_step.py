"""autocudagraph_step: the whole training step in one graph, bitwise equal to eager.

Every graphed run is compared with an eager run of the same step function from the same
parameters, data and seeds: every loss, and after every optimizer step every parameter,
optimizer state tensor (moments, beta powers, velocities), the learning rate and the
GraphGradScaler's state. Phases are pinned with the wrapper's counters.
"""

import os
import pathlib
import unittest
from unittest import mock
import warnings

import numpy as np
import paddle
from parameterized import parameterized

from paddlefleet.cudagraph import GraphGradScaler, autocudagraph_step
from paddlefleet.cudagraph.demo import transformer_steps as step_examples
from paddlefleet.cudagraph.step import optimizer_state as optim_state
from paddlefleet.cudagraph.errors import InputMismatchError
from paddlefleet.cudagraph.io.host_tensors import mark_host
from paddlefleet.cudagraph.options import ENV_BACKEND

from testkit.harness import BackendCase, for_each_backend
from tests.integration.test_distributed import TwoRankJob

DATA_PARALLEL_JOB = pathlib.Path(__file__).resolve().parents[1] / "dist_scripts" / "data_parallel_job.py"
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "train_step.md"


def _data(n, shape=(4, 8), seed=5):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.standard_normal(shape).astype("float32")) for _ in range(n)]


def _mlp(seed=3, dropout=0.1):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Dropout(dropout),
                                paddle.nn.Linear(16, 4))


def _state(model, opt, scaler=None):
    return step_examples.snapshot(model, opt, scaler)


def _run(make_opt, steps=8, backend=None, graphed=True, between=None, warmup_steps=2, step_fn=None, data=None,
         dropout=0.1):
    """Trains an MLP with ``make_opt(params) -> (opt, scheduler or None)``; returns (losses,
    states, wrapper or None)."""
    model = _mlp(dropout=dropout)
    opt, sched = make_opt(model.parameters())
    data = data or _data(steps)

    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    fn = step_fn(model, opt) if step_fn is not None else train_step
    step = autocudagraph_step(fn, optimizers=[opt], warmup_steps=warmup_steps, backend=backend) if graphed else fn
    paddle.seed(11)
    losses, states = [], []
    for i, x in enumerate(data):
        losses.append(step(x).numpy())
        states.append(_state(model, opt))
        if sched is not None:
            sched.step()
        if between is not None:
            between(i, opt)
    return losses, states, (step if graphed else None)


@for_each_backend
class WholeStepBitwiseTest(BackendCase):
    def assertRunsEqual(self, eager, graphed):
        self.assertBitwise(graphed[0], eager[0], "losses")
        for k, (a, b) in enumerate(zip(eager[1], graphed[1])):
            self.assertEqual(sorted(a), sorted(b))
            for name in a:
                self.assertBitwise(b[name], a[name], f"{name} after step {k}")

    def test_transformer_thirty_steps_accumulation_clipping_cosine_lr_and_loss_scaling(self):
        # Attention + MLP + LayerNorm + dropout, AdamW, global-norm clipping,
        # warmup + cosine LR, accumulation 2 (one graph per micro-batch phase), GraphGradScaler
        # with an overflow step that must be skipped - 30 optimizer steps, 60 calls.
        result = step_examples.compare_transformer_steps(steps=30, accumulate=2, backend=self.backend, inf_at=(7,))
        self.assertTrue(result.equal, result.first_mismatch)
        stats = result.graphed.stats
        self.assertEqual((stats["warmup_calls"], stats["captures"], stats["replays"], stats["eager_calls"]),
                         (4, 2, 54, 0), result.graphed.explain)
        states = result.eager.states
        # The overflow step was skipped (parameters unchanged) and halved the scale.
        self.assertFalse(np.isfinite(result.eager.losses[15]))
        p = "param ln1.weight"
        self.assertBitwise(states[7][p], states[6][p], "parameters across the skipped step")
        self.assertEqual(float(states[7]["scaler scale"][0]), float(states[6]["scaler scale"][0]) / 2)
        self.assertGreater(max(float(s["scaler scale"][0]) for s in states), 2.0**10)  # and it grew again
        # The learning rate followed warmup then cosine: it changed at every step after the capture.
        lrs = [float(s["lr tensor"]) for s in states]
        self.assertEqual(len(set(lrs[3:])), len(lrs[3:]))
        self.assertLess(lrs[-1], max(lrs))

    def test_momentum_with_step_decay_and_weight_decay(self):
        def make(params):
            sched = paddle.optimizer.lr.StepDecay(0.05, step_size=3, gamma=0.5)
            return paddle.optimizer.Momentum(sched, momentum=0.9, parameters=params, weight_decay=0.01), sched

        eager = _run(make, steps=10, graphed=False)
        graphed = _run(make, steps=10, backend=self.backend)
        self.assertRunsEqual(eager, graphed)
        self.assertEqual(graphed[2].stats()["replays"], 7)
        self.assertEqual(len({float(s["lr tensor"]) for s in graphed[1]}), 4)  # 0.05, 0.025, 0.0125, 0.00625

    def test_sgd_with_a_float_learning_rate_set_between_steps_and_clip_by_norm(self):
        def make(params):
            return paddle.optimizer.SGD(0.1, parameters=params, grad_clip=paddle.nn.ClipGradByNorm(0.5)), None

        def decay(i, opt):
            opt.set_lr(0.1 / (i + 2))

        eager = _run(make, steps=8, graphed=False, between=decay)
        graphed = _run(make, steps=8, backend=self.backend, between=decay)
        self.assertRunsEqual(eager, graphed)
        self.assertEqual(graphed[2].stats()["replays"], 5)

    def test_adam_beta_powers_kept_on_the_host_are_moved_to_the_device(self):
        # A GPU build keeps Adam's beta powers on the CPU; the simulated backend models them as
        # host tensors with mark_host. The capture moves them, and every step stays eager's.
        if self.backend != "simulate":
            self.skipTest("on a GPU the beta powers are on the CPU already; the cuda variant of the "
                          "transformer test covers the move")

        def make(params):
            return paddle.optimizer.Adam(0.01, parameters=params), None

        def mark(i, opt):
            if i == 0:
                optim_state.mark_beta_pows_host(opt)

        eager = _run(make, steps=6, graphed=False)
        graphed = _run(make, steps=6, backend="simulate", between=mark)
        self.assertRunsEqual(eager, graphed)
        self.assertIn("8 beta power(s) moved to the device", graphed[2].explain())  # 4 parameters x 2

    def test_batch_shapes_get_their_own_graphs_and_max_graphs_sends_more_to_eager(self):
        def make(params):
            return paddle.optimizer.AdamW(0.01, parameters=params), None

        data = [x for pair in zip(_data(4, (4, 8), 1), _data(4, (2, 8), 2), _data(4, (6, 8), 3)) for x in pair]
        eager = _run(make, graphed=False, data=data)
        model = _mlp()
        opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())

        def train_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=2, max_graphs=2, backend=self.backend)
        paddle.seed(11)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [step(x).numpy() for x in data]
        self.assertBitwise(losses, eager[0], "losses")
        self.assertBitwise(_state(model, opt), eager[1][-1], "final state")
        stats = step.stats()
        # Shapes interleave: each of the first two keys warms up twice, captures and replays once;
        # the third shape finds max_graphs=2 keys and runs eagerly.
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (2, 2, 4), step.explain())
        self.assertEqual(stats["eager_reasons"], {"max_graphs reached": 4})
        self.assertTrue(any("max_graphs=2" in str(w.message) for w in caught))

    def test_a_shape_that_repeats_takes_the_place_of_one_not_called_since(self):
        def make(params):
            return paddle.optimizer.AdamW(0.01, parameters=params), None

        data = _data(3, (4, 8), 1) + _data(3, (2, 8), 2) + _data(4, (6, 8), 3) + _data(4, (4, 8), 4)
        eager = _run(make, graphed=False, data=data)
        model = _mlp()
        opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())

        def train_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=1, max_graphs=2, backend=self.backend)
        paddle.seed(11)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            losses = [step(x).numpy() for x in data]
        self.assertBitwise(losses, eager[0], "losses")
        self.assertBitwise(_state(model, opt), eager[1][-1], "final state")
        stats = step.stats()
        # 4 rows: two warmups (the first makes the optimizer's state), capture; 2 rows: warmup, capture,
        # replay; 6 rows eager twice, then in place of 4 rows: warmup, capture; 4 rows eager twice, then in
        # place of 2 rows: captured again (no warmup), replayed.
        self.assertEqual((stats["captures"], stats["recaptures"], stats["replays"], stats["evictions"]),
                         (4, 1, 2, 2), step.explain())
        self.assertEqual(stats["eager_reasons"], {"max_graphs reached": 4})

    def test_multi_precision_master_weights(self):
        def run(graphed):
            paddle.seed(3)
            model = paddle.nn.Linear(8, 8)
            model.to(dtype="float16")
            opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters(), multi_precision=True)

            def train_step(x):
                loss = model(x).astype("float32").square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            step = autocudagraph_step(train_step, optimizers=[opt], backend=self.backend) if graphed else train_step
            losses = [step(x.astype("float16")).numpy() for x in _data(6)]
            return losses, _state(model, opt), step

        try:
            eager = run(False)
        except (RuntimeError, TypeError, ValueError) as err:
            self.skipTest(f"float16 kernels do not run here ({str(err).splitlines()[0][:100]})")
        graphed = run(True)
        self.assertTrue(any(name.startswith("master weight") for name in eager[1]))
        self.assertBitwise(graphed[0], eager[0], "losses")
        for name in eager[1]:
            self.assertBitwise(graphed[1][name], eager[1][name], name)
        self.assertEqual(graphed[2].stats()["replays"], 3)

    def test_outputs_are_copies_that_later_replays_leave_alone(self):
        def make(params):
            return paddle.optimizer.SGD(0.1, parameters=params), None

        def returns_two(model, opt):
            def train_step(x):
                y = model(x)
                loss = y.square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return {"loss": loss, "mean": y.mean()}

            return train_step

        model = _mlp()
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        step = autocudagraph_step(returns_two(model, opt), optimizers=[opt], warmup_steps=1, backend=self.backend)
        outs = [step(x) for x in _data(5)]
        # warmup_steps=1, and the first step created the optimizer state: a second warmup step.
        self.assertEqual((step.stats()["warmup_calls"], step.stats()["replays"]), (2, 2))
        self.assertEqual(len({float(o["loss"]) for o in outs}), 5)  # not overwritten by later replays
        self.assertTrue(all(o["loss"].stop_gradient for o in outs[3:]))  # replays hand out detached copies


    def test_kernel_less_gpu_step_matmul_mlp_with_a_matmul_sgd_update(self):
        # tools/step_gpu_check.py runs this on a GPU (cuBLAS and copies only).
        from testkit.step_gpu import whole_step_check

        results = whole_step_check(width=16, layers=3, batch=4, steps=8, backend=self.backend, timed_steps=2)
        for case, r in results.items():
            self.assertTrue(r["equal"], f"{case}: {r['first_mismatch']}")
            s = r["stats"]
            self.assertEqual((s["warmup_calls"], s["captures"], s["eager_calls"]), (2, 1, 0), case)

    def test_a_graphed_block_inside_the_step_becomes_part_of_the_step_graph(self):
        from paddlefleet.cudagraph import autocudagraph

        def make(params):
            return paddle.optimizer.AdamW(0.01, parameters=params), None

        def with_block(model, opt):
            autocudagraph(model[0], backend=self.backend, warmup_steps=1)

            def train_step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        eager = _run(make, steps=8, graphed=False)
        graphed = _run(make, steps=8, backend=self.backend, step_fn=with_block)
        self.assertRunsEqual(eager, graphed)
        self.assertEqual(graphed[2].stats()["replays"], 5)


class WholeStepRefusalsTest(unittest.TestCase):
    """Host values a graph would freeze are refused at capture, with the reason; the step keeps
    running eagerly and stays eager's bit for bit."""

    def _train(self, step_fn, steps=5, graphed=True, warmup_steps=2, before=None):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.05, parameters=model.parameters())
        fn = step_fn(model, opt)
        step = autocudagraph_step(fn, optimizers=[opt], warmup_steps=warmup_steps, backend="simulate") if graphed \
            else fn
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = []
            for i, x in enumerate(_data(steps)):
                if before is not None:
                    before(i)
                losses.append(step(x).numpy())
        return losses, _state(model, opt), step, [str(w.message) for w in caught]

    def assertRefused(self, step_fn, *patterns, steps=5, before=None):
        eager = self._train(step_fn, steps, graphed=False, before=before)
        losses, state, step, warned = self._train(step_fn, steps, before=before)
        for a, b in zip(losses, eager[0]):
            np.testing.assert_array_equal(a, b)
        for name in eager[1]:
            self.assertEqual(state[name].tobytes(), eager[1][name].tobytes(), name)
        stats = step.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (0, 0), step.explain())
        explain = step.explain()
        for pattern in patterns:
            self.assertRegex(explain, pattern)
        self.assertTrue(any("capture of key" in w for w in warned), warned)
        return explain

    def test_a_python_counter_read_by_the_step_is_refused(self):
        # The loop advances a counter that the step reads; it is a mutable object, so no name is
        # rebound: the op trace sees the value reach a kernel argument.
        progress = {"step": 0}

        def make(model, opt):
            def train_step(x):
                loss = model(x).square().mean() * (1.0 + 0.5 * progress["step"])
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        def before(i):
            progress["step"] = i

        explain = self.assertRefused(make, r"reads a host value that changes between steps",
                                     r"got argument 1 1\.5 at the last warmup step and 2\.0 at the capture",
                                     before=before)
        self.assertIn("test_train_step.py", explain)  # the user's line

    def test_a_global_rebound_between_steps_is_refused(self):
        global STEP_COUNT
        STEP_COUNT = 0

        def make(model, opt):
            def train_step(x):
                loss = model(x).square().mean() * (1.0 + STEP_COUNT)
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        def bump_then_train(step_fn):
            def wrapped(model, opt):
                fn = step_fn(model, opt)

                def train_step(x):
                    global STEP_COUNT
                    STEP_COUNT += 1
                    return fn(x)

                return train_step

            return wrapped

        # The step's own code reads STEP_COUNT; the loop (here: an outer function) bumps it.
        eager = self._train(bump_then_train(make), graphed=False)
        STEP_COUNT = 0
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.05, parameters=model.parameters())
        step = autocudagraph_step(make(model, opt), optimizers=[opt], warmup_steps=2, backend="simulate")
        losses = []
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for x in _data(5):
                STEP_COUNT += 1
                losses.append(step(x).numpy())
        for a, b in zip(losses, eager[0]):
            np.testing.assert_array_equal(a, b)
        self.assertRegex(step.explain(), r"reads 'STEP_COUNT', which was rebound .*\(2 -> 3\)")
        self.assertEqual(step.stats()["captures"], 0)

    def test_item_inside_the_step_is_refused(self):
        def make(model, opt):
            def train_step(x):
                loss = model(x).square().mean()
                if loss.item() > 1e9:  # a host read: a graph cannot wait for the device
                    loss = loss * 0.0
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        self.assertRefused(make, r"Tensor\.item\(\) was called during capture")

    def test_a_parameter_created_lazily_at_the_capture_step_is_refused(self):
        class Lazy(paddle.nn.Layer):
            # Counted in a list and added with add_parameter: no attribute assignment, which the capture
            # session would refuse first (NOTE [ Attributes a capture writes ]).
            def __init__(self):
                super().__init__()
                self.calls = [0]

            def forward(self, x):
                self.calls[0] += 1
                if self.calls[0] == 3:  # the capture step: warmups 1 and 2 did not create it
                    self.add_parameter("extra", self.create_parameter(
                        [4], default_initializer=paddle.nn.initializer.Constant(0.5)))
                extra = self._parameters.get("extra")
                return x if extra is None else x * extra

        def make(model, opt):
            lazy = Lazy()

            def train_step(x):
                loss = lazy(model(x)).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        self.assertRefused(make, r"the capture step created or replaced state: parameter 'extra' of Lazy was created")

    def test_a_step_that_creates_a_parameter_every_call_is_refused_after_extra_warmups(self):
        class Fresh(paddle.nn.Layer):
            def forward(self, x):
                self.w = self.create_parameter([4], default_initializer=paddle.nn.initializer.Constant(2.0))
                return x * self.w

        def make(model, opt):
            fresh = Fresh()

            def train_step(x):
                loss = fresh(model(x)).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        explain = self.assertRefused(make, r"every warmup step of this key created or replaced state: "
                                           r"parameter 'w' of Fresh was replaced", steps=7)
        self.assertIn("5 warmup", explain)  # warmup_steps=2 plus EXTRA_WARMUPS=3

    def test_an_op_reading_a_host_tensor_is_refused(self):
        def make(model, opt):
            weights = mark_host(paddle.to_tensor([1.0, 2.0, 3.0, 4.0]))  # a CPU tensor on a GPU build

            def train_step(x):
                loss = (model(x) * weights).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        self.assertRefused(make, r"op #\d+ Tensor.__mul__ at .*test_train_step.py:\d+ reads a host \(CPU\) tensor")

    def test_global_norm_clipping_with_auto_skip_clip_is_refused(self):
        # auto_skip_clip=True compares the global norm with the clip norm on the host.
        def make(model, opt):
            opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(0.1, auto_skip_clip=True)  # the listed optimizer

            def train_step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        self.assertRefused(make, r"Tensor\.__bool__\(\) was called during capture")

    def test_paddle_grad_scaler_is_refused_by_name(self):
        if not hasattr(paddle.amp, "GradScaler"):
            self.skipTest("no paddle.amp.GradScaler")

        def make(model, opt):
            scaler = _paddle_scaler_enabled_on_cpu(init_loss_scaling=8.0)

            def train_step(x):
                with paddle.amp.auto_cast(level="O1", dtype="float16"):
                    loss = model(x).square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.clear_grad()
                return loss

            return train_step

        self.assertRefused(make, r"paddle\.amp\.GradScaler\.step\(\) was called during capture.*GraphGradScaler")

    def test_a_value_that_changes_after_capture_sends_the_simulated_replay_to_eager_with_a_warning(self):
        # Caught at capture only if it changed between the last warmup and the capture; a GPU
        # replay would silently reuse it. The simulated backend re-runs Python and traces it.
        weight = {"w": 1.0}

        def make(model, opt):
            def train_step(x):
                loss = model(x).square().mean() * weight["w"]
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return train_step

        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.05, parameters=model.parameters())
        step = autocudagraph_step(make(model, opt), optimizers=[opt], warmup_steps=1, backend="simulate")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, x in enumerate(_data(6)):
                weight["w"] = 1.0 if i < 4 else 3.0
                step(x)
        stats = step.stats()
        # 2 warmups (the first created state), the capture, 1 good replay, the replay that read
        # 3.0 (its result is eager's: the simulated backend re-ran Python), then eager.
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (1, 2, 1), step.explain())
        self.assertIn("a replay read other host values than the capture", step.explain())
        self.assertTrue(any("On a GPU this replay would have silently reused" in str(w.message) for w in caught))


class GradSlotsTest(unittest.TestCase):
    """NOTE [ Grad slots across steps ]: grads between calls."""

    def _setup(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
        return model, opt

    def test_a_backward_outside_the_step_runs_the_next_call_eagerly(self):
        results = []
        for graphed in (False, True):
            model, opt = self._setup()

            def train_step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            step = autocudagraph_step(train_step, optimizers=[opt], backend="simulate") if graphed else train_step
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                for i, x in enumerate(_data(7)):
                    if i == 4:  # an extra loss, accumulated into the next step's grads
                        model(x).mean().backward()
                    step(x)
            results.append((_state(model, opt), step))
        (eager, _), (graphed, step) = results
        for name in eager:
            self.assertEqual(graphed[name].tobytes(), eager[name].tobytes(), name)
        self.assertEqual(step.stats()["eager_reasons"], {"grads changed between calls": 1}, step.explain())

    def test_accumulation_switches_to_persistent_grads_and_clear_grad_false_between_calls_recaptures(self):
        model, opt = self._setup()

        def train_step(x, apply):
            loss = model(x).square().mean()
            loss.backward()
            if apply:
                opt.step()
                opt.clear_grad()
            return loss

        step = autocudagraph_step(train_step, optimizers=[opt], backend="simulate")
        data = _data(12)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for i in range(8):
                step(data[i], i % 2 == 1)
            # The old grads stay referenced here, so the grads made after the release cannot land at
            # their addresses: a graph's grad slots are matched by address, and a new grad at an old
            # address is one the graph may rightly keep writing (the count would depend on the allocator).
            released = [p.grad for p in model.parameters()]
            opt.clear_grad(set_to_zero=False)  # released between calls: the graphs' grad buffers are gone
            for i in range(8, 12):
                step(data[i], i % 2 == 1)
        self.assertTrue(all(g is not None for g in released))
        self.assertIn("grads kept between calls (accumulation", step.explain())
        self.assertEqual(step.stats()["recaptures"], 2, step.explain())


class GraphGradScalerTest(unittest.TestCase):
    def test_bitwise_equal_to_paddle_grad_scaler_including_a_skipped_overflow(self):
        # paddle.amp.GradScaler turns itself off on the CPU; it is switched on here as on a GPU
        # (auto_cast float16 sets the AMP dtype it checks). decr_every_n_nan_or_inf=2 keeps it off
        # its overflow print, which raises with NumPy 2 (float() of a shape-[1] tensor).
        kw = dict(init_loss_scaling=1024.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
        runs = [_scaler_run(lambda: _paddle_scaler_enabled_on_cpu(**kw)), _scaler_run(lambda: GraphGradScaler(**kw))]
        for k, (a, b) in enumerate(zip(*runs)):
            for name in a:
                self.assertEqual(a[name].tobytes(), b[name].tobytes(), f"{name} after step {k}")
        self.assertEqual([float(s["scaler scale"][0]) for s in runs[1]], [1024.0, 2048.0, 2048.0, 2048.0, 2048.0,
                                                                          4096.0])

    def test_overflow_decreases_the_scale_and_skips_the_update(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
        scaler = GraphGradScaler(init_loss_scaling=64.0, decr_every_n_nan_or_inf=1)
        x = _data(1)[0]
        for value in (1.0, float("nan")):
            before = _state(model, opt)
            scaler.scale(model(x).square().mean() * value).backward()
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
        after = _state(model, opt)
        for name in before:
            if name.startswith(("param", "moment", "beta")):
                self.assertEqual(after[name].tobytes(), before[name].tobytes(), name)
        self.assertEqual(scaler.state_dict()["scale"].tolist(), [32.0])
        self.assertEqual(scaler.state_dict()["decr_count"], 0)

    def test_misuse_raises_like_paddle(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.01, parameters=model.parameters())
        scaler = GraphGradScaler()
        scaler.scale(model(_data(1)[0]).mean()).backward()
        scaler.step(opt)
        with self.assertRaisesRegex(RuntimeError, "step\\(\\) has already been called"):
            scaler.step(opt)


class DocExampleTest(unittest.TestCase):
    def test_the_first_example_in_docs_train_step_runs_and_matches_eager(self):
        text = DOC.read_text()
        section = text.split("## A first example", 1)[1]
        code = section.split("```python\n", 1)[1].split("```", 1)[0]
        scope = {"__name__": "docs_train_step"}
        exec(compile(code, str(DOC), "exec"), scope)  # the example asserts bitwise equality itself
        step = scope["step"]
        self.assertEqual((step.stats()["captures"], step.stats()["replays"]), (1, 9))


class OptionsTest(unittest.TestCase):
    def _opt(self):
        return paddle.optimizer.SGD(0.1, parameters=_mlp().parameters())

    @parameterized.expand([
        ("no_optimizers", {}, TypeError, r"optimizers must be a list of the step's paddle\.optimizer"),
        ("one_optimizer_not_a_list", {"optimizers": "OPT"}, TypeError, r"optimizers must be a list, got the optimizer"),
        ("not_an_optimizer", {"optimizers": [object()]}, TypeError, r"optimizers\[0\] is .* not a paddle"),
        ("zero_warmup", {"warmup_steps": 0}, ValueError, r"warmup_steps must be >= 1, got 0\. The first step creates"),
        ("float_warmup", {"warmup_steps": 1.5}, TypeError, r"warmup_steps must be an int"),
        ("negative_max_graphs", {"max_graphs": -1}, ValueError, r"max_graphs must be >= 0"),
        ("bad_backend", {"backend": "tpu"}, ValueError, r"backend must be one of"),
        ("bad_key_fn", {"dispatch_key_fn": 3}, TypeError, r"dispatch_key_fn must be callable"),
    ])
    def test_bad_options_name_the_argument(self, _, options, error, pattern):
        options = dict(options)
        if options.get("optimizers") == "OPT":
            options["optimizers"] = self._opt()
        elif "optimizers" not in options and _ != "no_optimizers":
            options["optimizers"] = [self._opt()]
        with self.assertRaisesRegex(error, "autocudagraph_step: " + pattern):
            autocudagraph_step(lambda x: x, **options)
        with self.assertRaisesRegex(error, "autocudagraph_step: " + pattern):
            autocudagraph_step(**options)  # the decorator form checks at decoration too

    def test_a_layer_is_not_a_step_function(self):
        with self.assertRaisesRegex(TypeError, "expected the training-step function"):
            autocudagraph_step(_mlp(), optimizers=[self._opt()])

    def test_decorator_form_and_reset(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())

        @autocudagraph_step(optimizers=[opt], warmup_steps=1, backend="simulate")
        def train_step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        for x in _data(4):
            train_step(x)
        self.assertEqual(train_step.stats()["replays"], 1)  # 2 warmups: the first created the LR tensor
        train_step.reset()
        self.assertEqual((train_step.stats()["graphs"], train_step.stats()["replays"]), (0, 0))
        with train_step.counters.expect(warmup_calls=1, captures=1, replays=1):
            for x in _data(3):
                train_step(x)
        self.assertTrue(train_step.explain().startswith("autocudagraph_step(train_step)"))

    def test_without_a_gpu_backend_none_runs_eagerly(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        step = autocudagraph_step(lambda x: model(x).mean(), optimizers=[opt])
        # backend=None itself is under test: the suite-wide override would replace it.
        with mock.patch.dict(os.environ):
            os.environ.pop(ENV_BACKEND, None)
            step(_data(1)[0])
        self.assertEqual(step.stats()["eager_reasons"], {"no GPU tensors or no CUDA build (backend=None runs eagerly)": 1})

    def test_dispatch_key_fn_checks_inputs_against_the_static_buffers(self):
        model = _mlp(dropout=0.0)
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())

        def train_step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=1, backend="simulate",
                                  dispatch_key_fn=lambda args: "one graph")
        for x in _data(3):
            step(x)
        with self.assertRaises(InputMismatchError):
            step(_data(1, (2, 8))[0])


@unittest.skipIf(paddle.is_compiled_with_cuda(), "CPU/gloo test; on GPUs the NCCL check is tools/dist_gpu_check.py")
class DataParallelWholeStepTest(TwoRankJob):
    """Two CPU ranks (gloo): the DataParallel all-reduce inside the graphed step, bitwise equal to
    eager on each rank (tests/dist_scripts/step_worker.py's cases, in the launch of
    tests/dist_scripts/data_parallel_job.py that tests/integration/test_distributed.py reads too)."""

    WORKER = DATA_PARALLEL_JOB

    def case(self, name):
        r0, r1 = super().case(name)
        # Each rank matched its eager run bit for bit (checked in the worker); across ranks the data
        # differ (losses) while the averaged updates keep the parameters identical.
        self.assertNotEqual(r0["loss"], r1["loss"])
        self.assertEqual(r0["params"], r1["params"], "parameters differ across ranks: grads not all-reduced")
        return r0

    def test_data_parallel_all_reduce_inside_the_graphed_step(self):
        self.assertEqual((self.case("dp_whole_step")["captures"], self.case("dp_whole_step")["replays"]), (1, 3))

    def test_data_parallel_accumulation_one_graph_per_micro_batch_phase(self):
        r = self.case("dp_whole_step_accumulation")
        self.assertEqual((r["captures"], r["replays"]), (2, 6))

    def test_fleet_distributed_model_and_optimizer(self):
        r = self.case("fleet_whole_step")
        self.assertEqual((r["captures"], r["replays"]), (1, 3))


def _paddle_scaler_enabled_on_cpu(**kwargs):
    """paddle.amp.GradScaler as it behaves on a GPU (it disables itself on a CPU place)."""
    import paddle.amp.grad_scaler as grad_scaler

    class _Place:
        def is_gpu_place(self):
            return True

        def is_xpu_place(self):
            return False

        def is_custom_place(self):
            return False

    class _Tracer:
        _expected_place = _Place()

    original = grad_scaler._dygraph_tracer
    grad_scaler._dygraph_tracer = lambda: _Tracer()
    try:
        return paddle.amp.GradScaler(**kwargs)
    finally:
        grad_scaler._dygraph_tracer = original


def _scaler_run(make_scaler):
    model = _mlp(dropout=0.0)
    opt = paddle.optimizer.AdamW(0.1, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    scaler = make_scaler()
    x = _data(1)[0]
    states = []
    for value in (1.0, 1.0, 1.0, float("inf"), 1.0, 1.0):
        with paddle.amp.auto_cast(level="O1", dtype="float16"):
            loss = model(x).square().mean() * value
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        state = _state(model, opt)
        state["scaler scale"] = scaler._scale.numpy()
        states.append(state)
    return states


if __name__ == "__main__":
    unittest.main()
