"""The capture-failure matrix for a whole step: every reason a capture is refused or fails (CASES in
tests/block/test_capture_failures.py, which holds the blocks' half) x {simulate, cuda}, and the grads a
failed step capture takes back. Every output and all model state equal an eager twin's.
"""

import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step
from testkit.common import MatMLP, build, cuda_skip_reason
from testkit.differential import Trainee, assert_same_state, differential_run, state_of
from testkit.harness import RECORD, MatmulOnlyCase, backend_variants, normal
from testkit.step_gpu import MatmulSGD

from tests.block.test_capture_failures import _KNOB, CASES, Boom, FailureCase, _matrix_test


class StepFailures(FailureCase):
    """A whole training step (a MatMLP, an explicit dy, a matmul-made SGD update) with ``inject``
    after the forward: every output and all model state (testkit.differential) equals eager's."""

    not_here = {"closure_leaf_needing_grad": "a whole step runs its own backward: any leaf gets its grad as in eager"}

    #: Cases refused only once the step has run (the capture's trace is compared at its end): their
    #: update goes through paddle.optimizer.SGD in optimizers=, which a refused simulated capture takes back.
    refused_at_the_end = ("changing_host_value",)

    def build(self, inject, paddle_sgd=False):
        def make():
            model = build(lambda: MatMLP([8, 8, 8]), 11)
            if paddle_sgd:
                opt = paddle.optimizer.SGD(0.125, parameters=model.parameters())
            else:
                opt = MatmulSGD(model.parameters(), 0.125)

            def step(x, u, v, dy):
                y = inject(model(x), u, v)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            objects = {"model": model, "opt": opt} if paddle_sgd else {"model": model}
            return Trainee(step, objects)

        return make

    def batches(self, n=4):
        draw = normal(7)
        return [tuple(self.tensor(a) for a in (draw(4, 8), draw(1, 4), draw(8, 1), draw(4, 8))) for _ in range(n)]

    def check(self, name):
        inject, names = self.case(name)
        wrappers = []

        late = name in self.refused_at_the_end

        def graph(trainee):
            optimizers = [trainee.objects["opt"]] if late else []
            wrappers.append(autocudagraph_step(trainee.step, optimizers=optimizers, warmup_steps=1,
                                               backend=self.backend))
            return wrappers[0]

        def after_step(*_):
            self.assertClean()
            _KNOB[0] += 1.0

        _KNOB[0] = 1.0
        eager, _ = differential_run(self.build(inject, paddle_sgd=late), self.batches(), graph, after_step=after_step)
        RECORD.notes.append(f"4 steps: outputs and {len(state_of(eager.objects))} state entries bitwise equal "
                            "after each (testkit.differential)")
        self.assertFellBack(wrappers[0], names)
        self.assertHealthy()

    def test_function_error_reaches_the_caller_once(self):
        """The step's own exception during its capture call is raised to the caller once; the next step
        captures, and all state stays equal to an eager twin that raised at the same step."""
        def raising_at_step_1():
            calls = []

            def inject(y, u, v):
                calls.append(1)
                if len(calls) == 2:  # step 1: the graphed twin's capture call
                    raise Boom("the step's own error")
                return y

            return inject

        eager, graphed = self.build(raising_at_step_1())(), self.build(raising_at_step_1())()
        step = autocudagraph_step(graphed.step, optimizers=[], warmup_steps=1, backend=self.backend)
        for i, batch in enumerate(self.batches(5)):
            results = []
            for fn in (eager.step, step):
                try:
                    results.append(fn(*batch))
                except Boom:
                    results.append("raised")
            self.assertBitwise(results[1], results[0], f"step {i} output")
                # Both twins raised at step 1 before their update: the capture left no trace either.
            assert_same_state(state_of(graphed.objects), state_of(eager.objects), f"after step {i}")
            self.assertClean()
        self.assertEqual(step.stats()["captures"], 1, step.explain())


for _name in CASES:
    setattr(StepFailures, f"test_{_name}", _matrix_test(_name))


class StepFailureAfterBackward(MatmulOnlyCase):
    """A whole step whose capture fails after its backward bound the grads (NOTE [ What a failed
    recording capture leaves ] in step/rollback.py)."""

    def _step(self, model, fail):
        opt = MatmulSGD(model.parameters(), 1e-2)

        def step(x, dy):
            y = model(x)
            y.backward(dy)
            if fail[0]:
                y.numpy()  # refused during the capture: after the backward, before the update
            opt.step()
            opt.clear_grad()
            return y
        return step

    def _run(self):
        draw = normal(31)
        xs = [self.tensor(draw(4, 16)) for _ in range(3)]
        dys = [self.tensor(draw(4, 16, scale=0.1)) for _ in range(3)]
        eager_model, graphed_model = self.twins(lambda: MatMLP([16, 32, 16]), 5)
        fail = [True]
        eager = self._step(eager_model, [False])
        graphed = autocudagraph_step(self._step(graphed_model, fail), optimizers=[], warmup_steps=1,
                                     backend=self.backend)
        for i in range(6):
            fail[0] = i < 2  # the first capture fails; the next one (a re-capture is not made: eager) holds
            x, dy = xs[i % 3], dys[i % 3]
            self.assertBitwise(graphed(x, dy), eager(x, dy), f"step {i} output")
            for k, (a, e) in enumerate(zip(graphed_model.parameters(), eager_model.parameters())):
                self.assertBitwise(a, e, f"step {i} parameter {k}")
                self.assertIsNone(a.grad, f"step {i} parameter {k}: a grad left by the failed capture")
        return graphed

    def test_grads_bound_by_a_failed_capture_are_taken_back(self):
        """The capture fails after backward() bound grads to the parameters: the eager run that
        replaces it starts from eager's grads (None), so every parameter equals eager's."""
        graphed = self._run()
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())

    def test_a_recording_capture_leaves_no_grad_either(self):
        """The same through a backend whose capture does not execute (as CUDA's): the grads its Python
        bound are taken back although no value changed."""
        if self.backend != "simulate":
            self.skipTest("the stand-in for a recording capture is the simulated backend")
        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        with mock.patch.object(SimulatedBackend, "capture_executes", False):
            graphed = self._run()
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())


class GradsHeldBeforeAFailedCapture(MatmulOnlyCase):
    """NOTE [ What a failed recording capture leaves ] in step/rollback.py: grads kept between calls (gradient
    accumulation) exist before a capture that fails after its backward added into them; the eager call that
    replaces it adds into their values from before (on a GPU kept by their storage, not by copies)."""

    def _step(self, model, fail):
        def step(x, dy):
            y = model(x)
            y.backward(dy)  # adds into the grads the last call left
            if fail[0]:
                y.numpy()  # refused during the capture, after the backward
            return y
        return step

    def _run(self):
        if self.backend == "cuda" and cuda_skip_reason("all"):
            self.skipTest(f"accumulating grads needs Paddle's add kernel: {cuda_skip_reason('all')}")
        draw = normal(37)
        eager_model, graphed_model = self.twins(lambda: MatMLP([16, 16, 16]), 7)
        x0, dy0 = draw(4, 16), draw(4, 16)
        for model in (eager_model, graphed_model):  # grads before the first call
            model(self.tensor(x0)).backward(self.tensor(dy0))
        fail = [True]
        eager = self._step(eager_model, [False])
        graphed = autocudagraph_step(self._step(graphed_model, fail), optimizers=[], warmup_steps=1,
                                     backend=self.backend)
        for i in range(5):
            fail[0] = i < 3  # the warmup calls (two: the first creates state) run it eagerly; the capture fails
            x, dy = draw(4, 16), draw(4, 16, scale=0.1)
            self.assertBitwise(graphed(self.tensor(x), self.tensor(dy)), eager(self.tensor(x), self.tensor(dy)),
                               f"step {i} output")
            self.assertBitwise([p.grad for p in graphed_model.parameters()],
                               [p.grad for p in eager_model.parameters()], f"step {i} accumulated grads")
        self.assertEqual(graphed.stats()["eager_reasons"].get("capture failed"), 1, graphed.explain())
        return graphed

    def test_grads_kept_between_calls_are_put_back_after_a_failed_capture(self):
        """A simulated capture runs the backward (its values are rolled back); a GPU's records it only (the
        grads keep their values, held by storage): RecordingGradValues pins that half on the CPU."""
        self._run()


class RecordingGradValues(unittest.TestCase):
    """NOTE [ What a failed recording capture leaves ] in step/rollback.py: a recording capture keeps
    device grads by their storage, a copy of none (a GPU stood in for by a place check)."""

    def test_device_grads_are_kept_by_storage_and_put_back_after_a_clear(self):
        from paddlefleet.cudagraph.step import rollback

        lin, other = paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 3)
        lin(paddle.ones([2, 3])).sum().backward()
        params = [lin.weight, lin.bias, other.weight]
        ptrs, values = [p.grad.data_ptr() for p in params[:2]], [p.grad.numpy().copy() for p in params[:2]]
        with mock.patch.object(rollback, "_on_host", lambda t: False):
            kept = rollback.GradValues(params, recording=True)
        self.assertEqual([saved.data_ptr() for _, saved in kept._grads[:2]], ptrs)  # no copy made
        # What a recording capture's Python does: a clear frees one grad, a backward binds a new one.
        lin.weight.clear_gradient(False)
        other(paddle.ones([2, 3])).sum().backward()
        kept.restore()
        for p, want in zip(params, values):
            np.testing.assert_array_equal(p.grad.numpy(), want)
        self.assertEqual(lin.bias.grad.data_ptr(), ptrs[1])
        self.assertTrue(other.weight.grad is None or not other.weight.grad._is_initialized())
        copied = rollback.GradValues(params[:1])  # a capture that executes: values copied
        self.assertNotEqual(copied._grads[0][1].data_ptr(), lin.weight.grad.data_ptr())


class GradAssignment(MatmulOnlyCase):
    """NOTE [ Assigning a grad during capture ] in guards/host_guard.py."""

    def test_assigning_a_grad_inside_a_whole_step_is_refused_and_stays_eager_exact(self):
        """p.grad = t inside the step is refused at capture on both backends (a GPU fails it with
        CUDA error 906); every step equals eager."""
        draw = normal(41)
        x, dy = self.tensor(draw(4, 16)), self.tensor(draw(4, 16, scale=0.1))

        def make(model):
            def step(x, dy):
                params = list(model.parameters())
                grads = paddle.grad([model(x)], params, [dy])
                for p, g in zip(params, grads):
                    p.grad = g
                out = params[0].grad.clone()  # a copy: the grad itself is released below
                for p in params:
                    p.clear_gradient(False)
                return out
            return step

        eager_model, graphed_model = self.twins(lambda: MatMLP([16, 32, 16]), 6)
        eager = make(eager_model)
        graphed = autocudagraph_step(make(graphed_model), optimizers=[], warmup_steps=1, backend=self.backend)
        for i in range(4):
            self.assertBitwise(graphed(x, dy), eager(x, dy), f"step {i}")
        stats = graphed.stats()
        self.assertEqual(stats["captures"], 0, graphed.explain())
        self.assertTrue(any("p.grad = tensor" in r for r in stats["eager_reasons"]), stats["eager_reasons"])


for _base in (StepFailures, StepFailureAfterBackward, GradAssignment, GradsHeldBeforeAFailedCapture):
    globals().update(backend_variants(_base))
del (FailureCase, StepFailures, StepFailureAfterBackward, GradAssignment, GradsHeldBeforeAFailedCapture, _base, _name)
