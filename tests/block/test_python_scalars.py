"""Python scalars inside a capture (NOTE [ Python scalars during capture ] in guards/host_guard.py).

``paddle.to_tensor(<Python bool, int or float>)`` inside a capture becomes a device fill with eager's
value, dtype, shape, place and stop_gradient, so ``paddle.where(mask, 0.0, finfo.min)`` and model code
like it capture, numpy scalars too; Python lists and numpy arrays stay refused. Every result is compared
bit for bit with eager, on both backends; counters pin that the graphs captured and replayed.
"""

import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph.guards.host_guard import host_guard
from paddlefleet.cudagraph.guards.host_marks import is_marked_host
from paddlefleet.cudagraph.errors import CaptureError
from testkit.differential import Trainee, differential_run, step_grapher
from testkit.harness import BackendCase, for_each_backend

VALUES = [True, False, 0, 3, -7, 2 ** 40, 2 ** 62 + 1, -2 ** 63, 0.0, -0.0, 0.1, 1 / 3, 65504.0, 1e-8,
          -3.4028234663852886e38, 1e300, float("inf"), float("-inf"), float("nan")]
DTYPES = [None, "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"]


def _made(call, guarded=False):
    """What ``call()`` made (dtype, shape, place, stop_gradient, bits), or the type of its exception;
    ``guarded``: called inside host_guard (as during a capture), read after it."""
    try:
        if guarded:
            with host_guard(is_marked_host):
                t = call()
        else:
            t = call()
    except Exception as err:  # noqa: BLE001 - eager's own error must be the capture's too
        return type(err)
    return (str(t.dtype), list(t.shape), str(t.place), t.stop_gradient, t.numpy().tobytes())


class ToTensorOfScalarTest(unittest.TestCase):
    """The guard directly: the fill against eager's to_tensor, value by value and dtype by dtype."""

    def check(self, value, dtype, stop_gradient=True):
        def make():
            return paddle.to_tensor(value, dtype=dtype, stop_gradient=stop_gradient)

        want = _made(make)
        self.assertEqual(_made(make, guarded=True), want, f"paddle.to_tensor({value!r}, dtype={dtype!r}, stop_gradient={stop_gradient})")

    def test_every_value_and_dtype_equals_eager_bit_for_bit(self):
        for value in VALUES:
            for dtype in DTYPES:
                self.check(value, dtype)

    def test_stop_gradient_false_and_the_default_dtype(self):
        for value in (0.5, 2, True):
            self.check(value, "float32", stop_gradient=False)
        old = paddle.get_default_dtype()
        paddle.set_default_dtype("float64")
        try:
            for value in (0.1, 1 / 3, 7):
                self.check(value, None)
        finally:
            paddle.set_default_dtype(old)

    def test_the_helpers_that_make_tensors_of_scalars(self):
        mask = paddle.to_tensor([[True, False, True]])
        x = paddle.to_tensor([[1.0, 2.0, 3.0]])
        low = paddle.finfo(paddle.float32).min
        calls = [lambda: paddle.where(mask, 0.0, low), lambda: paddle.where(mask, x, 0.0),
                 lambda: paddle.where(mask, 1, 2)]
        for call in calls:
            self.assertEqual(_made(call, guarded=True), _made(call))

    def test_numpy_scalars_equal_eager_bit_for_bit(self):
        """``paddle.to_tensor(np.float32(0.1))`` is a scalar like a Python float: a fill with eager's
        value and dtype (the numpy scalar's own where no dtype is given)."""
        values = [np.float32(0.1), np.float32(-0.0), np.float32("nan"), np.float64(1 / 3), np.float16(65504),
                  np.int64(-7), np.int32(2 ** 31 - 1), np.uint8(200), np.int8(-3), np.bool_(True)]
        for value in values:
            for dtype in DTYPES:
                self.check(value, dtype)

    def test_lists_arrays_and_complex_values_stay_refused_as_before(self):
        cases = [([1.0, 2.0], "paddle.to_tensor() of a list"), ((1, 2), "paddle.to_tensor() of a tuple"),
                 (np.ones([2], "float32"), "paddle.to_tensor() of a numpy array"),
                 (np.array(1.0), "paddle.to_tensor() of a numpy array"),
                 (1 + 2j, "paddle.to_tensor() of a Python complex")]
        for data, named in cases:
            with host_guard(is_marked_host):
                with self.assertRaises(CaptureError) as caught:
                    paddle.to_tensor(data)
            self.assertIn(f"autocudagraph: {named} was called during capture. It copies host data to the device",
                          str(caught.exception))

    def test_a_host_place_stays_a_host_tensor(self):
        with host_guard(is_marked_host):
            host = paddle.to_tensor(1.5, place=paddle.CPUPlace())
            self.assertTrue(is_marked_host(host))
            self.assertEqual(float(host), 1.5)


def masked_scores(x, mask):
    """An attention-mask helper as models write it (PaddleFormers' _prepare_decoder_attention_mask)."""
    bias = paddle.where(mask, 0.0, paddle.finfo(x.dtype).min)
    scale = paddle.to_tensor(0.5)
    shift = paddle.to_tensor(3, dtype=x.dtype) + paddle.to_tensor(np.float32(0.25))  # a numpy scalar too
    return paddle.nn.functional.softmax(x * scale + bias, axis=-1) * shift


@for_each_backend
class ScalarsInAGraphTest(BackendCase):
    def batches(self, n):
        rs = np.random.RandomState(0)
        mask = paddle.to_tensor(rs.rand(4, 6) > 0.3)
        return [(paddle.to_tensor(rs.randn(4, 6).astype("float32")), mask) for _ in range(n)]

    def test_a_block_with_scalar_tensors_captures_and_replays_like_eager(self):
        graphed = self.graphed(masked_scores, warmup_steps=1)
        want, got = [], []
        for x, mask in self.batches(5):
            for out, fn in ((want, masked_scores), (got, graphed)):
                leaf = x.detach()
                leaf.stop_gradient = False
                y = fn(leaf, mask)
                y.backward(paddle.ones_like(y))
                out.append((y, leaf.grad))
        self.assertBitwise(got, want)
        self.assertCounters(graphed, captures=1, replays=3, warmup_calls=1, eager=0)

    def test_a_whole_step_with_scalar_tensors_captures_and_replays_like_eager(self):
        wrappers = []

        def build():
            paddle.seed(3)
            model = paddle.nn.Linear(6, 6)
            opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())

            def step(x, mask):
                loss = masked_scores(model(x), mask).mean() * paddle.to_tensor(2.0)
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return Trainee(step, {"model": model, "opt": opt})

        graph = step_grapher(wrappers, backend=self.backend)

        differential_run(build, self.batches(6), graph)
        self.assertCounters(wrappers[0], captures=1, replays=3, warmup_calls=2, eager=0)

    def test_a_whole_step_whose_scalar_changes_is_refused_naming_it(self):
        # The value is frozen in the graph like any Python scalar: a step refuses the capture when the
        # value it passes changes between its last warmup and its capture, and stays eager.
        wrappers, knob = [], [1.0]

        def build():
            paddle.seed(3)
            model = paddle.nn.Linear(6, 6)
            opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())

            def step(x, mask):
                loss = (model(x) * paddle.to_tensor(knob[0])).mean()
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss

            return Trainee(step, {"model": model, "opt": opt})

        graph = step_grapher(wrappers, backend=self.backend)

        def after_step(*_):
            knob[0] += 1.0

        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            differential_run(build, self.batches(5), graph, after_step=after_step)
        stats = self.assertCounters(wrappers[0], captures=0, replays=0)
        self.assertIn("paddle.to_tensor", " ".join(stats["eager_reasons"]))


if __name__ == "__main__":
    unittest.main()
