"""NOTE [ Graphed calls that cannot pay ] in core/host_cost.py: a key whose graphed calls cost more
host time than its eager calls runs eagerly (eager_if_slower), judged on eager calls before the capture and replays alone and
in chains, with a stand-in clock: each eager forward of a layer costs EAGER_US, and each simulated
forward graph replay adds what the test says (the simulated replay re-runs the forward, so a replay costs
EAGER_US plus that); a backward costs what the test says, eager and graphed (``Tick``)."""

import contextlib
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import simulated
from paddlefleet.cudagraph.backends.base import in_rerun_replay, is_capturing
from paddlefleet.cudagraph.chains import links as chain_links
from paddlefleet.cudagraph.core import host_cost
from testkit.common import MatMLP, build, host_tensor, normal
from testkit.harness import hooked_params

EAGER_US = 100.0


class StandInClock:
    """Seconds that move only when the test says: a layer's forward and a graph replay."""

    def __init__(self):
        self.now = 0.0
        self.alone_us = 0.0  # added by a replay outside a chain run (or a callable giving it per replay)
        self.chained_us = 0.0  # added by a replay while a chain run is open
        self.eager_backward_us = 0.0  # added by an eager layer's backward
        self.graphed_backward_us = 0.0  # added by a backward graph's replay
        self.eager_probe_us = 0.0  # what host_cost.speed_probe() takes before the first replay (0: not probed)
        self.replay_probe_us = 0.0  # and from the first replay on
        self.replayed = False

    def probe(self):
        return (self.replay_probe_us if self.replayed else self.eager_probe_us) * 1e-6

    def __call__(self):
        return self.now

    def add(self, us):
        self.now += us * 1e-6


class Tick(paddle.autograd.PyLayer):
    """The identity, whose backward adds the stand-in clock's eager backward cost in an eager backward (the
    simulated backward graph's replay re-runs it: that one adds nothing here)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if TimedMLP.clock is not None and not in_rerun_replay() and not is_capturing():
            TimedMLP.clock.add(TimedMLP.clock.eager_backward_us)
        return grad


class TimedMLP(MatMLP):
    clock = None

    def forward(self, x):
        if TimedMLP.clock is not None:
            TimedMLP.clock.add(EAGER_US)
        return Tick.apply(super().forward(x))


def layers(n=4, width=8, seed=0):
    return build(lambda: paddle.nn.LayerList([TimedMLP([width, width]) for _ in range(n)]), seed)


def step(model, x, dy, set_to_zero=False):
    h = x
    for layer in model:
        h = layer(h)
    h.backward(dy)
    got = [h.numpy()] + [p.grad.numpy() for p in model.parameters()]
    for p in model.parameters():
        p.clear_gradient(set_to_zero)
    return got


class TestEagerIfSlower(unittest.TestCase):
    def setUp(self):
        self.clock = StandInClock()
        self.saved = list(host_cost._warned)
        host_cost._warned.clear()
        original = simulated._SimulatedGraph.replay
        clock = self.clock

        def replay(graph):
            if "backward" in getattr(graph._body, "__qualname__", ""):  # a backward graph
                clock.add(clock.graphed_backward_us)
                return original(graph)
            alone = clock.alone_us() if callable(clock.alone_us) else clock.alone_us
            clock.add(clock.chained_us if chain_links.current_run() is not None else alone)
            clock.replayed = True
            return original(graph)

        self.patches = contextlib.ExitStack()
        self.patches.enter_context(mock.patch.object(simulated._SimulatedGraph, "replay", replay))
        self.patches.enter_context(mock.patch.object(host_cost, "clock", self.clock))
        self.patches.enter_context(mock.patch.object(host_cost, "speed_probe", self.clock.probe))
        self.patches.enter_context(mock.patch("paddlefleet.cudagraph.core.entry.measured", return_value=True))
        self.patches.enter_context(mock.patch.object(TimedMLP, "clock", self.clock))

    def tearDown(self):
        self.patches.close()
        host_cost._warned[:] = self.saved

    def run_steps(self, n, set_to_zero=False, **options):
        """``n`` steps of a graphed model and its eager twin, bitwise equal at every step (grads cleared
        with ``clear_gradient(set_to_zero)``); returns the graphed model and the warnings given."""
        graphed, eager = layers(), layers()
        for layer in graphed:
            autocudagraph(layer, backend="simulate", **options)
        draw = normal(1)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(n):
                for a, e in zip(step(graphed, x, dy, set_to_zero), step(eager, x, dy, set_to_zero)):
                    np.testing.assert_array_equal(a, e, err_msg=f"step {i}")
        return graphed, [str(w.message) for w in caught if "us of host time" in str(w.message)]

    def test_a_slower_key_runs_eagerly_after_its_timed_calls_with_both_numbers(self):
        self.clock.alone_us = 30.0  # a replay: 130 us against 100 eager
        steps = 1 + 1 + (host_cost.SAMPLES + 1) + (host_cost.SAMPLES - 1) + 3
        model, warned = self.run_steps(steps, chain_calls=False)
        self.assertEqual(len(warned), 1, warned)  # once per process, not per layer
        self.assertIn("130.0 us of host time against 100.0 us", warned[0])
        self.assertIn("runs eagerly from now on", warned[0])
        for layer in model:
            stats = layer.forward.stats()
            self.assertEqual(stats["replays"], host_cost.SAMPLES + 1)
            # Its one key ran slower graphed: the wrapper's later calls run eagerly without a key.
            self.assertEqual(stats["eager_reasons"], {host_cost.TIMED: host_cost.SAMPLES - 1, host_cost.ALL_SLOWER: 3})
            self.assertEqual(stats["graphs"], 0)
            [row] = layer.forward.report()
            self.assertEqual(row["fallback_reason"], "its graphed calls cost more host time than its eager calls: 130.0 "
                             "against 100.0 us per call, forward and backward (lower quartiles of its eager calls before its "
                             "capture and its "
                             "replays; "
                             "eager_if_slower=False keeps it graphed)")
            text = layer.forward.explain()
            self.assertIn("host us per forward call: eager 100.0 (lower quartile of 8), graphed 130.0 "
                          "(lower quartile of 8); per backward: eager 0.0 (lower quartile of 8), graphed 0.0 "
                          "(lower quartile of 7)", text)
        x = host_tensor(normal(2)(6, 8))  # another shape: no key is made for it
        model[0](x)
        self.assertEqual(model[0].forward.stats()["keys"], 1)
        model[0].forward.reset()  # measures again: a new key is timed eagerly, warms up and is captured
        for _ in range(host_cost.SAMPLES + 1):
            model[0](x)
        self.assertEqual(model[0].forward.stats()["captures"], 1)

    def test_eager_samples_on_a_slowed_host_are_weighed_at_the_replays_host_speed(self):
        """NOTE [ Graphed calls that cannot pay ], "Samples taken at different host speeds": the host ran the probe
        twice as slow during the eager samples, so their 100 us count as 50 against the replays' 60."""
        self.clock.alone_us = -40.0  # a replay: 60 us against 100 eager, as the clock saw them
        self.clock.eager_probe_us, self.clock.replay_probe_us = 2.0, 1.0
        steps = 1 + 1 + (host_cost.SAMPLES + 1) + (host_cost.SAMPLES - 1) + 3
        model, warned = self.run_steps(steps, chain_calls=False)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("60.0 us of host time against 50.0 us for the eager call (forward and backward, lower quartiles, "
                      "the eager calls' at the replays' host speed (the host ran 2.00x slower during them))", warned[0])
        for layer in model:
            [row] = layer.forward.report()
            self.assertEqual(row["phase"], "fallback")
            self.assertEqual(row["host_us"]["slowdown"], 2.0)
            self.assertIn("60.0 against 50.0 us per call", row["fallback_reason"])
            self.assertIn("the eager calls' at the replays' host speed (the host ran 2.00x slower during them)",
                          row["fallback_reason"])
            self.assertIn("the host ran 2.00x slower during the eager calls than during the replays (their host time "
                          "divided by 2.00 where compared)", layer.forward.explain())

    def test_eager_samples_on_a_faster_host_keep_a_key_graphed_and_the_ratio_is_bounded(self):
        self.clock.alone_us = 30.0  # 130 us against 100 as the clock saw them: slower graphed at one speed
        self.clock.eager_probe_us, self.clock.replay_probe_us = 1.0, 2.0  # the replays ran on a host twice as slow
        model, warned = self.run_steps(1 + 1 + (host_cost.SAMPLES + 1) + (host_cost.SAMPLES - 1) + 3, chain_calls=False)
        self.assertEqual(warned, [])
        for layer in model:
            [entry] = layer.forward.entries().values()
            self.assertEqual((entry.phase.value, entry.host_cost.verdict), ("replay", "graphed"))
            self.assertEqual(entry.host_cost.slowdown(), 0.5)
            self.assertIn("the host ran 2.00x faster during the eager calls than during the replays (their host time "
                          "divided by 0.50 where compared)", layer.forward.explain())
            self.assertAlmostEqual(entry.host_cost.total_us(None), 200.0, places=6)  # the eager call at the replays' speed
        cost = host_cost.HostCost(measure=True, judge=True)
        cost.eager_probe_s, cost.replay_probe_s = [10e-6] * 8, [1e-6] * 8
        self.assertEqual(cost.slowdown(), host_cost.MAX_SLOWDOWN)
        cost.eager_probe_s, cost.replay_probe_s = [1e-6] * 8, [10e-6] * 8
        self.assertEqual(cost.slowdown(), 1 / host_cost.MAX_SLOWDOWN)
        cost.replay_probe_s = []
        self.assertEqual(cost.slowdown(), 1.0)  # not probed yet: no scaling

    def test_a_faster_key_stays_graphed_and_its_chained_calls_are_judged_too(self):
        self.clock.alone_us = -40.0
        self.clock.chained_us = -40.0
        model, warned = self.run_steps(40)
        self.assertEqual(warned, [])
        for k, layer in enumerate(model):
            [entry] = layer.forward.entries().values()
            self.assertEqual(entry.phase.value, "replay", layer.forward.explain())
            self.assertEqual(entry.host_cost.verdict, "graphed")
            if k == 0:  # the chain's first call pays every member's bridge: not judged in chains
                self.assertEqual(entry.chain.cost.verdict, "head")
                self.assertIn("graphed 0.0 (lower quartile of 7)\n", layer.forward.explain())  # no chained time
                # The verdict says how much faster, measured.
                self.assertIn("; a graphed call (forward and backward) takes 1.7x less host time than eager (60.0 "
                              "against 100.0 us, measured)", layer.forward.explain().splitlines()[0])
                continue
            self.assertEqual(entry.chain.cost.verdict, "graphed", layer.forward.explain())
            self.assertIn("graphed 0.0 (lower quartile of 7), chained 60.0 (lower quartile of 8)",
                          layer.forward.explain())
        # Steps 1-7 are timed eager calls, 8 warms up, 9 captures, 10-18 replay alone; a chain serves every later step.
        self.assertEqual([layer.forward.stats()["chained_calls"] for layer in model], [0, 22, 22, 22])
        self.assertEqual([layer.forward.stats()["eager_calls"] for layer in model], [host_cost.SAMPLES - 1] * 4)

    def test_a_faster_key_whose_every_other_replay_pays_a_stall_stays_graphed(self):
        """Noise only adds host time: a key whose replays cost 60 us, every other one stalled by 340 us
        more (a median of 230 against 100 eager), is judged on its lower quartile and stays graphed."""
        # Four layers, a forward and a backward replay each: every other step of replays stalls.
        stalls = iter(([-40.0] * 8 + [300.0] * 8) * 100)
        self.clock.alone_us = lambda: next(stalls)
        model, warned = self.run_steps(24, chain_calls=False)
        self.assertEqual(warned, [])
        for layer in model:
            [entry] = layer.forward.entries().values()
            self.assertEqual(entry.host_cost.verdict, "graphed", layer.forward.explain())
            timed = sorted(round(s * 1e6) for s in entry.host_cost.replay_s[1:])
            self.assertEqual(timed, [60] * 4 + [400] * 4)  # a median of 230 us would have sent it eager

    def test_a_faster_key_that_never_chains_is_not_timed_after_its_verdict(self):
        """Judged graphed alone, a key whose calls never chain (one layer) is not timed on its later
        calls: only whether a replay heads a chain is kept, and no call of its did."""
        self.clock.alone_us = -40.0
        reads = []
        clock = self.clock
        self.patches.enter_context(mock.patch.object(host_cost, "clock", lambda: reads.append(1) or clock()))
        graphed, eager = layers(n=1), layers(n=1)
        autocudagraph(graphed[0], backend="simulate")
        draw = normal(1)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        for i in range(30):
            if i == 20:
                [entry] = graphed[0].forward.entries().values()
                self.assertEqual((entry.host_cost.verdict, entry.chain), ("graphed", None))  # no chain record
                before = len(reads)
            for a, e in zip(step(graphed, x, dy), step(eager, x, dy)):
                np.testing.assert_array_equal(a, e, err_msg=f"step {i}")
        # One read a call: the start of a call a chain might serve (Lifecycle.__call__); the old code
        # read it twice more a call, forever, timing a replay no verdict would use.
        self.assertEqual(len(reads) - before, 10)
        self.assertEqual(graphed[0].forward.stats()["replays"], 30 - 2 - (host_cost.SAMPLES - 1))

    def assert_no_timing_hooks(self, params):
        """No hook of the verdict's is left on ``params``."""
        self.assertEqual(hooked_params(params), {})

    def test_the_backward_is_weighed_a_slower_forward_with_a_cheaper_backward_stays_graphed(self):
        """A graphed forward 130 us against 100 eager, but a graphed backward 20 against 200: 150 against
        300 us a call, so the key stays graphed (judged on forwards alone it ran eagerly)."""
        self.clock.alone_us = 30.0
        self.clock.eager_backward_us = 200.0
        self.clock.graphed_backward_us = 20.0
        model, warned = self.run_steps(24, chain_calls=False)
        self.assertEqual(warned, [])
        for layer in model:
            [entry] = layer.forward.entries().values()
            self.assertEqual((entry.phase.value, entry.host_cost.verdict), ("replay", "graphed"), layer.forward.explain())
            self.assertEqual([round(v, 6) for v in entry.host_cost.backward_us], [200.0, 20.0, 8, 7])
            text = layer.forward.explain()
            self.assertIn("per backward: eager 200.0 (lower quartile of 8), graphed 20.0 (lower quartile of 7)", text)
            self.assertIn("a graphed call (forward and backward) takes 2.0x less host time than eager (150.0 against "
                          "300.0 us, measured)", text)
            row = layer.forward.report()[0]["host_us"]
            self.assertEqual((row["eager_backward"], row["graphed_backward"]), (200.0, 20.0))
        self.assert_no_timing_hooks(model.parameters())  # removed at the verdict

    def test_a_faster_forward_with_a_dearer_backward_runs_eagerly(self):
        self.clock.alone_us = -40.0  # forward 60 against 100
        self.clock.graphed_backward_us = 200.0  # backward 200 against 0
        model, warned = self.run_steps(24, chain_calls=False)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("a graphed call costs 260.0 us of host time against 100.0 us for the eager call (forward and "
                      "backward, lower quartiles)", warned[0])
        for layer in model:
            [entry] = layer.forward.entries().values()
            self.assertEqual(entry.phase.value, "fallback", layer.forward.explain())
            self.assertIn("260.0 against 100.0 us per call, forward and backward", entry.fallback_reason)
        self.assert_no_timing_hooks(model.parameters())

    def test_a_backward_that_cannot_be_seen_leaves_the_verdict_to_the_forwards(self):
        """A plain function (no Layer to see the backward's end on) and a Layer whose parameters need no
        grad are judged on their forwards, and say so."""
        self.clock.alone_us = -40.0
        self.clock.graphed_backward_us = 200.0  # would send them eager if it were weighed
        for frozen in (False, True):
            graphed, eager = layers(n=1), layers(n=1)
            if frozen:
                for p in list(graphed.parameters()) + list(eager.parameters()):
                    p.stop_gradient = True
                run = autocudagraph(graphed[0], backend="simulate")
            else:
                run = autocudagraph(lambda h: graphed[0](h), backend="simulate")
            draw = normal(1)
            x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
            x.stop_gradient = False
            for i in range(20):
                got = run(x)
                got.backward(dy)
                want = eager[0](x)
                want.backward(dy)
                np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"step {i}")
            [entry] = (run.forward if frozen else run).entries().values()
            text = (run.forward if frozen else run).explain()
            self.assertEqual((entry.host_cost.verdict, entry.host_cost.backward_us), ("graphed", None), text)
            self.assertIn("graphed 60.0 (lower quartile of 8)\n", text)
            self.assertIn("a graphed forward call takes 1.7x less host time", text)
            self.assert_no_timing_hooks(graphed.parameters())

    def test_a_reset_or_a_fall_back_during_the_timed_calls_removes_the_hooks(self):
        graphed = layers(n=1)
        autocudagraph(graphed[0], backend="simulate")
        x, dy = host_tensor(normal(1)(4, 8)), host_tensor(normal(2)(4, 8))
        for _ in range(3):  # timed eager calls: the hooks are on
            graphed[0](x).backward(dy)
        [entry] = graphed[0].forward.entries().values()
        self.assertTrue(entry.host_cost.backward.armed)
        self.assertEqual(len(entry.host_cost.backward.eager_s), 2)  # the third call's backward is still open
        graphed[0].forward.reset()
        self.assertIsNone(entry.host_cost.backward)
        self.assert_no_timing_hooks(graphed.parameters())

    def test_keys_slower_only_in_chains_run_eagerly(self):
        self.clock.alone_us = -40.0  # alone: 60 us; the head of a chain too (its replay opens the run)
        self.clock.chained_us = 20.0  # a call a chain serves: 120 us (the head's own call is not judged in chains)
        model, warned = self.run_steps(40)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("a graphed call in a chain costs 120.0 us", warned[0])
        [head] = model[0].forward.entries().values()
        self.assertEqual(head.phase.value, "replay", model[0].forward.explain())
        for layer in model[1:]:
            [entry] = layer.forward.entries().values()
            self.assertEqual(entry.phase.value, "fallback", layer.forward.explain())
            self.assertIn("graphed calls in chains cost more host time than its eager calls: 120.0 against 100.0",
                          entry.fallback_reason)

    def test_the_eager_samples_come_before_the_capture_and_the_replays_after(self):
        """Eager samples after the capture would hold the key's graphs and an eager call's memory at
        once (docs/guides/memory.md, "Eager samples"): a judged key's eager calls all come first."""
        self.clock.alone_us = -40.0
        graphed, eager = layers(n=1), layers(n=1)
        autocudagraph(graphed[0], backend="simulate")
        draw = normal(1)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        seen = []
        for i in range(20):
            for a, e in zip(step(graphed, x, dy), step(eager, x, dy)):
                np.testing.assert_array_equal(a, e, err_msg=f"step {i}")
            stats = graphed[0].forward.stats()
            seen.append((stats["eager_calls"], stats["warmup_calls"], stats["captures"], stats["replays"]))
        samples = host_cost.SAMPLES - 1
        want = [(i + 1, 0, 0, 0) for i in range(samples)] + [(samples, 1, 0, 0), (samples, 1, 1, 0)]
        want += [(samples, 1, 1, i + 1) for i in range(20 - len(want))]
        self.assertEqual(seen, want)
        [entry] = graphed[0].forward.entries().values()
        self.assertEqual(entry.host_cost.verdict, "graphed", graphed[0].forward.explain())

    def test_accumulating_in_the_graph_a_faster_key_keeps_its_accumulator(self):
        """accumulate_in_graph=True, grads zeroed (or freed) after every step: the eager samples come
        before the capture, so the key is never captured again and stays graphed, bitwise eager's at
        every step."""
        self.clock.alone_us = -40.0
        for set_to_zero in (True, False):
            self.check_accumulator_kept(set_to_zero)

    def check_accumulator_kept(self, set_to_zero):
        model, warned = self.run_steps(24, set_to_zero, chain_calls=False, accumulate_in_graph=True)
        self.assertEqual(warned, [])
        for layer in model:
            [entry] = layer.forward.entries().values()
            self.assertEqual((entry.phase.value, entry.host_cost.verdict), ("replay", "graphed"), layer.forward.explain())
            stats = layer.forward.stats()
            self.assertEqual((stats["captures"], stats["recaptures"]), (1, 0), layer.forward.explain())
            self.assertEqual(stats["eager_reasons"], {host_cost.TIMED: host_cost.SAMPLES - 1})

    def test_eager_if_slower_false_keeps_the_key_graphed_and_warns_once(self):
        self.clock.alone_us = 30.0
        model, warned = self.run_steps(24, chain_calls=False, eager_if_slower=False)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("graphing it makes training slower", warned[0])
        for layer in model:
            stats = layer.forward.stats()
            self.assertEqual(stats["eager_calls"], 0, layer.forward.explain())
            self.assertEqual(stats["replays"], 22)
            self.assertIn("eager 100.0 (lower quartile of 1), graphed 130.0 (lower quartile of 8)",
                          layer.forward.explain())

    def test_a_backend_whose_replay_reruns_the_function_is_not_timed(self):
        self.patches.close()  # the measurement as it is (not the suite's: tests/conftest.py)
        self.patches = contextlib.ExitStack()
        self.patches.enter_context(mock.patch("paddlefleet.cudagraph.core.entry.measured", host_cost.measured))
        model, warned = self.run_steps(24, chain_calls=False)
        self.assertEqual(warned, [])
        self.assertEqual(model[0].forward.report()[0]["host_cost"], "")
        self.assertEqual(model[0].forward.stats()["eager_calls"], 0)

    def test_the_option_is_checked(self):
        with self.assertRaisesRegex(TypeError, "eager_if_slower must be True or False, got 'no'"):
            autocudagraph(lambda x: x, eager_if_slower="no")


if __name__ == "__main__":
    unittest.main()
