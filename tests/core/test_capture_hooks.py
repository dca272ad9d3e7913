"""Capture-time hooks: ``is_capturing()`` and ``capture_hooks=[factory, ...]``.

Communication code that has a graph-safe path (a custom all-reduce that, under its
``capture()`` context, reduces through buffers registered for the graph) must take that path
while a graph is captured, and a replay must then repeat that path: a CUDA graph re-launches
the kernels the capture recorded and runs no Python. The fake all-reduce below computes the
same sum two ways and counts its runs in device tensors, so the counts a replay leaves behind
show which branch it repeated on every backend.
"""

import contextlib
import sys
import unittest
import warnings

import paddle
from paddle.autograd import PyLayer

import paddlefleet.cudagraph as cudagraph
from paddlefleet.cudagraph import is_capturing

from testkit.harness import BackendCase, clone_leaf, for_each_backend


class FakeCustomAllReduce:
    """A custom all-reduce over two ranks that hold the same tensor (the sum is ``2 * x``).

    Outside ``capture()`` it takes its eager path (``scale``); inside, its graph-buffer path
    (``add``): different kernels, the same bits. Every run adds one to a device counter of its
    path, so a replayed graph keeps counting on the path the capture took.

    Attributes:
        log: ``(path, is_capturing(), open capture() contexts)`` per Python run.
        enters, exits: capture() entries, and the exception type (or None) of every exit.
    """

    def __init__(self, branch_on="hook"):
        self.branch_on = branch_on
        self.capturing = 0
        self.log = []
        self.enters = 0
        self.exits = []
        self.graph_runs = paddle.zeros([1])
        self.eager_runs = paddle.zeros([1])

    @contextlib.contextmanager
    def capture(self):
        self.enters += 1
        self.capturing += 1
        try:
            yield
        finally:
            self.capturing -= 1
            self.exits.append(sys.exc_info()[0])

    def graph_path(self):
        return self.capturing > 0 if self.branch_on == "hook" else is_capturing()

    def all_reduce(self, x):
        with paddle.no_grad():
            if self.graph_path():
                self.log.append(("graph", is_capturing(), self.capturing))
                self.graph_runs.add_(paddle.ones([1]))
                return paddle.add(x, x)
            self.log.append(("eager", is_capturing(), self.capturing))
            self.eager_runs.add_(paddle.ones([1]))
            return paddle.scale(x, 2.0)

    def counts(self):
        return int(self.graph_runs.numpy()[0]), int(self.eager_runs.numpy()[0])


class _AllReduce(PyLayer):
    """Column-parallel style: all-reduce in forward and in backward."""

    @staticmethod
    def forward(ctx, x, ar):
        ctx.ar = ar
        return ar.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ar.all_reduce(grad)


def parallel_block(x, w, ar):
    return paddle.tanh(_AllReduce.apply(paddle.matmul(x, w), ar))


class RecordingHook:
    """A capture hook factory that records every entry and exit."""

    def __init__(self, name, events):
        self.name = name
        self.events = events

    @contextlib.contextmanager
    def __call__(self):
        self.events.append(("enter", self.name, is_capturing()))
        try:
            yield
        finally:
            self.events.append(("exit", self.name, sys.exc_info()[0]))


@for_each_backend
class TestCaptureHooks(BackendCase):
    def _train(self, graphed_fn, ar, ref_ar, steps, warmup):
        w = paddle.randn([8, 8])
        w.stop_gradient = False
        w_ref = clone_leaf(w)
        per_call = []
        for step in range(steps):
            x = paddle.randn([4, 8])
            x.stop_gradient = False
            x_ref = clone_leaf(x)
            before = ar.counts()
            y = graphed_fn(x, w, ar)
            y_ref = parallel_block(x_ref, w_ref, ref_ar)
            self.assertBitwise(y, y_ref, f"output step {step}")
            dy = paddle.randn(y.shape)
            y.backward(dy)
            y_ref.backward(dy)
            self.assertBitwise(x.grad, x_ref.grad, f"x.grad step {step}")
            self.assertBitwise(w.grad, w_ref.grad, f"w.grad step {step}")
            after = ar.counts()
            per_call.append((after[0] - before[0], after[1] - before[1]))
            self.assertFalse(is_capturing(), "is_capturing() leaked out of a call")
        return per_call

    def _check_replays_repeat_the_capture_branch(self, branch_on, hooks):
        ar = FakeCustomAllReduce(branch_on)
        ref_ar = FakeCustomAllReduce(branch_on)
        warmup, steps = 2, 6
        g = self.graphed(parallel_block, warmup_steps=warmup, capture_hooks=hooks(ar))
        per_call = self._train(g, ar, ref_ar, steps, warmup)
        s = g.stats()
        self.assertEqual((s["warmup_calls"], s["captures"], s["replays"]), (warmup, 1, steps - warmup - 1))
        # Warmup calls run eagerly: forward and backward take the eager path once each.
        self.assertEqual(per_call[:warmup], [(0, 2)] * warmup)
        # Every replay repeats the graph path, forward and backward, and never the eager one;
        # on a GPU these are the recorded add kernels, on the simulated backend a re-run.
        self.assertEqual(per_call[warmup + 1:], [(2, 0)] * (steps - warmup - 1))
        self.assertEqual(per_call[warmup][1], 0, "the capture call ran the eager path")
        # The reference never captured: all eager.
        self.assertEqual(ref_ar.counts(), (0, 2 * steps))
        # Python runs after warmup (simulated capture and replays) all took the graph path,
        # inside a capture context.
        after_warmup = ar.log[2 * warmup:]
        self.assertTrue(all(path == "graph" and capturing for path, capturing, _ in after_warmup), ar.log)
        if self.backend == "cuda":
            self.assertEqual(len(after_warmup), 2, "a CUDA replay ran Python")
        return ar, g

    def test_hook_switches_custom_allreduce_and_replays_repeat_that_branch(self):
        ar, g = self._check_replays_repeat_the_capture_branch("hook", lambda ar: [ar.capture])
        # The hook is entered exactly around graph work: every graph-path run saw one open
        # capture() context, and every context was closed without error.
        self.assertTrue(all(depth == 1 for path, _, depth in ar.log if path == "graph"), ar.log)
        self.assertEqual(ar.capturing, 0)
        self.assertEqual(ar.exits, [None] * ar.enters)
        if self.backend == "cuda":
            self.assertEqual(ar.enters, 2, "one capture() per graph: forward and backward")

    def test_is_capturing_alone_switches_the_branch_without_hooks(self):
        ar, _ = self._check_replays_repeat_the_capture_branch("is_capturing", lambda ar: [])
        self.assertEqual(ar.enters, 0)

    def test_without_hook_the_hook_driven_branch_stays_eager_in_the_graph(self):
        # The negative control: a custom all-reduce nobody told about the capture records its
        # eager path into the graph (FastDeploy's warmup-before-capture bug, docs/guides/distributed.md).
        ar = FakeCustomAllReduce("hook")
        ref_ar = FakeCustomAllReduce("hook")
        g = self.graphed(parallel_block, warmup_steps=1)
        per_call = self._train(g, ar, ref_ar, steps=4, warmup=1)
        self.assertEqual(per_call[2:], [(0, 2)] * 2)
        self.assertEqual(g.stats()["replays"], 2)

    def test_hooks_enter_in_order_only_around_graph_work_and_exit_in_reverse(self):
        events = []
        hooks = [RecordingHook("first", events), RecordingHook("second", events)]
        ar = FakeCustomAllReduce("is_capturing")
        g = self.graphed(parallel_block, warmup_steps=1, capture_hooks=hooks)
        x, w = paddle.randn([4, 8]), paddle.randn([8, 8])
        w.stop_gradient = False
        marks = []
        for _ in range(4):
            g(x, w, ar).sum().backward()
            marks.append(len(events))
        self.assertEqual(marks[0], 0, "hooks entered during a warmup call")
        pairs = [events[i:i + 4] for i in range(0, len(events), 4)]
        for quad in pairs:  # each capture or replay of one graph: enter, enter, exit, exit
            self.assertEqual(
                [(kind, name) for kind, name, _ in quad],
                [("enter", "first"), ("enter", "second"), ("exit", "second"), ("exit", "first")],
            )
            self.assertEqual(quad[0][2], False, "is_capturing() is set inside the hooks, not before")
            self.assertEqual((quad[2][2], quad[3][2]), (None, None))
        if self.backend == "cuda":
            self.assertEqual(marks, [0, 8, 8, 8], "2 captures x 2 hooks, then no Python on replay")
        else:  # simulated replays re-enter the hooks for each graph
            self.assertEqual([b - a for a, b in zip(marks[1:], marks[2:])], [8, 8])

    def test_hooks_exit_with_the_error_when_capture_fails_and_the_key_runs_eagerly(self):
        events = []

        def fails_under_capture(x, w):
            if is_capturing():
                raise RuntimeError("refused under capture")
            return paddle.matmul(x, w)

        g = self.graphed(fails_under_capture, warmup_steps=1, capture_hooks=[RecordingHook("h", events)])
        x, w = paddle.randn([4, 8]), paddle.randn([8, 8])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                self.assertBitwise(g(x, w), paddle.matmul(x, w))
                self.assertFalse(is_capturing())
        self.assertEqual(events, [("enter", "h", False), ("exit", "h", RuntimeError)])
        self.assertEqual(g.stats()["captures"], 0)
        self.assertTrue(any("refused under capture" in str(w.message) for w in caught), [str(w.message) for w in caught])

    def test_hook_that_fails_to_enter_exits_the_hooks_before_it(self):
        events = []

        @contextlib.contextmanager
        def broken():
            raise RuntimeError("communicator not ready")
            yield  # pragma: no cover

        g = self.graphed(paddle.matmul, warmup_steps=0, capture_hooks=[RecordingHook("ok", events), broken])
        x, w = paddle.randn([4, 8]), paddle.randn([8, 8])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertBitwise(g(x, w), paddle.matmul(x, w))
        self.assertEqual(events, [("enter", "ok", False), ("exit", "ok", RuntimeError)])
        self.assertFalse(is_capturing())
        self.assertEqual(g.stats()["captures"], 0)
        self.assertTrue(any("communicator not ready" in str(w.message) for w in caught))


class TestPublicNames(unittest.TestCase):
    def test_is_capturing_is_exported_and_false_outside_capture(self):
        self.assertIn("is_capturing", cudagraph.__all__)
        self.assertIs(cudagraph.is_capturing, is_capturing)
        self.assertFalse(is_capturing())


if __name__ == "__main__":
    unittest.main()
