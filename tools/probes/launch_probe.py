"""Host time of the device work a replayed call launches, with the device idle and with it busy (a probe).

    python tools/probes/launch_probe.py [--shape 32x1024] [--calls 200] [--rounds 7]

A replayed call launches device copies into existing tensors (its inputs into the static buffers, a chain member's
output into the tensor its head made, the output grad into its static buffer) and graph replays; under cProfile in a
per-layer training step each ``Tensor.copy_`` took 12-13 us and each ``replay()`` 10-12.5 us of host time, against
2-3 us timed alone (docs/reports/per_layer_floor_probe.md). This times, interleaved, the host us per call of each
way to launch that work, in two states of the device: **idle** (synchronized before the round: the calls' own work
is all it runs) and **busy** (a graph of ``--busy`` large matmuls launched just before the round: every call queues
behind it, as the calls of a step queue behind the layers before them). The ways: ``Tensor.copy_(src, False)``,
the compiled ``copy_into`` (NOTE [ Compiled copies ] in native/__init__.py: the same Paddle copy, called from C),
``_C_ops.assign_out_`` (Paddle's in-place assign), ``_C_ops.assign`` (a new tensor holding a copy, the output
hand-out of a call replayed alone), ``CUDAGraph.replay()`` of a graph of one matmul of the shape, and a bare
``paddle.matmul`` for scale. Each copy is checked bit for bit before timing. Needs a CUDA GPU (cuBLAS matmuls and
copies only: NOTE [ Kernel-less GPUs ] in testkit/common.py).
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO]

import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402
from paddle.device.cuda.graphs import CUDAGraph  # noqa: E402

from paddlefleet.cudagraph import native  # noqa: E402
from testkit.common import host_tensor, normal  # noqa: E402


def captured(fn):
    """A CUDAGraph of ``fn()``, warmed up once outside the capture."""
    fn()
    paddle.device.cuda.synchronize()
    graph = CUDAGraph()
    graph.capture_begin()
    fn()
    graph.capture_end()
    return graph


def ways(src, dst, wt):
    made = {"Tensor.copy_(src, False)": lambda: dst.copy_(src, False)}
    if native.copy_into is not None:
        made["compiled copy_into(dst, src)"] = lambda: native.copy_into(dst, src)
    if hasattr(_C_ops, "assign_out_"):
        made["_C_ops.assign_out_(src, dst)"] = lambda: _C_ops.assign_out_(src, dst)
    made["_C_ops.assign(src) (a new tensor)"] = lambda: _C_ops.assign(src)
    graph = captured(lambda: paddle.matmul(src, wt))
    made["CUDAGraph.replay() of one matmul"] = graph.replay
    made["paddle.matmul (scale)"] = lambda: paddle.matmul(src, wt)
    return made


def check(made, src, dst):
    want = src.numpy().tobytes()
    for name, way in made.items():
        if "copy" not in name and "assign_out" not in name:
            continue
        dst.copy_(host_tensor(normal(9)(*src.shape)), False)
        way()
        paddle.device.cuda.synchronize()
        assert dst.numpy().tobytes() == want, name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="32x1024", help="ROWSxCOLS of the float32 tensors (default 32x1024)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round (default 200)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; best and median shown (default 7)")
    parser.add_argument("--busy", type=int, default=8,
                        help="4096 x 4096 matmuls in the graph that keeps the device busy (default 8)")
    args = parser.parse_args()
    if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0):
        print("launch_probe: needs a CUDA GPU")
        return 2
    native.load()
    rows, cols = (int(v) for v in args.shape.split("x"))
    src = host_tensor(normal(3)(rows, cols))
    dst = host_tensor(normal(5)(rows, cols))
    wt = host_tensor(normal(4)(cols, cols))
    made = ways(src, dst, wt)
    check(made, src, dst)
    big = host_tensor(normal(6)(4096, 4096))
    busy = captured(lambda: [paddle.matmul(big, big) for _ in range(args.busy)])
    sync = paddle.device.cuda.synchronize
    sync()
    start = time.perf_counter()
    busy.replay()
    sync()
    busy_ms = (time.perf_counter() - start) * 1e3
    times = {(name, state): [] for name in made for state in ("idle", "busy")}
    for r in range(args.rounds):
        order = list(made.items()) if r % 2 == 0 else list(made.items())[::-1]
        for name, way in order:
            for state in ("idle", "busy"):
                sync()
                if state == "busy":
                    busy.replay()
                start = time.perf_counter()
                for _ in range(args.calls):
                    way()
                times[(name, state)].append((time.perf_counter() - start) / args.calls * 1e6)
                sync()
    print(f"paddle {paddle.__version__}, shape {args.shape} float32, {args.calls} calls x {args.rounds} rounds; "
          f"busy: a graph of {args.busy} 4096 x 4096 matmuls ({busy_ms:.1f} ms alone); compiled reads: "
          f"{'in use' if native.reads is not None else native.status()[1]}")
    print(f"  {'way':40s} {'idle best':>10s} {'median':>8s} {'busy best':>10s} {'median':>8s}  (host us per call)")
    for name in made:
        idle, queued = times[(name, "idle")], times[(name, "busy")]
        print(f"  {name:40s} {min(idle):10.2f} {statistics.median(idle):8.2f} {min(queued):10.2f} "
              f"{statistics.median(queued):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
