"""Benchmark: autocudagraph against Paddle eager, raw CUDA-graph replay and PyTorch, in two timing modes.

On a GPU host with a GPU build of Paddle (README.md, "Install on a GPU")::

    python tools/bench.py                  # docs/reports/benchmarks.json, docs/reports/benchmarks.md, docs/reports/benchmarks.png
    python tools/bench.py --quick          # a few steps, to see that everything runs

CPU smoke test of the whole script (simulated backend, tiny models, torch on the CPU if importable;
writes only under the temp directory, its numbers are not results)::

    python tools/bench.py --smoke

Runs split over several processes or machines of one kind (``--configs`` each, ``--out-dir`` each)
make one report with ``--report-from DIR1,DIR2 --out-dir docs/reports``: their rows, the first
run's facts (each run also writes benchmarks_run.json: its facts, torch's and the run's).

Per config (tools/benchmark/timing.py: three matmul-only MLPs, each also as 4 graphed blocks) it
times Paddle eager, autocudagraph with default options and with each speed option, the whole-step
graph where the package has one, raw replay of one graph of the step (the floor), and torch eager,
``make_graphed_callables`` and raw replay, each in *throughput* and *latency* mode (NOTE [ Two
timing modes ]). Every graphed result is checked bit for bit against eager (NOTE [ Bench checks ]
in tools/benchmark/paddle_runs.py). Each config's Paddle runs happen in their own child process,
so a CUDA error that aborts one costs that config, not the report; torch runs in a child that
never loads Paddle's libraries. The plot needs matplotlib (``pip install -e .[bench]``); without
it the bench says that it skipped the plot.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (REPO, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]

from benchmark.timing import pick_configs  # noqa: E402

TOOL = "tools/bench.py"


def child(argv, env, timeout):
    """Runs this script with ``argv`` and a JSON output path; returns (result or None, why not)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_")
    os.close(fd)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json-out", path],
                              env=env, capture_output=True, text=True, timeout=timeout)
        sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
        if proc.returncode == 0:
            with open(path) as fh:
                return json.load(fh), None
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
        return None, f"exit {proc.returncode}: {' | '.join(tail)[:400]}"
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    finally:
        os.unlink(path)


def timing_argv(args):
    return ["--backend", args.backend, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--rounds", str(args.rounds)]


def paddle_configs(args, configs):
    """Each group of each config's Paddle runners in its own child (paddle_runs.GROUPS); returns
    ({config: merged result}, run facts)."""
    from benchmark import paddle_runs

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    groups = [g for g in paddle_runs.GROUPS if g != "step" or paddle_runs.has_whole_step()]
    results, info = {}, {}
    for cfg in configs:
        merged = {key: {} for key in paddle_runs.RESULT_KEYS}
        if "step" not in groups:
            merged["why_null"].update(dict.fromkeys(paddle_runs.runner_names("step"), paddle_runs.NO_STEP))
        for group in groups:
            argv = ["--paddle-worker", "--configs", cfg.name, "--group", group, *timing_argv(args)]
            got, why = child(argv, env, args.config_timeout)
            if got is None:
                failed = f"the Paddle child of this config failed: {why}"
                merged["why_null"].update(dict.fromkeys(paddle_runs.runner_names(group), failed))
                continue
            for key, value in got["result"].items():
                merged.setdefault(key, {}).update(value)
            info = info or got["info"]
        results[cfg.name] = merged
    return results, info


def torch_side(args, tf32):
    """The torch child, in the first environment it runs in (see below)."""
    if args.no_torch:
        return {"torch_note": "skipped (--no-torch)"}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"],
                           capture_output=True, text=True)
    if probe.returncode == 3:
        return {"torch_note": "torch is not importable"}
    # env.sh points libcublas.so.12 & co. at CUDA 13 libraries for Paddle 2.6 (/tmp/cuda12) and puts
    # Paddle's site (numpy 1.26, protobuf 3.20) first on PYTHONPATH: torch wants its own libraries,
    # so try without those first, then with less stripped.
    base = dict(os.environ)
    strip = lambda v, bad: os.pathsep.join(p for p in v.split(os.pathsep) if p and bad not in p)  # noqa: E731
    env1 = dict(base, LD_LIBRARY_PATH=strip(base.get("LD_LIBRARY_PATH", ""), "/tmp/cuda12"))
    env2 = dict(env1, PYTHONPATH=strip(base.get("PYTHONPATH", ""), "/tmp/site"))
    errors = []
    argv = ["--torch-worker", "--configs", args.configs or "", "--tf32", str(int(bool(tf32))), *timing_argv(args)]
    for label, env in (("without Paddle's /tmp/cuda12 and /tmp/site", env2),
                       ("without /tmp/cuda12 on LD_LIBRARY_PATH", env1), ("environment as is", base)):
        got, why = child(argv, env, args.torch_timeout)
        if got is not None:
            return dict(got, torch_env=label)
        errors.append(f"{label}: {why}")
    return {"torch_note": "the torch child failed: " + " ;; ".join(errors)}


def paddle_worker(args):
    """A child: one config's Paddle runs, and the run's facts."""
    import paddle

    from benchmark import paddle_runs
    from paddlefleet.cudagraph.options import ENV_BACKEND
    from testkit.common import run_info

    os.environ.pop(ENV_BACKEND, None)
    cuda = args.backend == "cuda"
    paddle.set_device("gpu" if cuda else "cpu")
    info = run_info(cuda, REPO)
    if cuda:
        info["paddle_fp32_matmul_rel_err"] = paddle_runs.tf32_probe()
        info["paddle_tf32"] = info["paddle_fp32_matmul_rel_err"] > 2e-5  # TF32 ~3e-4, FP32 ~1e-6
    else:
        info["paddle_tf32"] = False
    [cfg] = pick_configs(args.configs, smoke=not cuda)
    result = paddle_runs.bench_config(cfg, args.backend, args.group, args.warmup, args.rounds, args.steps)
    with open(args.json_out, "w") as fh:
        json.dump({"info": info, "result": result}, fh)
    return 0


def parse(argv=None):
    parser = argparse.ArgumentParser(description="autocudagraph benchmark, throughput and latency")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda",
                        help="cuda (default): time on this machine's GPU (exits 2 where there is none); simulate: a "
                             "CPU smoke run on the simulated backend, few steps (its timings are not GPU timings)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: --backend simulate --quick, output under the temp dir")
    parser.add_argument("--out-dir", help="where benchmarks.md/.json/.png go (default docs/; a smoke run: a new temp dir)")
    parser.add_argument("--quick", action="store_true", help="few steps: check that everything runs")
    parser.add_argument("--steps", type=int, help="steps per runner, mode and round (default 200; 20 with --quick or --backend simulate)")
    parser.add_argument("--warmup", type=int, help="warmup steps per runner (default 20; 3 with --quick or --backend simulate)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 2 with --quick or --backend simulate)")
    parser.add_argument("--configs", help="comma-separated config names (default all)")
    parser.add_argument("--pipeline", action="store_true",
                        help="the pipeline row only: 2 stages x 4 micro-batches (GPipe), slots against eager")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the torch rows (make_graphed_callables and raw torch graphs); they are marked skipped")
    parser.add_argument("--torch-timeout", type=int, default=300,
                        help="seconds for the torch child process before its rows are given up (default 300)")
    parser.add_argument("--report-from", help="comma-separated output folders of earlier runs: write one report of them "
                        "to --out-dir")
    parser.add_argument("--config-timeout", type=int, default=300, help="seconds for one config's Paddle child")
    for hidden in ("--paddle-worker", "--torch-worker"):
        parser.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="wrappers", help=argparse.SUPPRESS)
    parser.add_argument("--tf32", default="1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.backend, args.quick = "simulate", True
    quick = args.quick or args.backend != "cuda"  # a simulated run is a smoke run: small by default
    args.steps = args.steps or (20 if quick else 200)
    args.warmup = args.warmup or (3 if quick else 20)
    args.rounds = args.rounds or (2 if quick else 3)
    return args


def main():
    args = parse()
    if args.torch_worker:
        from benchmark import torch_runs

        return torch_runs.worker(args)
    if args.paddle_worker:
        return paddle_worker(args)
    if args.pipeline:
        return pipeline_main(args)
    if args.report_from:
        return report_from(args)
    from benchmark import report
    from testkit.common import check_smoke_path

    start = time.perf_counter()
    smoke = args.backend != "cuda"
    configs = pick_configs(args.configs, smoke)
    out_dir = args.out_dir or (os.path.join(REPO, "docs", "reports") if not smoke else tempfile.mkdtemp(prefix="bench_smoke_"))
    if smoke:
        try:
            check_smoke_path(os.path.join(out_dir, "benchmarks.md"), TOOL)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    else:
        from testkit.cli import require_gpu

        require_gpu(TOOL, args.backend)  # exit 2 naming --backend simulate / --smoke
    paddle, info = paddle_configs(args, configs)
    if not any(result.get("times") for result in paddle.values()):
        out_dir = tempfile.mkdtemp(prefix="bench_failed_")
        print(f"{TOOL}: no Paddle runner produced a time; the report goes to {out_dir}, not to docs/", file=sys.stderr)
    torch = torch_side(args, info.get("paddle_tf32", True))
    run = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "smoke": smoke,
           "elapsed_s": time.perf_counter() - start}
    rows = report.build_rows(configs, paddle, torch, info, run)
    lines, note = report.write(out_dir, rows, info, torch, run)
    with open(os.path.join(out_dir, "benchmarks_run.json"), "w") as fh:
        json.dump({"info": info, "torch": {k: v for k, v in torch.items() if k != "configs"}, "run": run}, fh, indent=1)
    print("\n".join(lines))
    print(f"wrote {out_dir}/benchmarks.md and benchmarks.json" + (f"; plot {note}" if note else ", benchmarks.png"),
          file=sys.stderr)
    return 0 if any(result.get("times") for result in paddle.values()) else 1


def report_from(args):
    """``--report-from DIR,...``: one report of the rows of earlier runs (each DIR holds a run's
    benchmarks.json and benchmarks_run.json), written to ``--out-dir``."""
    from benchmark import report

    rows, facts = [], []
    for folder in args.report_from.split(","):
        with open(os.path.join(folder, "benchmarks.json")) as fh:
            rows += json.load(fh)
        with open(os.path.join(folder, "benchmarks_run.json")) as fh:
            facts.append(json.load(fh))
    if not args.out_dir:
        raise SystemExit(f"{TOOL}: --report-from needs --out-dir (where the merged report goes)")
    info, torch = facts[0]["info"], facts[0]["torch"]
    run = dict(facts[0]["run"], elapsed_s=sum(f["run"]["elapsed_s"] for f in facts))
    lines, note = report.write(args.out_dir, rows, info, torch, run)
    with open(os.path.join(args.out_dir, "benchmarks_run.json"), "w") as fh:
        json.dump({"info": info, "torch": torch, "run": run, "merged_from": len(facts)}, fh, indent=1)
    print("\n".join(lines))
    return 0


def pipeline_main(args):
    """``--pipeline``: the pipeline row (tools/benchmark/pipeline_runs.py), printed and written to
    <out-dir>/benchmarks_pipeline.json (a smoke run: a temp dir)."""
    import paddle

    from benchmark.pipeline_runs import bench_pipeline

    cuda = args.backend == "cuda"
    if cuda and not cuda_build():
        raise SystemExit(f"{TOOL}: this Paddle has no CUDA (or sees no GPU); run `{TOOL} --smoke --pipeline`.")
    paddle.set_device("gpu" if cuda else "cpu")
    width, layers, batch = (512, 8, 16) if cuda else (32, 4, 8)
    result = bench_pipeline(args.backend, width, layers, batch, args.warmup, args.rounds, args.steps)
    out_dir = args.out_dir or (os.path.join(REPO, "docs", "reports") if cuda else tempfile.mkdtemp(prefix="bench_smoke_"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "benchmarks_pipeline.json"), "w") as fh:
        json.dump(dict(result, shape={"width": width, "layers_per_stage": layers, "batch": batch}), fh, indent=1)
    for name, times in result["times"].items():
        cells = "  ".join(f"{m} {times[m]['us']:.0f} us" if times[m].get("us") else f"{m} -"
                          for m in ("throughput", "latency"))
        held = result["device_bytes_after_warmup"].get(name)
        print(f"pipeline {name}: {cells}; check: {result['checks'].get(name, 'baseline') or 'bitwise'}"
              + (f"; {held} device bytes held once warm" if held is not None else ""))
    print(f"wrote {out_dir}/benchmarks_pipeline.json", file=sys.stderr)
    return 0 if not any(result["checks"].values()) else 1


def cuda_build():
    import paddle

    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


if __name__ == "__main__":
    sys.exit(main())
