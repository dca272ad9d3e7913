"""Cheap key parts (NOTE [ Cheap key parts ] in core/keys.py): dtypes and AMP levels keyed by their
ints give equal keys exactly where the enum objects did."""

import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.core.call import Call


class CheapKeyPartsTest(unittest.TestCase):
    """NOTE [ Cheap key parts ]: keys equal exactly when keys made with the dtype objects are."""

    DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
              "complex64", "complex128")

    def test_dtype_ints_are_distinct_and_stable(self):
        tensors = [paddle.zeros([2], dtype=d) for d in self.DTYPES]
        ints = [int(t.dtype) for t in tensors]
        self.assertEqual(len(set(ints)), len(ints), dict(zip(self.DTYPES, ints)))
        self.assertEqual(ints, [int(paddle.zeros([3], dtype=d).dtype) for d in self.DTYPES])
        for a in tensors:  # equal ints exactly where the dtype objects are equal
            for b in tensors:
                self.assertEqual(int(a.dtype) == int(b.dtype), a.dtype == b.dtype)

    def test_a_dtype_changed_in_place_changes_the_key(self):
        graphed = autocudagraph(lambda x: x * 2, backend="simulate")
        x = paddle.ones([2, 2])
        keys = graphed._keys
        before = keys.key((x,), {}, [x], Call((x,), {}).spec)
        self.assertEqual(before, keys.key((x,), {}, [x], Call((x,), {}).spec))
        paddle.assign(paddle.ones([2, 2], dtype="float64"), output=x)  # the same object, another dtype
        self.assertNotEqual(before, keys.key((x,), {}, [x], Call((x,), {}).spec))

    def test_amp_levels_key_apart(self):
        from paddlefleet.cudagraph.core import state
        from tests.grads.test_training import gpu_amp_state

        plain = state.amp_state()
        seen = {plain}
        for level in ("O1", "O2"):
            with gpu_amp_state(level, "float16"):
                seen.add(state.amp_state())
        self.assertEqual(len(seen), 3, seen)
        self.assertTrue(all(isinstance(s[0], int) for s in seen), seen)


if __name__ == "__main__":
    unittest.main()
