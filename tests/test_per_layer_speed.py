"""A model graphed layer by layer: start-up bookkeeping (capture_ms, bytes per key)."""

import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph
from testkit.common import MatMLP, build, host_tensor, normal


def per_layer_model(layers=4, width=8, **options):
    model = build(lambda: paddle.nn.LayerList([MatMLP([width, width]) for _ in range(layers)]), 0)
    for layer in model:
        autocudagraph(layer, backend="simulate", **options)
    return model


def run(model, x, dy):
    h = x
    for layer in model:
        h = layer(h)
    h.backward(dy)
    return h


class TestCaptureBookkeeping(unittest.TestCase):
    def test_stats_and_explain_record_capture_ms_and_bytes_per_key(self):
        model = per_layer_model()
        draw = normal(0)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        x.stop_gradient = False
        first = model[0].forward
        self.assertEqual(first.stats()["capture_ms"], {})
        for _ in range(3):
            run(model, x, dy)
        stats = first.stats()
        self.assertEqual(len(stats["capture_ms"]), 1)
        [(label, ms)] = stats["capture_ms"].items()
        self.assertGreater(ms, 0.0)
        self.assertEqual(stats["key_bytes"], {label: stats["static_bytes"]})
        self.assertGreater(stats["static_bytes"], 0)
        self.assertIn("captured in", first.explain())
        self.assertEqual(first.report()[0]["capture_ms"], ms)
        first.reset()
        self.assertEqual(first.stats()["capture_ms"], {})


if __name__ == "__main__":
    unittest.main()


class TestGraphedCallsThatCannotPay(unittest.TestCase):
    """NOTE [ Graphed calls that cannot pay ] in core/host_cost.py."""

    def setUp(self):
        from paddlefleet.cudagraph.core import host_cost

        self.host_cost = host_cost
        self.saved = list(host_cost._warned)
        host_cost._warned.clear()

    def tearDown(self):
        self.host_cost._warned[:] = self.saved

    def steps(self, model, n):
        draw = normal(1)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        for _ in range(n):
            run(model, x, dy)

    def test_a_measured_backend_warns_once_per_process_with_both_host_times(self):
        from unittest import mock

        # The simulated replay re-runs the function, so its graphed call always costs more host
        # time than the eager one: timed as if measured, every layer cannot pay.
        model = per_layer_model()
        with mock.patch("paddlefleet.cudagraph.core.entry.measured", return_value=True), \
                self.assertWarns(RuntimeWarning) as caught:
            self.steps(model, 3 + self.host_cost.REPLAYS_TIMED)
        texts = [str(w.message) for w in caught.warnings if "of host time against" in str(w.message)]
        self.assertEqual(len(texts), 1, texts)
        self.assertIn("autocudagraph_step", texts[0])
        self.assertIn("Graph larger blocks", texts[0])
        for layer in model:
            self.assertIn("host us per forward call: eager", layer.forward.explain())
            self.assertFalse(layer.forward._entries[next(iter(layer.forward._entries))].host_cost.timing)

    def test_a_backend_whose_replay_reruns_the_function_is_not_timed(self):
        import warnings

        model = per_layer_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.steps(model, 3 + self.host_cost.REPLAYS_TIMED)
        self.assertNotIn("host us per forward call", model[0].forward.explain())
        self.assertEqual(model[0].forward.report()[0]["host_cost"], "")
