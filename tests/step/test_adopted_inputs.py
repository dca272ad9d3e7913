"""NOTE [ Adopted inputs of a step ] (step/capture.py): a batch tensor passed in the last warmup call
and again in the capture call is the graph's input itself, so replays passed it again copy
nothing; another tensor there captures the key again once; a step that writes its input in place
writes the caller's tensor, as eager does, and a refused capture takes that write back.

Every case runs an eager twin next to the graphed step and compares every output and parameter
(and the input tensors themselves) bit for bit after every call.
"""

import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step
from testkit.common import MatMLP, build, host_tensor, normal
from testkit.harness import MatmulOnlyCase, for_each_backend
from testkit.step_gpu import MatmulStep

WIDTH = 16


@for_each_backend
class AdoptedStepInputsTest(MatmulOnlyCase):
    def _twins(self):
        return [MatmulStep(build(lambda: MatMLP([WIDTH] * 4), 1), lr=1e-2) for _ in range(2)]

    def _compare(self, eager, body, got, want, what):
        self.assertBitwise(got, want, f"output, {what}")
        for k, (p, q) in enumerate(zip(eager.model.parameters(), body.model.parameters())):
            self.assertBitwise(q, p, f"parameter {k}, {what}")

    def test_a_batch_tensor_refilled_in_place_is_read_in_place_without_copies(self):
        eager, body = self._twins()
        step = autocudagraph_step(body, optimizers=[], warmup_steps=2, backend=self.backend)
        draw = normal(5)
        x, dy = host_tensor(draw(4, WIDTH)), host_tensor(draw(4, WIDTH, scale=1e-2))
        for i in range(8):
            x.copy_(host_tensor(draw(4, WIDTH)), False)  # the loader refills the same device buffer
            self._compare(eager, body, step(x, dy), eager(x, dy), f"call {i}")
        stats = self.assertCounters(step, captures=1, recaptures=0, replays=5, eager=0)
        self.assertEqual((stats["input_copies"], stats["input_copies_skipped"]), (0, 10), step.explain())

    def test_another_tensor_after_the_capture_captures_the_key_again_once_then_copies(self):
        eager, body = self._twins()
        step = autocudagraph_step(body, optimizers=[], warmup_steps=2, backend=self.backend)
        draw = normal(6)
        xs = [host_tensor(draw(4, WIDTH)) for _ in range(2)]
        dy = host_tensor(draw(4, WIDTH, scale=1e-2))
        order = [0, 0, 0, 0, 1, 0, 1, 1, 0]  # warmup, warmup, capture (adopts xs[0]), replay, then both
        for i, k in enumerate(order):
            self._compare(eager, body, step(xs[k], dy), eager(xs[k], dy), f"call {i} with tensor {k}")
        self.assertCounters(step, captures=2, recaptures=1, replays=5, eager=0)
        self.assertIn("input copies 4 made", step.explain())  # the re-captured key copies both tensors


class AdoptedInputWrittenInPlaceTest(unittest.TestCase):
    """A step that writes its batch tensor in place (simulated backend: the capture executes)."""

    def _run(self, graphed, flip_at=None):
        paddle.seed(4)
        model = paddle.nn.Linear(6, 6)
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        eye = paddle.eye(6)
        flip = [False]

        def train_step(x):
            x.scale_(0.5)  # in place: the caller's tensor, in eager
            loss = model(paddle.matmul(x, eye, transpose_y=flip[0])).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        step = autocudagraph_step(train_step, optimizers=[opt], backend="simulate") if graphed else train_step
        x = paddle.to_tensor(np.random.RandomState(2).standard_normal((4, 6)).astype("float32"))
        log = []
        for i in range(7):
            flip[0] = flip_at is not None and i >= flip_at
            log.append((step(x).numpy(), x.numpy().copy(), [p.numpy() for p in model.parameters()]))
        return log, step

    def _assert_equal(self, eager, graphed):
        for i, (a, b) in enumerate(zip(eager, graphed)):
            for what, u, v in (("loss", a[0], b[0]), ("input", a[1], b[1])):
                self.assertEqual(u.tobytes(), v.tobytes(), f"{what} after call {i}")
            for k, (u, v) in enumerate(zip(a[2], b[2])):
                self.assertEqual(u.tobytes(), v.tobytes(), f"parameter {k} after call {i}")

    def test_the_callers_tensor_is_written_as_eager_writes_it(self):
        eager, _ = self._run(graphed=False)
        graphed, step = self._run(graphed=True)
        self._assert_equal(eager, graphed)
        self.assertEqual((step.stats()["captures"], step.stats()["replays"]), (1, 4), step.explain())

    def test_a_refused_capture_takes_its_write_to_the_input_back(self):
        # flip changes at the capture call: the capture step runs, then is refused (its op trace
        # differs from the last warmup step's); the eager re-run must scale the input once.
        eager, _ = self._run(graphed=False, flip_at=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed, step = self._run(graphed=True, flip_at=2)
        self.assertTrue(any("reads a host value that changes" in str(w.message) for w in caught), caught)
        self._assert_equal(eager, graphed)
        self.assertEqual(step.stats()["captures"], 0, step.explain())

    def test_an_input_written_in_place_and_passed_anew_each_call_is_refused(self):
        # A new tensor each call is copied into the graph's own input: a replay would write that copy,
        # never the caller's tensor. The capture is refused and every call runs eagerly, as eager.
        self.check_written_input_refused(lambda x: x.scale_(0.5))

    def test_an_input_copied_into_or_set_and_passed_anew_each_call_is_refused(self):
        # copy_ and set_value leave the inplace version alone: seen all the same (NOTE [ Writes without a
        # version bump ] in guards/in_place_writes.py).
        self.check_written_input_refused(lambda x: x.copy_(x * 0.5, False))
        self.check_written_input_refused(lambda x: x.set_value(x * 0.5))

    def check_written_input_refused(self, write):
        def run(graphed):
            paddle.seed(4)
            model = paddle.nn.Linear(6, 6)
            opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())

            def train_step(x):
                with paddle.no_grad():
                    write(x)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            step = autocudagraph_step(train_step, optimizers=[opt], backend="simulate") if graphed else train_step
            draw, log = np.random.RandomState(3), []
            for i in range(6):
                x = paddle.to_tensor(draw.standard_normal((4, 6)).astype("float32"))
                log.append((step(x).numpy(), x.numpy().copy(), [p.numpy() for p in model.parameters()]))
            return log, step

        eager, _ = run(graphed=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphed, step = run(graphed=True)
        self.assertTrue(any("writes its input(s)" in str(w.message) for w in caught), [str(w.message) for w in caught])
        self._assert_equal(eager, graphed)
        self.assertEqual(step.stats()["captures"], 0, step.explain())


if __name__ == "__main__":
    unittest.main()
