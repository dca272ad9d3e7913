"""A simulated replay is compared with its capture by dataflow (NOTE [ The dataflow of a trace ] in
guards/host_reads.py): which tensor each op reads, not only which ops run with which scalars.

Each case is one a GPU replays silently wrong (it replays the capture's kernels on the capture's
tensors): the simulated backend must run that call eagerly (forward and backward equal eager's,
``None`` grads for a parameter the call no longer uses), warn once naming the op and what it read,
and run the key eagerly from then on. On a GPU these cases cannot be seen (docs/guides/limitations.md),
so they run on the simulated backend only.
"""

import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from testkit.harness import BackendCase

GLOBAL = {"t": None}


def _ours(caught):
    return [str(w.message) for w in caught if "autocudagraph" in str(w.message)]


class _Simulated(BackendCase):
    backend = "simulate"

    def run_twins(self, graphed, eager, calls, change, inputs, backward=True, params=()):
        """Calls ``graphed`` and ``eager`` on the same inputs ``calls`` times, ``change(i)`` before
        call i; compares outputs (and the grads of ``inputs`` and ``params`` pairs) bitwise."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(calls):
                change(i)
                xs = inputs(i)
                twins = [t.detach().clone() for t in xs]
                for a, b in zip(xs, twins):
                    b.stop_gradient = a.stop_gradient
                got, want = graphed(*xs), eager(*twins)
                self.assertBitwise(got, want, f"call {i}")
                if backward and not got.stop_gradient:
                    dy = paddle.full(got.shape, 0.5)
                    got.backward(dy)
                    want.backward(dy)
                    self.assertBitwise([a.grad for a in xs], [b.grad for b in twins], f"input grads of call {i}")
                    for p, q in params:
                        self.assertBitwise(p.grad, q.grad, f"parameter grads of call {i}")
                        p.clear_gradient(False)
                        q.clear_gradient(False)
        return _ours(caught)

    def assertFellBack(self, f, messages, *words):
        self.assertIn("eager from now on; ", f.explain())
        warned = [m for m in messages if "ReplayTraceError" in m]
        self.assertEqual(len(warned), 1, messages)
        for word in words:
            self.assertIn(word, warned[0])


class WhichTensorTest(_Simulated):
    """A: the same ops with the same scalars on another tensor."""

    def test_a_flag_that_picks_another_tensor(self):
        z, y = paddle.full([4], 2.0), paddle.full([4], 3.0)
        cfg = {"flag": True}

        def fn(x):
            return x * (z if cfg["flag"] else y)

        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        messages = self.run_twins(f, fn, 5, lambda i: cfg.update(flag=i < 3), lambda i: [paddle.ones([4])])
        self.assertFellBack(f, messages, "Tensor.__mul__", "test_dataflow.py:")

    def test_split_picked_by_a_python_int(self):
        cfg = {"k": 0}

        def fn(x):
            return paddle.split(x, 3)[cfg["k"]] * 2.0

        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        messages = self.run_twins(f, fn, 5, lambda i: cfg.update(k=0 if i < 3 else 2),
                                  lambda i: [paddle.arange(6, dtype="float32")])
        self.assertFellBack(f, messages, "output 2 of op #0")

    def test_unbind_picked_by_a_python_int(self):
        cfg = {"k": 0}

        def fn(x):
            return paddle.unbind(x)[cfg["k"]] + 1.0

        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        messages = self.run_twins(f, fn, 5, lambda i: cfg.update(k=0 if i < 3 else 1),
                                  lambda i: [paddle.arange(6, dtype="float32").reshape([2, 3])])
        self.assertFellBack(f, messages, "output 1 of op #0")

    def test_a_module_global_tensor_rebound(self):
        GLOBAL["t"] = paddle.full([4], 2.0)

        def fn(x):
            return x * GLOBAL["t"]

        def change(i):
            if i == 3:
                GLOBAL["t"] = paddle.full([4], 7.0)

        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        messages = self.run_twins(f, fn, 5, change, lambda i: [paddle.ones([4])])
        self.assertFellBack(f, messages, "another tensor")

    def test_a_config_object_picks_another_weight_and_the_unused_one_gets_no_grad(self):
        class Cfg:
            use_b = False

        class Pick(paddle.nn.Layer):
            def __init__(self, cfg):
                super().__init__()
                self.wa = self.create_parameter([4, 4])
                self.wb = self.create_parameter([4, 4])
                self.cfg = cfg

            def forward(self, x):
                return paddle.matmul(x, self.wb if self.cfg.use_b else self.wa)

        shared = Cfg()  # one object: its attribute is no Layer attribute
        paddle.seed(1)
        graphed, eager = Pick(shared), Pick(shared)
        eager.set_state_dict(graphed.state_dict())
        pairs = [(graphed.wa, eager.wa), (graphed.wb, eager.wb)]
        graphed = autocudagraph(graphed, backend="simulate", warmup_steps=1)
        messages = self.run_twins(graphed, eager, 5, lambda i: setattr(shared, "use_b", i >= 3),
                                  lambda i: [paddle.ones([2, 4])], params=pairs)
        self.assertFellBack(graphed.forward, messages, "_C_ops.matmul", "parameter wa", "parameter wb")

    def test_a_random_choice_of_weight(self):
        import random

        rng = random.Random(3)
        w1, w2 = paddle.full([4], 2.0), paddle.full([4], 3.0)
        picks = []

        def graphed_fn(x):
            picks.append(rng.random() < 0.5)
            return x * (w1 if picks[-1] else w2)

        f = autocudagraph(graphed_fn, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(12):
                out = f(paddle.ones([4]))
                self.assertBitwise(out, paddle.ones([4]) * (w1 if picks[-1] else w2))
        self.assertIn("fell back", f.explain())


class IndexedInCppTest(_Simulated):
    """B: ``x[k]`` runs in C++ on both Paddles; a Python int picking a row is seen."""

    def test_a_table_row_picked_by_a_config_int(self):
        class Embed(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.table = self.create_parameter([5, 4])
                self.cfg = {"t": 0}

            def forward(self, x):
                return x + self.table[self.cfg["t"]]

        paddle.seed(2)
        graphed, eager = Embed(), Embed()
        eager.set_state_dict(graphed.state_dict())
        graphed = autocudagraph(graphed, backend="simulate", warmup_steps=1)

        def change(i):
            graphed.cfg["t"] = eager.cfg["t"] = 0 if i < 3 else i

        messages = self.run_twins(graphed, eager, 5, change, lambda i: [paddle.ones([2, 4])],
                                  params=[(graphed.table, eager.table)])
        self.assertFellBack(graphed.forward, messages, "Tensor.__getitem__", "0 at the capture and 3 at the replay")


class NeverWriteTheCallersTensorTest(_Simulated):
    """C: a view of an input passed as the same tensor every call, with a changing index."""

    def check_view(self, fn, knob, values):
        t = paddle.arange(4, dtype="float32").reshape([2, 2])
        before = t.numpy().copy()
        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for v in values:
                knob["k"] = v
                with paddle.no_grad():
                    got = f(t)
                np.testing.assert_array_equal(t.numpy(), before, strict=True)
                self.assertBitwise(got, fn(t))
        self.assertIn("fell back", f.explain())

    def test_a_row_of_the_input(self):
        knob = {"k": 0}
        self.check_view(lambda t: t[knob["k"]], knob, [0, 0, 0, 1, 1, 0])

    def test_a_transpose_of_the_input(self):
        knob = {"k": [0, 1]}
        self.check_view(lambda t: t.transpose(knob["k"]), knob, [[0, 1], [0, 1], [1, 0], [0, 1]])

    def test_a_view_that_does_not_change_replays_without_writing(self):
        t = paddle.arange(4, dtype="float32")
        f = autocudagraph(lambda t: t[1:], backend="simulate", warmup_steps=1)
        with paddle.no_grad():
            for _ in range(4):
                self.assertBitwise(f(t), t[1:])
                np.testing.assert_array_equal(t.numpy(), np.arange(4, dtype="float32"), strict=True)
        self.assertEqual(f.stats()["replays"], 2, f.explain())


class ReturnedPythonValuesTest(_Simulated):
    """G: a number a block returns is compared like an op's scalar."""

    def test_a_returned_number_that_changes(self):
        step = {"n": 0}

        def fn(x):
            return x * 2.0, step["n"]

        f = autocudagraph(fn, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                step["n"] = 0 if i < 3 else i
                out, n = f(paddle.ones([2]))
                self.assertEqual(n, step["n"])
        self.assertFellBack(f, _ours(caught), "returned values")


if __name__ == "__main__":
    unittest.main()


class ChainedMemberTest(_Simulated):
    """A chained call (the layer-by-layer pattern) runs the same trace check as a call alone."""

    def test_a_dict_value_read_by_every_chained_member(self):
        cfg = {"s": 1.0}

        class Scaled(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([8, 8])

            def forward(self, x):
                return paddle.matmul(x, self.w) * cfg["s"]

        paddle.seed(4)
        graphed = paddle.nn.LayerList([Scaled() for _ in range(4)])
        eager = paddle.nn.LayerList([Scaled() for _ in range(4)])
        eager.set_state_dict(graphed.state_dict())
        for layer in graphed:
            autocudagraph(layer, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(8):
                cfg["s"] = 1.0 if i < 5 else 0.5
                x = paddle.ones([2, 8])
                x.stop_gradient = False
                twin = x.detach().clone()
                twin.stop_gradient = False
                h, g = x, twin
                for a, b in zip(graphed, eager):
                    h, g = a(h), b(g)
                self.assertBitwise(h, g, f"output of step {i}")
                dy = paddle.full(h.shape, 0.25)
                h.backward(dy)
                g.backward(dy)
                self.assertBitwise(x.grad, twin.grad, f"input grad of step {i}")
                for a, b in zip(graphed, eager):
                    self.assertBitwise(a.w.grad, b.w.grad, f"grad of step {i}")
                    a.w.clear_gradient(False)
                    b.w.clear_gradient(False)
        self.assertGreater(graphed[1].forward.stats()["chained_calls"], 0, graphed[1].forward.explain())
        self.assertTrue(all("fell back" in layer.forward.explain() for layer in graphed),
                        [layer.forward.explain() for layer in graphed])
        self.assertTrue(any("Tensor.__mul__" in m for m in _ours(caught)), _ours(caught))


class BackwardPythonTest(_Simulated):
    """E: Python that runs in a graphed call's backward (a hook on an activation, a PyLayer backward)
    is traced at capture and at every replay; a replay whose backward differs keeps eager's grads and
    the key runs eagerly from the next call on."""

    def run_layer(self, make, change, calls=6):
        paddle.seed(5)
        graphed, eager = make(), make()
        eager.set_state_dict(graphed.state_dict())
        pairs = [(graphed.w, eager.w)]
        graphed = autocudagraph(graphed, backend="simulate", warmup_steps=1)
        messages = self.run_twins(graphed, eager, calls, change, lambda i: [paddle.ones([2, 4])], params=pairs)
        self.assertIn("eager from now on; ", graphed.forward.explain())
        warned = [m for m in messages if "backward read other values" in m]
        self.assertEqual(len(warned), 1, messages)
        return warned[0]

    def test_a_hook_on_an_activation_reads_a_schedule(self):
        sched = {"c": 1.0}

        class Hooked(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([4, 4])

            def forward(self, x):
                h = paddle.matmul(x, self.w)
                h.register_hook(lambda g: g * sched["c"])
                return h * 2.0

        warned = self.run_layer(Hooked, lambda i: sched.update(c=1.0 if i < 3 else 0.25))
        self.assertIn("1.0 at the capture and 0.25 at the replay", warned)

    def test_a_pylayer_backward_reads_a_coefficient_and_a_flag(self):
        sched = {"coef": 1.0, "flip": False}

        class Reverse(paddle.autograd.PyLayer):
            @staticmethod
            def forward(ctx, x):
                return x * 1.0

            @staticmethod
            def backward(ctx, g):
                return -g * sched["coef"] if sched["flip"] else g * sched["coef"]

        class Adversarial(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([4, 4])

            def forward(self, x):
                return Reverse.apply(paddle.matmul(x, self.w))

        def change(i):
            sched["coef"] = 1.0 if i < 2 else 0.5
            sched["flip"] = i >= 4

        self.run_layer(Adversarial, change)


class WritesOfARunThatRunsEagerlyTest(_Simulated):
    """A replay that differs runs the call eagerly: what it wrote in place into a tensor from outside
    is put back first, so the call writes it once, as eager does."""

    def test_a_closure_counter_is_written_once_per_call(self):
        cfg = {"s": 1.0}
        counter, twin = paddle.zeros([1]), paddle.zeros([1])

        def make(c):
            def fn(x):
                c.add_(paddle.ones([1]))
                return x * cfg["s"]

            return fn

        f, eager = autocudagraph(make(counter), backend="simulate", warmup_steps=1), make(twin)
        with warnings.catch_warnings(record=True), paddle.no_grad():
            warnings.simplefilter("always")
            for i in range(5):
                cfg["s"] = 1.0 if i < 3 else 2.0
                self.assertBitwise(f(paddle.ones([2])), eager(paddle.ones([2])), f"call {i}")
                self.assertBitwise(counter, twin, f"counter after call {i}")
        self.assertIn("eager from now on; ", f.explain())
