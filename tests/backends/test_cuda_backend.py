"""backends/cuda.py and backends/cuda_driver.py: a capture that breaks on the device is ended (NOTE [ Ending a
broken capture ]), against a stand-in of Paddle's CUDA graph."""

import contextlib
import types
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph.backends import cuda as cuda_backend
from paddlefleet.cudagraph.backends import cuda_driver
from paddlefleet.cudagraph.backends import is_own_error, own_error, shared_pool
from paddlefleet.cudagraph.backends.shared_pool import PoolConflictError
from paddlefleet.cudagraph.errors import CaptureError

from tests.block.test_capture_failures import HOST, Boom


class _FakeCuda:
    """Paddle's capture state and one stream's capture status, as NOTE [ Ending a broken capture ] reads
    them: Paddle's end_capture fails on a stream whose capture is not active and then keeps capturing."""

    def __init__(self):
        self.paddle_capturing, self.stream, self.resets = False, cuda_driver.NONE, 0
        world = self

        class Graph:
            def __init__(self, place=None, mode=None, pool_id=None):
                pass

            def capture_begin(self):
                world.paddle_capturing, world.stream = True, cuda_driver.ACTIVE

            def capture_end(self):
                world.end()

            def reset(self):
                world.resets += 1

        class Core:
            @staticmethod
            def end_capture():
                world.end()
                return Graph()

        self.graphs = types.SimpleNamespace(CUDAGraph=Graph)
        self.core = Core

    def end(self):
        if self.stream != cuda_driver.ACTIVE:
            self.stream = cuda_driver.NONE
            raise OSError("(External) CUDA error(901), operation failed due to a previous error during capture.")
        self.paddle_capturing, self.stream = False, cuda_driver.NONE

    def patches(self):
        driver = {"capture_status": lambda stream: self.stream,
                  "end_stream_capture": lambda stream: setattr(self, "stream", cuda_driver.NONE) or True,
                  "begin_stream_capture": lambda stream: setattr(self, "stream", cuda_driver.ACTIVE) or True,
                  "clear_last_error": lambda: None}
        return [mock.patch.object(cuda_backend, "_core_graph_class", lambda: (self.graphs, self.core)),
                mock.patch.object(cuda_backend, "_paddle_capturing", lambda: self.paddle_capturing),
                mock.patch.object(cuda_backend, "_stream_handle", lambda place: 1234)] + [
            mock.patch.object(cuda_driver, name, fn) for name, fn in driver.items()]


class BrokenCudaCapture(unittest.TestCase):
    """NOTE [ Ending a broken capture ] in backends/cuda.py, against a stand-in for Paddle and the driver
    (the real thing runs in tools/gpu_check.py): whatever broke a capture, Paddle is left not capturing."""

    def capture(self, body):
        """Captures ``body(fake)`` on a stand-in; returns ``(fake, the exception raised or None)``."""
        fake = _FakeCuda()
        with contextlib.ExitStack() as stack:
            for patch in fake.patches():
                stack.enter_context(patch)
            try:
                cuda_backend._CudaGraph(None, None).capture(lambda: body(fake))
            except Exception as err:  # noqa: BLE001 - the test inspects it
                return fake, err
        return fake, None

    def test_a_cuda_error_that_invalidated_the_capture_is_contained_and_ended(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED
            raise OSError("(External) CUDA error(906), operation would make the legacy stream depend on a "
                          "capturing blocking stream")

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertRegex(str(error), "invalidated on the device.*CUDA error\\(906\\)")
        self.assertFalse(fake.paddle_capturing, "Paddle left believing a capture is open")
        self.assertEqual(fake.stream, cuda_driver.NONE)
        self.assertEqual(fake.resets, 1, "the capturing graph handed back by the restarted capture was reset")

    def test_a_capture_that_fails_to_end_is_ended(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED  # broken without an error until the end
            return []

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertFalse(fake.paddle_capturing)

    def test_the_functions_own_error_during_a_broken_capture_is_a_capture_failure(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED
            raise own_error(RuntimeError("(External) CUDA error(900), operation not permitted when stream is "
                                         "capturing"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertFalse(fake.paddle_capturing)

    def test_the_functions_own_error_on_an_intact_capture_is_handed_on(self):
        def body(fake):
            raise own_error(Boom("the function's own error"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, Boom)
        self.assertTrue(is_own_error(error))
        self.assertFalse(fake.paddle_capturing)
        self.assertEqual(fake.resets, 1, "the partial graph was ended and reset")

    def test_a_wrong_stream_handle_cannot_break_a_valid_capture(self):
        def body(fake):
            paddle.to_tensor(HOST)  # refused: the capture Paddle holds is still valid

        fake = _FakeCuda()
        with contextlib.ExitStack() as stack:
            for patch in fake.patches():
                stack.enter_context(patch)
            # The driver reports another stream than Paddle's: not capturing.
            stack.enter_context(mock.patch.object(cuda_driver, "capture_status", lambda stream: cuda_driver.NONE))
            with self.assertRaisesRegex(CaptureError, "paddle.to_tensor"):
                cuda_backend._CudaGraph(None, None).capture(lambda: body(fake))
        self.assertEqual((fake.paddle_capturing, fake.resets), (False, 1), "Paddle's own end ended it")

    def test_a_host_read_is_refused_before_it_reaches_cuda(self):
        def body(fake):
            paddle.to_tensor(np.ones([2], "float32"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertIn("paddle.to_tensor() of a numpy array", str(error))
        self.assertEqual((fake.paddle_capturing, fake.resets), (False, 1), "ended cleanly, not broken")


class CurrentStreamTest(unittest.TestCase):
    """The capture stream's handle is read through paddle.device.current_stream (Paddle 2.6 and 3.x), not the
    deprecated paddle.device.cuda.current_stream, whose DeprecationWarning reached users' logs on every capture.
    Stand-ins: on a CPU build Paddle's own call segfaults."""

    def test_the_current_api_is_used_where_it_exists(self):
        self.assertTrue(callable(getattr(paddle.device, "current_stream", None)), "both Paddles have it")
        place = object()
        current = mock.Mock(return_value=types.SimpleNamespace(cuda_stream=1234))
        deprecated = mock.Mock(side_effect=AssertionError("the deprecated API was called"))
        with mock.patch.object(paddle.device, "current_stream", current), \
                mock.patch.object(paddle.device.cuda, "current_stream", deprecated):
            self.assertEqual(cuda_backend._stream_handle(place), 1234)
        current.assert_called_once_with(place)
        deprecated.assert_not_called()

    def test_the_old_api_only_where_the_current_one_is_missing(self):
        stream = types.SimpleNamespace(stream_base=types.SimpleNamespace(cuda_stream=99))
        with mock.patch.object(paddle.device, "current_stream", None), \
                mock.patch.object(paddle.device.cuda, "current_stream", mock.Mock(return_value=stream)):
            self.assertEqual(cuda_backend._stream_handle(object()), 99)


class ForwardPoolOnCudaTest(unittest.TestCase):
    """NOTE [ Keys sharing a forward pool ] in backends/shared_pool.py on the real backend, against a stand-in of a
    Paddle that names pools at capture (3.1 and newer; the GPU host's Paddle 2.6.2 cannot run it): every forward
    of a device captures with one pool id, and a replay the rule blocks is refused before it reaches the device."""

    def test_forwards_share_one_pool_id_per_device_and_a_blocked_replay_is_refused(self):
        fake, made, replays = _FakeCuda(), [], []
        ids = iter(range(7, 100))
        fake.core.gen_new_memory_pool_id = staticmethod(lambda: next(ids))
        fake.core.begin_capture_with_pool_id = staticmethod(lambda place, mode, pool_id: None)

        class Graph(fake.graphs.CUDAGraph):
            def __init__(self, place=None, mode=None, pool_id=None):
                made.append(pool_id)

            def replay(self):
                replays.append(self)

        fake.graphs.CUDAGraph = Graph
        with contextlib.ExitStack() as stack:
            for patch in fake.patches():
                stack.enter_context(patch)
            shared_pool.forget_forward_pools()
            stack.callback(shared_pool.forget_forward_pools)
            backend = cuda_backend.CudaBackend(place="gpu:0")
            pool = backend.forward_pool()
            self.assertIs(cuda_backend.CudaBackend(place="gpu:0").forward_pool(), pool, "one pool per device")
            self.assertIsNot(cuda_backend.CudaBackend(place="gpu:1").forward_pool(), pool)
            self.assertEqual(pool.handle, 7)
            first, second = backend.new_graph(pool), backend.new_graph(pool)
            for graph in (first, second):
                graph.capture(lambda: [])
            self.assertEqual(made, [7, 7])
            self.assertEqual(pool.graphs, [first, second])
            self.assertEqual(backend.new_pool(), 9, "a key's own pool is another id (8: gpu:1's forward pool)")
            second.live = lambda: True  # its forward waits for its backward
            second.replay()
            with self.assertRaisesRegex(PoolConflictError, "captured after it into the same memory pool"):
                first.replay()
            self.assertEqual(len(replays), 1, "the refused replay never reached the device")
            second.live = lambda: False
            first.replay()
            second.reset()
            self.assertEqual(pool.graphs, [first])
