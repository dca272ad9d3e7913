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
