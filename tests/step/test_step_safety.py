"""A whole-step capture that is refused or fails leaves the program where eager would be, and a
graphed step never hands out a stale value.

Every case trains an eager twin and a graphed twin side by side (testkit/differential.py) and
compares all their state - parameters, grads, optimizer state, the learning rate and its tensor,
buffers, the extra state each case registers - bit for bit after every step:

- a refused or failed capture re-runs the step with exactly eager's learning rate;
- state the step writes outside ``optimizers=`` (an EMA kept with paddle.assign, BatchNorm running
  statistics, a second optimizer, an in-place write to a global or to an attribute of an object the
  step closes over) is written once, not twice; an optimizer stepped inside the step but missing
  from ``optimizers=`` is refused before any capture, by name, with the fix;
- Python values the step returns are recomputed on every replay (``opt.get_lr()``) or refused;
- a scheduler stepped inside the step is refused (a replay would not step it), and the rate
  tensor is written only by the phases that step its optimizer, as eager writes it;
- GraphGradScaler with parameter groups skips an overflow step as paddle.amp.GradScaler does.
"""

import types
import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import GraphGradScaler, autocudagraph_step
from testkit.differential import Trainee, differential_run
from testkit.step_gpu import refused_capture_check

STEPS = 10


def _batches(n=STEPS, shape=(4, 6), seed=3):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.standard_normal(shape).astype("float32")) for _ in range(n)]


def _model(seed=7, norm=False):
    paddle.seed(seed)
    layers = [paddle.nn.Linear(6, 8)]
    layers += [paddle.nn.BatchNorm1D(8)] if norm else []
    layers += [paddle.nn.Tanh(), paddle.nn.Linear(8, 2)]
    return paddle.nn.Sequential(*layers)


def _sgd_cosine(model):
    sched = paddle.optimizer.lr.CosineAnnealingDecay(0.2, T_max=6)
    return paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters()), sched


def _objects(model, opt, sched, **extra):
    return {"model": model, "opt": opt, "sched": sched, "lr tensor": lambda: opt._global_learning_rate(), **extra}


def _host_read(loss):
    return float(loss)  # a host read: refused inside a capture


class _Run:
    """differential_run with the graphed twin wrapped by autocudagraph_step (simulated backend),
    its schedulers stepped between steps; keeps the wrapper and the warnings."""

    def __init__(self, build, batches=None, optimizers=lambda t: [t.objects["opt"]], warmup_steps=2, between=None):
        self.wrapper = None
        self.warned = []

        def graph(trainee):
            self.wrapper = autocudagraph_step(trainee.step, optimizers=optimizers(trainee),
                                              warmup_steps=warmup_steps, backend="simulate")
            return self.wrapper

        def after(i, eager, graphed):
            for t in (eager, graphed):
                sched = t.objects.get("sched")
                if sched is not None:
                    sched.step()
                if between is not None:
                    between(i, t)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(build, batches or _batches(), graph=graph, after_step=after)
        self.warned = [str(w.message) for w in caught]
        self.stats = self.wrapper.stats()
        self.explain = self.wrapper.explain()


class RefusedCaptureLearningRateTest(unittest.TestCase):
    """The eager re-run of a refused capture trains with the rate eager uses at that step."""

    def _build(self, where):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            scale = [1.0]

            def step(x):
                loss = model(x).square().mean()
                if where == "before the update":
                    _host_read(loss)
                loss.backward()
                opt.step()
                opt.clear_grad()
                if where == "after the update":
                    _host_read(loss)
                return loss * scale[0] if where == "a changing host value" else loss
            return Trainee(step, _objects(model, opt, sched, scale=lambda: scale[0]))
        return build

    def _check(self, where, pattern):
        run = _Run(self._build(where))
        self.assertEqual(run.stats["captures"], 0, run.explain)
        self.assertRegex(run.explain, pattern)
        self.assertTrue(any("capture of key" in w for w in run.warned), run.warned)

    def test_a_host_read_before_the_update(self):
        self._check("before the update", r"__float__|numpy|item")

    def test_a_host_read_after_the_update_fails_the_capture_mid_way(self):
        self._check("after the update", r"__float__|numpy|item")

    def test_a_refusal_found_after_the_whole_capture_step_ran(self):
        # The op trace compares the capture with the last warmup step once the step has run.
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            scale = [1.0]

            def step(x):
                loss = model(x).square().mean() * scale[0]
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss
            trainee = Trainee(step, _objects(model, opt, sched, scale=lambda: scale[0]))
            trainee.scale = scale
            return trainee

        def bump(i, trainee):  # host state the loop changes every step
            trainee.scale[0] += 0.5
        run = _Run(build, between=bump)
        self.assertEqual(run.stats["captures"], 0, run.explain)
        self.assertRegex(run.explain, r"host value that changes")


class RefusedCaptureFullStepTest(unittest.TestCase):
    def test_adamw_warmup_cosine_clipping_and_graph_grad_scaler_with_a_capture_failing_after_the_update(self):
        def build():
            model = _model()
            sched = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.05, T_max=8),
                                                     warmup_steps=3, start_lr=0.005, end_lr=0.05)
            opt = paddle.optimizer.AdamW(sched, parameters=model.parameters(), weight_decay=0.01,
                                         grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
            scaler = GraphGradScaler(init_loss_scaling=256.0, incr_every_n_steps=2)

            def step(x):
                loss = model(x).square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.clear_grad()
                _host_read(loss)
                return loss
            return Trainee(step, _objects(model, opt, sched, scaler=scaler))
        run = _Run(build)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        # One warning, ours: putting LinearWarmup's own state back is not Paddle's "unused values" case.
        self.assertEqual([w for w in run.warned if "unused values" in w], [], run.warned)
        self.assertEqual(len([w for w in run.warned if "capture of key" in w]), 1, run.warned)


class CrossEntropyStepTest(unittest.TestCase):
    def test_a_classifier_step_with_cross_entropy_sgd_and_a_cosine_rate_equals_eager(self):
        # Paddle 2.6's F.cross_entropy with integer labels reads a value on the host: there the
        # capture is refused and every call must still be eager's (elsewhere it is captured).
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)

            def step(x, label):
                loss = paddle.nn.functional.cross_entropy(model(x), label)
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss
            return Trainee(step, _objects(model, opt, sched))
        rs = np.random.RandomState(4)
        labels = [paddle.to_tensor(rs.randint(0, 2, (4, 1)).astype("int64")) for _ in range(STEPS)]
        run = _Run(build, batches=list(zip(_batches(), labels)))
        graphed = (run.stats["captures"], run.stats["replays"]) == (1, STEPS - 3)
        self.assertTrue(graphed or "capture failed" in run.explain, run.explain)


class SchedulerSteppedInsideTest(unittest.TestCase):
    def _build(self, inside_from):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            calls = [0]

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                if calls[0] >= inside_from:
                    sched.step()
                return loss
            # No "sched" entry: the loop does not step it, the step does.
            trainee = Trainee(step, {"model": model, "opt": opt, "lr tensor": lambda: opt._global_learning_rate(),
                                     "sched state": lambda: sched.state_dict()})
            trainee.calls = calls
            return trainee
        return build

    def _check(self, inside_from):
        def count(i, trainee):
            trainee.calls[0] = i + 1
        run = _Run(self._build(inside_from), between=count)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"steps its learning-rate scheduler \(CosineAnnealingDecay\) inside")

    def test_a_scheduler_stepped_inside_the_step_is_refused_at_warmup(self):
        # On a GPU a replay would not run sched.step(): the rate would stop at the capture.
        self._check(inside_from=0)

    def test_a_scheduler_first_stepped_inside_at_the_capture_is_refused_and_stepped_once(self):
        self._check(inside_from=2)


class RefusedCaptureWritesOnceTest(unittest.TestCase):
    """A capture attempt leaves no write the eager re-run repeats, whatever tensor it wrote."""

    def _refused(self, build, **kw):
        run = _Run(build, **kw)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"__float__|numpy|item")
        return run

    def test_an_ema_of_the_weights_kept_with_paddle_assign(self):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            ema = [p.detach().clone() for p in model.parameters()]

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                with paddle.no_grad():
                    for e, p in zip(ema, model.parameters()):
                        paddle.assign(e * 0.9 + p * 0.1, output=e)
                _host_read(loss)
                return loss
            return Trainee(step, _objects(model, opt, sched, ema=lambda: list(ema)))
        self._refused(build)

    def test_batch_norm_running_statistics(self):
        def build():
            model = _model(norm=True)
            opt, sched = _sgd_cosine(model)

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                _host_read(loss)
                return loss
            return Trainee(step, _objects(model, opt, sched))
        self._refused(build)

    def test_a_second_optimizer_listed_in_optimizers(self):
        def build():
            model, head = _model(), _model(seed=9)
            opt, sched = _sgd_cosine(model)
            opt2 = paddle.optimizer.Adam(0.01, parameters=head.parameters())

            def step(x):
                loss = model(x).square().mean() + head(x).abs().mean()
                loss.backward()
                opt.step()
                opt2.step()
                opt.clear_grad()
                opt2.clear_grad()
                _host_read(loss)
                return loss
            return Trainee(step, _objects(model, opt, sched, head=head, opt2=opt2))
        self._refused(build, optimizers=lambda t: [t.objects["opt"], t.objects["opt2"]])

    def test_in_place_writes_to_a_global_and_to_an_attribute_of_a_closed_over_object(self):
        source = (
            "def step(x):\n"
            "    loss = model(x).square().mean()\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    opt.clear_grad()\n"
            "    TOTAL.add_(loss.detach().reshape([1]))\n"
            "    meter.count.add_(paddle.ones([1]))\n"
            "    host_read(loss)\n"
            "    return loss\n"
        )

        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            meter = types.SimpleNamespace(count=paddle.zeros([1]))
            space = {"paddle": paddle, "model": model, "opt": opt, "meter": meter, "TOTAL": paddle.zeros([1]),
                     "host_read": _host_read}
            exec(compile(source, "<step with globals>", "exec"), space)  # its own globals: one per twin
            return Trainee(space["step"], _objects(model, opt, sched, total=lambda: space["TOTAL"],
                                                   count=lambda: meter.count))
        self._refused(build)


class RefusedCaptureModuleStateTest(unittest.TestCase):
    def test_an_in_place_write_to_a_tensor_reached_only_through_a_module_attribute(self):
        # The walk does not enter modules; the in-place op net catches the write.
        source = (
            "def step(x):\n"
            "    loss = model(x).square().mean()\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    opt.clear_grad()\n"
            "    metrics.TOTAL.add_(loss.detach().reshape([1]))\n"
            "    metrics.SEEN[0:1] = metrics.SEEN[0:1] + 1.0\n"
            "    host_read(loss)\n"
            "    return loss\n"
        )

        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            metrics = types.ModuleType("metrics")
            metrics.TOTAL, metrics.SEEN = paddle.zeros([1]), paddle.zeros([2])
            space = {"model": model, "opt": opt, "metrics": metrics, "host_read": _host_read}
            exec(compile(source, "<step with a module>", "exec"), space)
            return Trainee(space["step"], _objects(model, opt, sched, total=lambda: metrics.TOTAL,
                                                   seen=lambda: metrics.SEEN))
        run = _Run(build)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)


class KernelLessGpuRefusedCaptureTest(unittest.TestCase):
    def test_the_matmul_step_of_tools_step_gpu_check_with_a_refused_capture_and_an_ema(self):
        # tools/step_gpu_check.py runs the same case on the cuda backend (a GPU without kernels).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = refused_capture_check(width=16, layers=2, steps=6, backend="simulate")
        self.assertTrue(result["equal"], result["first_mismatch"])
        self.assertEqual((result["stats"]["captures"], result["stats"]["eager_calls"]), (0, 4), result["stats"])


class RefusedCaptureAccumulationTest(unittest.TestCase):
    def test_grads_left_for_the_next_call_are_put_back_with_adamw_and_a_cosine_rate(self):
        # Two micro-batches per optimizer step (one key per phase); every capture fails after
        # the step ran: the grads it added and the update it made are taken back.
        def build():
            model = _model()
            sched = paddle.optimizer.lr.CosineAnnealingDecay(0.05, T_max=4)
            opt = paddle.optimizer.AdamW(sched, parameters=model.parameters(), weight_decay=0.01)

            def step(x, apply):
                loss = model(x).square().mean()
                loss.backward()
                if apply:
                    opt.step()
                    opt.clear_grad()
                _host_read(loss)
                return loss
            return Trainee(step, _objects(model, opt, sched))
        batches = [(x, i % 2 == 1) for i, x in enumerate(_batches(12))]
        run = _Run(build, batches=batches, warmup_steps=1)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)

    def test_graphed_phases_write_the_rate_only_in_the_phase_that_steps(self):
        # Eager Paddle writes the learning-rate tensor in opt.step() only: the micro-batch after
        # an optimizer step still holds the previous rate (compared after every call).
        def build():
            model = _model()
            sched = paddle.optimizer.lr.CosineAnnealingDecay(0.05, T_max=4)
            opt = paddle.optimizer.AdamW(sched, parameters=model.parameters(), weight_decay=0.01)

            def step(x, apply):
                loss = model(x).square().mean()
                loss.backward()
                if apply:
                    opt.step()
                    opt.clear_grad()
                return loss
            trainee = Trainee(step, {"model": model, "opt": opt, "lr tensor": lambda: opt._global_learning_rate()})
            trainee.sched = sched
            return trainee

        def after_apply(i, trainee):
            if i % 2 == 1:
                trainee.sched.step()
        batches = [(x, i % 2 == 1) for i, x in enumerate(_batches(16))]
        run = _Run(build, batches=batches, warmup_steps=1, between=after_apply)
        self.assertEqual(run.stats["captures"], 2, run.explain)
        self.assertEqual(run.stats["replays"], 10, run.explain)


class UnlistedOptimizerTest(unittest.TestCase):
    def test_an_optimizer_missing_from_optimizers_is_refused_by_name_before_any_capture(self):
        def build():
            model, head = _model(), _model(seed=9)
            opt, sched = _sgd_cosine(model)
            head_opt = paddle.optimizer.Adam(0.01, parameters=head.parameters())

            def step(x):
                loss = model(x).square().mean() + head(x).abs().mean()
                loss.backward()
                opt.step()
                head_opt.step()
                opt.clear_grad()
                head_opt.clear_grad()
                return loss
            return Trainee(step, _objects(model, opt, sched, head=head, head_opt=head_opt))
        run = _Run(build)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"head_opt.*Adam.*not in optimizers=.*optimizers=\[opt, head_opt\]")

    def test_one_first_stepped_at_the_capture_is_stopped_before_its_update(self):
        run = _Run(self._late_head_build(), between=self._switch)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"head_opt \(SGD.*optimizers=\[opt, head_opt\]")

    def test_a_listed_one_first_stepped_at_the_capture_is_refused(self):
        # Its rate was not fed before the capture (the last warmup step did not update it).
        def switch(i, trainee):
            trainee.tune_head[0] = i != 0  # stepped at the first call and from the capture call on
        run = _Run(self._late_head_build(first=True), between=switch,
                   optimizers=lambda t: [t.objects["opt"], t.objects["head_opt"]])
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"updates optimizers\[1\] \(SGD\), which the last warmup step")

    @staticmethod
    def _switch(i, trainee):
        trainee.tune_head[0] = i >= 1  # from the capture call (the third) on

    @staticmethod
    def _late_head_build(first=False):
        def build():
            model, head = _model(), _model(seed=9)
            opt, sched = _sgd_cosine(model)
            head_opt = paddle.optimizer.SGD(0.01, parameters=head.parameters())
            tune_head = [first]  # switched by the loop

            def step(x):
                loss = model(x).square().mean() + head(x).abs().mean()
                loss.backward()
                opt.step()
                if tune_head[0]:
                    head_opt.step()
                opt.clear_grad()
                head_opt.clear_grad()
                return loss
            trainee = Trainee(step, _objects(model, opt, sched, head=head, head_opt=head_opt))
            trainee.tune_head = tune_head
            return trainee
        return build


class ReturnedPythonValuesTest(unittest.TestCase):
    def test_an_argument_returned_as_it_is_is_kept(self):
        # A non-tensor argument is part of the key: each key returns its own value.
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)

            def step(x, apply):
                loss = model(x).square().mean()
                loss.backward()
                if apply:
                    opt.step()
                    opt.clear_grad()
                return loss, apply
            return Trainee(step, _objects(model, opt, sched))
        batches = [(x, i % 2 == 1) for i, x in enumerate(_batches(12))]
        run = _Run(build, batches=batches, warmup_steps=1)
        self.assertEqual(run.stats["captures"], 2, run.explain)

    def test_a_float_derived_from_get_lr_is_refused_and_named(self):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return {"loss": loss, "lr x 2": opt.get_lr() * 2}
            return Trainee(step, _objects(model, opt, sched))
        run = _Run(build)
        self.assertEqual(run.stats["captures"], 0, run.explain)
        self.assertRegex(run.explain, r"returns the Python float .* at output\['lr x 2'\]")

    def test_the_learning_rate_returned_by_get_lr_is_recomputed_on_every_replay(self):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return {"loss": loss, "lr": opt.get_lr(), "tag": "train", "none": None}
            return Trainee(step, _objects(model, opt, sched))
        run = _Run(build)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (1, STEPS - 3), run.explain)

    def test_a_python_number_computed_from_host_state_is_refused_with_the_reason(self):
        def build():
            model = _model()
            opt, sched = _sgd_cosine(model)
            seen = {"steps": 0}  # counted by the loop

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss, seen["steps"], opt.get_lr() * 2
            trainee = Trainee(step, _objects(model, opt, sched, seen=lambda: seen["steps"]))
            trainee.seen = seen
            return trainee

        def count(i, trainee):
            trainee.seen["steps"] += 1
        run = _Run(build, between=count)
        self.assertEqual((run.stats["captures"], run.stats["replays"]), (0, 0), run.explain)
        self.assertRegex(run.explain, r"returns the Python int 2 .*at output\[1\]")


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


class GraphGradScalerParamGroupsTest(unittest.TestCase):
    """Decay / no-decay parameter groups with overflows at step 0 and later: GraphGradScaler
    (eager and in a graphed step) equals paddle.amp.GradScaler bit for bit after every step."""

    FACTORS = (float("inf"), 1.0, 1.0, 1.0, float("nan"), 1.0, 1.0, float("inf"), 1.0, 1.0)

    def _build(self):
        made = []
        # decr_every_n_nan_or_inf=2 with no two overflows in a row keeps Paddle's scaler off its
        # overflow print, which raises with NumPy 2 (float() of a shape-[1] tensor).
        kw = dict(init_loss_scaling=1024.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)

        def build():
            model = _model()
            decay = [p for p in model.parameters() if len(p.shape) == 2]
            no_decay = [p for p in model.parameters() if len(p.shape) == 1]
            opt = paddle.optimizer.AdamW(0.05, weight_decay=0.1, parameters=[
                {"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
            scaler = GraphGradScaler(**kw) if made else _paddle_scaler_enabled_on_cpu(**kw)
            made.append(scaler)

            def step(x, factor):
                with paddle.amp.auto_cast(level="O1", dtype="float16"):
                    loss = model(x).square().mean() * factor
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.clear_grad()
                return loss
            state = {"model": model, "opt": opt, "scaler": lambda: scaler.state_dict()}
            return Trainee(step, state)
        return build

    def _batches(self):
        return [(x, paddle.to_tensor(np.float32(f))) for x, f in zip(_batches(len(self.FACTORS)), self.FACTORS)]

    def test_eager_graph_grad_scaler_equals_paddle_grad_scaler(self):
        differential_run(self._build(), self._batches(), graph=lambda t: t.step)

    def test_a_graphed_step_with_graph_grad_scaler_equals_paddle_grad_scaler(self):
        wrappers = []

        def graph(t):
            wrappers.append(autocudagraph_step(t.step, optimizers=[t.objects["opt"]], warmup_steps=2,
                                               backend="simulate"))
            return wrappers[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            differential_run(self._build(), self._batches(), graph=graph)
        self.assertEqual(wrappers[0].stats()["replays"], 7, wrappers[0].explain())


if __name__ == "__main__":
    unittest.main()
