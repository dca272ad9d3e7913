"""Host time of the device work a replayed call launches, in four states of the device and the host (a probe).

    python tools/probes/launch_probe.py [--shape 32x1024] [--calls 200] [--rounds 7]

A replayed call launches device copies into existing tensors (its inputs into the static buffers, a chain member's
output into the tensor its head made, the output grad into its static buffer) and graph replays. Under cProfile in a
per-layer training step each ``Tensor.copy_`` took 12-13 us and each ``replay()`` 10-12.5 us of host time, against
2-5 us timed alone (docs/reports/per_layer_floor_probe.md). This times, interleaved, the host us per call of each
way to launch that work in four states:

* **idle**: the device synchronized before the round, the calls back to back (their own work is all it runs);
* **busy**: behind one graph of ``--busy`` 4096 x 4096 matmuls launched just before the round;
* **queued**: behind ``--queued`` launches of a graph of six matmuls of the shape (a per-layer model's forward
  layers, launched one after another as a step's calls launch them): many graph launches in flight;
* **cold**: each call timed alone after a pass of Python over ``--cold-mb`` MB of objects (what a call's checks and
  bookkeeping do to the CPU's caches between two of Paddle's calls), against **alone**: each call timed alone
  without that pass (the same timer, so the difference is the caches').

The ways: ``Tensor.copy_(src, False)``, ``_C_ops.assign_out_`` (Paddle's in-place assign), ``_C_ops.assign`` (a new
tensor holding a copy: the output hand-out of a call replayed alone), ``CUDAGraph.replay()`` of a graph of one
matmul of the shape, ``CUDAGraph.replay()`` of a graph of one copy between two fixed buffers (what a copy between two
static buffers costs as a captured graph: a chain member's input copy, were it captured from the previous member's
static output), and a bare ``paddle.matmul`` for scale. Each copy is checked bit for bit before timing. Needs a
CUDA GPU (cuBLAS matmuls and copies only: NOTE [ Kernel-less GPUs ] in testkit/common.py).
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

from testkit.common import host_tensor, normal  # noqa: E402

STATES = ("idle", "busy", "queued", "alone", "cold")


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
    """``(the ways by name, the static buffer the captured copy writes)``."""
    made = {"Tensor.copy_(src, False)": lambda: dst.copy_(src, False)}
    if hasattr(_C_ops, "assign_out_"):
        made["_C_ops.assign_out_(src, dst)"] = lambda: _C_ops.assign_out_(src, dst)
    made["_C_ops.assign(src) (a new tensor)"] = lambda: _C_ops.assign(src)
    graph = captured(lambda: paddle.matmul(src, wt))
    made["CUDAGraph.replay() of one matmul"] = graph.replay
    link = host_tensor(normal(7)(*src.shape))
    made["CUDAGraph.replay() of a captured copy"] = captured(lambda: link.copy_(src, False)).replay
    made["paddle.matmul (scale)"] = lambda: paddle.matmul(src, wt)
    return made, link


def check(made, src, dst, link):
    want = src.numpy().tobytes()
    for name, way in made.items():
        if "copy" not in name and "assign_out" not in name:
            continue
        into = link if "captured copy" in name else dst
        into.copy_(host_tensor(normal(9)(*src.shape)), False)
        way()
        paddle.device.cuda.synchronize()
        assert into.numpy().tobytes() == want, name


def timed_round(way, state, calls, before, junk):
    """Host us per call of ``way`` in ``state``; ``before()`` queues the device work of busy and queued."""
    if state in ("busy", "queued"):
        before[state]()
    if state in ("idle", "busy", "queued"):
        start = time.perf_counter()
        for _ in range(calls):
            way()
        return (time.perf_counter() - start) / calls * 1e6
    total = 0.0
    for _ in range(calls):
        if state == "cold":
            sum(len(s) for s in junk)  # the Python pass between two calls
        start = time.perf_counter()
        way()
        total += time.perf_counter() - start
    return total / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="32x1024", help="ROWSxCOLS of the float32 tensors (default 32x1024)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round (default 200)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; best and median shown (default 7)")
    parser.add_argument("--busy", type=int, default=8,
                        help="4096 x 4096 matmuls in the graph that keeps the device busy (default 8)")
    parser.add_argument("--queued", type=int, default=64,
                        help="launches of a six-matmul graph queued before a round (default 64)")
    parser.add_argument("--cold-mb", type=int, default=4, help="MB of Python objects walked before a cold call")
    args = parser.parse_args()
    if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0):
        print("launch_probe: needs a CUDA GPU")
        return 2
    rows, cols = (int(v) for v in args.shape.split("x"))
    src = host_tensor(normal(3)(rows, cols))
    dst = host_tensor(normal(5)(rows, cols))
    wt = host_tensor(normal(4)(cols, cols))
    made, link = ways(src, dst, wt)
    check(made, src, dst, link)
    big = host_tensor(normal(6)(4096, 4096))
    busy = captured(lambda: [paddle.matmul(big, big) for _ in range(args.busy)])

    def layer():
        h = src
        for _ in range(6):
            h = paddle.matmul(h, wt)
        return h

    six = captured(layer)
    before = {"busy": busy.replay, "queued": lambda: [six.replay() for _ in range(args.queued)]}
    junk = [str(i) * 8 for i in range(args.cold_mb * 1024 * 1024 // 64)]  # ~64 bytes an object with its string
    sync = paddle.device.cuda.synchronize
    span = {}
    for state, launch in before.items():
        sync()
        start = time.perf_counter()
        launch()
        sync()
        span[state] = (time.perf_counter() - start) * 1e3
    times = {(name, state): [] for name in made for state in STATES}
    for r in range(args.rounds):
        order = list(made.items()) if r % 2 == 0 else list(made.items())[::-1]
        for name, way in order:
            for state in STATES:
                sync()
                times[(name, state)].append(timed_round(way, state, args.calls, before, junk))
                sync()
    print(f"paddle {paddle.__version__}, shape {args.shape} float32, {args.calls} calls x {args.rounds} rounds; "
          f"busy: one graph of {args.busy} 4096 x 4096 matmuls ({span['busy']:.1f} ms alone); queued: "
          f"{args.queued} launches of a graph of six {args.shape} x {cols} matmuls ({span['queued']:.2f} ms alone); "
          f"cold: a pass over {args.cold_mb} MB of Python objects before each call")
    print("  host us per call, best / median of the rounds")
    print(f"  {'way':40s}" + "".join(f"{state:>16s}" for state in STATES))
    for name in made:
        cells = "".join(f"{min(times[(name, s)]):8.2f} /{statistics.median(times[(name, s)]):6.2f}"
                        for s in STATES)
        print(f"  {name:40s}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
