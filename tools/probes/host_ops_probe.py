"""Host cost of the Paddle calls a graphed call makes, one by one (a probe).

    python tools/probes/host_ops_probe.py

Times (perf_counter, best of 7 rounds of 2,000 calls, us per call) the tensor attribute reads a key makes,
the copies and views a replay makes and a CUDAGraph replay of one small matmul, on the GPU when there is one;
there also a device copy made through the driver directly (``cuMemcpyDtoDAsync`` through ctypes, on Paddle's
stream, checked to copy) against ``Tensor.copy_``. Report: docs/reports/host_ops_probe.md.
"""

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402

from paddlefleet.cudagraph.core.state import amp_state  # noqa: E402
from paddlefleet.cudagraph.io.static_inputs import place_key  # noqa: E402


def timed(fn, n=2000):
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    paddle.set_device("gpu" if gpu else "cpu")
    t = paddle.to_tensor([[1.0] * 64] * 32)
    out = paddle.empty([32, 64])
    w = paddle.to_tensor([[1.0] * 64] * 64)
    place = t.place
    rows = [
        ("t.place", lambda: t.place),
        ("place_key(t.place)", lambda: place_key(t.place)),
        ("place.is_gpu_place()", lambda: place.is_gpu_place()),
        ("place.gpu_device_id()", lambda: place.gpu_device_id()),
        ("t.shape", lambda: t.shape),
        ("tuple(t.shape)", lambda: tuple(t.shape)),
        ("t.dtype", lambda: t.dtype),
        ("int(t.dtype)", lambda: int(t.dtype)),
        ("t.stop_gradient", lambda: t.stop_gradient),
        ("t._inplace_version()", lambda: t._inplace_version()),
        ("t.data_ptr()", lambda: t.data_ptr()),
        ("amp_state()", amp_state),
        ("paddle.is_grad_enabled()", paddle.is_grad_enabled),
        ("out.copy_(t, False)", lambda: out.copy_(t, False)),
        ("_C_ops.assign(t)", lambda: _C_ops.assign(t)),
        ("_C_ops.assign_out_(t, out)", lambda: _C_ops.assign_out_(t, out)),
        ("_C_ops.view_shape(t, shape)", lambda: _C_ops.view_shape(t, [32, 64])),
        ("_C_ops.empty(shape)", lambda: _C_ops.empty([32, 64], t.dtype, place)),
        ("paddle.matmul(t, w)", lambda: paddle.matmul(t, w)),
    ]
    if gpu:
        import ctypes

        from paddlefleet.cudagraph.backends.cuda import _stream_handle
        from paddlefleet.cudagraph.backends.cuda_driver import _driver

        stream = _stream_handle(place)
        driver = _driver()
        memcpy = driver.cuMemcpyDtoDAsync_v2
        memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        nbytes = 32 * 64 * 4
        rows += [("current stream handle", lambda: _stream_handle(place)),
                 ("paddle.device.cuda.current_stream()", paddle.device.cuda.current_stream),
                 ("cuMemcpyDtoDAsync (ctypes)", lambda: memcpy(out.data_ptr(), t.data_ptr(), nbytes, stream)),
                 ("empty + cuMemcpyDtoDAsync", lambda: memcpy(_C_ops.empty([32, 64], t.dtype, place).data_ptr(),
                                                              t.data_ptr(), nbytes, stream))]
        from paddle.device.cuda.graphs import CUDAGraph
        g = CUDAGraph()
        g.capture_begin()
        paddle.matmul(t, w)
        g.capture_end()
        rows.append(("CUDAGraph.replay()", g.replay))
    if gpu:  # the ctypes copy wrote what copy_ writes
        memcpy(out.data_ptr(), w.data_ptr(), nbytes, stream)
        paddle.device.cuda.synchronize()
        print("ctypes copy equal to its source:", bool((out.numpy() == w.numpy()[:32]).all()))
    print(f"paddle {paddle.__version__}, {'GPU' if gpu else 'CPU'}; us per call (best of 7 rounds of 2,000)")
    for name, fn in rows:
        try:
            print(f"  {name:32s} {timed(fn):7.2f}")
        except Exception as err:  # an op this Paddle lacks
            print(f"  {name:32s} unavailable: {type(err).__name__}: {str(err)[:80]}")
        if gpu:
            paddle.device.cuda.synchronize()


if __name__ == "__main__":
    main()
