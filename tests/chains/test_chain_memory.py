"""A second grad buffer set captured at a chained call (NOTE [ Two grad buffer sets ] in
grads/hand_out_plan.py) is measured as its key's (NOTE [ What a key holds ] in core/memory.py), so
max_bytes counts it: a key whose second set would pass the budget runs eagerly from its next call,
the chained call that captured it keeps its result, and every step stays bitwise eager's."""

import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import simulated
from paddlefleet.cudagraph.chains import run as chain_run
from testkit.common import MatLayer, build
from tests.core.test_memory import W, train

LAYERS = 3


def stack():
    return build(lambda: paddle.nn.LayerList([MatLayer(W, W) for _ in range(LAYERS)]), 0)


class ChainSecondSetBudgetTest(unittest.TestCase):
    def run_twins(self, max_bytes):
        graphed, eager = stack(), stack()
        for layer in graphed:
            autocudagraph(layer, backend="simulate", warmup_steps=0, max_bytes=max_bytes)
        captured = []
        original = chain_run.capture_second_backward

        def counted(graphs):
            captured.append(graphs)
            return original(graphs)

        logs, held = [], []
        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True), \
                mock.patch.object(chain_run, "capture_second_backward", counted):
            for model in (graphed, eager):  # chained first, then accumulating over micro-batches
                log = train(model, 6, layers=list(model))
                held.append([layer.forward.stats()["held_bytes"] for layer in graphed])
                logs.append(log + train(model, 4, micro=2, seed=5, layers=list(model)))
        np.testing.assert_equal(logs[0], logs[1])
        return graphed, captured, held[0]

    def test_a_second_set_captured_in_a_chain_is_held_within_max_bytes(self):
        unbounded, captured, one_set = self.run_twins(None)
        two_sets = [layer.forward.stats()["held_bytes"] for layer in unbounded]
        self.assertEqual(len(captured), LAYERS)  # every layer's second set, at a chained call
        self.assertTrue(all(two > one for one, two in zip(one_set, two_sets)), (one_set, two_sets))
        budget = max(one_set) + (min(two_sets) - max(one_set)) // 2  # one set fits, two do not
        bounded, captured, _ = self.run_twins(budget)
        self.assertTrue(captured)
        for layer in bounded:
            self.assertLessEqual(layer.forward.stats()["held_bytes"], budget, layer.forward.explain())
        reasons = [e.fallback_reason or "" for layer in bounded for e in layer.forward.entries().values()]
        self.assertTrue(all("max_bytes" in r for r in reasons), reasons)  # each key, once its second set counted
        self.assertGreater(sum(layer.forward.stats()["chained_calls"] for layer in bounded), 0)


if __name__ == "__main__":
    unittest.main()
