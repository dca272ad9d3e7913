"""NOTE [ Host access during capture ] (backends/host_guard.py): the guard itself, on both backends."""

import threading
import unittest

import paddle

from paddlefleet.cudagraph.backends.host_guard import host_guard
from paddlefleet.cudagraph.backends.host_marks import is_marked_host
from paddlefleet.cudagraph.errors import CaptureError

from tests.block.test_capture_failures import HOST


class HostGuardTest(unittest.TestCase):
    """NOTE [ Host access during capture ] in backends/host_guard.py, directly."""

    def entry_points(self):
        tensor = {name: paddle.Tensor.__dict__.get(name) for name in dir(paddle.Tensor)}
        modules = [(m, n, m.__dict__.get(n)) for m in (paddle, paddle.tensor, paddle.tensor.creation)
                   for n in ("to_tensor", "assign")]
        return tensor, modules, paddle.device.__dict__.get("synchronize")

    def test_everything_patched_is_restored_also_after_a_refusal(self):
        before = self.entry_points()
        with self.assertRaises(CaptureError):
            with host_guard(is_marked_host):
                paddle.ones([2]).numpy()
        self.assertEqual(self.entry_points(), before)

    def test_other_threads_are_not_checked(self):
        t, seen = paddle.ones([2]), {}
        with host_guard(is_marked_host):
            worker = threading.Thread(target=lambda: seen.setdefault("values", t.numpy().tolist()))
            worker.start()
            worker.join()
            with self.assertRaises(CaptureError):
                t.numpy()
        self.assertEqual(seen, {"values": [1.0, 1.0]}, "a thread that is not capturing reads as usual")

    def test_host_tensors_made_inside_are_host_and_never_copied_to_the_device(self):
        with host_guard(is_marked_host):
            host = paddle.to_tensor(HOST, place=paddle.CPUPlace())
            self.assertTrue(is_marked_host(host))
            self.assertEqual(host.numpy().tobytes(), HOST.tobytes(), "reading host memory is host work")
            for copy in (lambda: paddle.to_tensor(host), lambda: paddle.ones([8, 8]).copy_(host, False),
                         lambda: paddle.assign(host, output=paddle.ones([8, 8])), lambda: host.to("gpu")):
                with self.assertRaisesRegex(CaptureError, "copies host data to the device"):
                    copy()
            device = paddle.to_tensor(paddle.ones([2]))  # device to device: no host involved
            self.assertFalse(is_marked_host(device))


# ----------------------------------------------------------------------------- a broken CUDA capture
