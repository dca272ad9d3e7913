"""Parameter grads stacked after paddle.grad against handed out one by one: time and memory (a probe).

    python tools/probes/stacks_probe.py [--configs mlp16x512_b16,...] [--steps 50] [--out report.md]
    python tools/probes/stacks_probe.py --smoke      # CPU: the simulated backend, a few steps

Where Paddle has no node post hooks (2.6), same-shape parameter grads can be stacked only after paddle.grad
returned (NOTE [ Stacking grads as they arrive ] in grads/stacks.py): the backward graph's pool then holds every
stacked grad twice, and the graph runs one more device copy per grad, to hand the grads out with one ``unbind``
per stack instead of one view per grad. This probe measures that trade on the benchmark's models
(tools/benchmark), which is why grads handed out as aliases are not stacked there (NOTE [ Stacks after
paddle.grad only for copied grads ]): per config, eager, graphed with every same-shape grad stacked after
paddle.grad (``stacked_after_backward`` taking every parameter while the model warms up and captures) and
graphed without stacks (``GROUP_MAX_BYTES`` 0), side by side in one process, in a loop that frees its grads after
every step (freed views re-pointed or made) and one that accumulates them (views reused), both modes (throughput:
one sync at the end; latency: a sync per step), best of 3 interleaved rounds; the bytes the graphs hold by the
package's own accounting (``held_bytes``, ``pool_bytes``). Every graphed runner is compared bit for bit with
eager (output and grads) before timing.
"""

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import numpy  # noqa: E402
import paddle  # noqa: E402

from benchmark.timing import CONFIGS  # noqa: E402
from paddlefleet.cudagraph.grads import stacks  # noqa: E402
from benchmark.rigs import BlockRig  # noqa: E402
from testkit.common import device, host_tensor, normal  # noqa: E402

TOOL = "tools/probes/stacks_probe.py"
DEFAULT_CONFIGS = "mlp16x512_b16,mlp32x256_b8,mlp16x512_b16_4blocks,xformer24x1024_b32_perlayer"
LOOPS = ("frees grads", "accumulates")
RUNNERS = ("eager", "stacked", "unstacked")


class Rig(BlockRig):
    """One runner's model (graphed or not) and its step for each loop."""

    def __init__(self, cfg, runner, backend, x, dy):
        super().__init__(cfg, backend, x, dy, runner != "eager", eager_if_slower=False)
        self.unstacked = runner == "unstacked"

    def step(self, frees):
        y = self.model(self.x)
        y.backward(self.dy)
        if frees:
            for p in self.params:
                p.clear_gradient(False)
        return y

    def warm(self, steps):
        """Warmup and capture (without stacks for the unstacked runner), then a freed step."""
        saved = stacks.GROUP_MAX_BYTES, stacks.stacked_after_backward
        if self.unstacked:
            stacks.GROUP_MAX_BYTES = 0
        else:
            stacks.stacked_after_backward = lambda copied: list(range(len(copied)))
        try:
            for _ in range(steps):
                self.step(True)
            for _ in range(steps):  # the accumulating loop's second grad buffer set is captured here
                self.step(False)
        finally:
            stacks.GROUP_MAX_BYTES, stacks.stacked_after_backward = saved
        self.release()

    def memory(self):
        if not self.graphed:
            return None, None
        stats = [b.forward.stats() for b in self.model.blocks]
        return sum(s["held_bytes"] or 0 for s in stats), sum(s["pool_bytes"] or 0 for s in stats)

    def counts(self):
        if not self.graphed:
            return {}
        stats = [b.forward.stats() for b in self.model.blocks]
        return {k: sum(s[k] for s in stats) for k in ("captures", "replays", "eager_calls")}

    def stacked_grads(self):
        """Parameters whose grads come out of a stack (the first grad buffer set of every block's key)."""
        if not self.graphed:
            return 0
        return sum(len(idxs) for b in self.model.blocks
                   for _, idxs in b.forward.entry().graphs.current.plans()[0].groups)


def timed(rig, frees, steps, latency, sync):
    sync()
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        rig.step(frees)
        if latency:
            sync()
            times.append(time.perf_counter() - t0)
    sync()
    total = time.perf_counter() - start
    rig.release()
    return float(numpy.median(times)) * 1e6 if latency else total / steps * 1e6


def run_config(cfg, backend, steps, rounds, sync, lines):
    draw = normal(1234)
    x, dy = host_tensor(draw(cfg.batch, cfg.width)), host_tensor(draw(cfg.batch, cfg.width))
    rigs = {name: Rig(cfg, name, backend, x, dy) for name in RUNNERS}
    reference = rigs["eager"].snapshot()
    for name, rig in rigs.items():
        rig.warm(6)
        same = all(numpy.array_equal(a, b) for a, b in zip(rig.snapshot(), reference))
        if not same:
            raise SystemExit(f"{TOOL}: {cfg.name} {name}: not bitwise equal to eager")
    results = {}
    for r in range(rounds):
        order = list(RUNNERS) if r % 2 == 0 else list(RUNNERS)[::-1]
        for loop in LOOPS:
            for latency in (False, True):
                for name in order:
                    t = timed(rigs[name], loop == LOOPS[0], steps, latency, sync)
                    results.setdefault((loop, latency, name), []).append(t)
    same_again = all(all(numpy.array_equal(a, b) for a, b in zip(rig.snapshot(), reference)) for rig in rigs.values())
    lines.append(f"\n## {cfg.name}: {cfg.matmuls()} matmuls of width {cfg.width}, batch {cfg.batch}, "
                 f"{cfg.blocks} graphed block(s)\n")
    lines.append(f"Bitwise equal to eager before and after timing: {same_again}; parameters with stacked grads "
                 f"(stacked runner): {rigs['stacked'].stacked_grads()}, without: {rigs['unstacked'].stacked_grads()}; "
                 f"counters: stacked {rigs['stacked'].counts()}, unstacked {rigs['unstacked'].counts()}.\n")
    lines.append("| loop | mode | eager | stacked | unstacked | unstacked / stacked |")
    lines.append("|---|---|---|---|---|---|")
    for loop in LOOPS:
        for latency in (False, True):
            best = {name: min(results[(loop, latency, name)]) for name in RUNNERS}
            lines.append(f"| {loop} | {'latency' if latency else 'throughput'} | {best['eager']:.1f} | "
                         f"{best['stacked']:.1f} | {best['unstacked']:.1f} | "
                         f"{best['unstacked'] / best['stacked']:.3f} |")
    mib = float(1 << 20)
    held_s, pool_s = rigs["stacked"].memory()
    held_u, pool_u = rigs["unstacked"].memory()
    lines.append(f"\nHeld by the graphs (MiB, the package's accounting; two grad buffer sets after the accumulating "
                 f"loop): stacked {held_s / mib:.2f} (pools {pool_s / mib:.2f}), unstacked {held_u / mib:.2f} "
                 f"(pools {pool_u / mib:.2f}); parameters {sum(p.numel().item() * 4 for p in rigs['eager'].params) / mib:.2f}.")
    for rig in rigs.values():
        del rig.model
    return same_again


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"benchmark configs (default {DEFAULT_CONFIGS})")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per runner, loop, mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best is reported)")
    parser.add_argument("--out", help="write the report here (else print it)")
    parser.add_argument("--smoke", action="store_true", help="CPU: simulated backend, tiny configs, 2 steps")
    args = parser.parse_args()
    known = {c.name: c for c in CONFIGS}
    cfgs = [known[name] for name in args.configs.split(",")]
    if args.smoke:
        cfgs = [dataclasses.replace(c, layers=min(c.layers, 4), width=16, batch=4,
                                    blocks=min(c.blocks, 4)) for c in cfgs[:2]]
        args.steps, args.rounds = 2, 1
    backend = "simulate" if args.smoke else "cuda"
    place = "cpu" if args.smoke else "gpu"
    sync = (lambda: None) if args.smoke else paddle.device.cuda.synchronize
    commit = os.environ.get("PADDLEFLEET_REPORT_COMMIT", "unknown")
    lines = [f"# Stacked against unstacked parameter grads (`{TOOL}`)\n",
             f"- paddlefleet at {commit}; paddle {paddle.__version__}; backend {backend}; "
             f"{args.rounds} rounds x {args.steps} steps per runner, loop and mode; us per step, best of the rounds"]
    if not args.smoke:
        lines.append(f"- GPU: {paddle.device.cuda.get_device_name()}")
    with device(place):
        ok = all([run_config(cfg, backend, args.steps, args.rounds, sync, lines) for cfg in cfgs])
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
