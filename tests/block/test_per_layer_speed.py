"""A model graphed layer by layer: start-up bookkeeping (capture_ms, bytes per key)."""

import unittest

import paddle

from testkit.common import MatMLP, eager_calls, host_tensor, layer_stack, normal, through
from testkit.harness import MatmulOnlyCase, backend_variants, release_grads


def per_layer_model(layers=4, width=8, **options):
    return layer_stack(layers, [width, width], {"backend": "simulate", **options})


class TestCaptureBookkeeping(unittest.TestCase):
    def test_stats_and_explain_record_capture_ms_and_bytes_per_key(self):
        model = per_layer_model()
        draw = normal(0)
        x, dy = host_tensor(draw(4, 8)), host_tensor(draw(4, 8))
        x.stop_gradient = False
        first = model[0].forward
        self.assertEqual(first.stats()["capture_ms"], {})
        for _ in range(3):
            through(model, x, dy)
        stats = first.stats()
        self.assertEqual(len(stats["capture_ms"]), 1)
        [(label, ms)] = stats["capture_ms"].items()
        self.assertGreater(ms, 0.0)
        self.assertEqual(stats["key_bytes"], {label: stats["static_bytes"]})
        self.assertEqual(stats["static_bytes"], 640)
        self.assertIn("captured in", first.explain())
        self.assertEqual(first.report()[0]["capture_ms"], ms)
        first.reset()
        self.assertEqual(first.stats()["capture_ms"], {})


if __name__ == "__main__":
    unittest.main()


class PerLayerCases(MatmulOnlyCase):
    """A model graphed layer by layer on every backend (tools/gpu_check.py runs it on a GPU): each
    layer's graphs are evicted and captured again while the other layers' graphs live, with garbage
    cycles holding earlier results, and every step stays bitwise equal to eager. On a GPU this is the
    case for captures without a full garbage collection first (NOTE [ Garbage collection around
    capture ] in backends/cuda.py)."""

    width = 16

    def layers(self):
        return paddle.nn.LayerList([MatMLP([self.width, self.width]) for _ in range(4)])

    def step(self, layers, xn, dyn):
        h = x = self.tensor(xn, grad=True)
        for layer in layers:
            h = layer(h)
        h.backward(self.tensor(dyn))
        got = [t.numpy() for t in [h, x.grad] + [p.grad for p in layers.parameters()]]  # before the release
        release_grads(layers)
        self.last = (h, x)
        return got

    def test_layers_evicted_and_captured_again_stay_bitwise(self):
        probe, _ = self.twins(self.layers, 0)
        for layer in probe:
            self.graphed(layer)
        draw = normal(3)
        for batch in (4, 8, 4, 8):
            self.step(probe, draw(batch, self.width), draw(batch, self.width))
        # Room for one key per layer: batches of 4 and 8 then evict each other on every call.
        stats = probe[0].forward.stats()  # held: what max_bytes counts (static buffers outside the pools, pools)
        budget = max(m["held"] for m in stats["key_memory"].values())
        graphed, eager = self.twins(self.layers, 1)
        for layer in graphed:
            self.graphed(layer, max_bytes=budget)
        garbage = []
        for k in range(8):
            batch = 4 if k % 2 == 0 else 8
            xn, dyn = draw(batch, self.width), draw(batch, self.width)
            got = self.step(graphed, xn, dyn)
            cycle = [got, self.last]
            cycle.append(cycle)  # freed only by the cyclic collector, never inside a capture
            garbage.append(cycle)
            self.assertBitwise(got, self.step(eager, xn, dyn), f"step {k} (batch {batch}): y, x.grad, parameter grads")
        for layer in graphed:
            stats = layer.forward.stats()
            self.assertEqual(stats["evictions"], 5, layer.forward.explain())
            self.assertEqual(stats["captures"], 6, layer.forward.explain())
            self.assertEqual(eager_calls(stats), 0, layer.forward.explain())
        del garbage


globals().update(backend_variants(PerLayerCases))
