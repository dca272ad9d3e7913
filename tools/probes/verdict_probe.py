"""What ``eager_if_slower`` weighs against what a step costs: the verdict on blocks near its edge (a probe).

    python tools/probes/verdict_probe.py [--configs mlp16x512_b16_4blocks,...] [--repeats 5] [--out report.md]
    python tools/probes/verdict_probe.py --smoke      # CPU: the simulated backend (its keys are not timed), a few steps

The verdict (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py) compares the lower quartiles of a key's
eager and graphed host times, forward plus backward where it sees the backward's end (a Layer's parameters, as
here). This probe measures, on the benchmark's block models (tools/benchmark), per config and per fresh build
(``--repeats``):

* the verdict of each block's key with the default options (``eager_if_slower=True``) and the numbers it
  compared (eager and graphed, forward + backward us);
* the graphed blocks' backward host time per block (their bridges' backward, GraphedFunction's or a chain's
  ChainFunction's, timed in this process only: the probe wraps them; a step's sum divided by its blocks) and
  each block's eager forward and eager backward host time (the backward of the whole eager model, timed around
  ``Tensor.backward``, divided by its blocks), lower quartiles of the timed steps;
* the step time, throughput (one sync at the end) and latency (a sync per step), of eager, of the graphed model with
  the verdicts made (default) and with every block kept graphed (``eager_if_slower=False``), interleaved.

Every graphed runner is compared bit for bit with eager (output and grads) after its steps. Nothing here changes
the library: the probe reads each key's HostCost and times calls from outside.
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import numpy  # noqa: E402
import paddle  # noqa: E402

from benchmark.timing import CONFIGS  # noqa: E402
from paddlefleet.cudagraph.block import bridge  # noqa: E402
from paddlefleet.cudagraph.chains import bridge as chain_bridge  # noqa: E402
from benchmark.rigs import BlockRig  # noqa: E402
from testkit.common import device, host_tensor, info_lines, normal, run_info  # noqa: E402

TOOL = "tools/probes/verdict_probe.py"
DEFAULT_CONFIGS = "mlp16x512_b16_4blocks,mlp32x256_b8_4blocks,mlp8x4096_b64_4blocks"
RUNNERS = ("eager", "default", "kept graphed")

_BACKWARD_US = []  # host us of each bridge backward (a block's or a chain's) since the last clear


def _timed_backward(original):
    def backward(ctx, *grads):
        start = time.perf_counter()
        try:
            return original(ctx, *grads)
        finally:
            _BACKWARD_US.append((time.perf_counter() - start) * 1e6)
    return staticmethod(backward)


def quartile(values):
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


class Rig(BlockRig):
    """One runner's model: eager, graphed with the default verdicts, or graphed with every key kept."""

    def __init__(self, cfg, runner, backend, x, dy):
        super().__init__(cfg, backend, x, dy, runner != "eager", eager_if_slower=runner == "default")

    def step(self):
        y = self.model(self.x)
        y.backward(self.dy)
        self.release()
        return y

    def verdicts(self):
        """Per block: (verdict, eager forward us, graphed forward us, eager backward us, graphed backward us) of
        its key (the backwards None where the verdict did not weigh them)."""
        out = []
        for block in self.model.blocks:
            entries = list(block.forward._entries.values())
            cost = entries[0].host_cost if entries else None
            if cost is None:
                out.append((None,) * 5)
                continue
            backward = cost.backward_us or (None, None)
            out.append((cost.verdict, cost.eager_us(), cost.graphed_us(), backward[0], backward[1]))
        return out


def eager_pieces(rig, steps, sync):
    """Per-block eager forward and backward host us (lower quartiles over ``steps`` steps; the backward of the
    whole model divided by its blocks)."""
    blocks = rig.model.blocks
    fwd = [[] for _ in blocks]
    bwd = []
    for _ in range(steps):
        h = rig.x
        for k, block in enumerate(blocks):
            t0 = time.perf_counter()
            h = block(h)
            fwd[k].append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        h.backward(rig.dy)
        bwd.append((time.perf_counter() - t0) * 1e6 / len(blocks))
        for p in rig.params:
            p.clear_gradient(False)
        sync()
    return [quartile(f) for f in fwd], quartile(bwd)


def step_us(rig, steps, latency, sync):
    sync()
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        rig.step()
        if latency:
            sync()
            times.append(time.perf_counter() - t0)
    sync()
    return float(numpy.median(times)) * 1e6 if latency else (time.perf_counter() - start) / steps * 1e6


def run_config(cfg, backend, repeats, steps, sync, lines):
    draw = normal(1234)
    x, dy = host_tensor(draw(cfg.batch, cfg.width)), host_tensor(draw(cfg.batch, cfg.width))
    ok = True
    lines += [f"## {cfg.name}", "",
              "| build | keys judged slower | per block: verdict, eager fwd + bwd / graphed fwd + bwd us | "
              "eager fwd per block / eager bwd per block / graphed bwd per block us | "
              "step T: eager / default / kept graphed | "
              "step L: eager / default / kept graphed | bitwise |", "|---|---|---|---|---|---|---|"]
    for build_no in range(repeats):
        rigs = {name: Rig(cfg, name, backend, x, dy) for name in RUNNERS}
        for rig in rigs.values():  # warmup, eager samples, captures, first replays: the verdicts are made here
            for _ in range(steps):
                rig.step()
        sync()
        reference = rigs["eager"].snapshot()
        same = all(all(numpy.array_equal(a, b) for a, b in zip(reference, rigs[n].snapshot())) for n in RUNNERS[1:])
        ok = ok and same
        per_step = []  # the bridges' backward host us of one step of the kept-graphed model, per block
        for _ in range(steps):
            _BACKWARD_US.clear()
            rigs["kept graphed"].step()
            per_step.append(sum(_BACKWARD_US) / cfg.blocks)
            sync()
        graphed_bwd = quartile(per_step) if any(per_step) else None
        eager_fwd, eager_bwd = eager_pieces(rigs["eager"], steps, sync)
        timings = {}
        for mode in (False, True):  # interleaved: each runner once per mode, twice
            for _ in range(2):
                for name, rig in rigs.items():
                    timings.setdefault((name, mode), []).append(step_us(rig, steps, mode, sync))
        kept = rigs["kept graphed"].verdicts()
        verdicts = rigs["default"].verdicts()
        slower = sum(v[0] == "eager" for v in verdicts)
        per_block = "; ".join(f"{v[0]}, {pair(v[1], v[3])} / {pair(v[2], v[4])}" for v in verdicts)
        eager_cols = "; ".join(f"{fmt(f)}" for f in eager_fwd) + f" / {fmt(eager_bwd)} / {fmt(graphed_bwd)}"
        t = " / ".join(fmt(min(timings[(n, False)])) for n in RUNNERS)
        lat = " / ".join(fmt(min(timings[(n, True)])) for n in RUNNERS)
        lines.append(f"| {build_no + 1} | {slower} of {len(verdicts)} | {per_block} | {eager_cols} | {t} | {lat} | "
                     f"{'yes' if same else 'NO'} |")
        lines.append("|  | (kept graphed, measured only) | " + "; ".join(
            f"{pair(v[1], v[3])} / {pair(v[2], v[4])}" for v in kept) + " |  |  |  |  |")
        del rigs
    lines.append("")
    return ok


def fmt(value):
    return "-" if value is None else f"{value:,.1f}"


def pair(forward, backward):
    """A key's forward + backward host us, or its forward alone where the backward was not weighed."""
    return fmt(forward) if backward is None else f"{fmt(forward)} + {fmt(backward)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default {DEFAULT_CONFIGS})")
    parser.add_argument("--repeats", type=int, default=5, help="fresh builds per config (default 5)")
    parser.add_argument("--steps", type=int, default=40, help="steps per phase (default 40)")
    parser.add_argument("--out", help="write the report here (else print it)")
    parser.add_argument("--smoke", action="store_true", help="CPU: simulated backend, tiny configs, a few steps")
    args = parser.parse_args()
    wanted = args.configs.split(",")
    cfgs = [c for c in CONFIGS if c.name in wanted]
    if args.smoke:
        import dataclasses

        cfgs = [dataclasses.replace(c, width=16, batch=2) for c in cfgs[:1]]
        args.repeats, args.steps = 1, 12
    backend = "simulate" if args.smoke else "cuda"
    sync = (lambda: None) if args.smoke else paddle.device.cuda.synchronize
    info = run_info(not args.smoke, REPO)
    lines = ["# eager_if_slower's verdict against the step it decides", "",
             f"`python {TOOL}`; what it measures: its docstring.", ""] + info_lines(info) + [
        f"- backend {backend}; {args.repeats} fresh builds per config; {args.steps} steps per phase; host us are "
        "lower quartiles, step times the best of two interleaved rounds (median of the steps in latency)", ""]
    originals = [(cls, cls.backward) for cls in (bridge.GraphedFunction, chain_bridge.ChainFunction)]
    for cls, backward in originals:
        cls.backward = _timed_backward(backward)
    try:
        with device("cpu" if args.smoke else "gpu"):
            ok = all([run_config(cfg, backend, args.repeats, args.steps, sync, lines) for cfg in cfgs])
    finally:
        for cls, backward in originals:
            cls.backward = staticmethod(backward)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
