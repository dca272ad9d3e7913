"""Grad and output safety of the fast paths, bitwise against eager:

* outputs that are views of another output or of an input (a slice, a transpose, a reshape, an
  unsqueeze): their values and the grads through them (NOTE [ Strided static outputs ]);
* ``clone_param_grads="auto"``: a handle ``g = p.grad`` held across micro-batches stays the same
  tensor as ``p.grad``, as in eager (NOTE [ Moving an adopted grad ]);
* ``accumulate_in_graph=True``: parameters the forward does not use keep ``grad`` None, freed grads
  stay None until a backward assigns them, parameters shared by two graphed blocks or used eagerly
  as well (a tied weight) sum their grads as eager does (NOTE [ Accumulation inside the graph ],
  NOTE [ Shared parameters leave the graph ]).
"""

import unittest
import warnings

import numpy as np
import paddle
from parameterized import parameterized

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from testkit.differential import Trainee, differential_run
from testkit.harness import BackendCase, for_each_backend


def _h(x, w):
    return paddle.matmul(x, w)


VIEW_OUTPUTS = {
    "slice": lambda x, w: (lambda h: (h, h[:, :3]))(_h(x, w)),
    "slice_only": lambda x, w: _h(x, w)[:, 1:4],
    "transpose": lambda x, w: (lambda h: (h, h.t()))(_h(x, w)),
    "reshape": lambda x, w: (lambda h: (h, h.reshape([-1])))(_h(x, w)),
    "unsqueeze": lambda x, w: (lambda h: (h.unsqueeze(0), h))(_h(x, w)),
    "view_of_input": lambda x, w: (_h(x, w), x[1:], x.t()),
    "twice": lambda x, w: (lambda v: (v, v))(_h(x, w).t()),
}


@for_each_backend
class ViewOutputsTest(BackendCase):
    @parameterized.expand([(f"{name}_clone{c}", name, c) for name in VIEW_OUTPUTS for c in (True, False)])
    def test_outputs_that_are_views_and_their_grads_equal_eager(self, _, name, clone_outputs):
        fn = VIEW_OUTPUTS[name]
        graphed = self.graphed(fn, warmup_steps=1, clone_outputs=clone_outputs)
        w0 = np.random.RandomState(9).standard_normal((4, 6)).astype("float32")
        ws = [paddle.to_tensor(w0, stop_gradient=False) for _ in range(2)]
        for i in range(5):
            xs = np.random.RandomState(i).standard_normal((3, 4)).astype("float32")
            got = []
            for f, w in ((fn, ws[0]), (graphed, ws[1])):
                x = paddle.to_tensor(xs, stop_gradient=False)
                out = f(x, w)
                out = list(out) if isinstance(out, (tuple, list)) else [out]
                values = [o.numpy().copy() for o in out]
                # A different weight per output: a grad summed in another order would show.
                loss = paddle.zeros([])
                for k, o in enumerate(out):
                    loss = loss + (o * float(k + 1) / 3.0).sum()
                loss.backward()
                got.append((values, x.grad.numpy(), w.grad.numpy()))
            self.assertBitwise(got[1], got[0], f"{name} call {i}")
        stats = graphed.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (1, 3), graphed.explain())


class WholeStepViewOutputsTest(unittest.TestCase):
    def test_a_step_returning_views_of_its_outputs_equals_eager(self):
        def build():
            paddle.seed(4)
            model = paddle.nn.Linear(8, 6)
            opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())

            def step(x):
                y = model(x)
                loss = (y * y).mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss, y[:, :3], y.t()

            return Trainee(step, {"model": model, "opt": opt})

        rs = np.random.RandomState(1)
        batches = [paddle.to_tensor(rs.standard_normal((4, 8)).astype("float32")) for _ in range(7)]
        steps = []

        def graph(trainee):
            steps.append(autocudagraph_step(trainee.step, optimizers=[trainee.objects["opt"]], backend="simulate"))
            return steps[0]

        differential_run(build, batches, graph)
        self.assertEqual(steps[0].stats()["replays"], 4, steps[0].explain())


class Net3(paddle.nn.Layer):
    """Three matmuls with parameters of different shapes (no grad stacks) and one of a shared shape."""

    def __init__(self):
        super().__init__()
        self.a = self.create_parameter([8, 6])
        self.b = self.create_parameter([6, 6])
        self.c = self.create_parameter([6, 6])

    def forward(self, x):
        return paddle.matmul(paddle.matmul(paddle.matmul(x, self.a), self.b), self.c)


def _mse(y):
    return (y * y).mean()


def _micro_batches(steps, micro, seed=0, shape=(4, 8)):
    rs = np.random.RandomState(seed)
    return [([paddle.to_tensor(rs.standard_normal(shape).astype("float32")) for _ in range(micro)],)
            for _ in range(steps)]


def _handle_trainee(set_to_zero, hook, take):
    """A step of several micro-batches that keeps ``g = p.grad`` of every parameter after
    micro-batch ``take`` and returns, before the optimizer step, each handle's values and whether it
    is still ``p.grad``'s storage (and what a hook kept, when ``hook``)."""

    def build():
        paddle.seed(5)
        model = Net3()
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
        kept = []
        if hook:
            model.b.register_hook(lambda t: kept.append(t))

        def step(xs):
            held = None
            for i, x in enumerate(xs):
                _mse(model(x)).backward()
                if i == take:
                    held = [p.grad for p in model.parameters()]
            params = list(model.parameters())
            result = ([h.numpy().copy() for h in held],
                      [h.data_ptr() == p.grad.data_ptr() for h, p in zip(held, params)],
                      [k.numpy().copy() for k in kept])
            kept.clear()
            opt.step()
            opt.clear_grad(set_to_zero=set_to_zero)
            return result

        return Trainee(step, {"model": model, "opt": opt})

    return build


@for_each_backend
class HeldGradHandleTest(BackendCase):
    @parameterized.expand([(f"{'zero' if z else 'free'}_hook{h}_take{t}", z, h, t)
                           for z in (True, False) for h in (False, True) for t in (0, 1)])
    def test_a_held_grad_handle_tracks_p_grad_over_later_micro_batches(self, _, set_to_zero, hook, take):
        graphed = []

        def graph(trainee):
            graphed.append(autocudagraph(trainee.objects["model"], backend=self.backend, warmup_steps=1))
            return trainee.step

        differential_run(_handle_trainee(set_to_zero, hook, take), _micro_batches(3, 4), graph)
        stats = graphed[0].forward.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (1, 10),
                         graphed[0].forward.explain())


class WithHeads(paddle.nn.Layer):
    """A trunk and two heads; ``forward(x, head)`` uses one head (a Python branch: the head index
    is part of the key), and ``spare`` is never used."""

    def __init__(self):
        super().__init__()
        self.trunk = self.create_parameter([8, 6])
        self.heads = paddle.nn.ParameterList([self.create_parameter([6, 4]) for _ in range(2)])
        self.spare = self.create_parameter([6, 4])

    def forward(self, x, head=0):
        return paddle.matmul(paddle.matmul(x, self.trunk), self.heads[head])


def _window_trainee(micro, set_to_zero, heads_per_step):
    """AdamW over steps of ``micro`` micro-batches; step i uses head ``heads_per_step[i]``."""

    def build():
        paddle.seed(11)
        model = WithHeads()
        opt = paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())
        calls = [0]

        def step(xs):
            head = heads_per_step[calls[0] % len(heads_per_step)]
            calls[0] += 1
            losses = []
            for x in xs:
                loss = _mse(model(x, head))
                loss.backward()
                losses.append(loss)
            opt.step()
            opt.clear_grad(set_to_zero=set_to_zero)
            return losses

        return Trainee(step, {"model": model, "opt": opt})

    return build


class Block(paddle.nn.Layer):
    def __init__(self, w=None):
        super().__init__()
        self.w = w if w is not None else self.create_parameter([8, 8])

    def forward(self, x):
        return paddle.matmul(x, self.w)


class TwoBlocksSharingAWeight(paddle.nn.Layer):
    """Two separately graphed blocks that share one weight, and one of their own."""

    def __init__(self):
        super().__init__()
        self.first = Block()
        self.second = Block(self.first.w)
        self.own = Block()

    def forward(self, x):
        return self.own(self.second(self.first(x)))


class TiedHead(paddle.nn.Layer):
    """An embedding-like weight used by the graphed block and again, eagerly, by the output head."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.mid = self.create_parameter([8, 8])

    def forward(self, x):
        h = self.block(x)
        return paddle.matmul(paddle.matmul(h, self.mid), self.block.w, transpose_y=True)


class TiedBefore(TiedHead):
    """The tied weight used eagerly before the graphed block (an embedding-like input projection)."""

    def forward(self, x):
        h = paddle.matmul(paddle.matmul(x, self.block.w, transpose_y=True), self.mid)
        return self.block(h)


class OneBlockTwice(paddle.nn.Layer):
    """One graphed block called twice in one forward (one key): both calls feed one backward pass."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x) * 1.5 + self.block(x * 0.5)


def _accumulating_trainee(factory, micro, set_to_zero):
    def build():
        paddle.seed(13)
        model = factory()
        opt = paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())

        def step(xs):
            losses = []
            for x in xs:
                loss = _mse(model(x))
                loss.backward()
                losses.append(loss)
            opt.step()
            opt.clear_grad(set_to_zero=set_to_zero)
            return losses

        return Trainee(step, {"model": model, "opt": opt})

    return build


@for_each_backend
class AccumulateInGraphSafetyTest(BackendCase):
    def _graph(self, graphed, layer_of, **options):
        def graph(trainee):
            for layer in layer_of(trainee.objects["model"]):
                graphed.append(autocudagraph(layer, backend=self.backend, accumulate_in_graph=True, **options))
            return trainee.step
        return graph

    @parameterized.expand([("zero", True), ("free", False)])
    def test_unused_parameters_keep_grad_none(self, _, set_to_zero):
        graphed = []
        graph = self._graph(graphed, lambda m: [m], warmup_steps=1)
        differential_run(_window_trainee(2, set_to_zero, [0]), _micro_batches(4, 2), graph)
        stats = graphed[0].forward.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (1, 6, 0),
                         graphed[0].forward.explain())

    @parameterized.expand([("micro1", 1), ("micro2", 2)])
    def test_a_head_unused_in_a_window_after_freed_grads_is_not_decayed(self, _, micro):
        graphed = []
        graph = self._graph(graphed, lambda m: [m], warmup_steps=1)
        differential_run(_window_trainee(micro, False, [0, 0, 1, 0, 1, 1]), _micro_batches(6, micro), graph)
        stats = graphed[0].forward.stats()
        # One key per head; they share the trunk but never a backward pass (the second key's eager
        # warmup included): both keep accumulating in their graphs.
        self.assertEqual((stats["captures"], stats["recaptures"], stats["eager_calls"]), (2, 0, 0),
                         graphed[0].forward.explain())
        self.assertNotIn("handed out", graphed[0].forward.explain())

    @parameterized.expand([(f"micro{m}_warmup{w}_{'zero' if z else 'free'}", m, w, z)
                           for m in (1, 3) for w in (1, m) for z in (True, False) if w <= m])
    def test_a_weight_shared_by_two_graphed_blocks_sums_as_eager(self, _, micro, warmup, set_to_zero):
        graphed = []  # a capture in the middle of a window (warmup < micro) too
        graph = self._graph(graphed, lambda m: [m.first, m.second, m.own], warmup_steps=warmup)
        differential_run(_accumulating_trainee(TwoBlocksSharingAWeight, micro, set_to_zero), _micro_batches(5, micro),
                         graph)
        first, second, own = (g.forward for g in graphed)
        # The first block is captured again once the second one shares its weight.
        self.assertEqual([f.stats()["captures"] for f in (first, second, own)], [2, 1, 1])
        self.assertEqual([f.stats()["eager_calls"] for f in (first, second, own)], [0, 0, 0])
        for shared in (first, second):  # their only parameter is shared: it goes through autograd
            self.assertIn("parameter grads handed to Paddle with clone_param_grads", shared.explain())
        self.assertIn("grads of 1 parameter(s) accumulated in the graph", own.explain())

    @parameterized.expand([(f"{where}_micro{m}_warmup{w}_{'zero' if z else 'free'}", factory, m, w, z)
                           for where, factory in (("after", TiedHead), ("before", TiedBefore))
                           for m in (1, 3) for w in (1, m) for z in (True, False) if w <= m])
    def test_a_tied_weight_used_eagerly_with_the_block_sums_as_eager(self, _, factory, micro, warmup, set_to_zero):
        graphed = []  # a capture in the middle of a window (warmup < micro) too
        graph = self._graph(graphed, lambda m: [m.block], warmup_steps=warmup)
        differential_run(_accumulating_trainee(factory, micro, set_to_zero), _micro_batches(5, micro), graph)
        stats = graphed[0].forward.stats()
        # Used after the block: seen by a hook in the capture call's backward, captured again.
        # Used before it: the call's input depends on it, seen at capture.
        expected = (2, 1, 0) if factory is TiedHead else (1, 0, 0)
        self.assertEqual((stats["captures"], stats["recaptures"], stats["eager_calls"]), expected,
                         graphed[0].forward.explain())
        self.assertIn("parameter grads handed to Paddle with clone_param_grads", graphed[0].forward.explain())

    @parameterized.expand([("slots", 4), ("one_in_flight", 1)])
    def test_one_block_called_twice_in_one_pass_sums_as_eager(self, _, max_inflight):
        """Two forwards of one key in flight (two slots, or the second call eager) count as sharing."""
        graphed = []
        graph = self._graph(graphed, lambda m: [m.block], warmup_steps=1, max_inflight=max_inflight)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the past-max_inflight warning
            differential_run(_accumulating_trainee(OneBlockTwice, 2, True), _micro_batches(4, 2), graph)
        stats = graphed[0].forward.stats()
        self.assertEqual(stats["recaptures"], 1, graphed[0].forward.explain())
        self.assertIn("parameter grads handed to Paddle with clone_param_grads", graphed[0].forward.explain())


def _micro_step_trainee(set_to_zero):
    """One call per micro-batch (``apply`` on the last one of a window: opt.step and clear_grad), the
    head chosen per window: grads are kept between calls (persistent grad slots)."""

    def build():
        paddle.seed(3)
        model = WithHeads()
        opt = paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())

        def step(x, head, apply):
            loss = _mse(model(x, head))
            loss.backward()
            if apply:
                opt.step()
                opt.clear_grad(set_to_zero=set_to_zero)
            return loss

        return Trainee(step, {"model": model, "opt": opt})

    return build


class WholeStepAccumulationTest(unittest.TestCase):
    @parameterized.expand([("free", False), ("zero", True)])
    def test_a_head_unused_in_a_window_matches_eager_under_persistent_grad_slots(self, _, set_to_zero):
        rs = np.random.RandomState(0)
        batches = [(paddle.to_tensor(rs.standard_normal((4, 8)).astype("float32")), head, m == 1)
                   for head in (0, 0, 1, 0, 1, 1, 0, 0) for m in range(2)]
        steps = []

        def graph(trainee):
            steps.append(autocudagraph_step(trainee.step, optimizers=[trainee.objects["opt"]], backend="simulate",
                                            warmup_steps=1))
            return steps[0]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(_micro_step_trainee(set_to_zero), batches, graph)
        if not set_to_zero:  # freeing windows run eagerly, with the reason
            self.assertTrue(any("created or replaced state" in str(w.message) or "set_to_zero=False" in str(w.message)
                                for w in caught), [str(w.message) for w in caught])


if __name__ == "__main__":
    unittest.main()
