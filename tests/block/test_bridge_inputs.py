"""The bridge's inputs (NOTE [ Bridge inputs ] in block/bridge.py): the tensors of a call that need no grad
are not PyLayer inputs, and the grads still reach the tensors that need them, bit for bit as in eager, in
every order of the arguments. Matmul-only models with an explicit ``y.backward(dy)`` (gpu-safe).
"""

import numpy as np
import paddle

from testkit.common import MatMLP
from testkit.harness import MatmulOnlyCase, for_each_backend


class TwoInputs(paddle.nn.Layer):
    """``(a @ w1) @ (b @ w2)``: matmuls only."""

    def __init__(self, d=8):
        super().__init__()
        self.w1 = self.create_parameter([d, d])
        self.w2 = self.create_parameter([d, d])

    def forward(self, a, b):
        return paddle.matmul(paddle.matmul(a, self.w1), paddle.matmul(b, self.w2))


def bridge_tensors(args):
    """The tensors a BridgeArgs hands to PyLayer.apply (one list argument, or one argument each)."""
    if len(args.args) == 1 and isinstance(args.args[0], list):
        return args.args[0]
    return list(args.args)


def draw(seed, *shape):
    return np.random.RandomState(seed).randn(*shape).astype("float32")


@for_each_backend
class BridgeInputsTest(MatmulOnlyCase):
    def run_twins(self, grad_at, steps=4):
        """Graphed and eager TwoInputs, called ``steps`` times with ``grad_at`` naming the arguments that
        need grad; every output and grad compared bit for bit. Returns the graphed Layer."""
        graphed, eager = self.twins(TwoInputs, seed=3)
        self.graphed(graphed, warmup_steps=1, eager_if_slower=False)
        for step in range(steps):
            args = [[self.tensor(draw(10 * step + i, 8, 8), grad=name in grad_at) for name, i in (("a", 1), ("b", 2))]
                    for _ in range(2)]
            dy = self.tensor(draw(100 + step, 8, 8))
            ys = [layer(*a) for layer, a in ((graphed, args[0]), (eager, args[1]))]
            for y in ys:
                y.backward(dy)
            self.assertBitwise(ys[0], ys[1], f"output {step}")
            for i in range(2):
                self.assertBitwise(args[0][i].grad, args[1][i].grad, f"grad of argument {i}, step {step}")
            for p, q in zip(graphed.parameters(), eager.parameters()):
                self.assertBitwise(p.grad, q.grad, f"grad of {p.name}, step {step}")
                p.clear_gradient(False)
                q.clear_gradient(False)
        self.assertCounters(graphed.forward, captures=1, replays=steps - 2)
        return graphed

    def test_arguments_that_need_no_grad_are_left_out_of_the_bridge(self):
        graphed = self.run_twins(grad_at=())
        graphs = graphed.forward.entry().graphs.current
        a, b = self.tensor(draw(1, 8, 8)), self.tensor(draw(2, 8, 8))
        taken = bridge_tensors(graphs.bridge.args([a, b]))
        self.assertEqual([id(t) for t in taken], [id(p) for p in graphed.parameters()])

    def test_grads_reach_the_arguments_that_need_them_in_any_order(self):
        for grad_at in (("b",), ("a",), ("a", "b")):
            with self.subTest(grad_at=grad_at):
                graphed = self.run_twins(grad_at=grad_at)
                graphs = graphed.forward.entry().graphs.current
                a, b = self.tensor(draw(1, 8, 8), grad="a" in grad_at), self.tensor(draw(2, 8, 8), grad="b" in grad_at)
                taken = bridge_tensors(graphs.bridge.args([a, b]))
                self.assertEqual(len(taken), 2 + len(grad_at))
                self.assertEqual([id(t) for t in taken[2:]], [id(t) for t in (a, b) if not t.stop_gradient])

    def test_a_frozen_layer_hands_the_grad_of_its_argument(self):
        graphed, eager = self.twins(lambda: MatMLP([8, 8, 8]), seed=4)
        for layer in (graphed, eager):
            for p in layer.parameters():
                p.stop_gradient = True
        self.graphed(graphed, warmup_steps=1, eager_if_slower=False)
        for step in range(4):
            xs = [self.tensor(draw(step, 4, 8), grad=True) for _ in range(2)]
            dy = self.tensor(draw(50 + step, 4, 8))
            ys = [graphed(xs[0]), eager(xs[1])]
            for y in ys:
                y.backward(dy)
            self.assertBitwise(ys[0], ys[1], f"output {step}")
            self.assertBitwise(xs[0].grad, xs[1].grad, f"grad of the argument, step {step}")
        self.assertCounters(graphed.forward, captures=1, replays=2)

    def test_a_first_tensor_that_needs_no_grad_takes_the_general_path(self):
        # The plan puts a tensor that needs grad first without a search; where that does not hold
        # (a parameter frozen after the check ran), BridgeArgs searches and swaps as in general.
        graphed = self.run_twins(grad_at=("b",))
        plan = graphed.forward.entry().graphs.current.bridge
        a, b = self.tensor(draw(1, 8, 8)), self.tensor(draw(2, 8, 8), grad=True)
        self.assertEqual(plan.args([a, b]).lead, 0)
        first = plan.tail[0]
        first.stop_gradient = True
        try:
            args = plan.args([a, b])
        finally:
            first.stop_gradient = False
        self.assertEqual(args.lead, 1)
        self.assertIs(bridge_tensors(args)[0], plan.tail[1])
