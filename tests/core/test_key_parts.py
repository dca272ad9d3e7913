"""Cheap key parts (NOTE [ Cheap key parts ] in core/keys.py): dtypes and AMP levels keyed by their
ints give equal keys exactly where the enum objects did."""

import itertools
import unittest
from unittest import mock

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.core.call import Call
from paddlefleet.cudagraph.io import host_tensors
from paddlefleet.cudagraph.io.static_inputs import place_key


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

    def test_amp_state_without_a_tracer_or_its_parts(self):
        from paddlefleet.cudagraph.core import state

        for tracer, expected in ((None, None), (object(), (None, None)),
                                 (mock.Mock(_amp_level="O1", _amp_dtype="float16"), ("O1", "float16"))):
            with self.subTest(tracer=tracer), mock.patch.object(state, "_dygraph_tracer", lambda: tracer):
                self.assertEqual(state.amp_state(), expected)


class _Place:
    """A stand-in place: a GPU (device id), the CPU, or another kind (pinned memory)."""

    def __init__(self, kind, device=0):
        self.kind, self.device = kind, device

    def is_gpu_place(self):
        return self.kind == "gpu"

    def is_cpu_place(self):
        return self.kind == "cpu"

    def gpu_device_id(self):
        return self.device

    def __str__(self):
        return f"Place({self.kind})"


class HostMaskFromPlaceKeysTest(unittest.TestCase):
    """The key decides host tensors from its place keys: the same mask as from the places."""

    def test_every_mix_of_places_on_a_cuda_build(self):
        ts = [paddle.ones([1]) for _ in range(3)]
        kinds = [_Place("gpu", 0), _Place("gpu", 1), _Place("cpu"), _Place("gpu_pinned")]
        with mock.patch.object(host_tensors, "_CUDA_BUILD", True):
            for places in itertools.product(kinds, repeat=3):
                for on_gpu in (None, True, False):
                    self.assertEqual(
                        host_tensors.host_mask(ts, on_gpu=on_gpu, place_keys=[place_key(p) for p in places]),
                        host_tensors.host_mask(ts, on_gpu=on_gpu, places=list(places)), [str(p) for p in places])


if __name__ == "__main__":
    unittest.main()
