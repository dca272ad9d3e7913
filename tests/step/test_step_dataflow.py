"""A whole step watches what the model's forward reads, not only the step function's names.

On the simulated backend every replay's op trace is compared with the capture's by dataflow (NOTE
[ The dataflow of a trace ] in guards/host_reads.py): two used parameters swapped, a global tensor
the model's forward reads rebound, a table row picked by a config int run eagerly from that step on,
bitwise against eager. On every backend the tensors requiring grad that the capture read from
outside (a closure tensor that is no Parameter) have their ``stop_gradient`` checked before every
replay (NOTE [ Step replay checks ] in step/replay_checks.py): freezing one warms the step up and
captures it again. That case is matmul-only (MatmulOnlyCase: tools/gpu_check.py runs it on a GPU).
"""

import unittest
import warnings

import paddle

from paddlefleet.cudagraph import autocudagraph_step
from testkit.common import MatMLP, host_tensor
from testkit.differential import Trainee, differential_run
from testkit.harness import BackendCase, MatmulOnlyCase, for_each_backend, normal
from testkit.step_gpu import MatmulSGD

MASK = {"t": None}


class _Box:
    """Holds the step's closure tensor for the twins' state comparison."""


class Pair(paddle.nn.Layer):
    """``x @ order[0] @ order[1]`` (a list attribute changed in place is no Layer attribute change),
    then ``@ MASK["t"]`` (a module global) when set."""

    def __init__(self, seed):
        super().__init__()
        draw = normal(seed)
        self.w1 = self.create_parameter([8, 8], default_initializer=paddle.nn.initializer.Assign(draw(8, 8)))
        self.w2 = self.create_parameter([8, 8], default_initializer=paddle.nn.initializer.Assign(draw(8, 8)))
        self.order = [self.w1, self.w2]

    def forward(self, x):
        y = paddle.matmul(paddle.matmul(x, self.order[0]), self.order[1])
        return y if MASK["t"] is None else paddle.matmul(y, MASK["t"])


class _Steps:
    def build(self, extra=None):
        def make():
            model = Pair(5)
            tensors = list(model.parameters()) + ([extra()] if extra is not None else [])
            opt = MatmulSGD(tensors, 0.125)

            def step(x, dy):
                y = model(x)
                if extra is not None:
                    y = paddle.matmul(y, tensors[-1])
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            box = _Box()
            box.w = tensors[-1] if extra is not None else None
            return Trainee(step, {"model": model, "box": box})

        return make

    def run_steps(self, make, steps, change):
        wrappers = []

        def graph(trainee):
            wrappers.append(autocudagraph_step(trainee.step, optimizers=[], warmup_steps=1, backend=self.backend))
            return wrappers[0]

        def after_step(i, eager, graphed):
            change(i, eager.objects)
            change(i, graphed.objects)

        draw = normal(11)
        batches = [(host_tensor(draw(4, 8)), host_tensor(draw(4, 8))) for _ in range(steps)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(make, batches, graph, after_step=after_step)
        return wrappers[0], [str(w.message) for w in caught]


class SimulatedStepDataflowTest(_Steps, BackendCase):
    backend = "simulate"

    def tearDown(self):
        MASK["t"] = None
        super().tearDown()

    def test_two_used_parameters_swapped(self):
        def change(i, objects):
            if i == 2:
                objects["model"].order.reverse()

        step, messages = self.run_steps(self.build(), 5, change)
        self.assertIn("eager from now on", step.explain())
        self.assertTrue(any("_C_ops.matmul" in m and "another tensor" in m for m in messages), messages)

    def test_a_global_tensor_read_by_the_models_forward_rebound(self):
        draw = normal(3)
        MASK["t"] = host_tensor(draw(8, 8))

        def change(i, objects):
            if i == 2 and objects is not None:
                MASK["t"] = host_tensor(draw(8, 8))

        # One global serves both twins: rebinding it once (after the eager twin's change) is enough.
        calls = []

        def once(i, objects):
            calls.append(i)
            if len(calls) % 2 == 0:
                change(i, objects)

        step, messages = self.run_steps(self.build(), 5, once)
        self.assertIn("eager from now on", step.explain())
        self.assertTrue(any("another tensor" in m for m in messages), messages)

    def test_a_table_row_picked_by_a_config_int(self):
        cfg = {"t": 0}
        table = paddle.to_tensor(normal(4)(3, 8, 8).astype("float32"))

        def make():
            model = Pair(6)
            opt = MatmulSGD(list(model.parameters()), 0.125)

            def step(x, dy):
                y = paddle.matmul(model(x), table[cfg["t"]])
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            return Trainee(step, {"model": model})

        calls = []

        def change(i, objects):
            calls.append(i)
            if i == 2:
                cfg["t"] = 2

        step, messages = self.run_steps(make, 5, change)
        self.assertIn("eager from now on", step.explain())
        self.assertTrue(any("Tensor.__getitem__" in m for m in messages), messages)


@for_each_backend
class OutsideTensorFrozenTest(_Steps, MatmulOnlyCase):
    def test_freezing_a_closure_tensor_that_is_no_parameter_captures_the_step_again(self):
        """``w.stop_gradient = True`` on a tensor the step reads from its closure (no Parameter of any
        Layer) after step 2: a replay would keep computing and applying its grad; the step warms up
        and is captured again, bitwise against eager after every step."""
        values = normal(8)(8, 8)

        def extra():
            w = host_tensor(values)
            w.stop_gradient = False
            return w

        def change(i, objects):
            if i == 2:
                objects["box"].w.stop_gradient = True

        step, messages = self.run_steps(self.build(extra), 6, change)
        self.assertCounters(step, captures=2, replays=2, eager=0)
        self.assertTrue(any("was frozen (stop_gradient False -> True)" in m for m in messages), messages)


@for_each_backend
class OneTensorTwiceTest(MatmulOnlyCase):
    """One tensor given as two arguments (an autoencoder's batch as its own target; here the output grad): a
    run reads it for either argument, the capture reads the static buffer of each. Such a tensor holds both
    input slots of the dataflow (NOTE [ The dataflow of a trace ] in guards/host_reads.py), so the capture
    agrees with its last warmup step whichever arguments were one tensor at either."""

    def run_steps(self, calls):
        """``calls``: per step, whether x and dy are one tensor (True) or two (False); every step bitwise against
        eager, no capture refused."""
        draw = normal(21)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())

        def make(m):
            def step(batch):
                y = m(batch["x"])
                y.backward(batch["dy"])
                for p in m.parameters():
                    p.clear_gradient(False)
                return y
            return step

        graphed = autocudagraph_step(make(model), optimizers=[], warmup_steps=2, backend=self.backend)
        eager = make(twin)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused capture warns
            for k, one in enumerate(calls):
                xn = draw(4, 8)
                dyn = xn if one else draw(4, 8)
                x = self.tensor(xn)
                got = graphed({"x": x, "dy": x if one else self.tensor(dyn)})
                self.assertBitwise(got, eager({"x": self.tensor(xn), "dy": self.tensor(dyn)}), f"step {k}")
        return graphed

    def test_a_step_given_one_tensor_twice_is_captured_and_replays_for_two_tensors_too(self):
        graphed = self.run_steps([True] * 4 + [False] * 2)
        self.assertCounters(graphed, captures=1, eager=0)
        self.assertEqual(graphed.stats()["replays"], 3)

    def test_the_last_warmup_with_two_tensors_and_the_capture_with_one(self):
        graphed = self.run_steps([True, False, True, True, False])
        self.assertCounters(graphed, captures=1, eager=0)
        self.assertEqual(graphed.stats()["replays"], 2)


if __name__ == "__main__":
    unittest.main()
