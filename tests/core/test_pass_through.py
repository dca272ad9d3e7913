"""Eager calls through a wrapper cost little. A wrapper that can only run eagerly (backend=None in a
Paddle build without CUDA graphs) costs about what the Layer's own call costs, and decides as it did before
(NOTE [ Pass-through wrappers ] in core/pass_through.py): the environment's backend is still read when a key
is first seen, and a call inside a capture, a whole step or saved-tensors hooks, or given a stale output, is
still told apart."""

import os
import subprocess
import sys
import time
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import StaleOutputError, autocudagraph
from paddlefleet.cudagraph.backends import cuda as cuda_backend
from paddlefleet.cudagraph.core.stats import Counters
from paddlefleet.cudagraph.guards import saved_hooks
from paddlefleet.cudagraph.options import ENV_BACKEND

from testkit.harness import on_device

NO_BACKEND = "no GPU tensors or no CUDA build (backend=None runs eagerly)"


def twins(width=4, **options):
    paddle.seed(0)
    own, wrapped = paddle.nn.Linear(width, width), paddle.nn.Linear(width, width)
    wrapped.set_state_dict(own.state_dict())
    return own, autocudagraph(wrapped, **options)


def best_us(fn, calls):
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


class TallyTest(unittest.TestCase):
    def test_calls_counted_in_a_tally_are_seen_by_every_reader(self):
        """NOTE [ Tallies of calls without a Decision ] in core/stats.py: a tally's calls are folded into
        eager_calls and eager_reasons on every read and write, snapshot() and expect() included."""
        counters = Counters()
        counters.eager("a")
        cell = counters.tally("b")
        cell[0] += 3
        snapshot = counters.snapshot()
        self.assertEqual((snapshot["eager_calls"], snapshot["eager_reasons"]), (4, {"a": 1, "b": 3}))
        cell[0] += 2
        with counters.expect(eager_calls=1):
            counters.eager("a")
        self.assertEqual((counters.eager_calls, dict(counters.eager_reasons)), (7, {"a": 2, "b": 5}))
        cell[0] += 1
        counters.eager_calls += 1  # a write folds first
        self.assertEqual((counters.eager_calls, counters.eager_reasons["b"], cell[0]), (9, 6, 0))
        self.assertIs(counters.tally("b"), cell)

    def test_a_wrapper_passing_calls_through_counts_each_in_stats_and_explain(self):
        paddle.seed(0)
        wrapped = autocudagraph(paddle.nn.Linear(4, 4), max_graphs=0)
        x = paddle.randn([2, 4])
        for _ in range(7):
            wrapped(x)
        self.assertEqual(wrapped.forward.stats()["eager_calls"], 7)
        self.assertIn("7 of 7 calls", wrapped.forward.explain())
        wrapped(x)
        self.assertEqual(wrapped.forward.counters.eager_reasons["max_graphs=0: no key may hold graphs, every call "
                                                                 "runs eagerly"], 8)


class PassThroughCase(unittest.TestCase):
    def setUp(self):
        if cuda_backend.cuda_available():
            self.skipTest("this Paddle has CUDA graphs: a call's tensors decide its backend")
        on_device(self, "cpu")
        patcher = mock.patch.dict(os.environ, {ENV_BACKEND: ""})  # unset for the test, restored after
        patcher.start()
        self.addCleanup(patcher.stop)


class PassThroughCostTest(PassThroughCase):
    def test_a_wrapped_layer_costs_about_its_own_eager_call(self):
        # Measured in a fresh process: the suite's own process holds process-wide patches that earlier
        # tests installed (the simulated backend's traced entry points, the stale-output translation),
        # which slow the Layer's own call and the wrapper's unevenly.
        # The bound holds with room on a machine running another suite on its other core (1.15x-1.22x
        # seen on Paddle 2.6, 1.05x-1.18x on 3.x, about 1.1x alone); a wrapper that makes a key per call costs
        # 1.9x-2.1x. A second core's burst can still slow one side of a round more than the other: the
        # measurement is taken up to three times, and the best must hold.
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if k != ENV_BACKEND}
        seen = []
        for _ in range(3):
            done = subprocess.run([sys.executable, "-c", "import tests.core.test_pass_through as t; t.measure()"],
                                  cwd=repo, env=env, capture_output=True, text=True, timeout=300)
            self.assertEqual(done.returncode, 0, done.stderr[-3000:])
            own_us, wrapped_us, reasons = done.stdout.strip().splitlines()[-1].split(" ", 2)
            self.assertEqual(reasons, repr({NO_BACKEND: 1 + 50 + 15 * 300}))
            seen.append(f"wrapped {wrapped_us} us against the Layer's own {own_us} us")
            if float(wrapped_us) / float(own_us) < 1.25:
                break
        else:
            self.fail("; ".join(seen))


def measure():
    """Prints ``own_us wrapped_us eager_reasons``: the best of interleaved rounds of many calls each, so that a
    loaded machine slows both sides alike and a round without interruption decides. A wrapper that makes a
    key per call cost 1.9x-2.1x the Layer's own call here; one that passes through about 1.05x."""
    paddle.set_device("cpu")
    own, wrapped = twins()
    x = paddle.randn([2, 4])
    np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())
    for _ in range(50):
        own(x), wrapped(x)
    own_us, wrapped_us = [], []
    for _ in range(15):
        own_us.append(best_us(lambda: own(x), 300))
        wrapped_us.append(best_us(lambda: wrapped(x), 300))
    print(f"{min(own_us):.3f} {min(wrapped_us):.3f} {wrapped.forward.stats()['eager_reasons']!r}")


class PassThroughDecisionTest(PassThroughCase):
    def test_the_environment_is_read_when_a_key_is_first_seen(self):
        own, wrapped = twins(warmup_steps=0)
        x = paddle.randn([2, 4])
        no_grad = paddle.no_grad()  # a forward without a backward in flight: the next call may replay
        no_grad.__enter__()
        self.addCleanup(no_grad.__exit__, None, None, None)
        for _ in range(3):
            np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())
        self.assertEqual(wrapped.forward.stats()["eager_reasons"], {NO_BACKEND: 3})
        with mock.patch.dict(os.environ, {ENV_BACKEND: "simulate"}):  # set later: the next key graphs
            np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())
        self.assertEqual(wrapped.forward.stats()["captures"], 1)
        np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())  # unset: the key keeps its backend
        self.assertEqual(wrapped.forward.stats()["replays"], 1, wrapped.forward.explain())
        wrapped.forward.reset()
        with mock.patch.dict(os.environ, {ENV_BACKEND: "eager"}):
            wrapped(x)
        wrapped(x)
        self.assertEqual(wrapped.forward.stats()["eager_reasons"],
                         {f"backend is eager: the environment sets {ENV_BACKEND}=eager": 1, NO_BACKEND: 1})

    def test_an_environment_set_at_the_first_call_still_passes_through_once_unset(self):
        own, wrapped = twins()
        x = paddle.randn([2, 4])
        with mock.patch.dict(os.environ, {ENV_BACKEND: "eager"}):
            wrapped(x)
        for _ in range(2):
            np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())
        self.assertEqual(wrapped.forward._keyless[0], NO_BACKEND)
        with mock.patch.dict(os.environ, {ENV_BACKEND: "simulate"}):
            for _ in range(3):  # warmup, capture, replay
                np.testing.assert_array_equal(wrapped(x).numpy(), own(x).numpy())
        self.assertEqual((wrapped.forward.stats()["captures"], wrapped.forward.stats()["replays"]), (1, 1))
        wrapped.forward.reset()
        wrapped(x)
        self.assertIsNone(wrapped.forward._keyless)  # it held a key (a chain may name it): every call makes one

    def test_saved_tensors_hooks_still_give_their_reason(self):
        _, wrapped = twins()
        x = paddle.randn([2, 4])
        wrapped(x)
        with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t):
            with self.assertWarns(RuntimeWarning):
                wrapped(x)
        self.assertEqual(wrapped.forward.stats()["eager_reasons"], {NO_BACKEND: 1, saved_hooks.REASON: 1})

    def test_a_stale_output_passed_to_it_still_raises(self):
        double = autocudagraph(lambda t: t * 2.0, backend="simulate", warmup_steps=0, clone_outputs=False,
                               check_stale_outputs=True)
        _, wrapped = twins()
        x = paddle.randn([2, 4])
        wrapped(x)
        y1 = double(x)
        double(x + 1.0)
        with self.assertRaises(StaleOutputError):
            wrapped(y1)
        self.assertEqual(wrapped.forward.stats()["eager_reasons"], {NO_BACKEND: 1})

    def test_options_that_decide_per_call_never_pass_through(self):
        x = paddle.randn([2, 4])
        for options in ({"dispatch_key_fn": lambda bound: None}, {"backend": "eager"}):
            g = autocudagraph(lambda t: t * 2.0, **options)
            g(x), g(x)
            self.assertIsNone(g._keyless, options)
            self.assertEqual(g.stats()["eager_calls"], 2)


if __name__ == "__main__":
    unittest.main()
