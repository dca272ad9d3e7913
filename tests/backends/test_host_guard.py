"""NOTE [ Host access during capture ] (guards/host_guard.py): the guard itself, on both backends."""

import threading
import unittest

import numpy as np
import paddle

from paddlefleet.cudagraph.guards.host_guard import host_guard
from paddlefleet.cudagraph.guards.host_marks import is_marked_host, mark_host
from paddlefleet.cudagraph.errors import CaptureError

from tests.block.test_capture_failures import HOST


class HostGuardTest(unittest.TestCase):
    """NOTE [ Host access during capture ] in guards/host_guard.py, directly."""

    def entry_points(self):
        tensor = {name: paddle.Tensor.__dict__.get(name) for name in dir(paddle.Tensor)}
        modules = [(m, n, m.__dict__.get(n)) for m in (paddle, paddle.tensor, paddle.tensor.creation)
                   for n in ("to_tensor", "assign")]
        return tensor, modules, paddle.device.__dict__.get("synchronize")

    def test_raw_tensor_reads_and_writes_are_guarded(self):
        """Tensor.get_tensor() (and Tensor.value().get_tensor()) hands out Paddle's raw tensor, whose own
        methods read or write device memory: refused for a device tensor, allowed for a host one."""
        device_tensor = paddle.ones([2])
        host = mark_host(paddle.ones([2]))
        with host_guard(is_marked_host):
            reads = (lambda d: np.array(d), str, repr, lambda d: d._get_float_element(0))
            for read in reads + (lambda d: d._copy(paddle.CPUPlace()),):
                with self.assertRaisesRegex(CaptureError, r"Tensor\.get_tensor\(\).*reads a device tensor on the host"):
                    read(device_tensor.value().get_tensor())
            for read in reads:
                read(host.get_tensor())  # host memory: host work
            with self.assertRaisesRegex(CaptureError, "copies host data to the device"):
                device_tensor.get_tensor().set(HOST[0, :2], paddle.CPUPlace())
            host.get_tensor().set(HOST[0, :2], paddle.CPUPlace())
        self.assertEqual(np.array(device_tensor.get_tensor()).tolist(), [1.0, 1.0], "readable again after the guard")

    def test_printing_a_device_tensor_is_refused_naming_print_not_numpy(self):
        """print(t), str(t), repr(t), '%s' % t, f"{t}" and format(t) read the values through numpy(): the refusal
        names what the user wrote; a host tensor prints as in eager."""
        device_tensor = paddle.ones([2])
        scalar = paddle.ones([])
        host = mark_host(paddle.ones([2]))
        printed = (print, str, repr, lambda t: "%s" % t)
        formatted = (lambda t: f"{t}", lambda t: format(t, ""))
        with host_guard(is_marked_host):
            for tensor in (device_tensor, scalar):
                for call in printed:
                    with self.assertRaisesRegex(CaptureError, r"^autocudagraph: print\(t\), str\(t\) or repr\(t\) of "
                                                r"a device tensor was called during capture\..*Print the call's output "
                                                r"after the call"):
                        call(tensor)
                for call in formatted:
                    with self.assertRaisesRegex(CaptureError, r"an f-string or format\(\) of a device tensor"):
                        call(tensor)
            self.assertIn("1.", str(host))
            self.assertIn("1.", f"{host}")
        self.assertIn("1.", str(device_tensor), "printable again after the guard")

    def test_stream_and_event_waits_are_refused(self):
        """Stream and Event waits and queries never reach the device during a capture (a CPU build has the
        classes, not the streams: the unbound methods are called with a stand-in)."""
        stand_in = object()
        waits = [(paddle.device, "synchronize", ())]
        for module in (paddle.device, getattr(paddle.device, "cuda", None)):
            for cls_name in ("Stream", "Event"):
                cls = getattr(module, cls_name, None) if module is not None else None
                for name in ("synchronize", "query", "elapsed_time"):
                    if isinstance(cls, type) and hasattr(cls, name):
                        waits.append((cls, name, (stand_in,)))
        self.assertGreaterEqual(len(waits), 6, waits)  # paddle.device's Stream and Event have all of them
        with host_guard(is_marked_host):
            for owner, name, args in waits:
                with self.assertRaisesRegex(CaptureError, "waits for the device"):
                    getattr(owner, name)(*args)

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
