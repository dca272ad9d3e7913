"""NOTE [ Attributes a capture writes ] (guards/attr_writes.py): how the writes a capture makes to Layer
attributes are compared (by value for plain values, by identity for tensors and objects), which writes
count (not a Layer made during the capture, not another thread's), and that undo() puts each back where it
lived (the instance, a buffer slot, a class attribute)."""

import threading
import unittest

import numpy as np
import paddle

from paddlefleet.cudagraph.errors import CaptureError
from paddlefleet.cudagraph.guards import layer_attrs, refusals
from paddlefleet.cudagraph.guards.attr_writes import AttrWrites, same_value


class WithDefault(paddle.nn.Layer):
    scale = 1.0  # a class attribute the instance shadows when assigned

    def __init__(self):
        super().__init__()
        self.count = 0
        self.register_buffer("steps", paddle.zeros([1]))


class SameValueTest(unittest.TestCase):
    def test_plain_values_and_their_containers_compare_by_value(self):
        for old, new in [(3, 3), ("a", "a"), (None, None), ((4, 8), (4, 8)), ([1, (2, "x")], [1, (2, "x")]),
                         ({"a": 1}, {"a": 1}), (float("nan"), float("nan")), (np.float32(2), np.float32(2)),
                         (paddle.float32, paddle.float32)]:
            self.assertTrue(same_value(old, new), (old, new))

    def test_types_lengths_and_values_must_match(self):
        for old, new in [(1, 1.0), (1, True), (0, 1), ((4, 8), (4, 9)), ((4, 8), [4, 8]), ((1,), (1, 2)),
                         ({"a": 1}, {"b": 1}), ("a", "b"), (None, 0)]:
            self.assertFalse(same_value(old, new), (old, new))

    def test_tensors_and_objects_compare_by_identity(self):
        t = paddle.ones([2])
        self.assertTrue(same_value(t, t))
        self.assertTrue(same_value([t], [t]))
        self.assertFalse(same_value(t, paddle.ones([2])), "an equal new tensor is another tensor")
        self.assertFalse(same_value((t,), (paddle.ones([2]),)))
        self.assertFalse(same_value(object(), object()))


class AttrWritesTest(unittest.TestCase):
    def setUp(self):
        layer_attrs.install()

    def test_a_changed_value_is_refused_and_every_write_put_back(self):
        layer = WithDefault()
        steps = layer.steps
        with AttrWrites() as writes:
            layer.count += 1
            layer.scale = 2.0
            layer.steps = layer.steps + 1
            layer.fresh = "new"
        with self.assertRaises(CaptureError) as raised:
            writes.check()
        self.assertIs(raised.exception.refusal, refusals.ATTR_WRITTEN)
        self.assertIn("changes attribute 'count' of WithDefault (0 -> 1", str(raised.exception))
        self.assertEqual(raised.exception.attribute, ("WithDefault", "count"))
        self.assertEqual(layer.count, 0)
        self.assertNotIn("scale", layer.__dict__)
        self.assertEqual(layer.scale, 1.0, "the class attribute shows again")
        self.assertIs(layer.steps, steps)
        self.assertIs(layer._buffers["steps"], steps)
        self.assertFalse(hasattr(layer, "fresh"))

    def test_a_tensor_is_named_by_its_shape_never_its_values(self):
        layer = WithDefault()
        layer.last = None
        with AttrWrites() as writes:
            layer.last = paddle.ones([4, 8])
        with self.assertRaises(CaptureError) as raised:
            writes.check()
        self.assertIn("(None -> a float32 tensor of shape [4, 8] (id 0x", str(raised.exception))
        self.assertIsNone(layer.last)

    def test_values_written_equal_pass(self):
        layer = WithDefault()
        with AttrWrites() as writes:
            layer.count = 0
            layer.scale = 1.0
            layer.training = True
        writes.check()
        self.assertIsNone(writes.changed())

    def test_a_layer_made_during_the_capture_is_not_compared(self):
        with AttrWrites() as writes:
            made = WithDefault()
            made.count = 5
        self.assertIsNone(writes.changed())

    def test_another_threads_writes_are_not_the_captures(self):
        layer = WithDefault()
        with AttrWrites() as writes:
            worker = threading.Thread(target=lambda: setattr(layer, "count", 7))
            worker.start()
            worker.join()
        self.assertIsNone(writes.changed())
        self.assertEqual(layer.count, 7)

    def test_no_write_is_recorded_outside_the_capture(self):
        layer = WithDefault()
        writes = AttrWrites()
        with writes:
            pass
        layer.count = 3
        self.assertIsNone(writes.changed())


if __name__ == "__main__":
    unittest.main()
