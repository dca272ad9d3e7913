"""Grad nodes are read without keeping them alive (NOTE [ Reading grad nodes ] in core/grad_nodes.py): a read
leaves the node's references as they were, the package reads ``grad_fn`` nowhere else, and a graphed model
that is dropped gives back the memory its captures' grad nodes saved (a capture runs its backward with
``paddle.grad``, which leaves a node that was read holding what it saved)."""

import ast
import gc
import pathlib
import sys
import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.core.grad_nodes import grad_node

from testkit.common import MatMLP, normal
from testkit.harness import MatmulOnlyCase, for_each_backend, on_device

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "paddlefleet" / "cudagraph"


def allocated():
    return paddle.base.core.host_memory_stat_current_value("Allocated", 0)


class ReadTest(unittest.TestCase):
    def setUp(self):
        on_device(self, "cpu")

    def test_a_read_adds_no_reference_the_reader_does_not_own(self):
        w = paddle.to_tensor([[1.0, 2.0]], stop_gradient=False)
        y = paddle.tanh(w * w)
        node = grad_node(y)
        before = sys.getrefcount(node)
        for _ in range(3):
            again = grad_node(y)
            self.assertIs(again, node)
            del again
        self.assertEqual(sys.getrefcount(node), before)

    def test_a_stop_gradient_tensor_and_a_leaf_read_the_same_way(self):
        for t in (paddle.ones([2]), paddle.to_tensor([1.0], stop_gradient=False)):
            node = grad_node(t)  # Paddle gives both an accumulation node
            before = sys.getrefcount(node)
            self.assertIs(grad_node(t), node)
            self.assertEqual(sys.getrefcount(node), before)
        self.assertIsNone(grad_node(3.0))

    def test_a_walk_of_a_graph_run_by_paddle_grad_keeps_nothing(self):
        def once():
            w = paddle.randn([256, 256])
            w.stop_gradient = False
            y = paddle.tanh(paddle.matmul(paddle.randn([4, 256]), w))
            node = grad_node(y)
            node.next_functions[0].next_functions  # the walk a capture makes
            paddle.grad([y], [w], [paddle.ones_like(y)])

        once()
        gc.collect()
        base = allocated()
        for _ in range(3):
            once()
        gc.collect()
        # Three walks that kept their nodes would keep three weights (786,432 bytes); less than one weight is
        # the rest of the process's own coming and going (frees of earlier tests' garbage read as negative).
        self.assertLess(allocated() - base, 256 * 256 * 4, "bytes the grad nodes read kept allocated")


class PackageReadsTest(unittest.TestCase):
    def test_grad_fn_is_read_only_by_grad_node(self):
        found = []
        for path in sorted(PACKAGE.rglob("*.py")):
            if path.name == "grad_nodes.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                attribute = isinstance(node, ast.Attribute) and node.attr == "grad_fn"
                by_name = (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                           and any(isinstance(a, ast.Constant) and a.value == "grad_fn" for a in node.args))
                if attribute or by_name:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
        self.assertEqual(found, [], "read grad nodes through core/grad_nodes.grad_node (NOTE [ Reading grad nodes ])")


@for_each_backend
class DroppedModelTest(MatmulOnlyCase):
    """Four graphed layers, trained and dropped: the memory is back where it was (the simulated backend's
    graphs live in the host allocator; on a GPU its pools and static buffers, tools/gpu_check.py)."""

    def allocated(self):
        gc.collect()
        if self.backend != "cuda":
            return allocated()
        paddle.device.cuda.synchronize()
        paddle.device.cuda.empty_cache()
        return paddle.device.cuda.memory_allocated()

    def train(self, reset, width=128):
        model = self.twins(lambda: paddle.nn.Sequential(*[MatMLP([width, width]) for _ in range(4)]), 0)[0]
        for layer in model:
            self.graphed(layer, warmup_steps=1, eager_if_slower=False)
        draw = normal(3)
        x, dy = self.tensor(draw(8, width)), self.tensor(draw(8, width))
        for _ in range(4):
            model(x).backward(dy)
            for p in model.parameters():
                p.clear_gradient(False)
        self.assertEqual(model[0].forward.stats()["replays"], 2)
        if reset:
            for layer in model:
                layer.forward.reset()

    def assert_gives_back(self, reset):
        self.train(reset)
        base = self.allocated()
        for _ in range(2):
            self.train(reset)
        # Two dropped models that kept their capture's nodes would keep eight weights (524,288 bytes on the CPU);
        # less than one weight is the rest of the process's own coming and going.
        self.assertLess(self.allocated() - base, 128 * 128 * 4, "bytes two dropped models kept allocated")

    def test_dropped_as_trained(self):
        self.assert_gives_back(reset=False)

    def test_dropped_after_reset(self):
        self.assert_gives_back(reset=True)
