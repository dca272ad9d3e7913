"""Where a graphed model's device memory goes, phase by phase: reserved and allocated bytes after each step.

On a GPU host (README.md, "Install on a GPU")::

    python tools/memory_timeline.py --out OUT.md   # also OUT.json; a GPU run's report goes under docs/reports/

CPU smoke test (simulated backend, the configs shrunk; readings are "-" where there is no device memory, and
the pool model's bytes stand in for the pools)::

    python tools/memory_timeline.py --dry-run --out /tmp/memory_timeline.md

Per config (``tools/bench.py``'s ``xformer24x1024_b32_perlayer``, one graphed Layer per transformer layer
of six matmuls, and ``mlp16x512_b16``, one graphed block) and per runner (Paddle eager, autocudagraph, and
autocudagraph with ``eager_if_slower=False``, which times no eager calls against the graphed ones)
it records ``memory_reserved``, ``memory_allocated``, ``max_memory_reserved`` and ``max_memory_allocated``
after each phase: the model built, each eager warmup step, every release of the allocator's cache the package
makes before a capture (before and after it), every capture (the graph's key, which capture of that key it
was - forward, backward, a second grad buffer set - and the bytes its pool made the process reserve), the
step that captured, and each later step; each step is named by what its layer calls did (timed eager calls:
on a GPU ``eager_if_slower`` times a key's first calls eagerly, before its capture, NOTE [ Graphed calls that
cannot pay ] in core/host_cost.py; warmup calls; captures; replays); then each wrapper's
``stats()["memory"]``, ``pool_bytes`` and ``held_bytes`` (NOTE [ What a key holds ] in core/memory.py). A step is forward, ``y.backward(dy)`` and the
parameter grads released with ``clear_gradient(False)`` (matmul-only: Paddle 2.6.2 on Hopper runs only cuBLAS
and copies, NOTE [ Kernel-less GPUs ] in testkit/common.py). Each runner starts after the previous one's
model is deleted and the allocator's cache released, so its readings are its own plus what stays reserved.

Exit code: 0 when every runner ran, 1 otherwise, 2 when asked for the cuda backend where there is no GPU.
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
TOOLS = os.path.join(REPO, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import numpy.random  # noqa: E402,F401  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise, docs/guides/compat.md)
import paddle  # noqa: E402

from benchmark.timing import CONFIGS  # noqa: E402
from paddlefleet.cudagraph.core import host_cost  # noqa: E402
from testkit.cli import BACKEND_HELP, require_gpu, sized, sized_help  # noqa: E402
from testkit.common import MatMLP, build, host_tensor, normal, run_info, short, write_generated  # noqa: E402

TOOL = "tools/memory_timeline.py"
DEFAULT_CONFIGS = "xformer24x1024_b32_perlayer,mlp16x512_b16"
READINGS = ("memory_reserved", "memory_allocated", "max_memory_reserved", "max_memory_allocated")
MIB = float(1 << 20)


def reading():
    """``{name: bytes or None}`` of READINGS now (None where this Paddle or machine cannot say)."""
    mod = getattr(paddle.device, "cuda", None)
    out = {}
    for name in READINGS:
        fn = getattr(mod, name, None)
        try:
            out[name] = int(fn()) if fn is not None else None
        except Exception:  # noqa: BLE001 - a CPU build has no device memory to read
            out[name] = None
    return out


class Timeline:
    """The rows of one runner: ``{"phase", "note", **reading()}``; ``current`` names the layer being called."""

    def __init__(self, sync):
        self.rows, self.sync, self.current = [], sync, None
        self.captures = {}  # layer -> captures so far

    def note(self, phase, note="", sync=True):
        if sync:
            self.sync()
        self.rows.append(dict(phase=phase, note=note, **reading()))

    def captured(self, graph):
        n = self.captures[self.current] = self.captures.get(self.current, 0) + 1
        what = ("forward", "backward", "second grad buffer set")[min(n, 3) - 1]
        pool = graph.pool_bytes
        self.note(f"capture: {self.current}, {what}", "" if pool is None else f"pool {pool / MIB:.2f} MiB",
                  sync=False)  # a capture just ended: nothing of it is queued

    @contextlib.contextmanager
    def watching(self):
        """Notes every cache release (before and after) and every capture while the runner runs."""
        from paddlefleet.cudagraph.backends import cuda, simulated

        mod = getattr(paddle.device, "cuda", None)
        release = getattr(mod, "empty_cache", None)
        graph_classes = [cuda._CudaGraph, simulated._SimulatedGraph]
        originals = [cls.capture for cls in graph_classes]

        def noted_release():
            self.note(f"before cache release ({self.current})", sync=False)
            release()
            self.note(f"after cache release ({self.current})", sync=False)

        def watched(original):
            def capture(graph, body, hooks=()):
                result = original(graph, body, hooks)
                self.captured(graph)
                return result
            return capture

        for cls, original in zip(graph_classes, originals):
            cls.capture = watched(original)
        if release is not None:
            mod.empty_cache = noted_release
        try:
            yield
        finally:
            for cls, original in zip(graph_classes, originals):
                cls.capture = original
            if release is not None:
                mod.empty_cache = release


def _model(cfg):
    """The config's model and what gets graphed: each layer (per-layer configs) or the whole MLP."""
    if cfg.per_layer:
        model = build(lambda: paddle.nn.Sequential(*[MatMLP(cfg.block_dims()) for _ in range(cfg.blocks)]), 1)
        return model, list(model)
    model = build(lambda: MatMLP(cfg.block_dims()), 1)
    return model, [model]


#: The runners: name, and autocudagraph's options (None: eager). eager_if_slower=False times no eager calls
#: before the capture: its keys capture right after their warmup calls.
RUNNERS = (("paddle eager", None), ("autocudagraph", {}),
           ("autocudagraph eager_if_slower=False", {"eager_if_slower": False}))


def run(cfg, backend, name, options, warmup, steps, cuda):
    """One runner's timeline: ``{"runner", "rows", "stats"}``."""
    graphed = options is not None
    sync = paddle.device.cuda.synchronize if cuda else (lambda: None)
    draw = normal(1234)
    x, dy = host_tensor(draw(cfg.batch, cfg.width)), host_tensor(draw(cfg.batch, cfg.width))
    tl = Timeline(sync)
    tl.note("start (cache released)")
    model, targets = _model(cfg)
    params = model.parameters()
    tl.note("model built")
    with tl.watching():
        if graphed:
            from paddlefleet.cudagraph import autocudagraph

            for i, target in enumerate(targets):
                autocudagraph(target, backend=backend, warmup_steps=warmup, **options)
                target.register_forward_pre_hook(lambda layer, args, i=i: setattr(tl, "current", f"layer {i}"))
        before = _counts(targets) if graphed else None
        # eager_if_slower measured (a GPU): 8 eager calls per key before its capture, its warmup among them
        timed = cuda and graphed and options.get("eager_if_slower", True)
        for step in range((max(warmup, host_cost.SAMPLES) if timed else warmup) + 1 + steps):
            y = model(x)
            y.backward(dy)
            for p in params:
                p.clear_gradient(False)
            tl.current = None
            if graphed:
                now = _counts(targets)
                tl.note(f"step {step + 1}: " + _step_name({k: now[k] - before[k] for k in now}))
                before = now
            else:
                tl.note(f"eager step {step + 1}")
    stats = None
    if graphed:
        every = [t.forward.stats() for t in targets]
        memory = {}
        for st in every:
            for k, v in st["memory"].items():
                memory[k] = None if v is None and memory.get(k) is None else (memory.get(k) or 0) + (v or 0)
        stats = {"memory": memory, "pool_bytes": sum(st["pool_bytes"] or 0 for st in every),
                 "held_bytes": sum(st["held_bytes"] for st in every), "captures": sum(st["captures"] for st in every),
                 "replays": sum(st["replays"] for st in every)}
        for t in targets:
            t.forward.reset()
    del model, targets, params, y
    return {"runner": name, "rows": tl.rows, "stats": stats}


def _counts(targets):
    every = [t.forward.stats() for t in targets]
    return {k: sum(st[k] for st in every) for k in ("eager_calls", "warmup_calls", "captures", "replays")}


def _step_name(done):
    """What a step's layer calls did, from the wrappers' counters: ``done`` holds each counter's growth."""
    parts = [f"{done[k]} {what}" for k, what in (("eager_calls", "eager (timed or fallen back)"),
                                                ("warmup_calls", "warmup"), ("captures", "captured"),
                                                ("replays", "replayed")) if done[k]]
    return ", ".join(parts) or "no layer call"


def fresh(cuda):
    """Before a runner: garbage collected, the allocator's cache released, the peak counters reset
    where this Paddle can (3.x; on 2.6 the max columns are the process's peaks so far)."""
    gc.collect()
    if cuda:
        mod = paddle.device.cuda
        mod.synchronize()
        mod.empty_cache()
        for name in ("reset_max_memory_reserved", "reset_max_memory_allocated"):
            if hasattr(mod, name):
                getattr(mod, name)()


def _mib(v):
    return "-" if v is None else f"{v / MIB:,.1f}"


def markdown(results, info):
    lines = ["# Memory timeline: where a graphed model's device memory goes", "",
             f"- {info['when']}; paddlefleet at {info.get('commit') or '?'}; paddle {info['paddle']}; backend "
             f"{info['backend']}; took {info['elapsed_s']:.1f} s",
             f"- warmup steps {info['warmup']}, replay steps {info['steps']}; MiB after each phase (the docstring "
             "of tools/memory_timeline.py says what each phase is); the max columns are reset before each runner "
             "where Paddle can (3.x), else they are the process's peaks so far (2.6)", ""]
    for config, runners in results.items():
        lines += [f"## {config}", ""]
        for r in runners:
            lines += [f"### {r['runner']}", "", "| phase | reserved | allocated | max reserved | max allocated | note |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {row['phase']} | " + " | ".join(_mib(row[k]) for k in READINGS) + f" | {row['note']} |"
                      for row in r["rows"]]
            if r["stats"]:
                m = r["stats"]["memory"]
                lines += ["", f"stats(): pool_bytes {_mib(r['stats']['pool_bytes'])} MiB, held_bytes "
                          f"{_mib(r['stats']['held_bytes'])} MiB, captures {r['stats']['captures']}, replays "
                          f"{r['stats']['replays']}; memory (MiB): " + ", ".join(f"{k} {_mib(v)}" for k, v in m.items())]
            lines.append("")
        peaks = {r["runner"]: peak(r["rows"], info.get("max_resettable", False)) for r in runners}
        if None not in peaks.values() and peaks.get("paddle eager"):
            lines += ["peak reserved MiB (what each runner added over its start): " + ", ".join(f"{k} {_mib(v)}" for k, v in peaks.items()) + "; over eager's: " +
                      ", ".join(f"{k} {v / peaks['paddle eager']:.2f}x" for k, v in peaks.items() if k != "paddle eager"),
                      ""]
    return lines


def peak(rows, resettable=None):
    """What a runner added to the reserved bytes at its highest: the highest its rows saw (its readings, and its
    max counter where Paddle resets it before each runner, ``resettable``; on 2.6 it holds the earlier runners'
    peaks too) less its first reading (what earlier runners left reserved), or None."""
    if resettable is None:
        resettable = hasattr(getattr(paddle.device, "cuda", None), "reset_max_memory_reserved")
    counter = ("max_memory_reserved",) if resettable else ()
    seen = [row[k] for row in rows for k in ("memory_reserved",) + counter if row[k] is not None]
    if not seen or rows[0]["memory_reserved"] is None:
        return None
    return max(seen) - rows[0]["memory_reserved"]


def parse(argv=None):
    parser = argparse.ArgumentParser(description="device memory after every phase of a graphed model's training steps")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    parser.add_argument("--dry-run", action="store_true", help="a CPU smoke run: --backend simulate, configs shrunk")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated tools/bench.py configs "
                        f"(default {DEFAULT_CONFIGS})")
    parser.add_argument("--warmup", type=int, help=sized_help("eager warmup steps per key", 2, 1))
    parser.add_argument("--steps", type=int, help=sized_help(
        "steps after the capture step (on a GPU eager_if_slower times 8 eager calls per key before its capture; "
        "its verdict comes after 9 replays)", 20, 2))
    parser.add_argument("--out", help="markdown report path (the JSON goes next to it); a smoke run only under the "
                        "temp dir")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.backend = "simulate"
    args.warmup = sized(args.warmup, args.backend, 2, 1)
    args.steps = sized(args.steps, args.backend, 20, 2)
    return args


def main(argv=None):
    args = parse(argv)
    require_gpu(TOOL, args.backend)
    cuda = args.backend == "cuda"
    if cuda:
        paddle.set_device("gpu")
    else:
        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        SimulatedBackend.pool_model = True  # its pool model stands in for the pools (NOTE [ What a key holds ])
    wanted = args.configs.split(",")
    configs = [c if cuda else c.smoke() for c in CONFIGS if c.name in wanted]
    start, results, failed = time.perf_counter(), {}, False
    for cfg in configs:
        results[cfg.name] = []
        for name, options in RUNNERS:
            fresh(cuda)
            try:
                results[cfg.name].append(run(cfg, args.backend, name, options, args.warmup, args.steps, cuda))
            except Exception as err:  # noqa: BLE001 - one runner's failure is reported, the others go on
                failed = True
                results[cfg.name].append({"runner": name,
                                          "rows": [], "stats": None, "error": short(err)})
                print(f"{TOOL}: {cfg.name} failed: {short(err)}", file=sys.stderr)
    info = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "paddle": paddle.__version__, "backend": args.backend,
            "commit": run_info(False, REPO)["commit"],
            "max_resettable": hasattr(getattr(paddle.device, "cuda", None), "reset_max_memory_reserved"),
            "warmup": args.warmup, "steps": args.steps, "elapsed_s": time.perf_counter() - start}
    lines = markdown(results, info)
    print("\n".join(lines))
    if args.out:
        write_generated(args.out, lines, TOOL, smoke=not cuda)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump({"info": info, "results": results}, fh, indent=1)
        print(f"wrote {args.out} and its .json", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
