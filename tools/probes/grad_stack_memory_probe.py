"""Pool bytes of a backward graph that stacks its grads, by how the stacks are made (a probe).

    python tools/probes/grad_stack_memory_probe.py

On a Paddle without node post hooks (2.6) the grads a backward graph stacks are copied into their stack after
``paddle.grad`` returned, so at the end of the capture each lives twice, as computed and stacked, and the graph's
private pool keeps that peak (NOTE [ Stacking grads as they arrive ] in paddlefleet/cudagraph/grads/stacks.py).
This probe asks whether making the stacks group by group, each group's grads as computed dropped right after
their copy, lets the pool's allocator put later stacks where earlier grads were. For a chain of square matmuls
(the benchmark's one-block MLPs), each variant's backward is captured into a graph of its own, right after the
allocator's cache is released, from the same eager forward, and the device memory the capture made the process
reserve is printed:

* ``raw``: the grads as ``paddle.grad`` returns them, no stack (the floor);
* ``one stack``: every grad copied into one stack after ``paddle.grad`` (what the package does on Paddle 2.6);
* ``stacks of k``: stacks of k grads each, in the order the backward made the grads (the last layer's first),
  each group's grads as computed dropped right after their copy; also in the parameters' order.

Every variant's replay is checked bit for bit against an eager ``paddle.grad``. Needs a GPU (CUDA graphs);
Paddle's own elementwise kernels are not used (matmuls and copies only: NOTE [ Kernel-less GPUs ] in
testkit/common.py). Report: docs/reports/grad_stack_memory_probe.md.
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise)
import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402

MIB = float(1 << 20)


def _model(layers, width, batch):
    rng = np.random.default_rng(0)
    ws = []
    for _ in range(layers):
        w = paddle.to_tensor((rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32"))
        w.stop_gradient = False
        ws.append(w)
    x = paddle.to_tensor(rng.standard_normal((batch, width)).astype("float32"))
    dy = paddle.to_tensor(rng.standard_normal((batch, width)).astype("float32"))
    return ws, x, dy


def _forward(ws, x):
    h = x
    for w in ws:
        h = paddle.matmul(h, w)
    return h


def _stacks(grads, groups):
    """Copies ``grads[i]`` for i in each group into a new stack, dropping each group's grads after the copy."""
    out = []
    for idxs in groups:
        first = grads[idxs[0]]
        stack = _C_ops.empty([len(idxs)] + list(first.shape), first.dtype, first.place)
        for part, i in zip(_C_ops.unbind(stack, 0), idxs):
            part.copy_(grads[i], False)
        for i in idxs:
            grads[i] = None
        out.append(stack)
    return out


def _variants(n):
    made = list(range(n))[::-1]  # the backward makes the last layer's grad first
    rows = [("raw", None), ("one stack", [list(range(n))])]
    for k in (8, 4, 2):
        if k < n and n % k == 0:
            rows.append((f"stacks of {k}, in the order the grads are made", [made[j:j + k] for j in range(0, n, k)]))
            rows.append((f"stacks of {k}, in the parameters' order", [list(range(j, j + k)) for j in range(0, n, k)]))
    return rows


def probe(layers, width, batch):
    from paddle.device.cuda.graphs import CUDAGraph

    ws, x, dy = _model(layers, width, batch)
    y = _forward(ws, x)
    want = [g.numpy() for g in paddle.grad([y], ws, [dy], retain_graph=True)]
    grads_mib = sum(g.nbytes for g in want) / MIB
    print(f"{layers} matmuls x {width}, batch {batch}: grads {grads_mib:.2f} MiB")
    kept = []  # graphs stay alive until the end, as a model's graphs do
    for name, groups in _variants(layers):
        def body():
            grads = list(paddle.grad([y], ws, [dy], retain_graph=True))
            return grads if groups is None else _stacks(grads, groups)

        paddle.device.cuda.synchronize()
        paddle.device.cuda.empty_cache()
        before = paddle.device.cuda.memory_reserved()
        graph = CUDAGraph()
        graph.capture_begin()
        try:
            results = body()
        finally:
            graph.capture_end()
        grown = (paddle.device.cuda.memory_reserved() - before) / MIB
        graph.replay()
        paddle.device.cuda.synchronize()
        got = [r.numpy() for r in results]
        if groups is not None:
            flat = {}
            for idxs, stack in zip(groups, got):
                flat.update(zip(idxs, stack))
            got = [flat[i] for i in range(layers)]
        same = all(np.array_equal(a, b) for a, b in zip(got, want))
        print(f"  {name:48s} pool {grown:8.2f} MiB  ({grown / grads_mib:.2f}x the grads)  "
              f"{'bitwise equal to eager' if same else 'NOT EQUAL to eager'}")
        kept.append((graph, results))
    for graph, _ in kept:
        graph.reset()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="16x512x16,32x256x8",
                        help="comma-separated LAYERSxWIDTHxBATCH (default: the benchmark's one-block MLPs)")
    args = parser.parse_args()
    if not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0):
        print("grad_stack_memory_probe: no GPU here: it measures CUDA graph pools", file=sys.stderr)
        sys.exit(2)
    paddle.set_device("gpu")
    print(f"paddle {paddle.__version__}; device memory reserved by each capture, after the cache was released")
    for config in args.configs.split(","):
        layers, width, batch = (int(v) for v in config.split("x"))
        probe(layers, width, batch)


if __name__ == "__main__":
    main()
