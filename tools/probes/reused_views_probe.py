"""Host time a model graphed layer by layer saves when its backwards hand out the views of the backward before (a probe).

    python tools/probes/reused_views_probe.py --out docs/reports/reused_views_probe.md
    python tools/probes/reused_views_probe.py --smoke      # CPU: the simulated backend, a few steps

A graphed layer hands its parameters' grads to autograd as views of its static grads; NOTE [ Reused aliases ] in
paddlefleet/cudagraph/grads/hand_out_plan.py hands out the views of the backward before again while nothing
touched them, instead of one ``unbind`` per stack and one view per single grad every backward. This probe times a
training loop that accumulates its grads (no ``clear_grad`` between steps: the grads stay ``p.grad`` and each
backward adds into them, cuBLAS's add on a GPU), for two models graphed layer by layer, each run twice from the
same parameters in interleaved rounds: as the package does it (views reused) and with every kept view treated as
touched (views made every backward, as before the reuse). Reported per config: host us per step (N steps back to
back, no sync inside; the host's own time, the lower quartile over rounds), the views made and reused, and a
bitwise check of both runs' grads against an eager twin that ran the same steps. Paddle's own elementwise kernels
are not used (matmuls, copies and the accumulation's add: NOTE [ Kernel-less GPUs ] in testkit/common.py).
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise)
import paddle  # noqa: E402

from paddlefleet.cudagraph.grads import hand_out_plan  # noqa: E402
from testkit.common import (host_tensor, info_lines, layer_stack, normal, run_info, through,  # noqa: E402
                            write_generated)

TOOL = "tools/probes/reused_views_probe.py"

#: (label, graphed layers, matmuls per layer, width, batch)
CONFIGS = (("16 layers x 1 matmul x 512 (one single grad per layer)", 16, 1, 512, 16),
           ("8 layers x 6 matmuls x 1024 (one stack of six grads per layer)", 8, 6, 1024, 16))


def _layers(n, matmuls, width, graphed, backend):
    graph = {"backend": backend, "warmup_steps": 1, "eager_if_slower": False} if graphed else None
    return layer_stack(n, [width] * (matmuls + 1), graph)


@contextlib.contextmanager
def _views_made_every_backward():
    """Every kept view counts as touched: the hand-out makes its views again, as it did before the reuse."""
    with mock.patch.object(hand_out_plan, "_unchanged", lambda kept: False):
        yield


def _counts(layers):
    plans = [p for layer in layers for p in layer.forward.entry().graphs.current.plans()]
    return sum(p.views_made for p in plans), sum(p.views_reused for p in plans)


def run_config(label, n, matmuls, width, batch, backend, steps, rounds, sync):
    draw = normal(7)
    x, dy = host_tensor(draw(batch, width)), host_tensor(draw(batch, width))
    runs = {"views reused": (_layers(n, matmuls, width, True, backend), contextlib.nullcontext),
            "views made every backward": (_layers(n, matmuls, width, True, backend), _views_made_every_backward)}
    eager = _layers(n, matmuls, width, False, backend)
    for _ in range(3):  # warmup, capture, first replay
        for layers, under in runs.values():
            with under():
                through(layers, x, dy)
        through(eager, x, dy)
    sync()
    host = {name: [] for name in runs}
    for _ in range(rounds):  # interleaved
        for name, (layers, under) in runs.items():
            with under():
                start = time.perf_counter()
                for _ in range(steps):
                    through(layers, x, dy)
                host[name].append((time.perf_counter() - start) / steps * 1e6)
                sync()
        for _ in range(steps):
            through(eager, x, dy)
    sync()
    want = [p.grad.numpy() for p in eager.parameters()]
    rows = []
    for name, (layers, _) in runs.items():
        got = [p.grad.numpy() for p in layers.parameters()]
        same = len(got) == len(want) and all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
        made, reused = _counts(layers)
        us = sorted(host[name])
        rows.append({"run": name, "host_us": us[len(us) // 4], "median_us": statistics.median(us), "made": made,
                     "reused": reused, "bitwise": same})
    return {"config": label, "layers": n, "steps": steps * rounds + 3, "rows": rows}


def markdown(results, info, steps, rounds):
    lines = ["# Reused views: host time of a loop that accumulates its grads", ""] + info_lines(info) + [
        f"- {rounds} interleaved rounds of {steps} steps per run (no sync inside a round); host us per step: the lower "
        "quartile over rounds (median in brackets); views counted over every backward of every layer", ""]
    for result in results:
        lines += [f"## {result['config']}", "", "| run | host us per step | views made | views reused | grads bitwise eager's |",
                  "|---|---|---|---|---|"]
        for row in result["rows"]:
            lines.append(f"| {row['run']} | {row['host_us']:.1f} ({row['median_us']:.1f}) | {row['made']} | "
                         f"{row['reused']} | {'yes' if row['bitwise'] else 'NO'} |")
        a, b = result["rows"]
        lines += ["", f"Reusing saves {b['host_us'] - a['host_us']:.1f} us a step, "
                      f"{(b['host_us'] - a['host_us']) / result['layers']:.1f} us per layer call.", ""]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: the simulated backend, a few steps, no report")
    parser.add_argument("--steps", type=int, default=50, help="steps per round (default 50)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--out", help="markdown report (text above its generated-text mark is kept)")
    args = parser.parse_args()
    on_gpu = not args.smoke
    if on_gpu and not paddle.device.is_compiled_with_cuda():
        raise SystemExit(f"{TOOL}: this Paddle has no CUDA; run it with --smoke on a CPU.")
    backend = "cuda" if on_gpu else "simulate"
    steps, rounds = (args.steps, args.rounds) if on_gpu else (3, 2)
    sync = paddle.device.cuda.synchronize if on_gpu else (lambda: None)
    configs = CONFIGS if on_gpu else tuple((label, 2, m, 16, 4) for label, _, m, _, _ in CONFIGS)
    results = [run_config(*config, backend, steps, rounds, sync) for config in configs]
    lines = markdown(results, run_info(on_gpu, REPO), steps, rounds)
    print("\n".join(lines))
    if args.out and on_gpu:
        write_generated(args.out, lines, TOOL)
    ok = all(row["bitwise"] for result in results for row in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
