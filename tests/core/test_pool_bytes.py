"""NOTE [ Graph pool bytes ] in core/entry.py: each capture's device memory, per key, in stats(),
explain() and max_bytes; on the simulated backend with a stand-in for a measured pool (each graph
captured reserves POOL bytes, holding its static results: NOTE [ What a key holds ] in core/memory.py)."""

import contextlib
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import simulated
from testkit.common import MatMLP, build, host_tensor, normal

POOL = 1000


class StandInMemory:
    """Every graph captured measures a pool of POOL bytes, as a GPU capture measures its own."""

    def __init__(self):
        self.graphs = 0

    def patches(self):
        memory = self
        original = simulated._SimulatedGraph.capture

        def capture(graph, body, hooks=()):
            memory.graphs += 1
            result = original(graph, body, hooks)
            graph.pool_bytes = POOL
            return result

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(simulated._SimulatedGraph, "capture", capture))
        stack.enter_context(mock.patch.object(simulated.SimulatedBackend, "reserved_bytes", lambda backend: 0))
        return stack


def steps(layer, batches, seed=3):
    draw = normal(seed)
    out = []
    for batch in batches:
        x = host_tensor(draw(batch, 8), stop_gradient=False)
        y = layer(x)
        y.backward(host_tensor(draw(batch, 8)))
        out.append([y.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in layer.parameters()])
        for p in layer.parameters():
            p.clear_gradient(False)
    return out


class TestPoolBytes(unittest.TestCase):
    def graphed(self, **options):
        graphed, eager = build(lambda: MatMLP([8, 8, 8]), 0), build(lambda: MatMLP([8, 8, 8]), 0)
        autocudagraph(graphed, backend="simulate", **options)
        return graphed, eager

    def test_each_capture_is_measured_per_key_in_stats_and_explain(self):
        memory = StandInMemory()
        graphed, eager = self.graphed()
        with memory.patches():
            for got, want in zip(steps(graphed, [4, 4, 4, 6, 6, 6]), steps(eager, [4, 4, 4, 6, 6, 6])):
                for a, e in zip(got, want):
                    np.testing.assert_array_equal(a, e)
            text = graphed.forward.explain()
        stats = graphed.forward.stats()
        self.assertEqual(memory.graphs, 4)  # forward and backward of two keys
        self.assertEqual(stats["pool_bytes"], 4 * POOL)
        self.assertEqual(sorted(stats["key_pool_bytes"].values()), [2 * POOL, 2 * POOL])
        self.assertIn(f"{4 * POOL} graph pool bytes", text)
        self.assertIn(f"pools {2 * POOL} (the outputs and grads inside)", text)
        graphed.forward.reset()
        self.assertEqual(graphed.forward.stats()["pool_bytes"], 0)

    def test_the_simulated_backend_shows_no_pool_bytes(self):
        graphed, _ = self.graphed()
        steps(graphed, [4, 4, 4])
        self.assertEqual(graphed.forward.stats()["pool_bytes"], 0)
        self.assertNotIn("0 graph pool bytes", graphed.forward.explain())  # not measured: said so, no number
        self.assertIsNone(graphed.forward.report()[0]["pool_bytes"])

    def test_max_bytes_counts_the_pools_with_the_static_buffers(self):
        memory = StandInMemory()
        probe, _ = self.graphed()
        with memory.patches():
            steps(probe, [4, 4])
        [mem] = probe.forward.stats()["key_memory"].values()
        outside = mem["inputs"] + mem["grad_outputs"]  # the outputs and grads live in the pools
        held = outside + 2 * POOL
        self.assertEqual(mem["held"], held)
        graphed, eager = self.graphed(max_bytes=held - 1)  # the static buffers alone would fit
        with memory.patches():
            for got, want in zip(steps(graphed, [4, 4, 4]), steps(eager, [4, 4, 4])):
                for a, e in zip(got, want):
                    np.testing.assert_array_equal(a, e)
        [row] = graphed.forward.report()
        self.assertEqual(row["phase"], "fallback")
        self.assertIn(f"need {held} bytes (holds {held}: inputs {mem['inputs']}", row["fallback_reason"])
        self.assertIn(f"pools {2 * POOL} (the outputs and grads inside)), more than max_bytes={held - 1}",
                      row["fallback_reason"])
        # Room for the larger key's buffers and pools: the two keys evict each other.
        with memory.patches():
            steps(probe, [6, 6])
        larger = max(m["held"] for m in probe.forward.stats()["key_memory"].values())
        graphed, _ = self.graphed(max_bytes=larger)
        with memory.patches():
            steps(graphed, [4, 4, 6, 6, 4, 6])
        stats = graphed.forward.stats()
        self.assertEqual((stats["graphs"], stats["evictions"]), (1, 3), graphed.forward.explain())
        self.assertEqual(stats["pool_bytes"], 2 * POOL)


if __name__ == "__main__":
    unittest.main()
