"""The device floor of graphing layer by layer: raw per-layer graphs against one graph of the whole step (a probe).

    python tools/probes/per_layer_floor_probe.py [--configs xformer24x1024_b32_perlayer,...] [--rounds 4]
                                                 [--steps 50] [--out docs/reports/per_layer_floor_probe.md]
    python tools/probes/per_layer_floor_probe.py --smoke   # CPU: the simulated backend, a few steps, no report

For each of the benchmark's per-layer configs (tools/benchmark/timing.py), side by side in one process and timed
as tools/bench.py times its runners (benchmark.timing: both modes, order and modes alternating every round; one
sync at the end of N steps, or a sync after every step), with the same model, data and eager reference:

* ``paddle_eager``, ``autocudagraph`` (every layer graphed on its own, default options), ``autocudagraph,
  chain_calls=False``, ``autocudagraph_step`` (the whole step) and ``raw_replay`` (one raw graph of the whole step:
  the floor): the benchmark's own runners (tools/benchmark/paddle_runs.py).
* ``autocudagraph_launched_copies``: ``autocudagraph`` with each chained member's grad copy launched (``copy_``)
  instead of replayed as a link graph (NOTE [ Link graphs ] in chains/link_graphs.py), for the difference.
* ``raw_per_layer``: Paddle's own CUDAGraph per layer and direction, nothing else: layer i's forward graph reads
  layer i-1's static output in place (a detached alias) and its backward graph reads layer i+1's static input
  grad in place, so a step is 2 x layers ``replay()`` calls and no copy. No wrapper can graph layer by layer for
  less device time: what it costs over ``raw_replay`` is the device's price of splitting one graph into many
  (each graph launch, the work no longer overlapping across layer boundaries).
* ``raw_per_layer_copies``: the same replays plus the device copies a wrapper's replay makes per layer when its
  calls do not chain (NOTE [ Chains of graphed calls ] in chains/chain.py): the call's input copied into a static
  buffer (``copy_``), the output handed out as a new tensor (``_C_ops.assign``), the output grad copied into a
  static buffer. Each copy goes to a scratch tensor of the right shape: the values are not the point, the device
  work and the host's launch of it are.

``--profile``: after the tables, a cProfile of the ``autocudagraph`` runner in each mode (the functions with the
most time of their own), which shows where the host waits, if it does (the call that waited holds the time).

The raw per-layer graphs' last output and parameter grads are compared bit for bit with eager before timing.
What the ratios answer: whether a per-layer target (autocudagraph within 1.15x of the whole step) is within reach of
host work at all; ``raw_per_layer / raw_replay`` is the part no host work removes. Needs a CUDA GPU (cuBLAS matmuls
and copies only: NOTE [ Kernel-less GPUs ] in testkit/common.py).
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402

from benchmark.paddle_runs import (Entry, Setup, capture_raw, compare, eager_entry, graphed_entry,  # noqa: E402
                                   raw_entry, whole_step_entry)
from benchmark.timing import MODES, PER_LAYER, Runner, run_rounds, timed_call  # noqa: E402
from paddlefleet.cudagraph.chains import bridge as chain_bridge  # noqa: E402
from testkit.common import device, info_lines, run_info, short  # noqa: E402


class RawPerLayer:
    """Raw forward and backward graphs of every layer of ``model`` (a benchmark Blocks: one block per layer), the
    static buffers chained (layer i reads layer i-1's static output; its backward reads layer i+1's input grad)."""

    def __init__(self, s, model):
        self.blocks = list(model.blocks)
        for _ in range(2):  # cuBLAS handles and workspaces made before any capture
            y = model(s.x)
            y.backward(s.dy)
            for p in model.parameters():
                p.clear_gradient(False)
        self.fwd, self.ins, self.outs = [], [], []
        h = s.x
        for i, block in enumerate(self.blocks):
            x = h if i == 0 else h.detach()  # an alias of the previous graph's static output
            x.stop_gradient = i == 0
            graph, y = capture_raw(s, lambda block=block, x=x: block(x))
            self.fwd.append(graph)
            self.ins.append(x)
            self.outs.append(y)
            h = y
        self.bwd, self.param_grads = [None] * len(self.blocks), [None] * len(self.blocks)
        g = s.dy
        for i in reversed(range(len(self.blocks))):
            params = list(self.blocks[i].parameters())
            wrt = params if i == 0 else [self.ins[i]] + params
            graph, grads = capture_raw(s, lambda i=i, wrt=wrt, g=g: paddle.grad([self.outs[i]], wrt, [g],
                                                                                retain_graph=True))
            self.bwd[i] = graph
            self.param_grads[i] = grads if i == 0 else grads[1:]
            g = None if i == 0 else grads[0]
        self.scratch = [(paddle.empty_like(x), paddle.empty_like(y)) for x, y in zip(self.ins, self.outs)]

    def step(self):
        for graph in self.fwd:
            graph.replay()
        for graph in reversed(self.bwd):
            graph.replay()

    def step_with_copies(self):
        h = self.ins[0]
        for graph, (x_buf, _), y in zip(self.fwd, self.scratch, self.outs):
            x_buf.copy_(h, False)  # the call's input into a static buffer
            graph.replay()
            h = _C_ops.assign(y)  # the output handed out
        g = h
        for i in reversed(range(len(self.bwd))):
            self.scratch[i][1].copy_(g, False)  # the output grad into a static buffer
            self.bwd[i].replay()
            g = self.scratch[i][1]

    def results(self):
        return [self.outs[-1].numpy()] + [g.numpy() for grads in self.param_grads for g in grads]

    def reset(self):
        for graph in self.fwd + self.bwd:
            graph.reset()


def raw_per_layer_entries(s):
    """The two raw per-layer runners of ``s`` (a Setup), sharing one set of graphs."""
    raw = RawPerLayer(s, s.model())

    def check():
        raw.step()
        return compare(raw.results(), s.reference, "raw per-layer y and grads")

    return [Entry(Runner("raw_per_layer", timed_call(raw.step), s.sync, short), check, cleanup=raw.reset),
            Entry(Runner("raw_per_layer_copies", timed_call(raw.step_with_copies), s.sync, short), check,
                  cleanup=lambda: None)]


def profiled(entry, steps):
    """cProfile lines of ``entry``'s runner in each mode (``steps`` steps), the top functions by own time."""
    out = []
    for mode in MODES:
        profile = cProfile.Profile()
        entry.runner.sync()
        profile.enable()
        entry.runner.measure(mode, steps)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        body = [line for line in text.getvalue().splitlines() if line.strip()][3:]
        out += [f"cProfile of {entry.runner.name}, {mode}, {steps} steps:", "```"] + body + ["```", ""]
    return out


def launched_copies(entry):
    """``entry`` (a graphed runner) with each chained member's grad copy launched (``copy_``) instead of replayed as a
    link graph (NOTE [ Link graphs ] in chains/link_graphs.py): the two timed side by side."""
    step = entry.runner.step

    def unlinked(*args, **kwargs):
        return False

    def run():
        linked, chain_bridge.linked_copy = chain_bridge.linked_copy, unlinked
        try:
            return step()
        finally:
            chain_bridge.linked_copy = linked

    entry.runner.step = run
    return entry


def run_config(cfg, rounds, steps, warmup, profile=False, backend="cuda"):
    s = Setup(cfg, backend)
    made = [("paddle_eager", lambda: [eager_entry(s)]),
            ("autocudagraph", lambda: [graphed_entry(s, "autocudagraph", {})]),
            ("autocudagraph_launched_copies",
             lambda: [launched_copies(graphed_entry(s, "autocudagraph_launched_copies", {}))]),
            ("autocudagraph_unchained", lambda: [graphed_entry(s, "autocudagraph_unchained", {"chain_calls": False})]),
            ("autocudagraph_step", lambda: [whole_step_entry(s, "autocudagraph_step", with_sgd=False)]),
            ("raw_replay", lambda: [raw_entry(s)]),
            ("raw_per_layer", lambda: raw_per_layer_entries(s))]
    entries, notes = [], []
    for name, make in made:
        try:
            built = make()
        except Exception as err:  # noqa: BLE001 - one runner's failure is reported, the others still run
            notes.append(f"{name}: could not be set up: {short(err)}")
            continue
        for entry in built:
            entry.runner.warm(warmup)
            s.sync()
            failures = entry.check() if entry.check is not None else []
            notes.append(f"{entry.runner.name}: bitwise equal to eager: {'yes' if not failures else failures[:2]}")
            entries.append(entry)
    s.sync()
    run_rounds([e.runner for e in entries], rounds, steps)
    times = {e.runner.name: {m: e.runner.summary(m) for m in MODES} for e in entries}
    if profile:
        notes_profile = [line for e in entries if e.runner.name == "autocudagraph" for line in profiled(e, steps)]
    else:
        notes_profile = []
    for e in entries:
        if e.cleanup is not None:
            e.cleanup()
    return times, notes, notes_profile


def table(cfg, times):
    names = list(times)
    us = {n: {m: times[n][m]["us"] for m in MODES} for n in names}
    lines = [f"### {cfg.name}: {cfg.describe()}", "",
             "| runner | throughput us | latency us | host us of the timed call (T) | / whole step (T / L) | / raw per-layer (T / L) |",
             "|---|---|---|---|---|---|"]
    whole, floor = us.get("autocudagraph_step"), us.get("raw_per_layer")

    def ratio(a, b):
        return " / ".join(f"{a[m] / b[m]:.2f}x" for m in MODES) if a and b else "-"

    for n in names:
        host = times[n]["throughput"].get("host_us")
        lines.append(f"| {n} | {us[n]['throughput']:,.0f} | {us[n]['latency']:,.0f} | "
                     f"{'-' if host is None else f'{host:,.1f}'} | {ratio(us[n], whole)} | {ratio(us[n], floor)} |")
    raw = us.get("raw_replay")
    if floor and raw:
        lines += ["", f"raw per-layer over one raw graph of the step: {ratio(floor, raw)} (T / L); "
                      f"{(floor['throughput'] - raw['throughput']) / cfg.blocks:.1f} / "
                      f"{(floor['latency'] - raw['latency']) / cfg.blocks:.1f} us per layer"]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="xformer24x1024_b32_perlayer,xformer32x512_b16_perlayer",
                        help="per-layer configs of tools/benchmark/timing.py, comma-separated")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--steps", type=int, default=50, help="steps per runner, mode and round (default 50)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps per runner (default 30)")
    parser.add_argument("--profile", action="store_true", help="then a cProfile of autocudagraph in each mode")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: the simulated backend, the configs shrunk, a few steps, no report")
    parser.add_argument("--out", help="write the report here (markdown)")
    args = parser.parse_args()
    if not args.smoke and not paddle.device.is_compiled_with_cuda():
        raise SystemExit("per_layer_floor_probe: needs a CUDA build of Paddle and a GPU; run it with --smoke on a CPU")
    wanted = args.configs.split(",")
    configs = [c.smoke() if args.smoke else c for c in PER_LAYER if c.name in wanted]
    if len(configs) != len(wanted):
        raise SystemExit(f"per_layer_floor_probe: per-layer configs are {[c.name for c in PER_LAYER]}")
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.out = 1, 3, 12, None
    lines = ["# The device floor of graphing layer by layer (probe output)", ""] + \
        info_lines(run_info(not args.smoke, REPO)) + \
        [f"- {args.rounds} rounds x {args.steps} steps per runner and mode after {args.warmup} warmup steps; us per "
         "step (median of rounds for throughput, of steps for latency)", ""]
    with contextlib.nullcontext() if args.smoke else device("gpu"):
        for cfg in configs:
            start = time.perf_counter()
            times, notes, profile = run_config(cfg, args.rounds, args.steps, args.warmup, args.profile,
                                               "simulate" if args.smoke else "cuda")
            part = table(cfg, times) + [""] + [f"- {n}" for n in notes] + \
                [f"- took {time.perf_counter() - start:.0f} s", ""] + profile
            print("\n".join(part), flush=True)
            lines += part
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
