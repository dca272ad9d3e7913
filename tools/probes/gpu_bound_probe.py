"""Graphed blocks against eager where graphing cannot pay: GPU-bound blocks, one-matmul layers (a probe).

    python tools/probes/gpu_bound_probe.py [--width 4096] [--layers 8] [--blocks 4] [--batch 64]

An MLP of ``--layers`` square matmuls in ``--blocks`` equal blocks (``--blocks`` = ``--layers``: one graphed
Layer per layer). Times, side by side in one process, eager and the blocks graphed under several options (every
key kept graphed, ``eager_if_slower=False``, unless the runner says otherwise; chains form where calls link),
some blocks graphed and the others plain, in both modes (throughput: one sync at the end; latency: a sync per
step), best of 3 interleaved rounds, with the forward call's host time per step; then a cProfile of graphed and
of eager throughput steps (where the host waits shows as the time of the call that waited). Every runner is
compared bit for bit with eager first. Report: docs/reports/gpu_bound_probe.md.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import numpy  # noqa: E402
import paddle  # noqa: E402

from benchmark.paddle_runs import Blocks  # noqa: E402
from benchmark.timing import Config  # noqa: E402
from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from testkit.common import build, device, host_tensor, normal  # noqa: E402


def sync():
    paddle.device.cuda.synchronize()


def make(args, options):
    """The model, its blocks graphed with ``options`` (None: eager). ``options["only"]``: the indices of the blocks
    graphed (the others stay plain Layers); ``eager_if_slower`` is False unless ``options`` says otherwise."""
    cfg = Config("probe", args.layers, args.width, args.batch, blocks=args.blocks)  # the benchmark's blocks
    model = build(lambda: Blocks(cfg), 1)
    if options is not None:
        options = dict(options)
        only = options.pop("only", range(args.blocks))
        options.setdefault("eager_if_slower", False)
        for i in only:
            autocudagraph(model.blocks[i], backend="cuda", **options)
    return model, model.parameters()


def step_fn(model, params, x, dy, host):
    pc = time.perf_counter

    def step():
        start = pc()
        y = model(x)
        host.append(pc() - start)
        y.backward(dy)
        for p in params:
            p.clear_gradient(False)
    return step


def snapshot(model, x, dy):
    y = model(x)
    y.backward(dy)
    out = [y.numpy()] + [p.grad.numpy() for p in model.parameters()]
    for p in model.parameters():
        p.clear_gradient(False)
    return out


def timed(step, steps, mode):
    sync()
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if mode == "latency":
            sync()
            times.append(time.perf_counter() - t0)
    sync()
    if mode == "throughput":
        return (time.perf_counter() - start) / steps * 1e6
    return float(numpy.median(times)) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096, help="width of every square matmul (default 4096)")
    parser.add_argument("--layers", type=int, default=8, help="matmuls of the MLP (default 8)")
    parser.add_argument("--blocks", type=int, default=4, help="graphed blocks the matmuls are split into (default 4)")
    parser.add_argument("--batch", type=int, default=64, help="rows of the input (default 64)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per runner, mode and round (default 50)")
    args = parser.parse_args()
    runners = {"eager": None, "graphed": {}, "clone_param_grads=True": {"clone_param_grads": True},
               "chain_calls=False": {"chain_calls": False}, "eager_if_slower=True": {"eager_if_slower": True},
               "blocks 0, 2 graphed": {"only": (0, 2)}, "blocks 0, 1 graphed": {"only": (0, 1)},
               "blocks 2, 3 graphed": {"only": (2, 3)}}
    with device("gpu"):
        draw = normal(1234)
        x, dy = host_tensor(draw(args.batch, args.width)), host_tensor(draw(args.batch, args.width))
        reference = snapshot(make(args, None)[0], x, dy)
        built = {}
        for name, options in runners.items():
            model, params = make(args, options)
            host = []
            step = step_fn(model, params, x, dy, host)
            for _ in range(30):  # eager_if_slower's 8 eager samples, the capture, 9 timed replays
                step()
            got = snapshot(model, x, dy)
            same = all(numpy.array_equal(a, b) for a, b in zip(got, reference))
            stats = [b.forward.stats() for b in model.blocks if hasattr(b.forward, "stats")]
            counts = {k: sum(s[k] for s in stats) for k in ("captures", "replays", "eager_calls")} if stats else {}
            print(f"{name}: bitwise equal to eager: {same}; {counts}", flush=True)
            built[name] = (model, step, host)
        results = {(n, m): [] for n in runners for m in ("throughput", "latency")}
        hosts = {n: [] for n in runners}
        for r in range(3):
            for mode in ("throughput", "latency"):
                for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                    model, step, host = built[name]
                    host.clear()
                    results[(name, mode)].append(timed(step, args.steps, mode))
                    if mode == "throughput":
                        hosts[name].extend(host)
        print(f"\n{args.layers} x {args.width}, batch {args.batch}, {args.blocks} blocks; us per step, best of 3 "
              "(throughput / latency); forward call host us (median, throughput steps)")
        for name in runners:
            print(f"  {name:24s} {min(results[(name, 'throughput')]):8.1f} / {min(results[(name, 'latency')]):8.1f}"
                  f"   forward host {numpy.median(hosts[name]) * 1e6:8.1f}", flush=True)
        for name in ("graphed", "eager"):
            model, step, host = built[name]
            sync()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                step()
            sync()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(f"\ncProfile of {args.steps} {name} throughput steps (tottime):")
            print("\n".join(text.getvalue().splitlines()[:45]), flush=True)


if __name__ == "__main__":
    main()
