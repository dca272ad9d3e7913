"""What a compiled autograd bridge would cost on the host, against Paddle's PyLayer (a probe).

    OMP_NUM_THREADS=1 python tools/probes/compiled_bridge.py [--out docs/reports/compiled_bridge.md]

A graphed layer call crosses autograd once per forward and once per backward: a PyLayer with one
input per tensor argument and one per parameter, whose backward hands one grad per input. A
compiled bridge would be a C++ custom operator (Paddle's extension API: ``PD_BUILD_OP`` with its
``PD_BUILD_GRAD_OP``, parameters as one ``paddle::Vec`` input) whose kernels replay the graphs.
This probe builds such an operator (tools/probes/compiled_bridge_op.cc, with Paddle's JIT
``cpp_extension.load``: needs a C++ compiler) whose kernels only copy (no graph: what is left is the
bridge's host cost), and times forward + backward of one call, thread CPU time, with 0, 6 and 16
parameters, side by side and interleaved with: the same PyLayer handing copies; the PyLayer handing
aliases (views, as the package's default hand-out does); the PyLayer whose parameter inputs need no
grad (what autograd's per-parameter edges cost). Both sides' grads are compared bitwise first.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

HERE = os.path.dirname(os.path.abspath(__file__))
VIEW = getattr(_C_ops, "view_shape", None)


def build_op():
    from paddle.utils.cpp_extension import load

    build = os.path.join(tempfile.gettempdir(), "paddlefleet_compiled_bridge_" + paddle.__version__)
    os.makedirs(build, exist_ok=True)
    return load(name="graph_bridge", sources=[os.path.join(HERE, "compiled_bridge_op.cc")], build_directory=build,
                verbose=False)


class Copies(PyLayer):
    @staticmethod
    def forward(ctx, x, *params):
        ctx.params = params
        return _C_ops.assign(x)

    @staticmethod
    def backward(ctx, g):
        return (_C_ops.assign(g),) + tuple(_C_ops.assign(p) for p in ctx.params)


class Frozen(PyLayer):
    @staticmethod
    def forward(ctx, x, *params):
        ctx.n = len(params)
        return _C_ops.assign(x)

    @staticmethod
    def backward(ctx, g):
        return (_C_ops.assign(g),) + (None,) * ctx.n


class Aliases(PyLayer):
    static_grads = ()

    @staticmethod
    def forward(ctx, x, *params):
        ctx.grads = Aliases.static_grads  # the static grads a backward graph writes, made once
        return _C_ops.assign(x)

    @staticmethod
    def backward(ctx, g):
        return (_C_ops.assign(g),) + tuple(VIEW(t, t.shape) for t in ctx.grads)


def timed(fn, clear, rounds=20, calls=50):
    best = []
    for _ in range(rounds):
        ts = []
        for _ in range(calls):
            t = time.thread_time()
            fn()
            ts.append(time.thread_time() - t)
            clear()
        best.append(statistics.median(ts))
    return min(best) * 1e6


def run(op, n):
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    params = [paddle.create_parameter([8, 8], "float32") for _ in range(n)]
    frozen = [paddle.randn([8, 8]) for _ in range(n)]  # inputs that need no grad
    dy = paddle.ones([4, 8])
    Aliases.static_grads = [_C_ops.assign(p) for p in params]

    def clear():
        for p in params:
            p.clear_gradient(False)
        x.clear_gradient(False)

    runners = {
        "custom operator (copies)": lambda: op.graph_bridge(x, params).backward(dy),
        "PyLayer (copies)": lambda: Copies.apply(x, *params).backward(dy),
        "PyLayer (aliases)": lambda: Aliases.apply(x, *params).backward(dy),
        "PyLayer, parameters needing no grad": lambda: Frozen.apply(x, *frozen).backward(dy),
    }
    grads = {}
    for name in ("custom operator (copies)", "PyLayer (copies)"):
        runners[name]()
        grads[name] = [x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in params]
        clear()
    a, b = grads.values()
    assert all((u == v).all() for u, v in zip(a, b)), "the custom operator's grads differ from the PyLayer's"
    times = {name: [] for name in runners}
    for _ in range(3):  # interleaved
        for name, fn in runners.items():
            times[name].append(timed(fn, clear, rounds=7))
    return {name: min(v) for name, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table as markdown here")
    args = parser.parse_args()
    op = build_op()
    rows = {n: run(op, n) for n in (0, 6, 16)}
    names = list(rows[0])
    lines = [f"Host us of one bridge call, forward + backward (thread CPU time, median of 50 calls, best of 21 "
             f"interleaved rounds); paddle {paddle.__version__}, python {sys.version.split()[0]}, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, CPU tensors [4, 8] and parameters [8, 8]",
             "", "| parameters | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {n} | " + " | ".join(f"{rows[n][k]:.1f}" for k in names) + " |" for n in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
