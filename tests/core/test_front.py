"""The front door of a Layer graphed in place (NOTE [ The front door ] in core/front.py): where the compiled module is
loaded the Layer's forward is a Front that runs a keyless rule's calls itself, in C, as the wrapper's own
pass-through runs them (same result, same counts, same errors), sends every other call and every attribute to the
wrapper, and survives copies and pickles; without the module the Layer holds the wrapper itself."""

import contextlib
import copy
import dataclasses
import inspect
import os
import pickle
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, native
from paddlefleet.cudagraph.block.graphed import GraphedCallable
from paddlefleet.cudagraph.core.dispatch import MAX_GRAPHS, KnownRefused
from paddlefleet.cudagraph.core.front import behind, is_front
from paddlefleet.cudagraph.core.host_cost import ALL_SLOWER, HostCost
from paddlefleet.cudagraph.backends import thread_nesting
from paddlefleet.cudagraph.core.pass_through import NO_PLACES, _unnested, _untouched, condition_gate
from paddlefleet.cudagraph.io.stale_outputs import stale_registry
from paddlefleet.cudagraph.options import ENV_BACKEND
from paddlefleet.cudagraph.grads.accumulate import CALLS
from paddlefleet.cudagraph.guards.host_marks import mark_host, marks

from testkit.common import MatLayer, build, host_tensor
from testkit.harness import (BackendCase, MatmulOnlyCase, assert_refused_from_front, for_each_backend,
                             refusal_books)


def loaded():
    native.load()
    active, why = native.status()
    if not active:
        raise unittest.SkipTest(f"compiled module unavailable here: {why}")


class Scaled(paddle.nn.Layer):
    """A Layer whose forward takes a keyword and can raise."""

    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(4, 4)

    def forward(self, x, scale=1.0, fail=False):
        """Scaled's own forward."""
        if fail:
            raise ValueError("the Layer's own error")
        return self.lin(x) * scale


def all_slower(layer, x):
    """``layer`` graphed (simulate), its one key judged slower than eager: every later call passes through."""
    graphed = autocudagraph(layer, backend="simulate", warmup_steps=1, eager_if_slower=True)
    wrapper = behind(graphed.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # warmup, capture
            graphed(x)
        [entry] = wrapper._entries.values()
        entry.host_cost = cost = HostCost(measure=True, judge=True)
        cost.eager_s, cost.replay_s, cost.verdict = [1e-5] * 8, [2e-5] * 9, "eager"
        wrapper._acted(entry)
    assert wrapper._keyless is not None and wrapper._keyless[0] == ALL_SLOWER, wrapper._keyless
    return graphed, wrapper


def fell_back_beside(layer, x):
    """``layer`` graphed (simulate) with a key of another batch captured and replayed, and the key of ``x`` fallen
    back (its capture refused) and armed as the key known to run eagerly: (the Layer, its wrapper, the other batch)."""
    from paddlefleet.cudagraph.errors import CudaGraphError

    graphed = autocudagraph(layer, backend="simulate", warmup_steps=1)
    wrapper = behind(graphed.forward)
    other = paddle.randn([3, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            graphed(other)  # a key captured and replayed
        capture = wrapper._body.capture
        wrapper._body.capture = lambda *a, **k: (_ for _ in ()).throw(CudaGraphError("refused here"))
        for _ in range(3):  # warmup, the refused capture (the key falls back), a call that arms the front path
            graphed(x)
        wrapper._body.capture = capture
    return graphed, wrapper, other


class FrontDoorTest(BackendCase):
    backend = "simulate"  # its calls run on the CPU; the front is the same on every backend
    def setUp(self):
        super().setUp()
        loaded()
        paddle.seed(0)
        self.x = paddle.randn([2, 4])

    def test_a_layer_graphed_in_place_holds_a_front_that_answers_as_its_wrapper(self):
        layer = autocudagraph(Scaled(), backend="simulate")
        self.assertTrue(is_front(layer.forward))
        wrapper = behind(layer.forward)
        self.assertIsInstance(wrapper, GraphedCallable)
        self.assertEqual(inspect.signature(layer.forward), inspect.signature(wrapper))
        self.assertEqual(list(inspect.signature(layer.forward).parameters), ["x", "scale", "fail"])
        self.assertEqual(layer.forward.__doc__, "Scaled's own forward.")
        self.assertEqual(repr(layer.forward), repr(wrapper))
        self.assertIs(layer.forward._body, wrapper._body)
        self.assertIs(layer.forward.__wrapped__, wrapper.__wrapped__)
        self.assertIs(layer.stats.__self__, wrapper)
        layer.forward.probe_attribute = 5  # set and deleted on the wrapper
        self.assertEqual(wrapper.probe_attribute, 5)
        del layer.forward.probe_attribute
        self.assertFalse(hasattr(wrapper, "probe_attribute"))
        for _ in range(4):
            layer(self.x, scale=2.0)
        self.assertEqual(layer.forward.stats(), wrapper.stats())
        self.assertEqual(layer.forward.stats()["replays"], 2)
        with self.assertRaises(TypeError):  # Layers hold one wrapper: the check sees through the front
            autocudagraph(layer)

    def test_calls_a_keyless_rule_passes_through_run_in_c_as_the_wrapper_runs_them(self):
        paddle.seed(1)
        own = Scaled()
        twin = Scaled()
        twin.set_state_dict(own.state_dict())
        graphed, wrapper = all_slower(twin, self.x)
        wrapper._run_eager = None  # the front does not use the wrapper's eager runner (a call through it fails)
        before = (wrapper.stats()["eager_calls"], wrapper.counters.eager_reasons[ALL_SLOWER], CALLS[0])
        for scale in (1.0, 3.0):
            self.assertBitwise(graphed(self.x, scale=scale), own(self.x, scale=scale))
            self.assertBitwise(graphed(self.x, scale), own(self.x, scale))
        after = (wrapper.stats()["eager_calls"], wrapper.counters.eager_reasons[ALL_SLOWER], CALLS[0])
        self.assertEqual([a - b for a, b in zip(after, before)], [4, 4, 4])
        with self.assertRaisesRegex(ValueError, "the Layer's own error"):
            graphed(self.x, fail=True)
        self.assertEqual(wrapper.counters.eager_reasons[ALL_SLOWER], before[1] + 5)  # counted before it ran

    def test_calls_of_a_key_known_to_run_eagerly_run_in_c_with_the_wrappers_books(self):
        paddle.seed(2)
        own, twin = Scaled(), Scaled()
        twin.set_state_dict(own.state_dict())
        graphed, wrapper, other = fell_back_beside(twin, self.x)
        known = wrapper._known_eager
        self.assertIsNotNone(known)
        wrapper._run_eager = None  # the front runs the call itself once take() says so
        reason = known.reason
        before = (wrapper.counters.eager_reasons[reason], wrapper._tick, CALLS[0], known.entry.last_used)
        # read in C (no tensor marked host by an earlier test counts here: the front would ask take())
        with mock.patch.dict(marks(), clear=True), \
                mock.patch.object(type(known), "take", side_effect=AssertionError("take() asked")):
            for _ in range(3):
                self.assertBitwise(graphed(self.x), own(self.x))
        after = (wrapper.counters.eager_reasons[reason], wrapper._tick, CALLS[0], known.entry.last_used)
        self.assertEqual([a - b for a, b in zip(after, before)], [3, 3, 3, 3])
        self.assertEqual(known.entry.last_used, wrapper._tick)
        wrapper._run_eager = wrapper._body.eager_runner()
        with mock.patch.dict(marks(), clear=True), \
                mock.patch.object(type(known), "take", side_effect=AssertionError("take() asked")):
            for _ in range(2):  # calls of the graphed key between: the C take moves the entries' order back
                self.assertBitwise(graphed(other), own(other))
                self.assertIsNot(wrapper._latest, known.entry)
                self.assertBitwise(graphed(self.x), own(self.x))
                self.assertIs(wrapper._latest, known.entry)
                self.assertIs(list(wrapper._entries.values())[-1], known.entry)
                self.assertEqual(known.entry.last_used, wrapper._tick)
        wrapper._run_eager = None
        marked = mark_host(paddle.zeros([1]))  # a tensor marked host alive: the front asks take() itself
        with mock.patch.object(type(known), "take", autospec=True, side_effect=type(known).take) as asked:
            self.assertBitwise(graphed(self.x), own(self.x))
        self.assertEqual(asked.call_count, 1)  # the front asked take(), which read the marks and took the call
        del marked
        wrapper._run_eager = wrapper._body.eager_runner()
        self.assertBitwise(graphed(self.x, scale=2.0), own(self.x, scale=2.0))  # a keyword: the wrapper decides
        replays = wrapper.stats()["replays"]
        self.assertBitwise(graphed(other), own(other))  # the graphed key: replayed
        self.assertEqual(wrapper.stats()["replays"], replays + 1)

    def test_calls_of_a_key_refused_under_max_graphs_are_refused_in_c_with_the_books_dispatch_keeps(self):
        """KnownRefused's take read from its gate decides, call by call, what dispatch() decides, and keeps the same
        books (the places' remembered calls, the wrapper's tick, the entries, the counts) as the full path."""
        from paddlefleet.cudagraph.core import dispatch as dispatch_module

        a, b, c = paddle.randn([2, 4]), paddle.randn([3, 4]), paddle.randn([4, 4])

        def run(in_c):
            paddle.seed(5)
            own, twin = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
            twin.set_state_dict(own.state_dict())
            graphed = autocudagraph(twin, backend="simulate", warmup_steps=1, max_graphs=1)
            patches = [mock.patch.dict(marks(), clear=True)]  # no tensor marked host by another test
            if in_c:  # the gate answers: take() is never asked
                patches.append(mock.patch.object(
                    dispatch_module.KnownRefused, "take", side_effect=AssertionError("take() asked")))
            else:  # no gate, and take() says no: every call goes through dispatch()
                patches += [mock.patch.object(dispatch_module, "refused_gate", lambda *args: None),
                            mock.patch.object(dispatch_module.KnownRefused, "take", lambda *args: False)]
            return refusal_books(behind(graphed.forward), lambda t: self.assertBitwise(graphed(t), own(t)), a, b, c,
                                 patches)

        in_c, dispatched = run(True)
        full, every = run(False)
        assert_refused_from_front(self, in_c, full, every, dispatched)

    def test_a_call_the_front_asked_about_goes_straight_to_dispatch(self):
        """A call that the front's known key does not take (a graphed key's call beside it), or whose keyless rule
        does not hold, is not asked about again by the wrapper: dispatch() decides it at once."""
        graphed, wrapper, other = fell_back_beside(Scaled(), self.x)
        known = wrapper._known_eager
        replays = wrapper.stats()["replays"]
        with mock.patch.dict(marks(), clear=True), \
                mock.patch.object(type(known), "take", side_effect=AssertionError("take() asked")):
            for _ in range(3):
                graphed(other)  # the gate says no in C; the wrapper does not ask take() again
        self.assertEqual(wrapper.stats()["replays"], replays + 3)
        with mock.patch.object(type(known), "take", autospec=True, return_value=False) as asked:
            wrapper._known_eager = known  # (a patched class attribute: the front and the wrapper see the same)
            known.gate = None  # the gate cannot tell: the front asks take() once, and only the front
            graphed(other)
        self.assertEqual(asked.call_count, 1)
        self.assertEqual(wrapper.stats()["replays"], replays + 4)
        rule = autocudagraph(paddle.nn.Linear(4, 4), max_graphs=0)
        wrapper = behind(rule.forward)
        keyless = wrapper._keyless
        asked = []
        wrapper._keyless = (keyless[0], lambda: asked.append(1) or keyless[1](), keyless[2], keyless[3])
        with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rule(self.x)  # the rule's condition fails: asked by the front, then by dispatch() (which reads it too)
            self.assertEqual(len(asked), 2)
            wrapper(self.x)  # the wrapper's own __call__ asks as the front does
            self.assertEqual(len(asked), 4)

    def test_a_call_whose_rule_does_not_hold_goes_to_the_wrapper(self):
        graphed = autocudagraph(paddle.nn.Linear(4, 4), max_graphs=0)
        wrapper = behind(graphed.forward)
        self.assertIsNotNone(wrapper._keyless[1])  # max_graphs=0: a rule with a condition
        graphed(self.x)
        self.assertEqual(dict(wrapper.counters.eager_reasons), {NO_PLACES: 1})
        with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graphed(self.x)  # the rule's condition fails: the dispatcher gives its own reason
        reasons = dict(wrapper.counters.eager_reasons)
        self.assertEqual(reasons.pop(NO_PLACES), 1)
        self.assertEqual(len(reasons), 1, reasons)
        self.assertIn("saved", next(iter(reasons)).lower())

    def test_a_wrapper_without_eager_parts_runs_its_own_pass_through(self):
        graphed, wrapper = all_slower(Scaled(), self.x)
        ran = []
        runner = wrapper._run_eager
        wrapper._run_eager = lambda args, kwargs: ran.append(1) or runner(args, kwargs)
        wrapper._eager_parts = None  # a body that lays none out (Body.eager_parts): the wrapper's __call__ runs it
        graphed(self.x)
        self.assertEqual(ran, [1])
        self.assertEqual(wrapper.counters.eager_reasons[ALL_SLOWER], 1)

    def test_copies_and_pickles_hold_a_front_of_their_own_wrapper(self):
        layer = autocudagraph(Scaled(), backend="simulate")
        layer(self.x)
        twin = copy.deepcopy(layer)
        self.assertTrue(is_front(twin.forward))
        self.assertIsNot(behind(twin.forward), behind(layer.forward))
        self.assertIs(behind(twin.forward).body().owner(), twin)
        self.assertIs(twin.stats.__self__, behind(twin.forward))
        self.assertBitwise(twin(self.x), layer(self.x))
        gain = autocudagraph(Gain(), backend="simulate")
        loaded_ = pickle.loads(pickle.dumps(gain))
        self.assertTrue(is_front(loaded_.forward))
        self.assertIs(behind(loaded_.forward).body().owner(), loaded_)
        self.assertIs(loaded_.stats.__self__, behind(loaded_.forward))

    def test_without_the_module_the_layer_holds_its_wrapper(self):
        with native.disabled():
            layer = autocudagraph(paddle.nn.Linear(4, 4))
        self.assertIsInstance(layer.forward, GraphedCallable)
        self.assertFalse(is_front(layer.forward))
        self.assertIs(behind(layer.forward), layer.forward)


class KeylessConditionTest(unittest.TestCase):
    """A keyless rule's condition (core/pass_through.py) read in C from its gate answers as ``when()`` answers, or
    leaves it to ``when()``; the front door asks no Python condition where the gate can tell."""

    def setUp(self):
        loaded()
        self.reads = native.reads

    def states(self):
        """``[(label, context)]``: every state a condition reads, each set for the duration of its context."""
        nesting = thread_nesting()

        @contextlib.contextmanager
        def nested():
            nesting.nested += 1
            try:
                yield
            finally:
                nesting.nested -= 1

        @contextlib.contextmanager
        def stale():
            registry = stale_registry()
            registry[-1] = None
            try:
                yield
            finally:
                del registry[-1]

        return [("plain", contextlib.nullcontext), ("nested", nested),
                ("saved-tensors hooks", lambda: paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t)),
                ("a stale output", stale), ("the backend named", lambda: mock.patch.dict(os.environ, {ENV_BACKEND: "simulate"})),
                ("the backend named empty", lambda: mock.patch.dict(os.environ, {ENV_BACKEND: ""})),
                ("os.environ replaced", lambda: mock.patch.object(os, "environ", dict(os.environ)))]

    def test_each_condition_in_each_state(self):
        for when in (_untouched, _unnested):
            gate = condition_gate(when)
            self.assertIsNotNone(gate)
            for label, context in self.states():
                with self.subTest(when=when.__name__, state=label), mock.patch.dict(os.environ), context():
                    got, want = self.reads.keyless_holds(gate), bool(when())
                    if label == "os.environ replaced" and when is _untouched:
                        self.assertIsNone(got)  # another mapping: when() reads it
                    else:
                        self.assertIs(got, want)
        self.assertIsNone(condition_gate(lambda: True))
        self.assertIsNone(self.reads.keyless_holds(("not", "a", "gate")))

    def test_the_front_door_asks_no_python_condition_where_the_gate_tells(self):
        rule = autocudagraph(paddle.nn.Linear(4, 4), max_graphs=0)
        wrapper = behind(rule.forward)
        reason, when, decision, tally, gate = wrapper._keyless
        asked = []
        wrapper._keyless = (reason, lambda: asked.append(1) or when(), decision, tally, gate)
        x = paddle.randn([2, 4])
        for _ in range(3):
            rule(x)
        self.assertEqual((asked, dict(wrapper.counters.eager_reasons)), ([], {NO_PLACES: 3}))
        wrapper._keyless = (reason, lambda: asked.append(1) or when(), decision, tally, None)
        rule(x)  # no gate: the front asks when()
        self.assertEqual((len(asked), dict(wrapper.counters.eager_reasons)), (1, {NO_PLACES: 4}))
        with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapper._keyless = (reason, when, decision, tally, gate)
            rule(x)  # the gate says no: the dispatcher gives its own reason
        reasons = dict(wrapper.counters.eager_reasons)
        self.assertEqual(reasons.pop(NO_PLACES), 4)
        self.assertIn("saved", next(iter(reasons)).lower())


@for_each_backend
class FrontOnDeviceTest(MatmulOnlyCase):
    """On the device too: a matmul Layer's calls that eager_if_slower sent eager, and those of a key that fell back
    beside a graphed key, run through the front bit for bit as the Layer's own calls (grads included)."""

    def setUp(self):
        super().setUp()
        loaded()

    def twins(self):
        own = build(lambda: MatLayer(8, 8), seed=3)
        twin = build(lambda: MatLayer(8, 8), seed=3)
        return own, twin

    def step(self, layer, x, dy):
        y = layer(x)
        y.backward(dy)
        out = [y.numpy(), layer.w.grad.numpy()]
        layer.w.clear_gradient(False)
        return out

    def test_calls_passed_through_and_of_a_key_known_eager(self):
        from paddlefleet.cudagraph.errors import CudaGraphError

        own, twin = self.twins()
        graphed = self.graphed(twin, warmup_steps=1, eager_if_slower=False)
        wrapper = behind(graphed.forward)
        self.assertTrue(is_front(graphed.forward))
        x, other, dy, dyo = (self.tensor(n, 8) for n in (4, 3, 4, 3))
        x.stop_gradient = other.stop_gradient = True
        for _ in range(3):  # the other key captured and replayed
            self.assertBitwise(self.step(graphed, other, dyo), self.step(own, other, dyo))
        wrapper._body.capture = lambda *a, **k: (_ for _ in ()).throw(CudaGraphError("refused here"))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(3):  # warmup, the refused capture, a call arming the front path
                    self.assertBitwise(self.step(graphed, x, dy), self.step(own, x, dy))
        finally:
            del wrapper._body.capture
        self.assertIsNotNone(wrapper._known_eager)
        wrapper._run_eager = None  # the front runs these calls itself
        for _ in range(3):
            self.assertBitwise(self.step(graphed, x, dy), self.step(own, x, dy))
        wrapper._run_eager = wrapper._body.eager_runner()
        replays = wrapper.stats()["replays"]
        self.assertBitwise(self.step(graphed, other, dyo), self.step(own, other, dyo))
        self.assertEqual(wrapper.stats()["replays"], replays + 1)
        for entry in wrapper._entries.values():  # both keys judged slower: every call passes through
            entry.host_cost = cost = HostCost(measure=True, judge=True)
            cost.eager_s, cost.replay_s, cost.verdict = [1e-5] * 8, [2e-5] * 9, "eager"
        wrapper._options = dataclasses.replace(wrapper.options, eager_if_slower=True)
        for entry in list(wrapper._entries.values()):
            if entry.has_graphs:
                wrapper._acted(entry)
        self.assertEqual(wrapper._keyless[0], ALL_SLOWER)
        wrapper._run_eager = None
        for t, g in ((x, dy), (other, dyo)):
            self.assertBitwise(self.step(graphed, t, g), self.step(own, t, g))
        self.assertEqual(wrapper.counters.eager_reasons[ALL_SLOWER], 2)

    def test_calls_of_a_key_refused_under_max_graphs(self):
        own, twin = self.twins()
        graphed = self.graphed(twin, warmup_steps=1, eager_if_slower=False, max_graphs=1)
        wrapper = behind(graphed.forward)
        x, other, dy, dyo = (self.tensor(n, 8) for n in (4, 3, 4, 3))
        x.stop_gradient = other.stop_gradient = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t, g in [(other, dyo)] * 3 + [(x, dy), (other, dyo)] * 5:  # x refused while the other key replays
                self.assertBitwise(self.step(graphed, t, g), self.step(own, t, g))
        self.assertIsInstance(wrapper._known_eager, KnownRefused)
        stats = wrapper.stats()
        self.assertEqual((stats["captures"], stats["eager_reasons"]), (1, {MAX_GRAPHS: 5}))
        self.assertEqual(stats["replays"], 6)  # the other key's 8 calls but its warmup and its capture

    def tensor(self, rows, cols):
        return host_tensor(np.random.RandomState(rows).randn(rows, cols).astype("float32"))


class Gain(paddle.nn.Layer):
    """A Layer without parameters (picklable on every Paddle)."""

    def forward(self, x):
        return x * 3.0


if __name__ == "__main__":
    unittest.main()
