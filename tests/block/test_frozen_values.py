"""Python values a replay would freeze, seen: a plain attribute of a graphed Layer or of any
sublayer changed after capture (NOTE [ Layer attributes a replay freezes ] in guards/layer_attrs.py),
a parameter of a whole step frozen or unfrozen, a plain attribute of a Layer a step calls.

Matmul-only (MatmulOnlyCase: conftest marks them ``gpu_safe``, tools/gpu_check.py runs them on a
GPU): explicit ``y.backward(dy)``, every output and grad bitwise against an eager twin after every
step (the step cases with testkit's differential checker).
"""

import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from testkit.common import MatMLP, build
from testkit.differential import Trainee, differential_run
from testkit.harness import MatmulOnlyCase, for_each_backend, normal, release_grads
from testkit.step_gpu import MatmulSGD


class Flagged(paddle.nn.Layer):
    """``x @ w1``, then ``@ w2`` only while ``self.extra`` (a flag read in forward)."""

    def __init__(self):
        super().__init__()
        self.w1 = self.create_parameter([8, 8], dtype="float32")
        self.w2 = self.create_parameter([8, 8], dtype="float32")
        self.extra = False

    def forward(self, x):
        y = paddle.matmul(x, self.w1)
        if self.extra:
            y = paddle.matmul(y, self.w2)
        return y


class Twice(paddle.nn.Layer):
    """``x @ w``, once or ``self.times`` times (a curriculum switch on a sublayer)."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([8, 8], dtype="float32")
        self.times = 1

    def forward(self, x):
        for _ in range(self.times):
            x = paddle.matmul(x, self.w)
        return x


class Outer(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.inner = Twice()
        self.w = self.create_parameter([8, 8], dtype="float32")

    def forward(self, x):
        return paddle.matmul(self.inner(x), self.w)


class SkippingSGD(MatmulSGD):
    """MatmulSGD that leaves parameters without a grad (frozen ones) alone."""

    def step(self):
        with paddle.no_grad():
            for p, stacked, update in zip(self.params, self._stacked, self._update):
                if p.grad is None:
                    continue
                n = p.shape[0]
                stacked._slice(0, n).copy_(p, False)
                stacked._slice(n, 2 * n).copy_(p.grad, False)
                p.copy_(paddle.matmul(update, stacked), False)


@for_each_backend
class LayerAttributeCases(MatmulOnlyCase):
    def run_twins(self, graphed, eager, steps, change_at, change):
        """Calls both twins on one batch per step, ``change(layer)`` applied to both before step
        ``change_at``; compares outputs and every grad; returns the warnings."""
        draw = normal(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(steps):
                if k == change_at:
                    change(graphed)
                    change(eager)
                xn, dyn = draw(4, 8), draw(4, 8)
                outs, grads = [], []
                for fn, layer in ((graphed, graphed), (eager, eager)):
                    x = self.tensor(xn, grad=True)
                    y = fn(x)
                    y.backward(self.tensor(dyn))
                    outs.append(y)
                    grads.append([x.grad] + [p.grad for p in layer.parameters()])
                self.assertBitwise(outs[0], outs[1], f"step {k} y")
                self.assertBitwise(grads[0], grads[1], f"step {k} grads")
                release_grads(graphed, eager)
        return [str(w.message) for w in caught]

    def test_flag_read_in_forward_changed_after_capture_captures_again(self):
        """``model.extra = True`` after capture: the key is captured again (a replay would skip the
        second matmul), with a warning naming the attribute and both values."""
        graphed, eager = self.twins(Flagged, 41)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, lambda m: setattr(m, "extra", True))
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any("attribute 'extra' of Flagged" in m and "False -> True" in m for m in messages), messages)

    def test_sublayer_attribute_changed_after_capture_captures_again(self):
        """``model.inner.times = 2`` (a sublayer's curriculum switch) after capture: captured again."""
        graphed, eager = self.twins(Outer, 42)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, lambda m: setattr(m.inner, "times", 2))
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any("attribute 'times' of Outer.inner" in m and "1 -> 2" in m for m in messages), messages)

    def test_a_value_set_back_replays(self):
        """A flag set and set back before the next call changes nothing the graph read: it replays."""
        graphed, eager = self.twins(Flagged, 43)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)

        def flip_and_back(m):
            m.extra = True
            m.extra = False

        self.run_twins(graphed, eager, 5, 3, flip_and_back)
        self.assertCounters(graphed.forward, captures=1, replays=3, eager=0)


@for_each_backend
class StepValueCases(MatmulOnlyCase):
    def build_step(self, factory=lambda: MatMLP([8, 8, 8, 8])):
        def make():
            model = build(factory, 17)
            opt = SkippingSGD(model.parameters(), 0.125)

            def step(x, dy):
                y = model(x)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            return Trainee(step, {"model": model})

        return make

    def batches(self, n):
        draw = normal(9)
        return [(self.tensor(draw(4, 8)), self.tensor(draw(4, 8))) for _ in range(n)]

    def run_step(self, build, steps, change):
        wrappers = []

        def graph(trainee):
            wrappers.append(autocudagraph_step(trainee.step, optimizers=[], warmup_steps=1, backend=self.backend))
            return wrappers[0]

        def after_step(i, eager, graphed):
            change(i, eager.objects["model"])
            change(i, graphed.objects["model"])

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(build, self.batches(steps), graph, after_step=after_step)
        return wrappers[0], [str(w.message) for w in caught]

    def test_freezing_a_parameter_captures_the_step_again(self):
        """``p.stop_gradient = True`` on the first layer after step 2, back to False after step 5:
        each change warms the step up and captures it again, with a message naming the parameter; every output,
        parameter and grad bitwise against eager after every step (a replay would keep training
        the frozen layer)."""
        names = []

        def change(i, model):
            p = model.layers[0].w
            names.append(p.name)
            if i == 2:
                p.stop_gradient = True
            elif i == 5:
                p.stop_gradient = False

        step, messages = self.run_step(self.build_step(), 9, change)
        self.assertCounters(step, captures=3, replays=3, eager=0)
        graphed_name = names[1]
        self.assertTrue(any(f"parameter {graphed_name} was frozen (stop_gradient False -> True)" in m
                            for m in messages), messages)
        self.assertTrue(any(f"parameter {graphed_name} was unfrozen" in m for m in messages), messages)

    def test_layer_attribute_the_step_reads_captures_again(self):
        """A sublayer's plain attribute changed between steps (``model.inner.times = 2``): the step
        warms up and is captured again, bitwise against eager."""
        def change(i, model):
            if i == 2:
                model.inner.times = 2

        step, messages = self.run_step(self.build_step(Outer), 6, change)
        self.assertCounters(step, captures=2, replays=2, eager=0)
        self.assertTrue(any("attribute 'times' of Outer.inner" in m for m in messages), messages)


class SetItemScalarTest(unittest.TestCase):
    """``t[i] = v`` with a Python scalar runs in C++ without a ``_C_ops`` call: the value is a kernel
    argument a GPU replay keeps from its capture. The simulated backend traces it as an op (block
    replays and whole steps alike) and runs eagerly where it changes; a numpy value is a host copy,
    refused (tests/block/test_capture_failures.py's setitem_numpy)."""

    def test_a_scalar_written_with_setitem_that_changes_runs_eagerly_on_simulate(self):
        knob = [1.0]

        def fill_row(x):
            t = x * 1.0
            t[1] = knob[0]
            return t

        graphed = autocudagraph(fill_row, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                knob[0] = 1.0 if i < 3 else float(i)
                x = paddle.ones([3, 2])
                np.testing.assert_array_equal(graphed(x).numpy(), fill_row(x).numpy(), strict=True)
        stats = graphed.stats()
        # Call 3's replay sees the new value before it hands anything out and runs eagerly; so does call 4.
        self.assertEqual((stats["captures"], stats["replays"]), (1, 1), graphed.explain())
        messages = " ".join(str(c.message) for c in caught)
        self.assertIn("Tensor.__setitem__", messages)
        self.assertIn("On a GPU this replay would reuse the capture's", messages)

    def test_a_whole_step_whose_setitem_scalar_changes_is_refused_at_capture(self):
        knob = [1.0]
        w = paddle.create_parameter([2, 2], "float32")
        opt = paddle.optimizer.SGD(0.1, parameters=[w])

        def step(x):
            t = paddle.matmul(x, w)
            t[0] = knob[0]
            loss = t.sum()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        graphed = autocudagraph_step(step, optimizers=[opt], backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                knob[0] = float(i)
                graphed(paddle.ones([2, 2]))
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())
        self.assertIn("Tensor.__setitem__", graphed.explain())
