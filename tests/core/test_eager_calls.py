"""Calls of a key that runs eagerly skip the dispatcher while nothing could give them another decision (NOTE
[ Calls of a key that runs eagerly ] in core/dispatch.py): the first call after the key fell back goes through
dispatch() and arms the front path; every later call of that key runs eagerly from the front, counted with the
same reason, bitwise eager's; a call whose key or surroundings differ in anything goes through dispatch() again
and warms up and captures as before."""

import contextlib
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import StaleOutputError, autocudagraph
from paddlefleet.cudagraph.chains import links
from paddlefleet.cudagraph.chains.entry import CHAINS
from paddlefleet.cudagraph.chains.table import TABLE
from paddlefleet.cudagraph.core import dispatch as dispatch_module
from paddlefleet.cudagraph.core import lifecycle
from paddlefleet.cudagraph.core.dispatch import keyless_rule
from paddlefleet.cudagraph.core.pass_through import NO_PLACES
from paddlefleet.cudagraph.errors import CudaGraphError
from paddlefleet.cudagraph.guards import saved_hooks
from paddlefleet.cudagraph.guards.host_marks import mark_host

from testkit.harness import assert_refused_from_front, on_device, refusal_books

REASON = "key fell back: CudaGraphError: refused here"


class AnyDtype(paddle.nn.Linear):
    """A Linear that takes inputs of any float dtype (computed in float32)."""

    def forward(self, x):
        return super().forward(x.astype("float32"))


@contextlib.contextmanager
def failing_capture(wrapper):
    """Captures of ``wrapper`` raise (a refusal of ours: the key falls back) while inside."""
    with mock.patch.object(wrapper._body, "capture", side_effect=CudaGraphError("refused here")), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class EagerCallsTest(unittest.TestCase):
    def setUp(self):
        on_device(self, "cpu")
        paddle.seed(0)
        self.own, layer = AnyDtype(4, 4), AnyDtype(4, 4)
        layer.set_state_dict(self.own.state_dict())
        self.layer = autocudagraph(layer, backend="simulate", warmup_steps=1)
        self.wrapper = self.layer.forward
        self.x = paddle.randn([2, 4])
        with failing_capture(self.wrapper):
            self.layer(self.x), self.layer(self.x)  # warmup, the capture refused: the key falls back
        self.dispatched = 0
        real = lifecycle.dispatch

        def counted(*args, **kwargs):
            self.dispatched += 1
            return real(*args, **kwargs)

        patcher = mock.patch.object(lifecycle, "dispatch", counted)
        patcher.start()
        self.addCleanup(patcher.stop)

    def fallen_back(self):
        return self.wrapper.stats()["eager_reasons"].get(REASON, 0)

    def assert_front(self, calls=3, x=None):
        """``calls`` calls of the key that fell back: one through dispatch() at most, eager's results."""
        x = self.x if x is None else x
        before, counted = self.dispatched, self.fallen_back()
        for _ in range(calls):
            np.testing.assert_array_equal(self.layer(x).numpy(), self.own(x).numpy())
        self.assertLessEqual(self.dispatched - before, 1)
        self.assertEqual(self.fallen_back(), counted + calls)

    def assert_full_path_warms_up_and_captures(self, call):
        """Two calls that go through dispatch(): a new key's warmup, then its capture."""
        stats = self.wrapper.stats()
        before = self.dispatched
        for _ in range(2):
            call()
        self.assertEqual(self.dispatched - before, 2)
        after = self.wrapper.stats()
        self.assertEqual((after["warmup_calls"] - stats["warmup_calls"], after["captures"] - stats["captures"]), (1, 1))

    def test_later_calls_of_the_key_skip_the_dispatcher_with_eager_results_and_counts(self):
        self.layer(self.x)  # through dispatch(): arms the front path
        before = self.dispatched
        for _ in range(5):
            y = self.layer(self.x)
            y.backward(paddle.ones_like(y))
            e = self.own(self.x)
            e.backward(paddle.ones_like(e))
            np.testing.assert_array_equal(y.numpy(), e.numpy())
        self.assertEqual(self.dispatched, before)  # none of the five went through dispatch()
        for p, q in zip(self.layer.parameters(), self.own.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
        self.assertEqual(self.wrapper.stats()["eager_reasons"], {"capture failed": 1, REASON: 6})
        self.assertIn("6 x key fell back", self.wrapper.explain())
        self.assertEqual(self.wrapper.stats()["eager_calls"], 7)

    def test_a_tensor_marked_host_elsewhere_leaves_the_front_path_and_one_passed_here_takes_the_full_path(self):
        kept = mark_host(paddle.ones([1]))  # alive for the whole test, as a test case's attributes can be
        self.assert_front()
        host = mark_host(self.x.clone())  # the same metadata, keyed by value on the simulated backend
        before = self.dispatched
        np.testing.assert_array_equal(self.layer(host).numpy(), self.own(host).numpy())
        self.assertEqual(self.dispatched - before, 1)
        self.assertTrue(kept is not None)

    def test_a_changed_key_goes_through_the_dispatcher_and_warms_up(self):
        self.assert_front()
        cases = {
            "shape": lambda: self.layer(paddle.randn([3, 4])),
            "dtype": lambda: self.layer(paddle.randn([2, 4]).astype("float64")),
            "keyword argument": lambda: self.layer(x=self.x),
        }
        for what, call in cases.items():
            with self.subTest(what), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.wrapper.reset()
                with failing_capture(self.wrapper):
                    self.layer(self.x), self.layer(self.x)
                self.assert_front()
                self.assert_full_path_warms_up_and_captures(call)
                self.assert_front()

    def test_a_changed_state_goes_through_the_dispatcher_and_warms_up(self):
        self.assert_front()
        with paddle.no_grad():
            self.assert_full_path_warms_up_and_captures(lambda: self.layer(self.x))
        self.layer.eval()
        self.assert_full_path_warms_up_and_captures(lambda: self.layer(self.x))
        self.layer.train()
        self.assert_front()
        tracer = paddle.base.framework._dygraph_tracer()
        level, dtype = tracer._amp_level, tracer._amp_dtype
        tracer._amp_level, tracer._amp_dtype = paddle.base.core.AmpLevel.O1, "bfloat16"  # what auto_cast sets
        try:
            self.assert_full_path_warms_up_and_captures(lambda: self.layer(self.x))
        finally:
            tracer._amp_level, tracer._amp_dtype = level, dtype
        self.assert_front()

    def test_an_input_changed_in_place_goes_through_the_dispatcher(self):
        self.assert_front()
        x = self.x.clone()
        self.assert_front(x=x)
        x.stop_gradient = False
        self.assert_full_path_warms_up_and_captures(lambda: self.layer(x))
        y = paddle.randn([4, 2])
        self.assert_front(calls=1, x=y.reshape([2, 4]))
        paddle.assign(paddle.randn([2, 4]).astype("float64"), output=y)  # the same object, another dtype
        y.reshape_([2, 4])
        self.assert_full_path_warms_up_and_captures(lambda: self.layer(y))

    def test_what_surrounds_the_call_still_decides(self):
        self.assert_front()
        with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            before = self.dispatched
            self.layer(self.x)
            self.assertEqual(self.dispatched, before + 1)
        self.assertEqual(self.wrapper.stats()["eager_reasons"][saved_hooks.REASON], 1)
        run = mock.Mock(claim=mock.Mock(return_value=None))  # a chain is open: it may claim the call (it does not)
        TABLE.thread.run = run
        try:
            before = self.dispatched
            self.layer(self.x)
            self.assertEqual(self.dispatched, before + 1)
            run.claim.assert_called_once()
        finally:
            TABLE.thread.run = None
        self.wrapper._keyless = keyless_rule(("every key slower", lambda: True), self.wrapper.counters)
        self.layer(self.x)
        self.assertEqual(self.wrapper.stats()["eager_reasons"]["every key slower"], 1)

    def test_a_stale_output_passed_to_it_still_raises(self):
        self.assert_front()
        double = autocudagraph(lambda t: t * 2.0, backend="simulate", warmup_steps=0, clone_outputs=False,
                               check_stale_outputs=True)
        y1 = double(self.x)
        double(self.x + 1.0)  # y1 is stale now
        with self.assertRaises(StaleOutputError):
            self.layer(y1)

    def test_after_reset_the_key_warms_up_and_captures(self):
        self.assert_front()
        self.wrapper.reset()
        self.assert_full_path_warms_up_and_captures(lambda: self.layer(self.x))


class RekeyedTest(unittest.TestCase):
    def test_a_key_extended_by_another_keys_capture_still_takes_the_front_path_and_its_flags_count(self):
        paddle.seed(0)
        inner = paddle.nn.Linear(4, 4)
        f = autocudagraph(lambda t: inner(t), backend="simulate", warmup_steps=1)
        x, other = paddle.randn([2, 4]), paddle.randn([3, 4])
        with failing_capture(f):
            f(x), f(x)  # this key falls back before any capture found the Layer
        f(x)  # arms the front path
        f(other), f(other)  # another key's capture finds the Layer: every key gets its training flag
        self.assertEqual([len(k.state.training) for k in f._entries], [1, 1])
        with mock.patch.object(dispatch_module.KnownEager, "take", autospec=True,
                               side_effect=dispatch_module.KnownEager.take) as take:
            f(x)
            inner.eval()
            f(x)  # the Layer's flag differs: a new key
        self.assertEqual([c.args[0].entry.key.state.training for c in take.call_args_list], [(True,), (True,)])
        self.assertEqual(f.stats()["eager_reasons"][REASON], 2)
        self.assertEqual(f.stats()["warmup_calls"], 1 + 1 + 1)

    def test_the_chain_hooks_are_idle_only_while_no_chain_is_open(self):
        self.assertTrue(CHAINS.idle())
        saved = links.current_run()
        links.set_run(object())
        try:
            self.assertFalse(CHAINS.idle())
        finally:
            links.set_run(saved)


class RefusedUnderMaxGraphsTest(unittest.TestCase):
    """A new key that finds every place under max_graphs taken names its arguments and makes its label only where
    they are read: for the max_graphs warning while it is still to give, or once the key gets a place."""

    def test_a_refused_key_makes_no_label_once_warned_and_its_label_when_it_gets_a_place(self):
        from paddlefleet.cudagraph.core.keys import KeyMaker

        f = autocudagraph(lambda t: t * 2.0, backend="simulate", warmup_steps=1, max_graphs=1)
        a, b = paddle.ones([2, 3]), paddle.ones([3, 3])
        f(a), f(a)  # warmup, capture
        with self.assertWarnsRegex(RuntimeWarning, r"key \(t: float32\[3, 3\]\) runs eagerly"):
            f(b)  # refused: the warning names it
        with mock.patch.object(KeyMaker, "label", autospec=True, side_effect=KeyMaker.label) as label, \
                mock.patch.object(KeyMaker, "named_arguments", autospec=True,
                                  side_effect=KeyMaker.named_arguments) as named:
            for _ in range(3):
                f(a), f(b)  # a replays between: b stays refused
            self.assertEqual((label.call_count, named.call_count), (0, 0))
            f(b), f(b)  # called twice more with no call of a since: b takes a's place
            self.assertEqual(label.call_count, 1)
        self.assertEqual(f.stats()["eager_reasons"], {"max_graphs reached": 5})
        self.assertEqual([row["label"] for row in f.report()][-1], "(t: float32[3, 3])")

    def test_a_key_refused_again_is_refused_from_the_front_with_the_books_dispatch_keeps(self):
        """NOTE [ Calls of a key that runs eagerly ]: KnownRefused decides what dispatch() decides, call by call, and
        keeps the same books (the places' remembered calls, the wrapper's tick, the entries, the counts)."""

        def run(front):
            f = autocudagraph(lambda t: t * 2.0, backend="simulate", warmup_steps=1, max_graphs=1)
            a, b, c = paddle.ones([2, 3]), paddle.ones([3, 3]), paddle.ones([4, 3])
            patches = [] if front else [mock.patch.object(dispatch_module.KnownRefused, "take", lambda *args: False)]
            return refusal_books(f, lambda t: np.testing.assert_array_equal(f(t).numpy(), (t * 2.0).numpy()), a, b, c,
                                 patches)

        front, dispatched = run(True)
        full, every = run(False)
        assert_refused_from_front(self, front, full, every, dispatched)

    def test_arguments_that_are_not_all_tensors_are_still_checked(self):
        class Cache:
            def update(self):
                pass

            def get_seq_length(self):
                return 0

        f = autocudagraph(lambda t, cache=None: t * 2.0, backend="simulate")
        with self.assertWarnsRegex(RuntimeWarning, "argument 'cache' is a Cache"):
            f(paddle.ones([2, 2]), Cache())
        g = autocudagraph(lambda t, cache=Cache(): t * 2.0, backend="simulate")  # a default refused too
        with self.assertWarnsRegex(RuntimeWarning, "argument 'cache' is a Cache"):
            g(paddle.ones([2, 2]))



class MaxGraphsZeroTest(unittest.TestCase):
    """max_graphs=0: no key may hold graphs, so every call runs the function directly, without a key (NOTE
    [ Pass-through wrappers ] in core/pass_through.py), bitwise eager's, counted with that reason."""

    def test_a_layer_trains_as_eagerly_and_makes_no_key(self):
        on_device(self, "cpu")
        paddle.seed(0)
        own, layer = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
        layer.set_state_dict(own.state_dict())
        autocudagraph(layer, backend="simulate", max_graphs=0)
        with mock.patch.object(layer.forward._keys, "key", side_effect=AssertionError("a key was made")):
            for shape in ([2, 4], [2, 4], [3, 4]):
                x = paddle.randn(shape)
                got, want = layer(x), own(x)
                got.sum().backward(), want.sum().backward()
                np.testing.assert_array_equal(got.numpy(), want.numpy())
                for p, q in zip(layer.parameters(), own.parameters()):
                    np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
        stats = layer.forward.stats()
        self.assertEqual((stats["eager_reasons"], stats["keys"]), ({NO_PLACES: 3}, 0))
        self.assertIn(NO_PLACES, layer.forward.explain())

    def test_a_whole_step_with_max_graphs_0_runs_eagerly_every_time(self):
        from paddlefleet.cudagraph import autocudagraph_step

        on_device(self, "cpu")
        paddle.seed(0)
        model, twin = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
        twin.set_state_dict(model.state_dict())

        def step_of(m):
            def step(x):
                loss = m(x).sum()
                loss.backward()
                return loss
            return step

        graphed = autocudagraph_step(step_of(model), optimizers=[], backend="simulate", max_graphs=0)
        eager = step_of(twin)
        for _ in range(3):  # grads accumulate over the calls, as eagerly
            x = paddle.randn([2, 4])
            np.testing.assert_array_equal(graphed(x).numpy(), eager(x).numpy())
        self.assertEqual(graphed.stats()["eager_reasons"], {NO_PLACES: 3})
        for p, q in zip(model.parameters(), twin.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())

if __name__ == "__main__":
    unittest.main()
