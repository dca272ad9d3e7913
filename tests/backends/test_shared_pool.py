"""NOTE [ Sharing a pool safely ] in backends/shared_pool.py: the liveness rule of a shared pool, on stand-in
graphs for orders that are safe and orders that are not, and through the simulated backend's model of shared
pools (``SimulatedBackend.pool_model``): the pool a key's graphs get, and a sharing the rule refuses."""

import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph.block import partial_grad
from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import simulated
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
                      mock.patch.object(simulated.SimulatedBackend, "new_pool", lambda backend: self.pool)):
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

if __name__ == "__main__":
    unittest.main()
