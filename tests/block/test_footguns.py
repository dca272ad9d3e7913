"""One test per surprising behaviour in docs/guides/limitations.md, named after it: each shows what the
doc promises (and fails when the behaviour changes, so the doc gets updated with it).
"""

import os
import subprocess
import sys
import textwrap
import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import CudaGraphError, InputMismatchError, StaleOutputError, autocudagraph
from paddlefleet.cudagraph.io.host_tensors import MAX_HOST_KEY_ELEMENTS, mark_host

from testkit.harness import (
    add_tracker_state,
    assert_bitwise,
    BackendCase,
    clone_leaf,
    for_each_backend,
    grads_of,
    on_device,
    twin_layers,
)
from tests.core.test_patterns import hierarchy

THIS_FILE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))


def data(*shape, seed=0, grad=False):
    t = paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype("float32"))
    t.stop_gradient = not grad
    return t


def double(x):
    return x * 2.0


def mm(x, w):
    return paddle.matmul(x, w)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 4)
        self.drop = paddle.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


@for_each_backend
class FootgunTest(BackendCase):
    def setUp(self):
        super().setUp()
        ctx = warnings.catch_warnings(record=True)
        self.warned = ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("always")

    def host(self, value, dtype=None):
        t = paddle.to_tensor(value, dtype=dtype, place=paddle.CPUPlace())
        return t if self.backend == "cuda" else mark_host(t)

    def our_warnings(self):
        return [str(w.message) for w in self.warned if "autocudagraph" in str(w.message)]

    # ------------------------------------------------------------------ keys and shapes
    def test_each_new_shape_is_a_new_key_up_to_max_graphs(self):
        f = self.graphed(double, warmup_steps=1, max_graphs=2)
        for rows in (2, 3, 4):
            for _ in range(3):
                x = data(rows, 3)
                self.assertBitwise(f(x), double(x))
        stats = f.stats()
        # Rows 4 runs eagerly twice, then takes the place of rows 2 (not called while rows 4 was called
        # three times): its third call is its warmup; rows 2 keeps its counts, without graphs.
        self.assertEqual((stats["keys"], stats["graphs"], stats["captures"], stats["replays"]), (3, 1, 2, 2))
        self.assertEqual((stats["eager_reasons"], stats["evictions"]), ({"max_graphs reached": 2}, 1))
        full = [m for m in self.our_warnings() if "max_graphs=2" in m]
        self.assertEqual(len(full), 1)
        self.assertIn("The keys differ in argument 'x' (float32[2, 3], float32[3, 3], float32[4, 3])", full[0])

    def test_dispatch_key_fn_must_separate_shapes(self):
        f = self.graphed(double, warmup_steps=0, dispatch_key_fn=lambda bound: "one key")
        f(data(2, 3))
        with self.assertRaisesRegex(InputMismatchError, r"input 'x' was captured with shape \[2, 3\].*got shape \[4, 3\]"):
            f(data(4, 3))

    def test_train_and_eval_are_separate_keys(self):
        layer = self.graphed(Net(), warmup_steps=0)
        x = data(2, 4)
        layer(x)
        layer.eval()
        with layer.forward.counters.expect(captures=1):
            layer(x)
        layer.train()
        with layer.forward.counters.expect(captures=0, replays=1):
            layer(x)

    # ------------------------------------------------------------------ what cannot be captured
    def test_host_sync_in_the_function_runs_that_key_eagerly(self):
        def normalise(x):
            return x / float(x.abs().max())  # a host read

        f = self.graphed(normalise, warmup_steps=0)
        for i in range(3):
            x = data(2, 3, seed=i)
            self.assertBitwise(f(x), normalise(x))
        (message,) = self.our_warnings()
        self.assertIn("failed: CaptureError", message)
        self.assertIn("The key runs eagerly from now on", message)
        self.assertIn(f"{THIS_FILE}:", message)
        self.assertEqual(f.stats()["captures"], 0)

    def test_a_failed_key_never_retries_until_reset(self):
        state = {"sync": True}

        def block(x):
            if state["sync"]:
                x = x * float(x.sum())  # a host read, only while state['sync'] is set
            return x * 2.0

        f = self.graphed(block, warmup_steps=0)
        f(data(2, 2))
        state["sync"] = False
        with f.counters.expect(captures=0, eager_calls=2):
            f(data(2, 2))
            f(data(2, 2))
        f.reset()
        with f.counters.expect(captures=1, replays=1):
            f(data(2, 2))
            f(data(2, 2))

    def test_function_writing_its_input_runs_eagerly(self):
        def bump(x):
            with paddle.no_grad():
                x.add_(paddle.ones_like(x))
            return x * 2.0

        f = self.graphed(bump, warmup_steps=0)
        xs, xe = [paddle.zeros([2]) for _ in range(3)], [paddle.zeros([2]) for _ in range(3)]
        self.assertBitwise([f(x) for x in xs], [bump(x) for x in xe])
        self.assertBitwise(xs, xe, "the caller's tensors are written exactly once, as in eager")
        (message,) = self.our_warnings()
        self.assertIn("writes its input(s) 'x' in place", message)

    def check_versionless_write(self, write):
        """``write(x, value)`` (a write that leaves the inplace version alone) into the argument: the
        capture refuses it, and the caller's tensors are written exactly once, as eagerly."""
        def block(x):
            with paddle.no_grad():
                write(x, paddle.full_like(x, 3.0))
            return x * 2.0

        f = self.graphed(block, warmup_steps=0)
        xs, xe = [paddle.zeros([2, 2]) for _ in range(3)], [paddle.zeros([2, 2]) for _ in range(3)]
        self.assertBitwise([f(x) for x in xs], [block(x) for x in xe])
        self.assertBitwise(xs, xe, "the caller's tensors are written, as in eager")
        (message,) = self.our_warnings()
        self.assertIn("writes its input(s) 'x' in place", message)

    def test_function_copying_into_its_input_runs_eagerly(self):
        self.check_versionless_write(lambda x, v: x.copy_(v, False))

    def test_function_setting_its_input_value_runs_eagerly(self):
        self.check_versionless_write(lambda x, v: x.set_value(v))

    def test_function_copying_into_a_view_of_its_input_runs_eagerly(self):
        self.check_versionless_write(lambda x, v: x.reshape([4]).copy_(v.reshape([4]), False))

    def test_closure_tensor_requiring_grad_runs_eagerly(self):
        w = data(3, 3, grad=True)

        def block(x):
            return paddle.matmul(x, w)

        f = self.graphed(block, warmup_steps=0)
        x = data(2, 3, grad=True)
        f(x).sum().backward()
        self.assertIsNotNone(w.grad)
        (message,) = self.our_warnings()
        self.assertIn("neither arguments nor parameters of a Layer it calls or is bound to: w", message)

    def test_a_parameter_passed_as_an_argument_and_read_through_its_layer_is_captured(self):
        """f(x, lin.weight) that also calls lin: the parameter is read through its Layer and, as the argument,
        through its buffer. Both reads get their grad through the bridge (the argument's and the parameter's),
        which autograd adds as eager adds its two; every output and grad bitwise, and the key replays."""
        lin_g, lin_e = twin_layers(lambda: paddle.nn.Linear(4, 4))

        def make(lin):
            def f(x, w):
                return paddle.matmul(lin(x), w)

            return f

        graphed, eager = self.graphed(make(lin_g), warmup_steps=1), make(lin_e)
        for k in range(4):
            x, dy = data(2, 4, seed=k), data(2, 4, seed=10 + k)
            y, y_e = graphed(x, lin_g.weight), eager(x, lin_e.weight)
            self.assertBitwise(y, y_e, f"call {k}")
            y.backward(dy)
            y_e.backward(dy)
            self.assertBitwise(grads_of(lin_g), grads_of(lin_e), f"call {k} grads")
            for p in lin_g.parameters() + lin_e.parameters():
                p.clear_gradient(False)
        self.assertCounters(graphed, captures=1, replays=2, eager=0)
        self.assertEqual(self.our_warnings(), [])

    def test_graphed_call_inside_another_capture_runs_eagerly(self):
        inner = self.graphed(double, warmup_steps=0)
        outer = self.graphed(lambda x: inner(x) + 1.0, warmup_steps=0)
        x = data(2, 2)
        for _ in range(3):
            self.assertBitwise(outer(x), double(x) + 1.0)
        self.assertEqual(outer.stats()["captures"], 1)
        self.assertEqual(inner.stats()["captures"], 0)
        self.assertIn("called inside another capture", inner.stats()["eager_reasons"])

    def test_graphed_super_forward_runs_inside_the_subclass_graph(self):
        Base, Sub = hierarchy(lambda fn: self.graphed(fn, warmup_steps=0))
        _, EagerSub = hierarchy(lambda fn: fn)
        model, ref = Sub(), EagerSub()
        ref.set_state_dict(model.state_dict())
        for step in range(3):
            x = data(2, 4, seed=step)
            y, y_e = model(x), ref(x)
            self.assertBitwise(y, y_e, f"call {step}")
            y.sum().backward()
            y_e.sum().backward()
            self.assertBitwise(grads_of(model), grads_of(ref), f"grads, call {step}")
        inner = super(Sub, model).forward
        self.assertEqual((model.forward.stats()["captures"], model.forward.stats()["replays"]), (1, 2))
        self.assertEqual(inner.stats()["captures"], 0)
        self.assertIn("called inside another capture", inner.stats()["eager_reasons"])

    def test_a_container_that_cannot_be_rebuilt_runs_eagerly(self):
        class Scaled(dict):  # its __init__ needs an argument that its items do not hold
            def __init__(self, pairs, scale):
                super().__init__(pairs)
                self.scale = scale

        class Batch(dict):
            pass

        def head(batch):
            return Scaled({"y": batch["ids"] * 2.0}, scale=0.5)

        def tail(batch):
            return batch["ids"] * float(len(batch.meta))

        f, g = self.graphed(head, warmup_steps=0), self.graphed(tail, warmup_steps=0)
        for i in range(3):
            x = data(2, 3, seed=i)
            out = f(Batch(ids=x))
            self.assertIs(type(out), Scaled)
            self.assertEqual(out.scale, 0.5)
            self.assertBitwise(out["y"], x * 2.0, f"call {i}")
            batch = Batch(ids=x)
            batch.meta = "abc"  # state besides its items
            self.assertBitwise(g(batch), x * 3.0, f"call {i}")
        for wrapped, where, cause in (
            (f, "the result (type Scaled)", "missing 1 required positional argument: 'scale'"),
            (g, "argument batch (type Batch)", "it holds the attribute 'meta' (str) besides its items"),
        ):
            self.assertEqual(wrapped.stats()["captures"], 0)
            self.assertEqual(wrapped.stats()["eager_reasons"].get("capture failed"), 1)
            (reason,) = [row["fallback_reason"] for row in wrapped.report()]
            self.assertIn(f"{where} cannot be rebuilt as an equal object: ", reason)
            self.assertIn(cause, reason)
            self.assertNotIn("(at ", reason, "the reason blames our conversion, not a line of the user's code")
            self.assertIn(where, wrapped.explain())
        self.assertEqual(len([m for m in self.our_warnings() if "cannot be rebuilt" in m]), 2)
        self.assertFalse([m for m in self.our_warnings() if THIS_FILE in m])

    def test_ops_whose_output_shape_depends_on_tensor_values_run_eagerly(self):
        cases = {
            "paddle.masked_select()": lambda x, i: paddle.masked_select(x, x > 0) * 2.0,
            "paddle.nonzero()": lambda x, i: paddle.nonzero(x > 0).astype("float32"),
            "paddle.where(cond) with one argument": lambda x, i: paddle.where(x > 0)[0].astype("float32"),
            "paddle.unique()": lambda x, i: paddle.unique(paddle.round(x)),
            "paddle.bincount()": lambda x, i: paddle.bincount((x > 0).astype("int64").flatten()),
            "a tensor of repeats": lambda x, i: paddle.repeat_interleave(x, (x[:, 0] > 0).astype("int64"), axis=0),
            "indexing with a boolean tensor": lambda x, i: x[x > 0] * 2.0,
            "indexing with a 0-D integer tensor": lambda x, i: x[i] * 2.0,
        }
        for what, fn in cases.items():
            f = self.graphed(fn, warmup_steps=0)
            for seed in range(3):
                x, x_e = data(4, 3, seed=seed, grad=True), data(4, 3, seed=seed, grad=True)
                i = paddle.to_tensor(seed, dtype="int64")
                y, y_e = f(x, i), fn(x_e, i)
                self.assertBitwise(y, y_e, f"{what}, call {seed}")
                if not y_e.stop_gradient:
                    y.sum().backward()
                    y_e.sum().backward()
                    self.assertBitwise(x.grad, x_e.grad, f"{what}, grad of call {seed}")
            self.assertEqual((f.stats()["captures"], f.stats()["eager_reasons"].get("capture failed")), (0, 1), what)
            if self.backend == "simulate":
                (reason,) = [row["fallback_reason"] for row in f.report()]
                self.assertIn(what, reason)
                self.assertIn(f"{THIS_FILE}:", reason, "the user's line that called the op")

    def test_backward_that_paddle_grad_refuses_is_captured_with_backward(self):
        from unittest import mock

        model, ref = twin_layers(Net)
        self.graphed(model, warmup_steps=0)
        x = data(4, 4)
        with mock.patch.object(paddle, "grad", side_effect=RuntimeError("refused")), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paddle.seed(7)
            y = model(x)
        y.sum().backward()
        paddle.seed(7)
        ref(x).sum().backward()
        for (name, p), p_e in zip(model.named_parameters(), ref.parameters()):
            self.assertBitwise(p.grad, p_e.grad, name)
        self.assertEqual(model.forward.stats()["captures"], 1)
        messages = [str(c.message) for c in caught]
        self.assertTrue(any("captured with paddle.autograd.backward instead" in m and "hooks" in m for m in messages),
                        messages)

    def test_an_error_of_the_function_during_capture_reaches_the_caller_once(self):
        calls = {"n": 0}

        def flaky(x):
            calls["n"] += 1
            if calls["n"] == 2:  # the capture call
                raise RuntimeError("a bad batch")
            return x * 2.0

        f = self.graphed(flaky, warmup_steps=1)
        x = data(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertBitwise(f(x), double(x))
            with self.assertRaisesRegex(RuntimeError, "a bad batch"):
                f(x)
            self.assertEqual(calls["n"], 2, "the failing call ran the function once, as eager does")
            for _ in range(2):
                self.assertBitwise(f(x), double(x))
        self.assertEqual(f.stats()["captures"], 1, "the next call captured")
        self.assertFalse(any("a bad batch" in str(c.message) for c in caught), "not reported as a capture failure")

    def test_a_host_read_during_capture_makes_that_key_eager(self):
        def reads(x):
            y = x * 2.0
            return y * float(y.sum())

        f = self.graphed(reads, warmup_steps=1)
        x = data(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                self.assertBitwise(f(x), reads(x))
        stats = f.stats()
        self.assertEqual((stats["captures"], stats["eager_calls"]), (0, 2))
        self.assertTrue(any("Tensor.__float__()" in str(c.message) for c in caught))

    # ------------------------------------------------------------------ values frozen at capture
    def test_host_value_read_in_the_function_is_frozen_at_capture(self):
        scale = {"t": self.host(2.0)}

        def block(x):
            return x * float(scale["t"])  # a host read: done once, at capture

        f = self.graphed(block, warmup_steps=0)
        x = paddle.ones([2])
        f(x)
        scale["t"] = self.host(5.0)
        self.assertBitwise(f(x), paddle.full([2], 2.0), "the replay repeats what capture read")
        self.assertBitwise(block(x), paddle.full([2], 5.0))

    def test_layer_attribute_changed_after_capture_captures_again(self):
        class Flag(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = paddle.nn.Linear(4, 4)
                self.double = False

            def forward(self, x):
                y = self.fc(x)
                return y * 2.0 if self.double else y

        model = Flag()
        self.graphed(model, warmup_steps=0)
        x = paddle.ones([2, 4])
        with paddle.no_grad():  # no backward pending: each call replays the one slot
            first = model(x)
            model(x)
            model.double = True  # a replay would return the capture's (single) value
            self.assertBitwise(model(x), first * 2.0, "the new value is read")
        self.assertEqual((model.forward.stats()["captures"], model.forward.stats()["replays"]), (2, 1))
        self.assertTrue(any("attribute 'double' of Flag changed" in m and "False -> True" in m
                            for m in self.our_warnings()), self.our_warnings())

    def test_an_attribute_changed_by_every_call_is_refused_at_capture(self):
        class Counter(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = paddle.nn.Linear(4, 4)
                self.calls = 0

            def forward(self, x):
                self.calls += 1  # a GPU replay runs no Python: the count would stop at the capture's
                return self.fc(x)

        model = Counter()
        self.graphed(model, warmup_steps=1)
        x = paddle.ones([2, 4])
        with paddle.no_grad():
            for _ in range(5):
                model(x)
        self.assertEqual(model.calls, 5)
        self.assertEqual(model.forward.stats()["captures"], 0)
        self.assertTrue(any("changes attribute 'calls' of Counter (2 -> 3" in m for m in self.our_warnings()),
                        self.our_warnings())

    def test_simulated_backend_rereads_python_state(self):
        if self.backend != "simulate":
            self.skipTest("a GPU graph freezes Python state at capture")
        factor = {"value": 2.0}
        f = self.graphed(lambda x: x * factor["value"], warmup_steps=0)
        x = paddle.ones([2])
        f(x)
        factor["value"] = 5.0
        # A GPU replay would still multiply by 2.0; the simulated replay re-runs the Python, sees
        # the op's scalar change before it hands anything out, and says so: that call and the
        # next run eagerly.
        self.assertBitwise(f(x), paddle.full([2], 5.0))
        self.assertBitwise(f(x), paddle.full([2], 5.0))
        stats = f.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (1, 0, 2), f.explain())
        warned = [m for m in self.our_warnings() if "would reuse the capture's value" in m]
        self.assertTrue(warned and "2.0" in warned[0] and "5.0" in warned[0] and "test_footguns.py:" in warned[0],
                        self.our_warnings())

    def test_verify_replays_never_verifies_a_replay_a_gpu_would_get_wrong(self):
        if self.backend != "simulate":
            self.skipTest("a GPU replay's values are compared with eager's by verify_replays itself")
        factor = {"value": 2.0}
        f = self.graphed(lambda x: x * factor["value"], warmup_steps=0, verify_replays=3)
        x = paddle.ones([2])
        f(x)
        factor["value"] = 5.0
        self.assertBitwise(f(x), paddle.full([2], 5.0))
        self.assertEqual(f.stats()["verified_replays"], 1, f.explain())  # the capture call only
        self.assertBitwise(f(x), paddle.full([2], 5.0))
        self.assertEqual(f.stats()["verified_replays"], 1, f.explain())

    def test_verify_replays_checks_only_the_first_n_calls(self):
        scale = {"t": self.host(1.0)}

        def block(x):
            return x * float(scale["t"])

        f = self.graphed(block, warmup_steps=0, verify_replays=2)
        x = paddle.ones([2])
        f(x)
        f(x)  # both verified and equal
        scale["t"] = self.host(3.0)
        self.assertBitwise(f(x), paddle.ones([2]), "a third call is not verified: frozen value")
        self.assertEqual((f.stats()["verified_replays"], f.stats()["verify_mismatches"]), (2, 0))

    # ------------------------------------------------------------------ host (CPU) tensors
    def test_cpu_inputs_select_the_graph_by_value(self):
        def take(x, n):
            return x[: int(n)] * 2.0

        f = self.graphed(take, warmup_steps=0)
        x = data(4, 2)
        for n in (1, 2, 1, 3):
            self.assertBitwise(f(x, self.host(n, "int64")), take(x, self.host(n, "int64")))
        self.assertEqual(f.stats()["keys"], 3)

    def test_large_cpu_input_is_refused(self):
        f = self.graphed(lambda x, ids: x * 2.0, warmup_steps=0)
        with self.assertRaisesRegex(CudaGraphError, "CPU tensor with .* elements, more than the 1024"):
            f(data(2, 2), self.host(list(range(MAX_HOST_KEY_ELEMENTS + 1)), "int64"))

    def test_cpu_outputs_keep_their_capture_time_value(self):
        seen = {"calls": 0}

        def block(x):
            seen["calls"] += 1
            return x * 2.0, self.host(seen["calls"], "int64")

        f = self.graphed(block, warmup_steps=0)
        outs = [f(data(2, 2, seed=i))[1] for i in range(3)]
        if self.backend == "cuda":
            self.assertBitwise(outs, [paddle.to_tensor(1, dtype="int64")] * 3)
            return
        # The simulated backend re-runs the function for the capture call's replay, sees the value
        # a GPU would freeze (NOTE [ Values a simulated replay reads ] in block/replay_fallback.py) and runs
        # the call eagerly: the function's third run (capture, replay, eager) gives its result.
        self.assertBitwise(outs[0], paddle.to_tensor(3, dtype="int64"), "the capture call runs eagerly")
        self.assertEqual(f.stats()["captures"], 1)
        self.assertTrue(any("paddle.to_tensor" in m and "would reuse the capture's value" in m
                            for m in self.our_warnings()), self.our_warnings())

    # ------------------------------------------------------------------ buffers and lifetimes
    def test_outputs_are_overwritten_by_the_next_replay_without_clone_outputs(self):
        f = self.graphed(double, warmup_steps=0, clone_outputs=False)
        y1 = f(data(2, 2))
        y2 = f(data(2, 2, seed=1))
        self.assertBitwise(y1, y2, "y1 now holds the second call's values")
        self.assertEqual(y1.data_ptr(), y2.data_ptr())

    def test_stale_output_views_taken_before_the_overwrite_are_not_detected(self):
        f = self.graphed(double, warmup_steps=0, clone_outputs=False, check_stale_outputs=True)
        y1 = f(data(2, 2))
        row = y1[0]  # a view with its own handle on the static buffer
        y2 = f(data(2, 2, seed=1))
        self.assertFalse(y1._is_initialized(), "the stale alias's storage handle was released")
        with self.assertRaises(StaleOutputError):  # Paddle's numpy() of a tensor without storage would not raise
            y1.numpy()
        self.assertBitwise(row, y2[0], "the view silently reads the new values")

    def test_a_tensor_feeding_three_outputs_may_differ_from_eager_in_the_last_bit(self):
        # The grads a tensor gets from several outputs are summed in the order the backward's
        # engine meets them: in eager that order comes from the caller's graph, in the captured
        # backward from the outputs' grad nodes. Two terms commute exactly; three need not.
        class Head(paddle.nn.Layer):
            def __init__(self, outputs):
                super().__init__()
                self.fc = paddle.nn.Linear(5, 5)
                self.outputs = outputs

            def forward(self, x):
                h = self.fc(x)
                return (h.mean(0), h.sum(), h.sum())[: self.outputs]

        for outputs in (2, 3):
            eager, graphed = twin_layers(lambda: Head(outputs))
            self.graphed(graphed, warmup_steps=1)
            differ = 0
            for i in range(12):
                grads = []
                for model in (graphed, eager):
                    x = clone_leaf(data(6, 5, seed=i), stop_gradient=False)
                    paddle.add_n([o.sum() for o in model(x)]).backward()
                    grads.append(x.grad.numpy())
                np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)
                differ += grads[0].tobytes() != grads[1].tobytes()
            if outputs == 2:
                self.assertEqual(differ, 0, "two outputs: bitwise equal")
            self.assertEqual(graphed.forward.stats()["replays"], 10)

    def test_second_call_before_backward_runs_eagerly_past_max_inflight(self):
        f = self.graphed(mm, warmup_steps=0, max_inflight=1)
        w = data(3, 3, grad=True)
        y1 = f(data(2, 3), w)
        with f.counters.expect(replays=0, eager_calls=1):
            y2 = f(data(2, 3, seed=1), w)
        (y1.sum() + y2.sum()).backward()
        self.assertIn("before the backward of the previous call ran", self.our_warnings()[0])
        self.assertIn("max_inflight=1", self.our_warnings()[0])

    def test_second_call_before_backward_gets_its_own_slot(self):
        f = self.graphed(mm, warmup_steps=0)
        w = data(3, 3, grad=True)
        y1 = f(data(2, 3), w)
        with f.counters.expect(captures=1, slot_captures=1, replays=0, eager_calls=0):
            y2 = f(data(2, 3, seed=1), w)
        (y1.sum() + 2 * y2.sum()).backward()
        w_eager = data(3, 3, grad=True)
        (mm(data(2, 3), w_eager).sum() + 2 * mm(data(2, 3, seed=1), w_eager).sum()).backward()
        self.assertBitwise(y2, mm(data(2, 3, seed=1), w_eager))
        self.assertBitwise(w.grad, w_eager.grad, "w.grad")
        self.assertEqual(f.stats()["slots"], 2)

    def test_reused_argument_is_read_in_place_and_recaptured_when_replaced(self):
        f = self.graphed(mm, warmup_steps=1)
        x, w = data(2, 3), data(3, 3, seed=1)
        f(x, w)
        with f.counters.expect(captures=1, replays=1, input_copies=0):
            f(x, w)
            f(x, w)
        x.copy_(data(2, 3, seed=2), False)  # refilled in place: seen, no copy
        self.assertBitwise(f(x, w), mm(x, w))
        kept = x.numpy()
        x2 = data(2, 3, seed=3)
        with f.counters.expect(recaptures=1, captures=1):
            self.assertBitwise(f(x2, w), mm(x2, w))
        np.testing.assert_array_equal(x.numpy(), kept, "the old tensor is never overwritten")

    def test_each_key_holds_its_own_static_buffers(self):
        f = self.graphed(mm, warmup_steps=0)
        f(data(2, 3), data(3, 3))
        one = f.stats()["static_bytes"]
        held = f.stats()["held_bytes"]  # what max_bytes counts: static buffers outside the pools, and the pools
        f(data(4, 3), data(3, 3))
        self.assertEqual(f.stats()["static_bytes"], 216)  # 2x3 and 4x3 inputs, 3x3 weight, outputs: float32
        g = self.graphed(lambda x, w, tag: mm(x, w), warmup_steps=0, max_bytes=held)
        g(data(2, 3), data(3, 3), "a")
        with g.counters.expect(evictions=1, captures=1):  # the same bytes for another key
            g(data(2, 3), data(3, 3), "b")
        self.assertEqual(g.stats()["static_bytes"], one)

    def test_replaced_parameter_is_recaptured(self):
        eager, graphed = twin_layers(Net)
        eager.eval(), graphed.eval()
        self.graphed(graphed, warmup_steps=0)
        x = data(2, 4)
        graphed(x)
        new_weight = graphed.create_parameter([4, 4])
        new_weight.set_value(data(4, 4, seed=5))
        graphed.fc.weight = new_weight
        eager.fc.weight.set_value(new_weight.numpy())
        with graphed.forward.counters.expect(recaptures=1, captures=1):
            self.assertBitwise(graphed(x), eager(x))

    # ------------------------------------------------------------------ chains and paddle.grad
    def chain(self, **options):
        layers = [paddle.nn.Linear(3, 3) for _ in range(3)]
        for layer in layers:
            self.graphed(layer, warmup_steps=0, **options)
        return layers

    def test_hooks_on_a_chained_output_see_its_whole_grad(self):
        graphed, eager = self.chain(), [paddle.nn.Linear(3, 3) for _ in range(3)]
        for g, e in zip(graphed, eager):
            e.set_state_dict(g.state_dict())
        for step in range(5):
            got = []
            for layers in (graphed, eager):
                seen = []
                x = data(2, 3)
                h1 = layers[1](layers[0](x))
                h1.register_hook(lambda g: g * 2.0)
                h1.register_hook(lambda g: seen.append(g.numpy()))
                layers[2](h1).sum().backward()
                got.append(seen + [p.grad.numpy() for layer in layers for p in layer.parameters()])
                for layer in layers:
                    layer.clear_gradients()
            self.assertBitwise(got[0], got[1], f"step {step}")
        self.assertEqual(graphed[2].forward.stats()["chained_calls"], 2)

    def test_paddle_grad_of_an_output_a_chain_consumed_is_refused(self):
        layers = self.chain()
        for _ in range(4):
            x = data(2, 3)
            h1 = layers[0](x)
            y = layers[2](layers[1](h1))
            if layers[2].forward.stats()["chained_calls"]:
                with self.assertRaisesRegex(CudaGraphError, "chain_calls=False"):
                    paddle.grad([y.sum()], [h1])
                return
            y.sum().backward()
        self.fail("never chained")

    def test_paddle_grad_through_a_graphed_call_on_the_simulated_backend_is_refused(self):
        if self.backend != "simulate":
            self.skipTest("a GPU replay runs no Python: paddle.grad through it runs (tests/chains/test_chains.py)")
        layer = self.graphed(paddle.nn.Linear(3, 3), warmup_steps=0)
        x = data(2, 3)
        x.stop_gradient = False
        y = layer(x)
        with self.assertRaisesRegex(CudaGraphError, "simulated backend"):
            paddle.grad([y.sum()], [x])
        y.sum().backward()  # the forward is still there to backward through
        z = paddle.tanh(x)
        (g,) = paddle.grad([z.sum()], [x])  # unrelated paddle.grad runs once nothing graphed waits
        self.assertEqual(list(g.shape), [2, 3])

    def test_autocast_on_a_cpu_build_shares_the_key(self):
        if paddle.is_compiled_with_cuda():
            self.skipTest("on a CUDA build auto_cast takes effect on GPU tensors")
        f = self.graphed(double, warmup_steps=0)
        x = data(2, 2)
        f(x)
        with paddle.amp.auto_cast():
            with f.counters.expect(captures=0, replays=1):
                self.assertBitwise(f(x), double(x))


class RecomputedDropout(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(8, 8)
        self.drop = paddle.nn.Dropout(0.5)

    def forward(self, x):
        from paddle.distributed.fleet.utils import recompute

        return recompute(lambda h: self.drop(self.fc(h)), x)


class TrackedDropout(paddle.nn.Layer):
    """Dropout under a Fleet RNG tracker state inside the forward."""

    STATE = "cg_footgun_tracked"

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(8, 8)

    def forward(self, x):
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        with get_rng_state_tracker().rng_state(self.STATE):
            return paddle.nn.functional.dropout(self.fc(x), 0.5)


class RecordingCaptureTest(unittest.TestCase):
    def test_recompute_with_dropout_runs_eagerly_on_cuda(self):
        # A real CUDA capture only records; the simulated backend stands in for it with
        # capture_executes=False (NOTE [ Recompute under CUDA graphs ] in core/state.py).
        from unittest import mock

        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        on_device(self, "cpu")
        model, ref = twin_layers(RecomputedDropout)
        autocudagraph(model, backend="simulate", warmup_steps=0)
        x = paddle.randn([4, 8])
        x.stop_gradient = False
        x_e = clone_leaf(x)
        with mock.patch.object(SimulatedBackend, "capture_executes", False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paddle.seed(3)
            y = model(x)
        paddle.seed(3)
        y_e = ref(x_e)
        y.sum().backward()
        y_e.sum().backward()
        np.testing.assert_array_equal(y.numpy(), y_e.numpy(), strict=True)
        np.testing.assert_array_equal(x.grad.numpy(), x_e.grad.numpy(), strict=True)
        np.testing.assert_array_equal(model.fc.weight.grad.numpy(), ref.fc.weight.grad.numpy(), strict=True)
        self.assertEqual(model.forward.stats()["eager_reasons"], {"capture failed": 1})
        self.assertTrue(any("rewinds the RNG" in str(c.message) for c in caught))

    def _recording(self, model, ref, state_indices, recording=True):
        """Calls ``model`` (autocudagraph'd, simulate) under a recording capture (or, without
        ``recording``, one that executes) and ``ref`` eagerly from the same RNG state; returns the
        warnings of the capture."""
        from unittest import mock

        from paddlefleet.cudagraph.guards import rng
        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        on_device(self, "cpu")
        x = paddle.randn([4, 8])
        with mock.patch.object(SimulatedBackend, "capture_executes", not recording), \
                mock.patch.object(rng, "generator_state_indices", lambda: state_indices), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paddle.seed(3)
            y = model(x)
            after = paddle.rand([4])
        paddle.seed(3)
        y_e = ref(x)
        np.testing.assert_array_equal(y.numpy(), y_e.numpy(), strict=True)
        np.testing.assert_array_equal(after.numpy(), paddle.rand([4]).numpy(), strict=True)
        stats = model.forward.stats() if hasattr(model, "forward") else model.stats()
        self.assertEqual((stats["captures"], stats["eager_reasons"]), (0, {"capture failed": 1}))
        return [str(c.message) for c in caught]

    def test_random_kernels_other_than_dropout_run_eagerly_on_cuda(self):
        # NOTE [ Random draws seen from generator state ] in guards/rng.py; the simulated backend
        # stands in for a recording capture with capture_executes=False.
        def noisy(x):
            return x + paddle.rand(x.shape)

        for indices in (True, False):
            graphed = autocudagraph(noisy, backend="simulate", warmup_steps=0)
            messages = self._recording(graphed, noisy, indices)
            self.assertTrue(any("random kernel 'uniform'" in m and "does not re-seed" in m for m in messages),
                            messages)

    def test_every_random_function_runs_eagerly_on_cuda(self):
        # Decided from the generators' state, not from names (NOTE [ Random draws seen from
        # generator state ] in guards/rng.py): each function is refused at capture, never captured.
        from tests.grads.test_training import random_draws

        for name, draw in random_draws():
            with self.subTest(name):
                def noisy(x, draw=draw):
                    return x + draw().astype(x.dtype).sum()

                graphed = autocudagraph(noisy, backend="simulate", warmup_steps=0)
                messages = self._recording(graphed, noisy, True)
                self.assertTrue(any("random kernel" in m or "outside any Paddle op" in m for m in messages),
                                (name, messages))

    def test_every_random_function_runs_eagerly_on_simulate(self):
        # A capture that executes refuses what a recording one refuses: CPU CI sees the fallback.
        from tests.grads.test_training import random_draws

        for name, draw in random_draws():
            with self.subTest(name):
                def noisy(x, draw=draw):
                    return x + draw().astype(x.dtype).sum()

                graphed = autocudagraph(noisy, backend="simulate", warmup_steps=0)
                messages = self._recording(graphed, noisy, True, recording=False)
                self.assertTrue(any("random kernel" in m or "outside any Paddle op" in m for m in messages),
                                (name, messages))

    def test_tracker_dropout_inside_the_function_runs_eagerly_without_state_indices(self):
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        tracker = get_rng_state_tracker()
        start = add_tracker_state(self, TrackedDropout.STATE, 5150)
        model, ref = twin_layers(TrackedDropout)
        autocudagraph(model, backend="simulate", warmup_steps=0)
        tracker.set_states_tracker(dict(start))
        messages = self._recording(model, lambda x: (tracker.set_states_tracker(dict(start)), ref(x))[1], False)
        self.assertTrue(any("generator state indices" in m for m in messages), messages)


class Select(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 4)
        self.norm = paddle.nn.BatchNorm1D(4)
        self.drop = paddle.nn.Dropout(0.5)

    def forward(self, x, keep):
        return paddle.masked_select(self.drop(self.norm(self.fc(x))), keep)


class SimulatedReplayTest(unittest.TestCase):
    def test_a_simulated_replay_that_changes_shape_falls_back(self):
        # The backstop behind NOTE [ Shapes from tensor values ]: an op the capture does not refuse
        # (here masked_select, with the list of refused ops emptied) changes shape at a replay.
        from unittest import mock

        from paddlefleet.cudagraph.guards import value_shapes

        on_device(self, "cpu")
        model, ref = twin_layers(Select)
        autocudagraph(model, backend="simulate", warmup_steps=0)
        # Elements kept per call: BatchNorm1D's first call sets its _data_format, so the first capture
        # warms the key up again (NOTE [ Attributes a capture writes ]); the capture's, a replay's, other shapes.
        kept = [5, 5, 5, 9, 3]
        phases = [dict(warmup_calls=1), dict(captures=1), dict(replays=1), dict(replays=0, eager_calls=1),
                  dict(replays=0, eager_calls=1)]
        runs = {}
        for name, layer in (("graphed", model), ("eager", ref)):
            paddle.seed(21)
            runs[name] = []
            for step, (n, phase) in enumerate(zip(kept, phases)):
                x = data(4, 4, seed=step, grad=True)
                keep = paddle.to_tensor(np.arange(16).reshape(4, 4) < n)
                with mock.patch.dict(value_shapes.VALUE_SHAPED_OPS, clear=True), warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    if layer is model:
                        with model.forward.counters.expect(**phase):
                            y = layer(x, keep)
                    else:
                        y = layer(x, keep)
                y.sum().backward()
                runs[name].append([y, x.grad, [p.grad.numpy() for p in layer.parameters() if not p.stop_gradient],
                                   [b.numpy() for b in layer.norm.state_dict().values()], paddle.rand([2])])
        for step, (got, want) in enumerate(zip(runs["graphed"], runs["eager"])):
            assert_bitwise(got, want, f"call {step}: output, grads, BatchNorm statistics, RNG")
        (reason,) = [row["fallback_reason"] for row in model.forward.report()]
        self.assertIn("ReplayShapeError: autocudagraph: a simulated replay computed result #0 with shape [9]", reason)
        self.assertIn("where its capture computed [5]", reason)
        self.assertEqual(model.forward.stats()["eager_reasons"], {"a replay changed an output's shape": 1,
                                                                   f"key fell back: {reason}": 1})


class PaddleCrashTest(unittest.TestCase):
    def test_double_backward_through_a_pylayer_crashes_paddle(self):
        # Not autocudagraph's: Paddle 3.3.1 and 2.6.2 segfault on a second backward through any PyLayer
        # (retain_graph=True the first time). Graphed calls run through a PyLayer, so they do too.
        script = textwrap.dedent(
            """
            import paddle
            from paddle.autograd import PyLayer

            class Twice(PyLayer):
                @staticmethod
                def forward(ctx, x):
                    return x * 2

                @staticmethod
                def backward(ctx, dy):
                    return dy * 2

            x = paddle.ones([2])
            x.stop_gradient = False
            y = Twice.apply(x)
            y.sum().backward(retain_graph=True)
            print("first backward ok", flush=True)
            y.sum().backward()
            print("second backward ok", flush=True)
            """
        )
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
        self.assertIn("first backward ok", run.stdout)
        if "second backward ok" in run.stdout:  # behaviour, not version strings, decides
            self.skipTest(f"Paddle {paddle.__version__} survives a second backward through a PyLayer: "
                          "docs/guides/limitations.md describes 2.6.2 and 3.3.1, where it crashes")
        self.assertNotEqual(run.returncode, 0)


class DocTest(unittest.TestCase):
    def test_every_footgun_in_the_doc_has_its_test_and_every_test_its_entry(self):
        import re

        with open(os.path.join(ROOT, "docs", "guides", "limitations.md")) as fh:
            doc = fh.read()
        named = set(re.findall(r"Test: `(?:\w+\.)?(test_\w+)`", doc))
        classes = [c for name, c in globals().items() if name.startswith("FootgunTest_")] + [
            PaddleCrashTest, RecordingCaptureTest, SimulatedReplayTest]
        tests = {n for cls in classes for n in dir(cls) if n.startswith("test_")}
        self.assertEqual(named - tests, set(), "entries whose test is missing")
        self.assertEqual(tests - named, set(), "tests without an entry in docs/guides/limitations.md")

    def test_every_test_named_in_compat_md_exists(self):
        import importlib
        import re

        with open(os.path.join(ROOT, "docs", "guides", "compat.md")) as fh:
            doc = fh.read()
        named = set(re.findall(r"tests/(\w+)/(\w+)\.py::(\w+)::(test_\w+)", doc))
        self.assertGreater(len(named), 20)
        missing = []
        for folder, module, cls, test in sorted(named):
            owner = getattr(importlib.import_module(f"tests.{folder}.{module}"), cls, None)
            if owner is None or not hasattr(owner, test):
                missing.append(f"tests/{folder}/{module}.py::{cls}::{test}")
        self.assertEqual(missing, [], "docs/guides/compat.md names tests that do not exist")
