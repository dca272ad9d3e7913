"""Where the host time of a graphed training step goes: each piece timed alone.

On the GPU host (after ``source .gpu/bin/env.sh``)::

    python tools/host_breakdown.py --out docs/host_breakdown.md

CPU smoke test (simulated backend; Paddle's own pieces only)::

    python tools/host_breakdown.py --backend simulate

Each row is the median host time of one operation (no device synchronisation inside the timed
region; one sync after each batch of repetitions so the queue stays short), for the 16-layer
512-wide matmul MLP of tools/bench.py (batch 16). The rows split the wrapper's per-step overhead
into Paddle's parts (PyLayer, autograd engine, Tensor.backward, copies) and ours (key, checks).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402
from paddle.autograd import PyLayer  # noqa: E402

from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from paddlefleet.cudagraph.static_io import flatten  # noqa: E402


class MLP(paddle.nn.Layer):
    def __init__(self, layers, width, rng):
        super().__init__()
        self.ws = paddle.nn.ParameterList()
        for _ in range(layers):
            w = self.create_parameter([width, width])
            w.set_value((rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32"))
            self.ws.append(w)

    def forward(self, x):
        for w in self.ws:
            x = paddle.matmul(x, w)
        return x


class Passthrough(PyLayer):
    """A PyLayer with the bridge's shape: one output, grads for the input and every parameter."""

    grads = ()

    @staticmethod
    def forward(ctx, x, *params):
        return _C_ops.assign(x)

    @staticmethod
    def backward(ctx, dy):
        return (None,) + tuple(Passthrough.grads)  # x needs no grad, as in the benchmark


def timed(fn, reps, sync):
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        sync()
    return statistics.median(samples) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "gpu" if args.backend == "cuda" else "cpu"
    paddle.set_device(device)
    sync = (lambda: paddle.device.synchronize()) if device == "gpu" else (lambda: None)
    rng = np.random.default_rng(0)
    model = MLP(args.layers, args.width, rng)
    params = list(model.parameters())
    x = paddle.to_tensor(rng.standard_normal((args.batch, args.width)).astype("float32"))
    dy = paddle.to_tensor(rng.standard_normal((args.batch, args.width)).astype("float32"))
    stack = paddle.to_tensor(np.zeros((args.layers, args.width, args.width), "float32"))
    Passthrough.grads = [paddle.to_tensor(np.zeros((args.width, args.width), "float32")) for _ in params]

    def release():
        for p in params:
            p.clear_gradient(False)

    autocudagraph(model, backend=args.backend, warmup_steps=1)
    for _ in range(3):
        model(x).backward(dy)
        release()
    sync()
    g = model.forward
    entry = next(iter(g._entries.values()))
    tensors, consts, spec = flatten(((x,), {}))
    rows = []

    def row(name, fn, who):
        rows.append((name, who, timed(fn, args.reps, sync)))

    def step():
        model(x).backward(dy)
        release()

    row("graphed step: forward call + backward + release grads", step, "total")
    row("release 16 grads (clear_gradient(False))", release, "benchmark loop")
    row("forward call alone (then drop the output)", lambda: model(x), "total")
    row("flatten the arguments", lambda: flatten(((x,), {})), "ours")
    row("key of the call", lambda: g._keys.key((x,), {}, tensors, spec), "ours")
    row("parameter-address check", lambda: g._params_moved(entry), "ours")
    row("input copy into the static buffer (copy_)", lambda: entry.static_inputs.copy_in(tensors), "ours (1 device copy)")
    row("forward graph replay()", lambda: entry.fwd_graph.replay(), "Paddle")
    row("backward graph replay()", lambda: entry.bwd_graph.replay(), "Paddle")
    row("one device copy (_C_ops.assign of the 16x512 output)", lambda: _C_ops.assign(x), "Paddle")
    row("one device copy of a 16 x 512 x 512 grad stack", lambda: _C_ops.assign(stack), "Paddle")
    row("unbind of the grad stack into 16 views", lambda: _C_ops.unbind(stack, 0), "Paddle")

    def pylayer_forward():
        Passthrough.apply(x, *params)

    row("PyLayer.apply with 17 tensor inputs (forward: 1 copy)", pylayer_forward, "Paddle")

    def pylayer_step():
        Passthrough.apply(x, *params).backward(dy)
        release()

    row("PyLayer forward + Tensor.backward handing 16 grads to autograd + release", pylayer_step, "Paddle")
    x_leaf = x.detach()
    x_leaf.stop_gradient = False

    def tiny_backward():
        y = paddle.matmul(x_leaf, params[0])
        y.backward(dy)
        release()
        x_leaf.clear_gradient(False)

    row("eager matmul + Tensor.backward (1 layer) + release, for scale", tiny_backward, "Paddle")

    lines = [
        "# Host time of the pieces of a graphed step",
        "",
        f"- Paddle {paddle.__version__}, backend {args.backend}, device {paddle.get_device()}"
        + (f" ({paddle.device.cuda.get_device_name()})" if device == "gpu" else ""),
        f"- model: {args.layers} matmul layers x {args.width}, batch {args.batch}; median of {args.reps} "
        "repetitions, host time without a device sync inside the timed region",
        "",
        "| piece | whose | host us |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {who} | {us:.1f} |" for name, who, us in rows]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
