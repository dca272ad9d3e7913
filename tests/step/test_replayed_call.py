"""One replayed call of a whole-step graph: the learning-rate feed, the output hand-out, and a
replay on a backend that records (as CUDA does) rather than re-running the step's Python.

The recording cases swap in, for the test only, a simulated graph whose capture records like a
CUDA capture (``capture_executes=False``) and whose replay runs nothing, as NOTE [ Stand-in graph ]
in tools/cpu_host_time.py does: on the CPU this is the only way to run the code path a GPU replay
takes (no pending result, no op trace, none of the step's Python on replay).
"""

import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step
from paddlefleet.cudagraph.backends import simulated
from paddlefleet.cudagraph.step.optimizer_state import LRFeed


def _batches(n, seed=4):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.standard_normal((4, 6)).astype("float32")) for _ in range(n)]


class LRFeedTest(unittest.TestCase):
    """LRFeed writes exactly when it wrote before the identity test was added: the test skips only
    a value whose hex() it already compared."""

    def _opt(self, lr):
        p = paddle.create_parameter([2], "float32")
        opt = paddle.optimizer.SGD(lr, parameters=[p])
        p.sum().backward()
        opt.step()  # creates the rate's tensor
        opt.clear_grad()
        return opt

    def test_writes_on_a_change_and_only_then(self):
        sched = paddle.optimizer.lr.StepDecay(0.5, step_size=1, gamma=0.5)
        opt = self._opt(sched)
        feed = LRFeed(opt)
        self.assertTrue(feed.feed())  # the first feed writes
        self.assertFalse(feed.feed())  # the same float object
        sched.last_lr = float(repr(sched.last_lr))  # equal value, new object: compared by hex, no write
        self.assertFalse(feed.feed())
        sched.step()
        self.assertTrue(feed.feed())
        self.assertEqual(float(opt._global_learning_rate()), 0.25)
        opt.set_lr_scheduler(paddle.optimizer.lr.StepDecay(0.25, step_size=1))  # same value again
        self.assertFalse(feed.feed())
        feed.forget()
        self.assertTrue(feed.feed())

    def test_a_replaced_tensor_is_written(self):
        opt = self._opt(0.1)
        feed = LRFeed(opt)
        feed.feed()
        program = next(iter(opt._learning_rate_map))  # the rate's tensor, replaced by a zero one
        opt._learning_rate_map[program] = paddle.zeros(opt._learning_rate_map[program].shape)
        self.assertTrue(feed.feed())
        self.assertEqual(float(opt._global_learning_rate()), np.float32(0.1))


class _RecordingGraph(simulated._SimulatedGraph):
    """A graph that records like a CUDA capture and whose replay runs no Python (NOTE [ Stand-in
    graph ] in tools/cpu_host_time.py): its static outputs keep what the capture wrote."""

    def replay(self):
        pass


def _recording():
    return mock.patch.multiple(simulated.SimulatedBackend, capture_executes=False,
                               new_graph=lambda self, pool: _RecordingGraph())


class RecordingReplayTest(unittest.TestCase):
    """The path a GPU replay takes, on the CPU: the step's Python does not run on replay."""

    def _step(self):
        paddle.seed(3)
        model = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 2))
        sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
        opt = paddle.optimizer.SGD(sched, parameters=model.parameters())

        def train_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return {"loss": loss, "lr": opt.get_lr()}

        return model, opt, sched, autocudagraph_step(train_step, optimizers=[opt], backend="simulate")

    def test_replays_hand_out_fresh_detached_copies_and_feed_the_rate(self):
        with _recording():
            model, opt, sched, step = self._step()
            held = []
            for i, x in enumerate(_batches(8)):
                out = step(x)
                if i >= 2:  # the capture call and the replays
                    static = step.entry().graphs.static_outputs[0]
                    self.assertTrue(out["loss"].stop_gradient)
                    self.assertNotEqual(out["loss"].data_ptr(), static.data_ptr())
                    np.testing.assert_array_equal(out["loss"].numpy(), static.numpy())
                    held.append((out["loss"], out["loss"].numpy().copy(), static))
                # The rate the step's update read: fed before the run, as eager's step() fills it.
                self.assertEqual(float(opt._global_learning_rate()), np.float32(sched.last_lr))
                self.assertEqual(out["lr"], sched.last_lr)
                sched.step()
        self.assertEqual((step.stats()["captures"], step.stats()["replays"], step.stats()["eager_calls"]), (1, 5, 0),
                         step.explain())
        with paddle.no_grad():
            held[0][2].add_(paddle.ones_like(held[0][2]))  # what the next replay would do to the static output
        for t, value, _ in held:
            np.testing.assert_array_equal(t.numpy(), value)

    def test_a_backward_between_recorded_replays_is_still_seen(self):
        with _recording():
            model, _, _, step = self._step()
            data = _batches(8)
            for x in data[:5]:
                step(x)
            model(data[5]).mean().backward()  # grads the graph would ignore
            step(data[6])
            step(data[7])  # the eager call cleared them again: replays
        self.assertEqual(step.stats()["eager_reasons"], {"grads changed between calls": 1}, step.explain())
        self.assertEqual(step.stats()["replays"], 3, step.explain())


if __name__ == "__main__":
    unittest.main()
