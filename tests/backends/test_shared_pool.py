"""NOTE [ Sharing a pool safely ] in backends/shared_pool.py: the liveness rule of a shared pool, on stand-in
graphs for orders that are safe and orders that are not, and through the simulated backend's model of shared
pools (``SimulatedBackend.pool_model``): the pool a key's graphs get, and a sharing the rule refuses."""

import gc
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph.block import partial_grad
from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import simulated
from paddlefleet.cudagraph.backends import shared_pool
from paddlefleet.cudagraph.backends.shared_pool import PoolConflictError, SharedPool
from paddlefleet.cudagraph.block import capture as block_capture
from testkit.common import build, host_tensor, normal


class StandIn:
    """A graph of a shared pool whose live data a test sets."""

    def __init__(self, pool, what):
        self.what, self.holding = what, False
        self.live = lambda: self.holding
        pool.join(self)


class LivenessRuleTest(unittest.TestCase):
    def layers(self, order):
        """Graphs captured into one pool in ``order`` (names like "f1", "b2")."""
        pool = SharedPool()
        return pool, {name: StandIn(pool, name) for name in order}

    def replay(self, pool, graphs, name):
        """What replaying ``name`` would overwrite (None: nothing live)."""
        return pool.conflict(graphs[name])

    def test_a_chain_captured_and_replayed_in_one_order_is_safe(self):
        pool, g = self.layers(["f1", "f2", "b2", "b1"])  # forwards in call order, backwards in reverse
        for _ in range(3):  # steps: each consumes its data before the next begins
            for name in ("f1", "f2"):
                self.assertIsNone(self.replay(pool, g, name))
                g[name].holding = True  # saved activations until its backward
            for fwd, bwd in (("f2", "b2"), ("f1", "b1")):
                self.assertIsNone(self.replay(pool, g, bwd))
                g[fwd].holding = False
            # grads copied out (or freed) before the next step: the backwards hold nothing

    def test_micro_batches_in_flight_are_refused(self):
        pool, g = self.layers(["f1", "f2", "b2", "b1"])
        g["f1"].holding = g["f2"].holding = True  # micro-batch 1 waits for its backward
        why = self.replay(pool, g, "f1")  # micro-batch 2's forward
        self.assertIn("replaying f1 would overwrite what f2, captured after it into the same memory pool", why)

    def test_grads_kept_as_aliases_across_micro_batches_are_refused(self):
        pool, g = self.layers(["f", "b"])  # one key's forward and backward in one pool
        g["b"].holding = True  # p.grad aliases the backward's static grads (accumulation)
        self.assertIn("replaying f would overwrite what b", self.replay(pool, g, "f"))
        self.assertIsNone(self.replay(pool, g, "b"))  # a graph never endangers one captured before it

    def test_keys_captured_lazily_and_replayed_in_another_order_are_refused(self):
        pool, g = self.layers(["fa", "ba", "fb", "bb"])  # key a captured first, then key b
        g["fb"].holding = True  # key b's forward waits for its backward when key a is called
        self.assertIn("replaying fa would overwrite what fb", self.replay(pool, g, "fa"))
        self.assertIsNone(self.replay(pool, g, "fb"))

    def test_a_graph_that_left_the_pool_holds_nothing(self):
        pool, g = self.layers(["f", "b"])
        g["b"].holding = True
        pool.leave(g["b"])
        self.assertIsNone(self.replay(pool, g, "f"))


class Two(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.w1 = self.create_parameter([8, 8])
        self.w2 = self.create_parameter([8, 8])

    def forward(self, x):
        return paddle.matmul(paddle.matmul(x, self.w1), self.w2)


def accumulate(model, steps=3, micro=2, seed=4):
    """Grads kept over ``micro`` micro-batches (``p.grad`` adopts the graph's buffers), then freed."""
    draw = normal(seed)
    log = []
    for _ in range(steps):
        for _ in range(micro):
            x = host_tensor(draw(4, 8), stop_gradient=False)
            y = model(x)
            y.backward(host_tensor(draw(4, 8)))
            log += [y.numpy(), x.grad.numpy()]
        log += [p.grad.numpy() for p in model.parameters()]
        for p in model.parameters():
            p.clear_gradient(False)
    return log


class ModelledPoolsTest(unittest.TestCase):
    """The simulated backend with modelled pools: the pools a key's graphs get keep the rule."""

    def setUp(self):
        patch = mock.patch.object(simulated.SimulatedBackend, "pool_model", True)
        patch.start()
        self.addCleanup(patch.stop)

    def run_twins(self, **options):
        graphed, eager = build(Two, 0), build(Two, 0)
        autocudagraph(graphed, backend="simulate", warmup_steps=0, **options)
        np.testing.assert_equal(accumulate(graphed), accumulate(eager))
        return graphed.forward.entry().graphs.current  # the slot that served the latest call

    def test_aliased_grads_give_the_backward_its_own_pool(self):
        graphs = self.run_twins()  # clone_param_grads="auto": p.grad aliases the static grads
        self.assertEqual(len(graphs.plans()), 2)
        pools = [graphs.fwd_graph._pool] + [g._pool for g in graphs.backward.graphs()]
        self.assertEqual(len({id(p) for p in pools}), 3, "forward, backward and second set: a pool each")

    def test_copied_grads_share_the_forward_s_pool(self):
        graphs = self.run_twins(clone_param_grads=True)
        self.assertIs(graphs.backward.graph._pool, graphs.fwd_graph._pool)
        self.assertEqual(graphs.fwd_graph._pool.graphs, [graphs.fwd_graph, graphs.backward.graph])

    def test_sharing_the_forward_s_pool_with_aliased_grads_is_refused(self):
        # What a key's graphs got before the rule: one pool for the forward and backward, whatever
        # the hand-out. The second micro-batch's forward would overwrite the first's grads.
        graphed = build(Two, 0)
        autocudagraph(graphed, backend="simulate", warmup_steps=0)
        with mock.patch.object(block_capture, "_shares_pool", lambda backward, opts: True), \
                mock.patch.object(simulated.SimulatedBackend, "forward_pool", lambda backend: None), \
                self.assertRaises(PoolConflictError) as refused:
            accumulate(graphed)
        self.assertIn("replaying the forward graph of key (x: float32[4, 8] grad) would overwrite what the "
                      "backward graph of key (x: float32[4, 8] grad)", str(refused.exception))


class OnePoolForAllKeysTest(unittest.TestCase):
    """A model graphed layer by layer whose keys all capture into one modelled pool, as a chain's layers would
    share one on Paddle >= 3.1 (each key captures into its own today: NOTE [ One pool per key ] in
    backends/cuda.py): the rule lets through one micro-batch at a time with grads handed out as copies, and
    refuses micro-batches in flight and grads kept as aliases across micro-batches."""

    def setUp(self):
        self.pool = SharedPool()
        for patch in (mock.patch.object(simulated.SimulatedBackend, "pool_model", True),
                      mock.patch.object(simulated.SimulatedBackend, "new_pool", lambda backend: self.pool),
                      mock.patch.object(simulated.SimulatedBackend, "forward_pool", lambda backend: None)):
            patch.start()
            self.addCleanup(patch.stop)
        before = set(partial_grad._pending)
        self.addCleanup(self._forget_pending, before)

    @staticmethod
    def _forget_pending(before):
        """A backward pass that raised leaves the grad nodes it did not reach held by Paddle's C++ side, never
        freed (no Python object refers to them): their forwards would look pending to the rest of the process,
        and the simulated backend refuses paddle.grad while one is (NOTE [ paddle.grad through a graphed call ]
        in block/partial_grad.py). The cases below make such passes on purpose; what they leave is let go."""
        for token in set(partial_grad._pending) - before:
            token.done = True

    def layers(self, **options):
        graphed = build(lambda: paddle.nn.Sequential(*[Two() for _ in range(3)]), 0)
        for layer in graphed:
            autocudagraph(layer, backend="simulate", warmup_steps=0, **options)
        return graphed, build(lambda: paddle.nn.Sequential(*[Two() for _ in range(3)]), 0)

    def test_layers_replayed_in_their_capture_order_with_copied_grads_share_safely(self):
        graphed, eager = self.layers(clone_param_grads=True)
        np.testing.assert_equal(accumulate(graphed, micro=1), accumulate(eager, micro=1))
        np.testing.assert_equal(accumulate(graphed, micro=2, seed=6), accumulate(eager, micro=2, seed=6))
        self.assertEqual([g.what.split(" of key")[0] for g in self.pool.graphs], ["the forward graph",
                                                                                  "the backward graph"] * 3)

    def test_grads_kept_as_aliases_across_micro_batches_are_refused(self):
        graphed, _ = self.layers()  # p.grad aliases each key's static grads while they accumulate
        with self.assertRaises(Exception) as refused:  # raised in the bridge's backward, which Paddle wraps
            accumulate(graphed, micro=2)
        self.assertIn("PoolConflictError: autocudagraph: replaying the backward graph of key (x: float32[4, 8] grad) "
                      "would overwrite what the backward graph of key", str(refused.exception))

    def test_micro_batches_in_flight_are_refused(self):
        # The second micro-batch's forwards capture slots into the pool after the first's backward graphs; the
        # first's backward replay would then overwrite the second's saved activations.
        graphed, _ = self.layers(clone_param_grads=True)
        draw = normal(8)
        with self.assertRaises(Exception) as refused:
            xs = [host_tensor(draw(4, 8), stop_gradient=False) for _ in range(2)]
            ys = [graphed(x) for x in xs]  # two micro-batches in flight
            for y in ys:
                y.backward(host_tensor(draw(4, 8)))
        self.assertIn("PoolConflictError: autocudagraph: replaying the backward graph of key (x: float32[4, 8] grad) "
                      "would overwrite what the forward graph of key", str(refused.exception))

class IncrementalCheckTest(unittest.TestCase):
    """NOTE [ Keys sharing a forward pool ]: ``blocked``, which looks only at graphs replayed since last seen dead,
    says what ``conflict``, which asks every later graph, says, over random orders of replays and backwards."""

    def test_blocked_agrees_with_the_walk_of_every_later_graph(self):
        rng = np.random.default_rng(0)
        for trial in range(200):
            pool = SharedPool()
            graphs = [StandIn(pool, f"f{i}") for i in range(int(rng.integers(1, 7)))]
            for g in graphs:
                g.holding = False
            for _ in range(40):
                g = graphs[int(rng.integers(len(graphs)))]
                if rng.random() < 0.5 and not g.holding:  # a forward call
                    want = pool.conflict(g)
                    self.assertEqual(pool.blocked(g) is None, want is None, f"trial {trial}")
                    if want is None:
                        pool.replayed(g)
                        g.holding = True
                elif g.holding:  # its backward ran, or its outputs were dropped
                    g.holding = False
                if rng.random() < 0.05:  # a key captured again lands at the end of the pool
                    pool.leave(g)
                    pool.join(g)
                    g.holding = False

    def test_a_graph_dropped_without_reset_leaves_the_pool(self):
        pool = SharedPool()
        first, second = StandIn(pool, "f1"), StandIn(pool, "f2")
        second.holding = True
        pool.replayed(second)
        self.assertIsNotNone(pool.blocked(first))
        del second
        gc.collect()  # its live() refers to itself
        self.assertEqual(pool.graphs, [first])
        self.assertIsNone(pool.blocked(first))


class Pair(paddle.nn.Layer):
    """Two graphed Layers whose calls a test orders."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Two(), Two()


def forward_pool_of(layer):
    return layer.forward.entry().graphs.all[0].shared_pool


class ForwardPoolTest(unittest.TestCase):
    """NOTE [ Keys sharing a forward pool ] in backends/shared_pool.py, through the simulated backend's pool model:
    the forwards of keys share one pool; a replay the rule would refuse is never made (the key is captured again
    into a pool of its own), and every result stays eager's."""

    def setUp(self):
        patch = mock.patch.object(simulated.SimulatedBackend, "pool_model", True)
        patch.start()
        self.addCleanup(patch.stop)
        shared_pool.forget_forward_pools()
        self.addCleanup(shared_pool.forget_forward_pools)

    def layers(self, **options):
        make = lambda: paddle.nn.Sequential(*[Two() for _ in range(3)])  # noqa: E731
        graphed, eager = build(make, 0), build(make, 0)
        for layer in graphed:
            autocudagraph(layer, backend="simulate", warmup_steps=0, **options)
        return graphed, eager

    def test_layers_share_one_forward_pool_in_call_order(self):
        graphed, eager = self.layers()
        np.testing.assert_equal(accumulate(graphed, micro=1), accumulate(eager, micro=1))
        np.testing.assert_equal(accumulate(graphed, micro=2, seed=6), accumulate(eager, micro=2, seed=6))
        pool = forward_pool_of(graphed[0])
        self.assertIsNotNone(pool)
        fwds = [layer.forward.entry().graphs.all[0].fwd_graph for layer in graphed]
        self.assertEqual(pool.graphs, fwds, "the three forwards, in call order, and nothing else")
        for layer in graphed:
            stats = layer.forward.stats()
            self.assertEqual((stats["recaptures"], stats["eager_calls"]), (0, 0), layer.forward.explain())
            self.assertIs(forward_pool_of(layer), pool)
            backward = layer.forward.entry().graphs.all[0].backward
            self.assertTrue(all(g._pool is not pool for g in backward.graphs()), "backward graphs keep their own")
        self.assertIn("pool: its forward graph shares one memory pool with 2 other keys' forward graphs",
                      graphed[1].forward.explain())

    def run_pair(self, model, orders, seed=3):
        """Per step, calls ``model.a`` and ``model.b`` in the order given, then one backward of both."""
        draw = normal(seed)
        log = []
        for order in orders:
            xs = {name: host_tensor(draw(4, 8), stop_gradient=False) for name in "ab"}
            ys = {name: getattr(model, name)(xs[name]) for name in order}
            paddle.autograd.backward([ys["a"], ys["b"]], [host_tensor(draw(4, 8)), host_tensor(draw(4, 8))])
            log += [ys["a"].numpy(), ys["b"].numpy(), xs["a"].grad.numpy(), xs["b"].grad.numpy()]
            log += [p.grad.numpy() for p in model.parameters()]
            for p in model.parameters():
                p.clear_gradient(False)
        return log

    def pair(self):
        graphed, eager = build(Pair, 1), build(Pair, 1)
        for layer in (graphed.a, graphed.b):
            autocudagraph(layer, backend="simulate", warmup_steps=0)
        return graphed, eager

    def test_a_key_called_out_of_its_capture_order_is_captured_again_into_its_own_pool(self):
        graphed, eager = self.pair()
        orders = ["ab", "ba", "ab", "ba", "ba"]  # a captured first; then b waits for its backward when a is called
        np.testing.assert_equal(self.run_pair(graphed, orders), self.run_pair(eager, orders))
        a, b = graphed.a.forward, graphed.b.forward
        self.assertEqual((a.stats()["recaptures"], b.stats()["recaptures"]), (1, 0))
        self.assertEqual(a.stats()["eager_calls"] + b.stats()["eager_calls"], 0)
        self.assertIsNone(forward_pool_of(graphed.a), "a key captured again keeps a pool of its own")
        self.assertEqual(forward_pool_of(graphed.b).graphs, [b.entry().graphs.all[0].fwd_graph])
        self.assertIn("captured again: replaying the forward graph of key (x: float32[4, 8] grad) would overwrite "
                      "what the forward graph of key (x: float32[4, 8] grad), captured after it into the same memory "
                      "pool, still holds", a.explain())

    def test_the_check_is_what_keeps_that_order_safe(self):
        # Without the check before the replay, the pool model refuses the replay that would overwrite b's
        # saved activations: the case above is one a GPU would get wrong.
        graphed, _ = self.pair()
        with mock.patch.object(SharedPool, "blocked", lambda pool, graph: None), \
                self.assertRaises(PoolConflictError) as refused:
            self.run_pair(graphed, ["ab", "ba"])
        self.assertIn("replaying the forward graph of key (x: float32[4, 8] grad) would overwrite what the forward "
                      "graph of key", str(refused.exception))

    def test_a_forward_whose_outputs_were_dropped_holds_nothing(self):
        graphed, eager = self.pair()
        np.testing.assert_equal(self.run_pair(graphed, ["ab"]), self.run_pair(eager, ["ab"]))
        for model in (graphed, eager):
            model.b(host_tensor(normal(9)(4, 8), stop_gradient=False))  # evaluated and dropped, no backward
        np.testing.assert_equal(self.run_pair(graphed, ["ab", "ab"], seed=5), self.run_pair(eager, ["ab", "ab"], seed=5))
        self.assertEqual(graphed.a.forward.stats()["recaptures"], 0, graphed.a.forward.explain())

    def test_keys_whose_data_outlive_the_call_keep_their_own_pools(self):
        for options in ({"clone_outputs": False}, {"clone_param_grads": True}):
            with self.subTest(**options):
                shared_pool.forget_forward_pools()
                graphed, eager = self.layers(**options)
                np.testing.assert_equal(accumulate(graphed, micro=1), accumulate(eager, micro=1))
                for layer in graphed:
                    self.assertIsNone(forward_pool_of(layer))

    def test_a_further_slot_keeps_its_own_pool(self):
        graphed, eager = self.layers(max_inflight=2)
        for model in (graphed, eager):
            draw = normal(8)
            xs = [host_tensor(draw(4, 8), stop_gradient=False) for _ in range(2)]
            ys = [model(x) for x in xs]  # two micro-batches in flight: a second slot per key
            for y in ys:
                y.backward(host_tensor(draw(4, 8)))
        for g, e in zip(graphed.parameters(), eager.parameters()):
            np.testing.assert_equal(g.grad.numpy(), e.grad.numpy())
        slots = graphed[0].forward.entry().graphs.all
        self.assertEqual(len(slots), 2)
        self.assertIsNotNone(slots[0].shared_pool)
        self.assertIsNone(slots[1].shared_pool)

    def test_chained_layers_share_the_pool(self):
        graphed, eager = self.layers()
        np.testing.assert_equal(accumulate(graphed, steps=6, micro=2), accumulate(eager, steps=6, micro=2))
        self.assertGreater(sum(layer.forward.stats()["chained_calls"] for layer in graphed), 0)
        self.assertEqual(sum(layer.forward.stats()["recaptures"] for layer in graphed), 0)
        self.assertEqual(len(forward_pool_of(graphed[0]).graphs), 3)


if __name__ == "__main__":
    unittest.main()
