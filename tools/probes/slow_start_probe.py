"""Verdicts made while the host runs slow during the keys' eager samples only (a probe).

    python tools/probes/slow_start_probe.py [--width 2048 --layers 24 --batch 8] [--slow-steps 8] [--steps 40]

The benchmark's one-matmul per-layer model (``--layers`` square matmuls of ``--width``, one graphed Layer per layer;
on a quiet H200 host every key is judged slower graphed: docs/reports/pass_through_probe.md), built once per runner
with the same parameters. The probe pins itself to one CPU; for the runners marked "slowed", a busy process runs
during the first ``--slow-steps`` steps (the keys' eager samples: NOTE [ Graphed calls that cannot pay ] in
core/host_cost.py) on the core sibling of that CPU where it has one (``--busy sibling``: every instruction of the
probe slower while both run) or on the CPU itself (``--busy same``: the two take turns in time slices, so a call
runs at full speed or waits a slice), and is stopped before the captures; the replays are then timed on a quiet
host. Runners:

* eager (no wrapper): the reference, bit for bit, and the step time;
* judged, slowed: the library as it is (each sample followed by its host-speed probe, ``speed_probe``);
* judged, slowed, the host speed not probed (``speed_probe`` a constant while it is built: the verdict as it was
  before the probe);
* judged, quiet: no busy process.

Each runner runs ``--steps`` steps (every key judged by then), is compared bit for bit with eager (output and grads),
and prints how many keys stayed graphed, the keys' slowdowns (HostCost.slowdown(), the verdict's scale) and the
forward host time a step and the step time in throughput against eager's, timed interleaved after every runner was
built (best of 3 rounds). Nothing here changes the library but the stand-in probe of the third runner.

Report: docs/reports/slow_start_probe.md.
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools"), os.path.dirname(os.path.abspath(__file__))]

import numpy  # noqa: E402
import paddle  # noqa: E402

from gpu_bound_probe import make, snapshot, step_fn, timed  # noqa: E402
from testkit.common import device, host_tensor, normal  # noqa: E402

RUNNERS = {"eager": None, "judged, slowed": "probed", "judged, slowed, host speed not probed": "unprobed",
           "judged, quiet": "quiet"}


def busy(cpu):
    """A process spinning on ``cpu`` until killed."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def bare_us(fn, calls=500):
    """(mean, lower quartile) us of host time of ``calls`` calls of ``fn``, each timed."""
    took = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)
    return statistics.mean(took) * 1e6, statistics.quantiles(took, n=4)[0] * 1e6


def sibling(cpu):
    """Another CPU sharing ``cpu``'s core (SMT), or None."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    others = sorted(cpus - {cpu})
    return others[0] if others else None


def build(args, kind, x, dy, busy_cpu, matmul):
    """(model, step, host samples, the bare matmul's us while slowed or None) of one runner, its ``args.steps``
    steps run (the first ``args.slow_steps`` of them beside a busy process where ``kind`` says so)."""
    from unittest import mock

    from paddlefleet.cudagraph.core import host_cost

    model, params = make(args, None if kind is None else {"eager_if_slower": True})
    host = []
    step = step_fn(model, params, x, dy, host)
    hog, slowed = None, None
    with mock.patch.object(host_cost, "speed_probe", lambda: 1e-6) if kind == "unprobed" else contextlib.nullcontext():
        if kind in ("probed", "unprobed"):
            hog = busy(busy_cpu)
            time.sleep(0.2)  # the busy process started and spinning
        try:
            for i in range(args.steps):
                if i == args.slow_steps and hog is not None:
                    slowed = bare_us(matmul)
                    hog.kill()
                    hog.wait()
                    hog = None
                step()
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    return model, step, host, slowed


def verdicts(model):
    """(keys graphed, keys in all, the keys' slowdowns) of a model's wrappers."""
    entries = [e for b in model.blocks if hasattr(b.forward, "entries") for e in b.forward.entries().values()]
    graphed = sum(1 for e in entries if e.phase.value == "replay")
    slowdowns = [e.host_cost.slowdown() for e in entries]
    return graphed, len(entries), slowdowns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="width of every square matmul (default 2048)")
    parser.add_argument("--layers", type=int, default=24, help="one-matmul Layers, each wrapped (default 24)")
    parser.add_argument("--batch", type=int, default=8, help="rows of the input (default 8)")
    parser.add_argument("--steps", type=int, default=40, help="steps each runner runs before timing (default 40)")
    parser.add_argument("--slow-steps", type=int, default=8,
                        help="first steps run beside the busy process (default 8: the eager samples)")
    parser.add_argument("--timed", type=int, default=50, help="timed steps per runner and round (default 50)")
    parser.add_argument("--busy", choices=("sibling", "same"), default="sibling",
                        help="where the busy process spins: the probe's core sibling where it has one (default), or "
                             "its own CPU (time slices: the lower quartiles leave those stalls out)")
    args = parser.parse_args()
    args.blocks = args.layers
    cpu = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {cpu})
    busy_cpu = cpu if args.busy == "same" or sibling(cpu) is None else sibling(cpu)
    warnings.simplefilter("ignore")
    with device("gpu"):
        draw = normal(1234)
        x, dy = host_tensor(draw(args.batch, args.width)), host_tensor(draw(args.batch, args.width))
        w = host_tensor(draw(args.width, args.width))
        matmul = lambda: paddle.matmul(x, w)  # noqa: E731
        mean, low = bare_us(matmul)
        where = "the same CPU" if busy_cpu == cpu else "its core sibling"
        print(f"pinned to CPU {cpu}, the busy process on CPU {busy_cpu} ({where}); a bare matmul [{args.batch}, "
              f"{args.width}] x [{args.width}, {args.width}]: {mean:.2f} us of host time (lower quartile {low:.2f})",
              flush=True)
        reference = snapshot(make(args, None)[0], x, dy)
        built = {}
        for name, kind in RUNNERS.items():
            model, step, host, slowed = build(args, kind, x, dy, busy_cpu, matmul)
            got = snapshot(model, x, dy)
            same = all(numpy.array_equal(a, b) for a, b in zip(got, reference))
            if not same:
                raise SystemExit(f"{name} differs from eager")
            line = f"{name}: bitwise equal to eager: {same}"
            if kind is not None:
                graphed, keys, slowdowns = verdicts(model)
                line += (f"; {graphed} of {keys} keys graphed; slowdown median {statistics.median(slowdowns):.2f} "
                         f"(min {min(slowdowns):.2f}, max {max(slowdowns):.2f})")
            if slowed is not None:
                line += f"; a bare matmul beside the busy process {slowed[0]:.2f} us (lower quartile {slowed[1]:.2f})"
            print(line, flush=True)
            built[name] = (step, host)
        results = {n: [] for n in RUNNERS}
        hosts = {n: [] for n in RUNNERS}
        for r in range(3):
            for name in (list(RUNNERS) if r % 2 == 0 else list(RUNNERS)[::-1]):
                step, host = built[name]
                host.clear()
                results[name].append(timed(step, args.timed, "throughput"))
                hosts[name].extend(host)
        print(f"\n{args.layers} x {args.width}, batch {args.batch}, one wrapper per layer; us per step in throughput "
              "(best of 3 rounds) and the forward call's host time a step (median)")
        eager = min(results["eager"])
        for name in RUNNERS:
            best = min(results[name])
            print(f"  {name:40s} {best:8.1f} ({best / eager:.3f}x eager)   forward host "
                  f"{numpy.median(hosts[name]) * 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
