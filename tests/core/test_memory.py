"""NOTE [ What a key holds ] in core/memory.py: every component a key holds, one test each, in stats(),
report(), explain() and max_bytes; the cuda backend's measuring path with a stand-in for Paddle's
CUDA graph and allocator (NOTE [ Allocator cache before a capture ] in backends/pool_memory.py)."""

import contextlib
import types
import unittest
from unittest import mock

import numpy as np
from parameterized import parameterized
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from paddlefleet.cudagraph.backends import cuda, pool_memory, simulated
from paddlefleet.cudagraph.chains import run as chain_run
from paddlefleet.cudagraph.core.memory import Footprint, footprint
from paddlefleet.cudagraph.grads.stacks import stacks_as_grads_arrive
from paddlefleet.cudagraph.io.static_inputs import StaticInputs
from testkit.common import MatLayer, MatMLP, build, host_tensor, normal

B, W = 4, 8
ROW = B * W * 4  # bytes of one [B, W] float32 tensor
PARAM = W * W * 4
#: Grads handed out as copies (clone_param_grads=True) that the pool holds a second time, as computed, per stacked
#: grad: where Paddle has no node post hooks they are stacked after paddle.grad (NOTE [ Stacks after paddle.grad
#: only for copied grads ] in grads/stacks.py). Aliases, the default, are held once on every Paddle.
TWICE = 0 if stacks_as_grads_arrive() else 1


def batch(draw, rows=B, grad=True):
    return host_tensor(draw(rows, W), stop_gradient=not grad)


def train(model, steps, micro=1, rows=B, seed=3, layers=None):
    """``steps`` steps of ``micro`` micro-batches (grads accumulate over them, then are freed); the
    outputs, input grads and parameter grads of every step, as numpy."""
    draw = normal(seed)
    log = []
    for _ in range(steps):
        for _ in range(micro):
            x = batch(draw, rows)
            h = x
            for layer in layers or [model]:
                h = layer(h)
            h.backward(batch(draw, rows, grad=False))
            log += [h.numpy(), x.grad.numpy()]
        log += [p.grad.numpy() for p in model.parameters()]
        for p in model.parameters():
            p.clear_gradient(False)
    return log


def key_memory(wrapper):
    [mem] = wrapper.stats()["key_memory"].values()
    return mem


class ComponentsTest(unittest.TestCase):
    """One block key of MatMLP([8, 8, 8]) on batch 4: each component in bytes."""

    def graphed(self, **options):
        graphed, eager = build(lambda: MatMLP([W, W, W]), 0), build(lambda: MatMLP([W, W, W]), 0)
        autocudagraph(graphed, backend="simulate", warmup_steps=0, **options)
        return graphed, eager

    def test_every_component_of_a_block_key(self):
        graphed, eager = self.graphed()
        np.testing.assert_equal(train(graphed, 3), train(eager, 3))
        mem = key_memory(graphed.forward)
        # x's buffer; y; dy's buffer; x's grad and the two parameters' grads (one stack of two views).
        self.assertEqual(mem, {"inputs": ROW, "outputs": ROW, "grad_outputs": ROW, "grads": ROW + 2 * PARAM,
                               "pool": None, "cache_released": 0, "held": 3 * ROW + ROW + 2 * PARAM})
        stats = graphed.forward.stats()
        self.assertEqual(stats["held_bytes"], mem["held"])
        self.assertEqual(stats["memory"], mem)
        self.assertEqual(graphed.forward.report()[0]["memory"], mem)
        self.assertIn(f"holds {mem['held']}: inputs {ROW}, outputs {ROW}, grad outputs {ROW}, "
                      f"grads {ROW + 2 * PARAM};", graphed.forward.explain())
        graphed.forward.reset()
        self.assertEqual(graphed.forward.stats()["held_bytes"], 0)

    def test_an_adopted_input_holds_no_bytes(self):
        graphed, _ = build(lambda: MatMLP([W, W, W]), 0), None
        autocudagraph(graphed, backend="simulate", warmup_steps=1)
        x = batch(normal(1))
        for _ in range(3):  # the same tensor at warmup and capture: its own storage is the buffer
            graphed(x).backward(batch(normal(2), grad=False))
        self.assertEqual(graphed.forward.stats()["input_copies_skipped"], 1)
        self.assertEqual(key_memory(graphed.forward)["inputs"], 0)

    def test_outputs_at_an_input_buffer_count_once(self):
        x = paddle.ones([B, W])
        static = StaticInputs([x], ["x"])
        own = paddle.ones([B, W])
        got = footprint(static, outputs=[static.buffers[0], own, own], grads=[own])
        self.assertEqual((got.inputs, got.outputs, got.grads), (ROW, ROW, 0))

    @parameterized.expand([("aliases", "auto", 0), ("copies", True, TWICE)])
    def test_a_modelled_pool_holds_the_outputs_and_grads(self, _, clone, twice):
        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True):
            graphed, eager = self.graphed(clone_param_grads=clone)
            np.testing.assert_equal(train(graphed, 3), train(eager, 3))
        mem = key_memory(graphed.forward)
        # The pool holds the outputs and grads, and where copies are stacked after paddle.grad the grads as
        # computed before they were stacked; the static buffers inside it are not counted again.
        self.assertEqual(mem["pool"], mem["outputs"] + mem["grads"] + twice * 2 * PARAM)
        self.assertEqual(mem["held"], mem["inputs"] + mem["grad_outputs"] + mem["pool"])
        self.assertIn("(the outputs and grads inside)", graphed.forward.explain())

    def test_a_whole_step_holds_its_batch_buffers_outputs_and_pool(self):
        model = build(lambda: MatMLP([W, W, W]), 0)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())

        def step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            return loss

        draw = normal(4)
        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True):
            graphed = autocudagraph_step(step, optimizers=[opt], backend="simulate", warmup_steps=1)
            for _ in range(4):
                graphed(batch(draw, grad=False))
        mem = key_memory(graphed)
        self.assertEqual((mem["inputs"], mem["outputs"], mem["grad_outputs"], mem["grads"]), (ROW, 4, 0, 0))
        self.assertEqual(mem["pool"], 4)  # the modelled pool holds the loss; a GPU's also the grads
        self.assertEqual(mem["held"], ROW + 4)


class Chain(paddle.nn.Layer):
    def __init__(self, depth=3):
        super().__init__()
        self.ws = paddle.nn.ParameterList([self.create_parameter([W, W]) for _ in range(depth)])

    def forward(self, x):
        for w in self.ws:
            x = paddle.matmul(x, w)
        return x


class SecondGradSetTest(unittest.TestCase):
    """NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py: a set captured at a replay is held and budgeted."""

    def test_the_second_set_is_counted_with_its_pool(self):
        graphed, eager = build(Chain, 0), build(Chain, 0)
        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True):
            autocudagraph(graphed, backend="simulate", warmup_steps=0)
            np.testing.assert_equal(train(graphed, 1, micro=1), train(eager, 1, micro=1))
            one = key_memory(graphed.forward)
            np.testing.assert_equal(train(graphed, 2, micro=2, seed=5), train(eager, 2, micro=2, seed=5))
        two = key_memory(graphed.forward)
        self.assertEqual(len(graphed.forward.entry().graphs.plans()), 2)
        self.assertEqual(two["grads"] - one["grads"], ROW + 3 * PARAM)  # x's grad and the three parameters'
        # the second backward graph's (aliases: no grad held twice on any Paddle)
        self.assertEqual(two["pool"] - one["pool"], ROW + 3 * PARAM)
        self.assertEqual(two["held"] - one["held"], ROW + 3 * PARAM)

    def test_max_bytes_evicts_another_key_when_a_second_set_is_captured(self):
        probe = build(Chain, 0)
        autocudagraph(probe, backend="simulate", warmup_steps=0)
        train(probe, 1, rows=B)
        train(probe, 1, rows=2 * B)
        sizes = {label: m["held"] for label, m in probe.forward.stats()["key_memory"].items()}
        budget = sum(sizes.values()) + PARAM  # both keys with one set each, not a second set of 3 grads
        graphed, eager = build(Chain, 0), build(Chain, 0)
        autocudagraph(graphed, backend="simulate", warmup_steps=0, max_bytes=budget)
        for model in (graphed, eager):
            log = train(model, 1, rows=B) + train(model, 1, rows=2 * B)
            log += train(model, 2, micro=2, rows=2 * B, seed=7)  # the larger key's second set
            model.log = log
        np.testing.assert_equal(graphed.log, eager.log)
        stats = graphed.forward.stats()
        self.assertEqual(stats["evictions"], 1, graphed.forward.explain())
        self.assertLessEqual(stats["held_bytes"], budget)

    def test_a_chain_s_second_set_is_counted(self):
        models = {name: build(lambda: paddle.nn.LayerList([MatLayer(W, W) for _ in range(3)]), 0)
                  for name in ("graphed", "eager")}
        for layer in models["graphed"]:
            autocudagraph(layer, backend="simulate", warmup_steps=0)
        captured = []
        original = chain_run.capture_second_backward

        def counted(graphs):
            captured.append(graphs)
            return original(graphs)

        logs = {}
        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True), \
                mock.patch.object(chain_run, "capture_second_backward", counted):
            for name, model in models.items():  # chained first, then accumulating over micro-batches
                logs[name] = train(model, 6, layers=list(model)) + train(model, 4, micro=2, layers=list(model))
        np.testing.assert_equal(logs["graphed"], logs["eager"])
        layers = list(models["graphed"])
        self.assertTrue(captured, [layer.forward.explain() for layer in layers])
        self.assertGreater(sum(layer.forward.stats()["chained_calls"] for layer in layers), 0)
        for graphs in captured:  # x's grad and the parameter's, in each of two sets; the pools hold them
            [layer] = [layer for layer in layers if layer.forward.entry().graphs.current is graphs]
            mem = key_memory(layer.forward)
            self.assertEqual(len(graphs.plans()), 2)
            self.assertEqual(mem["grads"], 2 * (ROW + PARAM))
            self.assertEqual(mem["pool"], mem["outputs"] + mem["grads"])


class StandInCuda:
    """Paddle's CUDA graph and allocator stood in for: reserved bytes that each capture grows by
    ``pool`` and empty_cache shrinks by ``cached``; every call logged in order."""

    def __init__(self, pool=3000, cached=5000):
        self.reserved, self.pool, self.cached, self.log = 10000, pool, cached, []

    def memory_reserved(self, place=None):
        return self.reserved

    def empty_cache(self):
        self.log.append("empty_cache")
        self.reserved -= self.cached
        self.cached = 0

    def graph_class(self):
        device = self

        class Graph:
            def __init__(self, place=None, mode=None, pool_id=None):
                pass

            def capture_begin(self):
                device.log.append("begin")

            def capture_end(self):
                device.log.append("end")
                device.reserved += device.pool

            def reset(self):
                pass

        return Graph

    def patches(self, with_empty_cache=True):
        module = types.SimpleNamespace(memory_reserved=self.memory_reserved)
        if with_empty_cache:
            module.empty_cache = self.empty_cache
        graphs = types.SimpleNamespace(CUDAGraph=self.graph_class())
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(pool_memory, "_cuda_module", lambda: module))
        stack.enter_context(mock.patch.object(cuda, "_core_graph_class", lambda: (graphs, object)))
        stack.enter_context(mock.patch.object(cuda, "_stream_handle", lambda place: None))
        return stack


class CudaMeasuringTest(unittest.TestCase):
    """The cuda backend's own path: each graph measures its pool and releases the cache before it."""

    def capture(self, device, **patches):
        graph = cuda._CudaGraph(paddle.CPUPlace(), None)
        with device.patches(**patches):
            graph.capture(lambda: device.log.append("body"))
        return graph

    def test_the_cache_is_released_before_the_capture_begins_and_the_pool_measured(self):
        device = StandInCuda()
        graph = self.capture(device)
        self.assertEqual(device.log, ["empty_cache", "begin", "body", "end"])
        self.assertEqual((graph.pool_bytes, graph.cache_released), (3000, 5000))
        again = self.capture(device)  # nothing cached any more
        self.assertEqual((again.pool_bytes, again.cache_released), (3000, 0))

    def test_without_empty_cache_nothing_is_released(self):
        device = StandInCuda()
        graph = self.capture(device, with_empty_cache=False)
        self.assertEqual(device.log, ["begin", "body", "end"])
        self.assertEqual((graph.pool_bytes, graph.cache_released), (3000, 0))

    def test_a_failed_capture_measures_no_pool(self):
        device = StandInCuda()
        graph = cuda._CudaGraph(paddle.CPUPlace(), None)

        def fails():
            raise ValueError("the function's own error")

        with device.patches(), mock.patch.object(cuda, "_end_failed_capture", lambda *a, **k: None), \
                self.assertRaises(ValueError):
            graph.capture(fails)
        self.assertIsNone(graph.pool_bytes)

    def test_a_key_s_footprint_adds_its_graphs_pools_and_released_cache(self):
        graphs = [types.SimpleNamespace(pool_bytes=3000, cache_released=5000),
                  types.SimpleNamespace(pool_bytes=1000, cache_released=0)]
        got = footprint(outputs=[paddle.ones([B, W])], grads=[paddle.ones([W, W])], graphs=graphs)
        self.assertEqual((got.pool, got.cache_released, got.held), (4000, 5000, 4000))
        self.assertIn("allocator cache released before capture 5000", got.describe())
        self.assertEqual((Footprint() + got).as_dict(), got.as_dict())


if __name__ == "__main__":
    unittest.main()
