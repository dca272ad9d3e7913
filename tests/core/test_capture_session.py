"""NOTE [ One capture session ] in guards/session.py: a block's capture and a whole step's capture
open the same CaptureSession, its record is what the graphs keep, and a simulated replay that
reads other values falls back through one check (core/body.replay_read_other_values) whose
wording each body gives."""

import gc
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step, is_capturing
from paddlefleet.cudagraph.core.body import Action, replay_read_other_values
from paddlefleet.cudagraph.guards.host_reads import OpTrace
from paddlefleet.cudagraph.guards.session import CaptureRecord, CaptureSession
from testkit.common import normal
from testkit.harness import BackendCase, MatmulOnlyCase, for_each_backend


class _Sessions:
    """Counts the sessions' captures (and keeps the sessions) while active."""

    def __enter__(self):
        self.sessions = []
        original = CaptureSession.capture
        sessions = self.sessions

        def capture(session, graph, body, hooks):
            sessions.append(session)
            return original(session, graph, body, hooks)

        self._patch = mock.patch.object(CaptureSession, "capture", capture)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


@for_each_backend
class SessionTest(BackendCase):
    def tensor(self, array, grad=False):
        return paddle.to_tensor(array, stop_gradient=not grad)

    def test_a_block_opens_one_session_for_its_forward_and_one_for_its_backward(self):
        w = self.tensor(np.full((4, 4), 0.5, np.float32), grad=True)

        @autocudagraph(warmup_steps=1, backend=self.backend, chain_calls=False)
        def block(x, w):
            return paddle.matmul(x, w)

        x = self.tensor(np.ones((2, 4), np.float32))
        with _Sessions() as seen:
            for _ in range(3):
                block(x, w).sum().backward()
        self.assertEqual(block.stats()["captures"], 1, block.explain())
        self.assertEqual(len(seen.sessions), 2)
        forward = seen.sessions[0]
        self.assertIsInstance(forward.record, CaptureRecord)
        self.assertTrue(forward.record.captured)
        self.assertIs(block.entry().graphs.current.live, forward.record)
        # The forward is traced where the backend's replays re-run it (NOTE [ Values a simulated replay reads ]).
        self.assertEqual(forward.record["trace"] is not None, self.backend == "simulate")

    def test_a_step_opens_one_session_and_traces_on_every_backend(self):
        w = self.tensor(np.full((4, 4), 0.5, np.float32), grad=True)

        @autocudagraph_step(optimizers=[], warmup_steps=1, backend=self.backend)
        def step(x):
            y = paddle.matmul(x, w)
            y.backward(paddle.ones_like(y))
            with paddle.no_grad():
                w.copy_(w - w.grad * 0.5, False)
            w.clear_gradient()
            return y

        x = self.tensor(np.ones((2, 4), np.float32))
        with _Sessions() as seen:
            for _ in range(3):
                step(x)
        self.assertEqual(step.stats()["captures"], 1, step.explain())
        self.assertEqual(len(seen.sessions), 1)
        self.assertIsInstance(seen.sessions[0].record["trace"], OpTrace)


@for_each_backend
class CollectorTest(MatmulOnlyCase):
    """A capture session keeps Python's cyclic collector paused from its guards' install to their removal, and
    leaves it as it found it (guards/session.py, collector_paused)."""

    def setUp(self):
        super().setUp()
        was_enabled = gc.isenabled()
        gc.enable()
        self.addCleanup(gc.enable if was_enabled else gc.disable)

    def runs(self, read_host=False):
        seen = []
        draw = normal(1)
        w = self.tensor(draw(8, 8), grad=True)

        @autocudagraph(warmup_steps=1, backend=self.backend, eager_if_slower=False, chain_calls=False)
        def block(x, w):
            seen.append((is_capturing(), gc.isenabled()))
            y = paddle.matmul(x, w)
            if read_host:
                y.numpy()  # refused during a capture: the capture fails, the key runs eagerly
            return y

        for _ in range(3):
            block(self.tensor(draw(4, 8), grad=True), w).backward(self.tensor(draw(4, 8)))
        return block, seen

    def test_paused_while_the_capture_runs_the_function_on_outside(self):
        block, seen = self.runs()
        self.assertEqual(block.stats()["captures"], 1, block.explain())
        # The warmup call, then the capture's run; a simulated replay runs the function again, with it on (a
        # GPU replay runs no Python).
        self.assertEqual(seen[:2], [(False, True), (True, False)])
        self.assertTrue(all(enabled for _, enabled in seen[2:]), seen)
        self.assertTrue(gc.isenabled())

    def test_on_again_after_a_failed_capture(self):
        block, seen = self.runs(read_host=True)
        self.assertEqual(block.stats()["captures"], 0, block.explain())
        self.assertIn("Tensor.numpy() was called during capture", block.explain())
        self.assertEqual(seen[:2], [(False, True), (True, False)])
        self.assertTrue(gc.isenabled())

    def test_left_off_where_the_caller_turned_it_off(self):
        gc.disable()
        block, _ = self.runs()
        self.assertEqual(block.stats()["captures"], 1, block.explain())
        self.assertFalse(gc.isenabled())


class _Backend:
    def __init__(self, replays):
        self.replays_python = replays


class SessionUnitTest(unittest.TestCase):
    def test_a_traced_session_records_the_capture_run_then_each_replay(self):
        session = CaptureSession(_Backend(True), trace={})
        with session.function_run():
            paddle.full([1], 2.0)
        captured = session.record["trace"]
        with session.function_run():
            paddle.full([1], 3.0)
        self.assertIs(session.record["trace"], captured)
        replayed = session.record.take_replayed()
        self.assertIsNot(replayed, captured)
        self.assertIsNone(session.record.take_replayed())
        blocked = replay_read_other_values(captured, replayed, "values", "reuse the capture's value", "Fix it.")
        self.assertEqual(blocked.action, Action.FALL_BACK)
        self.assertTrue(blocked.reason.startswith("a replay read other values than the capture: op #0"), blocked.reason)
        self.assertIn("On a GPU this replay would reuse the capture's value;", blocked.warning)
        self.assertTrue(blocked.warning.endswith("Fix it."), blocked.warning)

    def test_a_recording_backend_traces_nothing_unless_asked_always(self):
        session = CaptureSession(_Backend(False), trace={})
        with session.function_run():
            paddle.full([1], 2.0)
        self.assertIsNone(session.record["trace"])
        session = CaptureSession(_Backend(False), trace={"always": True})
        with session.function_run():
            paddle.full([1], 2.0)
        self.assertIsInstance(session.record["trace"], OpTrace)

    def test_the_same_ops_with_the_same_values_do_not_fall_back(self):
        session = CaptureSession(_Backend(True), trace={})
        for _ in range(2):
            with session.function_run():
                paddle.full([1], 2.0)
        self.assertIsNone(replay_read_other_values(session.record["trace"], session.record.take_replayed(),
                                                   "values", "x", "y"))


if __name__ == "__main__":
    unittest.main()
