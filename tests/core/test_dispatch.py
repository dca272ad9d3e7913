"""Each call's Decision pinned without running a body (NOTE [ One call through the dispatcher ] in
core/dispatch.py): a stand-in body that fails when any phase of it runs, entries moved by hand to the
phase a case needs, and the blocker's answer or a chain's claim scripted."""

import dataclasses
import os
import unittest
import unittest.mock
import warnings

import paddle

from paddlefleet.cudagraph.backends import whole_step
from paddlefleet.cudagraph.core import dispatch as dispatch_module, host_cost
from paddlefleet.cudagraph.core.body import Action as Blocker, Blocked
from paddlefleet.cudagraph.core.dispatch import ENDLESS, IN_FLIGHT, WHOLE_STEP, Action, dispatch, keyless_rule
from paddlefleet.cudagraph.core.entry import ATTR_RECAPTURES, Phase
from paddlefleet.cudagraph.core.host_cost import HostCost
from paddlefleet.cudagraph.core.lifecycle import Lifecycle
from paddlefleet.cudagraph.core.memory import Footprint
from paddlefleet.cudagraph.core.pass_through import NO_PLACES
from paddlefleet.cudagraph.options import ENV_BACKEND, GraphOptions


class _Graphs:
    """What a capture would have made: enough for an entry to hold graphs."""

    layers = []

    def release(self):
        pass

    def backward_pending(self):
        return False

    def nbytes(self):
        return 0

    def grad_copies(self):
        return 0

    def footprint(self):
        return Footprint()


class _StandInBody:
    """A body whose phases may not run: the dispatcher only asks ``ready``, ``blocker`` and ``claim``."""

    name, api, bound = "f", "autocudagraph", False

    def __init__(self, **options):
        self.options = GraphOptions(backend="simulate", **options)
        self.is_ready, self.blocked, self.claimed = True, None, None
        self.asked = []

    def layers(self):
        return []

    def ready(self, entry):
        self.asked.append("ready")
        return self.is_ready

    def blocker(self, entry, call):
        self.asked.append("blocker")
        return self.blocked

    def claim(self, args, kwargs, keys):
        return self.claimed

    def idle(self):
        return self.claimed is None

    def idle_holder(self):  # Body.idle_holder: a compiled check asks idle() itself
        return False

    def _ran(self, *args, **kwargs):
        raise AssertionError("the dispatcher ran a phase of the body")

    run = warmup = capture = replay = add_slot = verified_replay = serve = _ran

    def eager_runner(self):  # what Body.eager_runner gives: run(args, kwargs), whatever run is when called
        return lambda args, kwargs: self.run(args, kwargs)

    def eager_parts(self):  # Body.eager_parts: no compiled front door lays out this body's runner
        return None


class DispatchTest(unittest.TestCase):
    def setUp(self):
        self.body = _StandInBody(warmup_steps=2)
        self.wrapper = Lifecycle(self.body, lambda x: x)
        self.x = paddle.ones([2, 3])

    def decide(self):
        return dispatch(self.wrapper, (self.x,), {})

    def replaying(self, cost=None):
        """The key's entry, moved by hand to REPLAY with stand-in graphs."""
        entry = self.decide().entry
        entry.phase, entry.graphs = Phase.REPLAY, _Graphs()
        if cost is not None:
            entry.host_cost = cost
        return entry

    def test_a_new_key_warms_up_then_captures_and_no_phase_moves(self):
        first = self.decide()
        self.assertIs(first.action, Action.WARMUP)
        self.assertEqual((first.entry.phase, first.entry.warmup_calls, first.call.tensors), (Phase.WARMUP, 0, [self.x]))
        self.assertIs(self.decide().action, Action.WARMUP)  # the runner counts warmup calls, not the dispatcher
        first.entry.warmup_calls = 2
        self.assertIs(self.decide().action, Action.CAPTURE)
        self.body.is_ready = False  # a body not ready yet (a step whose warmup still makes state)
        self.assertIs(self.decide().action, Action.WARMUP)
        self.assertEqual(first.entry.phase, Phase.WARMUP)

    def test_a_known_key_replays_untimed(self):
        entry = self.replaying()
        decision = self.decide()
        self.assertEqual((decision.action, decision.entry, decision.start, decision.warn), (Action.REPLAY, entry, None, ()))
        self.assertEqual(entry.phase, Phase.REPLAY)

    def test_a_judged_key_takes_its_eager_samples_before_its_warmup_calls(self):
        with unittest.mock.patch("paddlefleet.cudagraph.core.entry.measured", return_value=True):
            first = self.decide()  # a new key, timed as on a GPU: a timed eager sample, then another, ...
        self.assertEqual((first.action, first.reason), (Action.TIMED_EAGER, host_cost.TIMED))
        cost = first.entry.host_cost
        self.assertTrue(cost.judging)
        cost.eager_s.extend([1e-5] * (host_cost.SAMPLES - 2))  # ... until the warmup call makes the last sample
        self.assertIs(self.decide().action, Action.WARMUP)

    def test_a_captured_key_replays_with_its_eager_samples_short(self):
        cost = HostCost(measure=True, judge=True)
        cost.replay_s.append(1e-5)  # one replay timed, no eager call yet: no eager call after the capture
        entry = self.replaying(cost)
        decision = self.decide()
        self.assertEqual((decision.action, decision.entry), (Action.REPLAY, entry))

    def test_a_call_of_the_latest_calls_key_reads_the_key_without_making_it(self):
        from paddlefleet.cudagraph.core.keys import KeyMaker

        entry = self.replaying()
        with unittest.mock.patch.object(KeyMaker, "key", autospec=True, side_effect=KeyMaker.key) as made:
            self.assertEqual([self.decide().entry for _ in range(3)], [entry] * 3)
            self.assertEqual(made.call_count, 0)  # NOTE [ Calls of a key that runs eagerly ]
            other = dispatch(self.wrapper, (paddle.ones([3, 3]),), {})
            self.assertEqual((other.action, made.call_count), (Action.WARMUP, 1))
            self.assertIs(self.decide().entry, entry)  # the latest is the other key now: this key is made
            self.assertEqual(made.call_count, 2)

    def test_a_timed_replay_starts_its_clock_before_the_blocker(self):
        cost = HostCost(measure=True, judge=True)
        cost.eager_s.append(1e-5)
        self.replaying(cost)
        ticks = iter([1.0, 2.0])
        with unittest.mock.patch.object(host_cost, "clock", lambda: next(ticks)):
            decision = self.decide()
        self.assertEqual((decision.action, decision.start), (Action.REPLAY, 2.0))

    def test_the_blockers_answers(self):
        entry = self.replaying()
        cases = [
            (Blocked(Blocker.REWARM, "a frozen parameter thawed", "warm"), Action.WARMUP),
            (Blocked(Blocker.RECAPTURE, "a parameter moved", "moved"), Action.RECAPTURE),
            (Blocked(Blocker.RECAPTURE_ONCE, "a buffer was rebound", "rebound"), Action.RECAPTURE),
            (Blocked(Blocker.NEW_SLOT, "every slot waits for its backward"), Action.NEW_SLOT),
            (Blocked(Blocker.EAGER, "an input moved", "moved input"), Action.EAGER),
        ]
        for blocked, action in cases:
            with self.subTest(blocked.action):
                self.body.blocked = blocked
                decision = self.decide()
                self.assertEqual((decision.action, decision.reason, decision.blocked), (action, blocked.reason, blocked))
                self.assertEqual(decision.warn, ((("blocked", blocked.reason), blocked.warning),)
                                 if blocked.warning else ())
                self.assertEqual((entry.phase, entry.recaptures), (Phase.REPLAY, 0))

    def test_a_call_in_flight_runs_eagerly_with_the_in_flight_warning(self):
        self.replaying()
        self.body.blocked = Blocked(Blocker.EAGER, "the previous call's backward has not run")
        decision = self.decide()
        self.assertEqual((decision.action, decision.warn), (Action.EAGER, (("inflight", IN_FLIGHT),)))

    def test_a_key_captured_again_before_falls_back_when_blocked_again(self):
        entry = self.replaying()
        entry.recaptures = 1
        self.body.blocked = Blocked(Blocker.RECAPTURE_ONCE, "a buffer was rebound")
        decision = self.decide()
        self.assertEqual((decision.action, decision.reason),
                         (Action.FALL_BACK, "a buffer was rebound, again after a re-capture"))
        self.assertEqual(entry.phase, Phase.REPLAY)  # the runner moves it

    def test_an_attribute_that_changes_before_every_call_falls_back_after_the_streak(self):
        entry = self.replaying()
        actions = []
        for step in range(ATTR_RECAPTURES + 1):
            self.body.blocked = Blocked(Blocker.RECAPTURE, "attribute 'calls' changed", "changed",
                                        ("Block", "calls", step, step + 1))
            decision = self.decide()
            actions.append(decision.action)
        self.assertEqual(actions, [Action.RECAPTURE] * ATTR_RECAPTURES + [Action.FALL_BACK])
        self.assertIn("attribute 'calls' of Block changed before every call", decision.reason)
        self.assertEqual(decision.warn[1], (("endless", id(entry)), ENDLESS.format(label=entry.label,
                                                                                   reason=decision.reason)))

    def test_a_chain_claims_the_call_before_any_key(self):
        entry = self.replaying()
        self.body.claimed = (entry, "plan")
        ticks = iter([5.0])
        with unittest.mock.patch.object(host_cost, "clock", lambda: next(ticks)):
            decision = self.decide()
        self.assertEqual((decision.action, decision.entry, decision.plan, decision.start, decision.call),
                         (Action.CHAINED, entry, "plan", 5.0, None))
        self.assertEqual(self.body.asked, [])

    def test_keys_in_recapture_and_fallback(self):
        entry = self.decide().entry
        entry.phase = Phase.RECAPTURE
        decision = self.decide()
        self.assertEqual((decision.action, decision.blocked), (Action.RECAPTURE, None))
        entry.phase, entry.fallback_reason = Phase.FALLBACK, "capture failed"
        decision = self.decide()
        self.assertEqual((decision.action, decision.reason), (Action.EAGER, "key fell back: capture failed"))

    def test_calls_without_a_key(self):
        self.wrapper._keyless = keyless_rule(("passes through", lambda: True), self.wrapper.counters)
        decision = self.decide()
        self.assertEqual((decision.action, decision.reason, decision.entry, decision.call),
                         (Action.EAGER, "passes through", None, None))
        body = _StandInBody(dispatch_key_fn=lambda bound: None)
        decision = dispatch(Lifecycle(body, lambda x: x), (self.x,), {})
        self.assertEqual((decision.action, decision.reason), (Action.EAGER, "dispatch_key_fn returned None"))
        self.assertEqual(decision.call.tensors, [self.x])

    def test_no_place_under_max_graphs(self):
        body = _StandInBody(max_graphs=1)
        wrapper = Lifecycle(body, lambda x: x)
        self.assertIsNotNone(dispatch(wrapper, (self.x,), {}).entry)
        decision = dispatch(wrapper, (paddle.ones([5, 3]),), {})
        self.assertEqual((decision.action, decision.reason, decision.entry), (Action.EAGER, "max_graphs reached", None))
        self.assertEqual(len(wrapper.entries()), 1)

    def test_a_key_refused_again_makes_no_entry_and_still_takes_a_place_once_it_may(self):
        """NOTE [ Places under max_graphs ]: a refused key called again while every place is taken is refused
        without an entry made (its call remembered all the same); once it may displace a key, it gets its place."""
        wrapper = Lifecycle(_StandInBody(max_graphs=1), lambda x: x)
        y = paddle.ones([5, 3])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = dispatch(wrapper, (self.x,), {}).entry
            self.assertIsNone(dispatch(wrapper, (y,), {}).entry)  # refused, warned
        self.assertEqual(len([w for w in caught if "max_graphs=1" in str(w.message)]), 1)
        made = []
        real = dispatch_module._new_entry
        with unittest.mock.patch.object(dispatch_module, "_new_entry", lambda *a: made.append(a) or real(*a)):
            dispatch(wrapper, (self.x,), {})  # the held key is called again: y may not displace it
            decision = dispatch(wrapper, (y,), {})
            self.assertEqual((decision.action, decision.reason, decision.entry, made),
                             (Action.EAGER, "max_graphs reached", None, []))
            decision = dispatch(wrapper, (y,), {})  # twice while the held key, in warmup, was not called
            self.assertEqual(len(made), 1)
        self.assertIsNotNone(decision.entry)
        self.assertEqual(list(wrapper._entries), [decision.entry.key])  # the held key (in warmup) was dropped
        self.assertNotIn(held.key, wrapper._entries)

    def test_refused_again_answers_what_admit_would_over_random_books(self):
        """NOTE [ Places under max_graphs ]: ``refused_again`` (one pass over the entries, asked at the front of every
        call of a refused key) refuses exactly where ``admit`` would (no free place, no key to displace) and keeps
        the same books; 500 random sets of entries (phases, graphs with or without a pending backward, last calls)
        and remembered ticks."""
        import collections
        import random
        from paddlefleet.cudagraph.core import budgets

        class _Held:
            def __init__(self, pending):
                self.pending = pending

            def backward_pending(self):
                return self.pending

        class _Entry:
            def __init__(self, key, phase, graphs, last_used):
                self.key, self.phase, self.graphs, self.last_used = key, phase, graphs, last_used

            @property
            def has_graphs(self):
                return self.graphs is not None

            def backward_pending(self):
                return self.graphs is not None and self.graphs.backward_pending()

        draw = random.Random(0)
        answers = collections.Counter()
        for _ in range(500):
            entries = collections.OrderedDict()
            for k in range(draw.randint(0, 4)):
                phase = draw.choice([Phase.WARMUP, Phase.REPLAY, Phase.REPLAY, Phase.FALLBACK, Phase.RECAPTURE])
                graphs = _Held(draw.random() < 0.3) if phase is Phase.REPLAY or draw.random() < 0.2 else None
                entries[k] = _Entry(k, phase, graphs, draw.randint(0, 20))
            max_graphs, tick = draw.randint(1, 3), 30
            ticks = tuple(sorted(draw.sample(range(0, 25), draw.choice([1, 2]))))
            places, expected = budgets.Places(), budgets.Places()
            for other in range(draw.randint(0, 2)):  # other refused keys, remembered before and after
                places._waiting[("other", other)] = expected._waiting[("other", other)] = (other,)
            places._waiting["k"] = expected._waiting["k"] = ticks
            places._waiting[("after",)] = expected._waiting[("after",)] = (3,)
            live = budgets._live(entries)
            refuses = not (len(live) < max_graphs or budgets._displaced(live, ticks) is not None)
            if refuses:
                expected._refused("k", ticks, tick)
            self.assertEqual(places.refused_again(entries, "k", tick, max_graphs), refuses)
            self.assertEqual(list(places._waiting.items()), list(expected._waiting.items()))
            self.assertFalse(places.refused_again(entries, "unknown", tick, max_graphs))
            answers[refuses] += 1
        self.assertGreater(min(answers[True], answers[False]), 50, answers)

    def test_max_graphs_0_runs_every_call_without_a_key(self):
        """No key can ever get a place: the calls take the keyless rule (no key made, no entry), and a call inside
        something else still gets that reason from the dispatcher."""
        wrapper = Lifecycle(_StandInBody(max_graphs=0), lambda x: x)
        for _ in range(2):
            decision = dispatch(wrapper, (self.x,), {})
            self.assertEqual((decision.action, decision.reason, decision.entry, decision.call),
                             (Action.EAGER, NO_PLACES, None, None))
            self.assertEqual(len(wrapper.entries()), 0)
            wrapper.reset()  # the rule comes back with the options
        with whole_step():
            self.assertEqual(dispatch(wrapper, (self.x,), {}).reason, WHOLE_STEP)
        with unittest.mock.patch.dict(os.environ, {ENV_BACKEND: "simulate"}):  # no backend can give a key a place
            self.assertEqual(dispatch(wrapper, (self.x,), {}).reason, NO_PLACES)
        wrapper._options = dataclasses.replace(wrapper.options, max_graphs=2)
        self.assertIsNotNone(dispatch(wrapper, (self.x,), {}).entry)


class RunnerTest(unittest.TestCase):
    """What the runner makes of a decision the dispatcher pinned above."""

    def test_a_call_the_blocker_keeps_from_replaying_is_no_replay_sample(self):
        body = _StandInBody()
        body.run = lambda args, kwargs: "eager"
        wrapper = Lifecycle(body, lambda x: x)
        x = paddle.ones([2, 3])
        entry = dispatch(wrapper, (x,), {}).entry
        entry.phase, entry.graphs = Phase.REPLAY, _Graphs()
        entry.host_cost = HostCost(measure=True, judge=True)
        entry.host_cost.eager_s.append(1e-5)
        entry.host_cost.replay_s.append(1e-5)  # as many eager samples as replays: the next call replays
        body.blocked = Blocked(Blocker.EAGER, "the previous call's backward has not run", "in flight")
        with unittest.mock.patch.object(host_cost, "clock", lambda: 1.0):
            self.assertEqual(wrapper(x), "eager")
        self.assertEqual((entry.host_cost.replay_s, entry.host_cost.eager_s), ([1e-5], [1e-5]))
        self.assertEqual(wrapper.stats()["eager_reasons"], {"the previous call's backward has not run": 1})


class EagerKeyTest(unittest.TestCase):
    """NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py: a key that fell back gets its Decision made
    once, from the key alone; a call whose key differs in anything takes the full path."""

    def setUp(self):
        self.layer = paddle.nn.Linear(3, 3)
        self.body = _StandInBody(warmup_steps=1)
        self.body.layers = lambda: [self.layer]
        self.wrapper = Lifecycle(self.body, lambda x: x)
        self.x = paddle.ones([2, 3])
        self.entry = self.decide().entry
        self.entry.fall_back("capture failed")

    def decide(self, *args, **kwargs):
        return dispatch(self.wrapper, args or (self.x,), kwargs)

    def assert_new_key_warms_up(self, decision):
        self.assertIs(decision.action, Action.WARMUP)
        self.assertIsNot(decision.entry, self.entry)
        self.assertEqual(decision.entry.phase, Phase.WARMUP)

    def test_a_key_that_fell_back_gets_one_decision_made_once_and_its_books_kept(self):
        other = self.decide(paddle.ones([4, 3])).entry  # another key, called last
        first, second = self.decide(), self.decide()
        self.assertIs(first, second)  # made once: no Call, no reason formatted per call
        self.assertEqual((first.action, first.entry, first.call, first.reason, first.warn),
                         (Action.EAGER, self.entry, None, "key fell back: capture failed", ()))
        self.assertEqual((self.entry.last_used, other.last_used, self.wrapper._tick), (4, 2, 4))
        self.assertIs(list(self.wrapper._entries.values())[-1], self.entry)  # moved last, as any call
        self.entry.fall_back("verification found a mismatch")  # another reason: another Decision
        self.assertEqual(self.decide().reason, "key fell back: verification found a mismatch")

    def test_a_call_whose_key_differs_takes_the_full_path(self):
        cases = {
            "shape": lambda: self.decide(paddle.ones([2, 4])),
            "dtype": lambda: self.decide(paddle.ones([2, 3], dtype="float64")),
            "stop_gradient": lambda: self.decide(_requires_grad(paddle.ones([2, 3]))),
            "arguments": lambda: self.decide(self.x, self.x),
        }
        for what, decide in cases.items():
            with self.subTest(what):
                self.assert_new_key_warms_up(decide())

    def test_a_changed_state_takes_the_full_path(self):
        with paddle.no_grad():
            self.assert_new_key_warms_up(self.decide())
        self.layer.eval()
        self.assert_new_key_warms_up(self.decide())
        self.layer.train()
        tracer = paddle.base.framework._dygraph_tracer()
        level, dtype = tracer._amp_level, tracer._amp_dtype
        tracer._amp_level, tracer._amp_dtype = paddle.base.core.AmpLevel.O1, "bfloat16"  # what auto_cast sets
        try:
            self.assert_new_key_warms_up(self.decide())
        finally:
            tracer._amp_level, tracer._amp_dtype = level, dtype
        self.assertEqual(self.decide().reason, "key fell back: capture failed")

    def test_a_tensor_changed_in_place_takes_the_full_path(self):
        self.x.stop_gradient = False
        self.assert_new_key_warms_up(self.decide())
        y = paddle.ones([2, 3])
        self.assertIs(self.decide(y).entry, self.entry)
        y.reshape_([3, 2])
        self.assert_new_key_warms_up(self.decide(y))
        z = paddle.ones([2, 3])
        paddle.assign(paddle.ones([2, 3], dtype="float64"), output=z)  # the same object, another dtype
        self.assert_new_key_warms_up(self.decide(z))

    def test_keyword_arguments_and_dispatch_key_fn_take_the_full_path(self):
        body = _StandInBody(dispatch_key_fn=lambda bound: "one")
        wrapper = Lifecycle(body, lambda x: x)
        dispatch(wrapper, (self.x,), {}).entry.fall_back("capture failed")
        decision = dispatch(wrapper, (self.x,), {})
        self.assertEqual((decision.action, decision.reason), (Action.EAGER, "key fell back: capture failed"))
        self.assertIsNotNone(decision.call)  # the call as dispatch_key_fn canonicalised it
        wrapper = Lifecycle(_StandInBody(), lambda x=None: x)
        dispatch(wrapper, (), {"x": self.x}).entry.fall_back("capture failed")
        self.assertIsNotNone(dispatch(wrapper, (), {"x": self.x}).call)

    def test_after_reset_the_key_warms_up_again(self):
        self.decide()
        self.wrapper.reset()
        self.assertEqual(self.decide().action, Action.WARMUP)

    def test_the_calls_run_eagerly_counted_with_the_reason(self):
        ran = []
        self.body.run = lambda args, kwargs: ran.append((args, kwargs)) or "eager"
        for _ in range(3):
            self.assertEqual(self.wrapper(self.x), "eager")
        self.assertEqual(ran, [((self.x,), {})] * 3)
        self.assertEqual(self.wrapper.stats()["eager_reasons"], {"key fell back: capture failed": 3})
        self.assertIn("capture failed", self.wrapper.explain())


def _requires_grad(t):
    t.stop_gradient = False
    return t


if __name__ == "__main__":
    unittest.main()
