"""A key's chain record (chains/record.py): what the key knows about chains, in one object held by its
entry; the chain half of its host cost; the one invalidator."""

import gc
import unittest
import weakref
from unittest import mock

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.chains.record import ChainCost, ChainRecord
from paddlefleet.cudagraph.core import host_cost
from paddlefleet.cudagraph.core.host_cost import SAMPLES, HostCost
from testkit.common import MatLayer, host_tensor, normal


class ChainCostTest(unittest.TestCase):
    def setUp(self):
        # the host's speed probed as the same at every sample (NOTE [ Graphed calls that cannot pay ])
        patch = mock.patch.object(host_cost, "speed_probe", lambda: 1e-6)
        patch.start()
        self.addCleanup(patch.stop)

    def test_a_head_replay_is_no_sample_alone_and_its_key_is_not_judged_in_chains(self):
        alone, chained = HostCost(measure=True), ChainCost()
        alone.add_eager(1e-4)
        chained.headed(alone)
        alone.add_replay(9.0)  # the replay that started the chain: dropped
        alone.add_replay(2e-4)
        self.assertEqual((alone.replay_s, chained.verdict), ([2e-4], "head"))
        self.assertFalse(chained.timing(alone))

    def test_served_calls_are_judged_against_the_eager_quartile_once_judged_alone(self):
        alone, chained = HostCost(measure=True), ChainCost()
        for _ in range(SAMPLES):
            alone.add_eager(1e-4)
        for _ in range(SAMPLES + 1):
            alone.add_replay(5e-5)
        self.assertEqual(alone.verdict, "graphed")
        for i in range(SAMPLES):
            self.assertTrue(chained.timing(alone))
            chained.add(alone, 2e-4)
        self.assertEqual(chained.verdict, "eager")
        self.assertTrue(chained.slower() and not alone.slower())
        self.assertIn("graphed calls in chains cost more host time than its eager calls: 200.0 against 100.0",
                      chained.reason(alone))
        self.assertIn("a graphed call in a chain costs 200.0 us", chained.warning("k", alone, acted=True))
        self.assertEqual(chained.describe(), ", chained 200.0 (lower quartile of 8)")

    def test_not_timed_where_the_replay_re_runs_the_function(self):
        self.assertEqual(ChainCost(measure=False).verdict, "not timed")


class ChainRecordTest(unittest.TestCase):
    def test_forget_drops_only_the_named_chain_or_all_it_caches(self):
        held, chain, other = ChainRecord(), object(), object()
        held.chain, held.note = chain, "calls after it are not chained to it: x"
        held.forget(other)  # a run of a chain built before: the current one stays
        self.assertIs(held.chain, chain)
        held.forget(chain)
        self.assertIsNone(held.chain)
        asked = []

        class Graphs:  # weakly referenced, as BlockGraphs
            pass

        graphs = Graphs()
        why = lambda g: asked.append(g) or "accumulate_in_graph"  # noqa: E731
        self.assertEqual([held.never(graphs, why), held.never(graphs, why)], ["accumulate_in_graph"] * 2)
        self.assertEqual(len(asked), 1)  # once per capture
        held.forget()  # the entry released its graphs
        held.never(graphs, why)
        self.assertEqual(len(asked), 2)
        self.assertEqual(held.note, "calls after it are not chained to it: x")  # kept: the link stays barred


class ReleaseTest(unittest.TestCase):
    def test_a_released_head_lets_its_chain_and_graphs_go_and_keeps_its_record(self):
        paddle.seed(3)
        layers = [MatLayer(8, 8) for _ in range(3)]
        for layer in layers:
            autocudagraph(layer, backend="simulate", warmup_steps=1)
        draw = normal(2)
        x = host_tensor(draw(4, 8), stop_gradient=False)
        for _ in range(6):
            h = x
            for layer in layers:
                h = layer(h)
            h.backward(host_tensor(draw(4, 8)))
        self.assertEqual([layer.forward.stats()["chained_calls"] for layer in layers][1:], [2, 2])
        [head] = layers[0].forward.entries().values()
        held = head.chain
        self.assertIsInstance(held, ChainRecord)
        self.assertIsNotNone(held.chain)
        graphs = weakref.ref(head.graphs.current)
        head.release()
        gc.collect()
        self.assertIs(head.chain, held)  # one record per key, for its life
        self.assertIsNone(held.chain)
        self.assertIsNone(graphs())  # the chain held the head's graphs through its first member
        self.assertEqual(held.cost.verdict, "not timed")  # simulate: replays re-run the function


if __name__ == "__main__":
    unittest.main()
