"""Benchmark: autocudagraph against Paddle eager, raw CUDA-graph replay, and PyTorch.

On the GPU host (after ``bash .gpu/bin/setup.sh && source .gpu/bin/env.sh``)::

    python tools/bench.py                 # writes docs/benchmarks.md and docs/benchmarks.json
    python tools/bench.py --quick         # a few steps, to see that everything runs

CPU smoke test of the script logic (simulated backend, small models, no raw replay, no torch)::

    python tools/bench.py --backend simulate --quick --out-dir /tmp/bench_smoke

What is measured, per config (a chain of matmul layers, no bias, no activation; one step is
forward + backward with an explicit output grad ``dy``; parameter grads are released with
``clear_gradient(False)`` / ``p.grad = None`` after each step so no add kernel is needed):

* Paddle eager; Paddle ``autocudagraph`` (default options, and the clone_outputs=False /
  clone_param_grads=False variants); raw ``paddle.device.cuda.graphs.CUDAGraph`` replay of the
  same forward + backward (capture_begin; y = mlp(x); backward; capture_end; time replay()).
* PyTorch (when importable, in a child process so that its CUDA libraries do not meet
  Paddle's): eager, ``torch.cuda.make_graphed_callables`` and raw ``torch.cuda.CUDAGraph``
  replay, with TF32 for float32 matmuls set to what Paddle does (measured, see below).

Timing: every timed step is followed by a device synchronisation and timed on the host with
``time.perf_counter``; the table gives the median of ``--rounds`` x ``--steps`` (default 2 x 200)
such steps after ``--warmup`` steps, the rounds interleaving the runners of a config in
alternating order so that neither a slow phase of the machine nor the order favours one. A per-step synchronisation measures the latency of one training step
including the host work that launches it, which is what graphs remove; batching N steps
between two CUDA events would instead let the host run ahead and hide launch overhead behind
the GPU work of earlier steps (reported separately as "pipelined": N steps, one sync, divided
by N). The wrapper's host time is the median time of the graphed call itself (no sync).
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, layers, width, batch); the first two are launch-bound, the last compute-bound.
CONFIGS = [
    ("mlp16x512_b16", 16, 512, 16),
    ("mlp32x256_b8", 32, 256, 8),
    ("mlp8x4096_b64", 8, 4096, 64),
]
LAUNCH_BOUND = ("mlp16x512_b16", "mlp32x256_b8")
SMOKE_WIDTH = 64  # simulate mode: widths capped so the CPU finishes in seconds

VARIANTS = [  # (json key prefix, autocudagraph options)
    ("autocudagraph", {}),
    ("autocudagraph_no_clone_outputs", {"clone_outputs": False}),
    ("autocudagraph_no_clone_param_grads", {"clone_param_grads": False}),
    ("autocudagraph_no_clones", {"clone_outputs": False, "clone_param_grads": False}),
]

JSON_KEYS = (
    "config", "gpu", "paddle_eager_us", "autocudagraph_us", "raw_replay_us", "torch_eager_us",
    "torch_graphed_us", "torch_raw_replay_us", "wrapper_host_us",
)


def median_us(values):
    return statistics.median(values) * 1e6 if values else None


def short(err, limit=300):
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    pick = next((l for l in lines if l.startswith("(") and ")" in l[:40]), None)
    pick = pick or next((l for l in lines if "rror" in l), None) or (lines[-1] if lines else "")
    return f"{type(err).__name__}: {pick}"[:limit]


class Runner:
    """One way of running a training step; its timed samples accumulate over rounds.

    ``step()`` runs one step and returns the host seconds of its forward call and of its
    backward call (0.0 where there is none); ``sync()`` waits for the device.
    """

    def __init__(self, name, step, sync):
        self.name, self.step, self.sync = name, step, sync
        self.step_t, self.fwd_t, self.bwd_t, self.pipe = [], [], [], []
        self.error = None

    def timed(self, n):
        if self.error:
            return
        pc = time.perf_counter
        try:
            for _ in range(n):
                t0 = pc()
                f, b = self.step()
                self.sync()
                self.step_t.append(pc() - t0)
                self.fwd_t.append(f)
                self.bwd_t.append(b)
        except Exception as err:  # noqa: BLE001 - keep the other runners
            self.error = short(err)

    def pipelined(self, n):
        if self.error:
            return
        try:
            self.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                self.step()
            self.sync()
            self.pipe.append((time.perf_counter() - t0) / n)
        except Exception as err:  # noqa: BLE001
            self.error = short(err)

    def summary(self, prefix):
        out = {}
        if self.error:
            out[f"{prefix}_error"] = self.error
        if self.step_t:
            st = sorted(self.step_t)
            out[f"{prefix}_us"] = median_us(st)
            out[f"{prefix}_p10_us"] = st[len(st) // 10] * 1e6
            out[f"{prefix}_p90_us"] = st[(9 * len(st)) // 10] * 1e6
            out[f"{prefix}_host_us"] = median_us(self.fwd_t)
            out[f"{prefix}_backward_host_us"] = median_us(self.bwd_t)
            out[f"{prefix}_samples"] = len(st)
        if self.pipe:
            out[f"{prefix}_pipelined_us"] = statistics.mean(self.pipe) * 1e6
        return out


def run_rounds(runners, args):
    """Times every runner ``args.rounds`` times, interleaved (ABC then CBA ...), so that a slow
    phase of the machine or the order of the runners does not favour one of them."""
    for r in range(args.rounds):
        order = runners if r % 2 == 0 else list(reversed(runners))
        for run in order:
            run.timed(args.steps)
        for run in order:
            run.pipelined(args.steps)


def profile_runner(run, steps, path):
    """cProfile of ``steps`` steps of one runner (host side), top functions to ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run.step()
    run.sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"# {run.name}: {steps} steps (host time; each line's times are totals over all steps)\n")
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    with open(path, "w") as fh:
        fh.write(buf.getvalue())


# ============================================================================ Paddle side
def paddle_side(args, configs):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import numpy as np
    import paddle

    from paddlefleet.cudagraph import autocudagraph
    from paddlefleet.cudagraph.backends import pool_sharing_supported
    from paddlefleet.cudagraph.options import ENV_BACKEND

    os.environ.pop(ENV_BACKEND, None)
    cuda = args.backend == "cuda"
    device = "gpu" if cuda else "cpu"
    paddle.set_device(device)
    pc = time.perf_counter

    def sync():
        if cuda:
            paddle.device.cuda.synchronize()

    class MatLayer(paddle.nn.Layer):
        def __init__(self, din, dout):
            super().__init__()
            self.w = self.create_parameter([din, dout], dtype="float32")

        def forward(self, x):
            return paddle.matmul(x, self.w)

    class MLP(paddle.nn.Layer):
        def __init__(self, layers, width):
            super().__init__()
            self.layers = paddle.nn.LayerList([MatLayer(width, width) for _ in range(layers)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def build(layers, width, weights):
        """On the CPU (no initialiser kernels on the GPU), numpy weights, then moved."""
        old = paddle.get_device()
        paddle.set_device("cpu")
        try:
            mlp = MLP(layers, width)
            for p, w in zip(mlp.parameters(), weights):
                p.set_value(w)
        finally:
            paddle.set_device(old)
        if cuda:
            mlp.to(device=device)
        return mlp

    def T(a):
        return paddle.to_tensor(a, stop_gradient=True)

    def release(params):
        for p in params:
            p.clear_gradient(False)

    def step_of(model, x, dy, params):
        def step():
            t0 = pc()
            y = model(x)
            t1 = pc()
            y.backward(dy)
            t2 = pc()
            release(params)
            return t1 - t0, t2 - t1

        return step

    def reference(model, x, dy, params):
        y = model(x)
        y.backward(dy)
        out = (y.numpy(), [p.grad.numpy() for p in params])
        release(params)
        return out

    def same(got, ref):
        y, grads = got
        ry, rgrads = ref
        return y.tobytes() == ry.tobytes() and len(grads) == len(rgrads) and all(
            g is not None and g.tobytes() == r.tobytes() for g, r in zip(grads, rgrads))

    info = {"paddle": paddle.__version__, "paddle_commit": getattr(paddle.version, "commit", "?"),
            "paddle_cuda": paddle.version.cuda() if paddle.is_compiled_with_cuda() else None,
            "pool_sharing_supported": pool_sharing_supported(), "device": device}
    if cuda:
        cap = paddle.device.cuda.get_device_capability()
        info["gpu"] = f"{paddle.device.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})"
        # What Paddle does for float32 matmuls: TF32 (cuBLAS TF32 handle, on by default in
        # Paddle 2.6 with no Python switch) or full FP32. Measured against float64.
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((256, 256)).astype("float32"), rng.standard_normal((256, 256)).astype("float32")
        got = paddle.matmul(T(a), T(b)).numpy().astype("float64")
        ref = a.astype("float64") @ b.astype("float64")
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        info["paddle_fp32_matmul_rel_err"] = rel
        info["paddle_tf32"] = rel > 2e-5  # TF32 ~3e-4, FP32 ~6e-7 here
    else:
        info["gpu"] = "none (CPU, simulate backend)"
        info["paddle_tf32"] = False

    def bench_config(name, layers, width, batch):
        """One config; a function so that every tensor it made is freed when it returns (a
        tensor of a graph's private pool freed while a later capture is open aborts Paddle 2.6
        with CUDA error 900 from CUDAGraphAllocator::FreeImpl)."""
        print(f"[paddle] {name}: {layers} layers x {width}, batch {batch}", file=sys.stderr, flush=True)
        rng = np.random.default_rng(1234)
        weights = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32") for _ in range(layers)]
        xn = rng.standard_normal((batch, width)).astype("float32")
        dyn = rng.standard_normal((batch, width)).astype("float32")
        row = {"config": name, "gpu": info["gpu"], "layers": layers, "width": width, "batch": batch,
               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds}
        x, dy = T(xn), T(dyn)
        runners, keep = [], []

        # --- eager
        eager = build(layers, width, weights)
        ep = eager.parameters()
        ref = reference(eager, x, dy, ep)
        eager_run = Runner("paddle_eager", step_of(eager, x, dy, ep), sync)
        for _ in range(args.warmup):
            eager_run.step()
        runners.append(eager_run)
        keep.append(eager)

        # --- autocudagraph variants
        wrapped = {}
        for key, opts in VARIANTS:
            try:
                model = build(layers, width, weights)
                params = model.parameters()
                autocudagraph(model, backend=args.backend, **opts)
                run = Runner(key, step_of(model, x, dy, params), sync)
                for _ in range(max(args.warmup, 3)):
                    run.step()
                row[f"{key}_bitwise_vs_eager"] = same(reference(model, x, dy, params), ref)
                runners.append(run)
                wrapped[key] = (model, run)
            except Exception as err:  # noqa: BLE001 - keep the other columns
                row[f"{key}_error"] = short(err)

        # --- raw CUDA-graph replay (the floor)
        graph = None
        if cuda:
            try:
                from paddle.device.cuda import graphs

                raw = build(layers, width, weights)
                rp = raw.parameters()
                sx, sdy = T(xn), T(dyn)
                for _ in range(2):
                    y = raw(sx)
                    y.backward(sdy)
                    release(rp)
                gc.collect()  # nothing of a graph's pool may be freed while the capture is open
                graph = graphs.CUDAGraph()
                graph.capture_begin()
                try:
                    sy = raw(sx)
                    paddle.autograd.backward([sy], [sdy])
                finally:
                    graph.capture_end()
                graph.replay()
                sync()
                row["raw_replay_bitwise_vs_eager"] = same((sy.numpy(), [p.grad.numpy() for p in rp]), ref)

                def raw_step(graph=graph):
                    t0 = pc()
                    graph.replay()
                    return pc() - t0, 0.0

                run = Runner("raw_replay", raw_step, sync)
                for _ in range(args.warmup):
                    run.step()
                runners.append(run)
                keep += [raw, rp, sx, sdy, sy]
            except Exception as err:  # noqa: BLE001
                row["raw_replay_error"] = short(err)

        # --- timing, interleaved over rounds
        sync()
        run_rounds(runners, args)
        for run in runners:
            row.update(run.summary(run.name))
        row["paddle_eager_host_us"] = (row.get("paddle_eager_host_us") or 0) + (row.get("paddle_eager_backward_host_us") or 0)
        row["wrapper_host_us"] = row.get("autocudagraph_host_us")
        if args.profile and "autocudagraph" in wrapped:
            path = os.path.join(args.out_dir, f"profile_{name}.txt")
            profile_runner(wrapped["autocudagraph"][1], min(args.steps, 100), path)
            row["autocudagraph_profile"] = os.path.basename(path)
        for key, (model, run) in wrapped.items():
            st = model.forward.stats()
            row[f"{key}_stats"] = {k: st.get(k) for k in ("captures", "replays", "fallbacks", "graphs",
                                                         "input_copies", "input_copies_skipped")}
            if st.get("captures", 0) < 1 or st.get("fallbacks", 0) > 0:
                row[f"{key}_warning"] = "not replaying: " + model.forward.explain().replace("\n", " / ")
            model.forward.reset()
        if graph is not None:
            graph.reset()
        return row

    results = []
    for name, layers, width, batch in configs:
        results.append(bench_config(name, layers, width, batch))
        gc.collect()
        if cuda:
            try:
                paddle.device.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass
    return info, results


# ============================================================================ torch side
def torch_worker(args):
    """Runs in a child process: torch eager, make_graphed_callables, raw CUDAGraph replay."""
    import torch

    tf32 = bool(int(args.tf32))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dev = torch.device("cuda")
    pc = time.perf_counter
    sync = torch.cuda.synchronize
    configs = [c for c in CONFIGS if c[0] in args.worker_configs.split(",")]

    class TMLP(torch.nn.Module):
        def __init__(self, weights):
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in weights])

        def forward(self, x):
            for w in self.ws:
                x = torch.matmul(x, w)
            return x

    def release(model):
        for p in model.parameters():
            p.grad = None

    def step_of(call, model, x, dy):
        def step():
            t0 = pc()
            y = call(x)
            t1 = pc()
            y.backward(dy)
            t2 = pc()
            release(model)
            return t1 - t0, t2 - t1

        return step

    def snapshot(call, model, x, dy):
        y = call(x)
        y.backward(dy)
        out = (y.detach().clone(), [p.grad.clone() for p in model.parameters()])
        release(model)
        return out

    def same(a, b):
        return torch.equal(a[0], b[0]) and all(torch.equal(g, r) for g, r in zip(a[1], b[1]))

    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_tf32": tf32,
           "torch_gpu": torch.cuda.get_device_name(0), "rows": {}}
    for name, layers, width, batch in configs:
        print(f"[torch] {name}", file=sys.stderr, flush=True)
        row, runners, keep = {}, [], []
        gen = torch.Generator().manual_seed(1234)
        weights = [torch.randn(width, width, generator=gen) / width ** 0.5 for _ in range(layers)]
        x = torch.randn(batch, width, generator=gen).to(dev)
        dy = torch.randn(batch, width, generator=gen).to(dev)
        ref = None
        try:
            eager = TMLP(weights).to(dev)
            ref = snapshot(eager, eager, x, dy)
            run = Runner("torch_eager", step_of(eager, eager, x, dy), sync)
            for _ in range(args.warmup):
                run.step()
            runners.append(run)
            keep.append(eager)
        except Exception as err:  # noqa: BLE001
            row["torch_eager_error"] = short(err)
        try:
            model = TMLP(weights).to(dev)
            graphed = torch.cuda.make_graphed_callables(model, (x.clone(),))
            run = Runner("torch_graphed", step_of(graphed, model, x, dy), sync)
            for _ in range(args.warmup):
                run.step()
            if ref is not None:
                row["torch_graphed_bitwise_vs_eager"] = same(snapshot(graphed, model, x, dy), ref)
            runners.append(run)
            keep += [model, graphed]
        except Exception as err:  # noqa: BLE001
            row["torch_graphed_error"] = short(err)
        try:
            model = TMLP(weights).to(dev)
            sx, sdy = x.clone(), dy.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(sx).backward(sdy)
                    release(model)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                sy = model(sx)
                sy.backward(sdy)
            graph.replay()
            sync()
            if ref is not None:
                row["torch_raw_replay_bitwise_vs_eager"] = same((sy, [p.grad for p in model.parameters()]), ref)

            def raw_step(graph=graph):
                t0 = pc()
                graph.replay()
                return pc() - t0, 0.0

            run = Runner("torch_raw_replay", raw_step, sync)
            for _ in range(args.warmup):
                run.step()
            runners.append(run)
            keep += [model, graph, sx, sdy, sy]
        except Exception as err:  # noqa: BLE001
            row["torch_raw_replay_error"] = short(err)
        sync()
        run_rounds(runners, args)
        for run in runners:
            row.update(run.summary(run.name))
        del runners, keep
        torch.cuda.empty_cache()
        out["rows"][name] = row
    with open(args.json_out, "w") as fh:
        json.dump(out, fh)


def torch_side(args, configs, tf32):
    """Runs torch_worker in a child process; tries a few environments (see below)."""
    if args.no_torch:
        return {"torch_note": "skipped (--no-torch)"}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"],
                           capture_output=True, text=True)
    if probe.returncode == 3:
        return {"torch_note": "torch is not importable"}
    # env.sh points libcublas.so.12 & co. at CUDA 13 libraries for Paddle 2.6 (/tmp/cuda12) and
    # puts Paddle's site (numpy 1.26, protobuf 3.20) first on PYTHONPATH: torch wants its own
    # libraries, so try without those first, then with less stripped.
    base = dict(os.environ)
    strip = lambda v, bad: os.pathsep.join(p for p in v.split(os.pathsep) if p and bad not in p)  # noqa: E731
    env1 = dict(base, LD_LIBRARY_PATH=strip(base.get("LD_LIBRARY_PATH", ""), "/tmp/cuda12"))
    env2 = dict(env1, PYTHONPATH=strip(base.get("PYTHONPATH", ""), "/tmp/site"))
    attempts = [("without Paddle's /tmp/cuda12 and /tmp/site", env2),
                ("without /tmp/cuda12 on LD_LIBRARY_PATH", env1), ("environment as is", base)]
    errors = []
    for label, env in attempts:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--json-out", path,
               "--worker-configs", ",".join(c[0] for c in configs), "--tf32", str(int(tf32)),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.torch_timeout)
            sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
            if proc.returncode == 0:
                with open(path) as fh:
                    out = json.load(fh)
                out["torch_env"] = label
                return out
            tail = [l for l in proc.stderr.splitlines() if l.strip()][-2:]
            errors.append(f"{label}: exit {proc.returncode}: {' | '.join(tail)[:300]}")
        except subprocess.TimeoutExpired:
            errors.append(f"{label}: timed out after {args.torch_timeout}s")
        finally:
            os.unlink(path)
    return {"torch_note": "torch worker failed: " + " ;; ".join(errors)}


# ============================================================================ report
def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:,.1f}{unit}" if v < 100 else f"{v:,.0f}{unit}"
    return f"{v}{unit}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def write_report(out_dir, info, rows, args, elapsed):
    os.makedirs(out_dir, exist_ok=True)
    objs = []
    for row in rows:
        obj = {k: row.get(k) for k in JSON_KEYS}
        obj.update({k: v for k, v in row.items() if k not in obj})
        objs.append(obj)
    with open(os.path.join(out_dir, "benchmarks.json"), "w") as fh:
        json.dump(objs, fh, indent=1, sort_keys=False)
        fh.write("\n")

    L = []
    smoke = args.backend != "cuda"
    L.append("# Benchmarks: autocudagraph vs eager, raw replay and PyTorch" + (" (SMOKE RUN, not a benchmark)" if smoke else ""))
    L.append("")
    L.append(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; run took {elapsed:.0f} s"
             f"{' (--quick)' if args.quick else ''}")
    L.append(f"- GPU: {info.get('gpu')}; driver {info.get('driver', '?')}")
    L.append(f"- Paddle {info.get('paddle')} (commit {str(info.get('paddle_commit'))[:12]}, CUDA {info.get('paddle_cuda')}), "
             f"pool sharing: {info.get('pool_sharing_supported')}; python {platform.python_version()}")
    if "torch" in info:
        L.append(f"- PyTorch {info['torch']} (CUDA {info.get('torch_cuda')}, {info.get('torch_gpu')}), "
                 f"run in a child process ({info.get('torch_env')})")
    else:
        L.append(f"- PyTorch: {info.get('torch_note', 'not run')}")
    err = info.get("paddle_fp32_matmul_rel_err")
    L.append(f"- TF32 for float32 matmuls: Paddle {'on' if info.get('paddle_tf32') else 'off'}"
             + (f" (measured: max relative error {err:.1e} against float64)" if err is not None else "")
             + (f"; torch.backends.cuda.matmul.allow_tf32={info.get('torch_tf32')} to match" if "torch" in info else "")
             + f"; NVIDIA_TF32_OVERRIDE={os.environ.get('NVIDIA_TF32_OVERRIDE', 'unset')}")
    L.append(f"- method: median of {args.steps * args.rounds} steps ({args.rounds} interleaved round(s) of {args.steps}, "
             f"the runners in alternating order) after {args.warmup} warmup steps, each step "
             "followed by a device synchronisation (host perf_counter); one step = forward + backward "
             "with an explicit dy, then parameter grads released. Raw replay = replay() of a graph "
             "holding that forward + backward (no input copy). Wrapper host = time of the graphed call "
             "itself (no sync). See tools/bench.py for why per-step synchronisation.")
    L.append("")
    L.append("## Time per training step (us, lower is better)")
    L.append("")
    L.append("| config | Paddle eager | autocudagraph | raw replay | torch eager | torch make_graphed | torch raw replay | wrapper host |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        L.append(f"| {r['config']} ({r['layers']} x {r['width']}, batch {r['batch']}) | {fmt(r.get('paddle_eager_us'))} | "
                 f"{fmt(r.get('autocudagraph_us'))} | {fmt(r.get('raw_replay_us'))} | {fmt(r.get('torch_eager_us'))} | "
                 f"{fmt(r.get('torch_graphed_us'))} | {fmt(r.get('torch_raw_replay_us'))} | {fmt(r.get('wrapper_host_us'))} |")
    L.append("")
    L.append("## Ratios and overheads")
    L.append("")
    L.append("| config | autocudagraph / raw | eager / autocudagraph | autocudagraph - raw (us) | make_graphed - torch raw (us) | make_graphed / torch raw |")
    L.append("|---|---|---|---|---|---|")
    for r in rows:
        a, raw, e = r.get("autocudagraph_us"), r.get("raw_replay_us"), r.get("paddle_eager_us")
        tg, tr = r.get("torch_graphed_us"), r.get("torch_raw_replay_us")
        L.append(f"| {r['config']} | {fmt(ratio(a, raw))} | {fmt(ratio(e, a))} | "
                 f"{fmt(None if a is None or raw is None else a - raw)} | {fmt(None if tg is None or tr is None else tg - tr)} | "
                 f"{fmt(ratio(tg, tr))} |")
    L.append("")
    L.append("## autocudagraph options (us per step; host us of the forward call / of backward)")
    L.append("")
    L.append("| config | " + " | ".join(k.replace("autocudagraph", "acg") for k, _ in VARIANTS) + " |")
    L.append("|---|" + "---|" * len(VARIANTS))
    for r in rows:
        cells = []
        for k, _ in VARIANTS:
            if f"{k}_error" in r:
                cells.append("ERROR " + r[f"{k}_error"][:80])
            else:
                cells.append(f"{fmt(r.get(k + '_us'))} ({fmt(r.get(k + '_host_us'))} / {fmt(r.get(k + '_backward_host_us'))})")
        L.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("## Pipelined: N steps, one sync at the end (us per step)")
    L.append("")
    L.append("| config | Paddle eager | autocudagraph | raw replay | torch eager | torch make_graphed | torch raw replay |")
    L.append("|---|---|---|---|---|---|---|")
    for r in rows:
        L.append(f"| {r['config']} | {fmt(r.get('paddle_eager_pipelined_us'))} | {fmt(r.get('autocudagraph_pipelined_us'))} | "
                 f"{fmt(r.get('raw_replay_pipelined_us'))} | {fmt(r.get('torch_eager_pipelined_us'))} | "
                 f"{fmt(r.get('torch_graphed_pipelined_us'))} | {fmt(r.get('torch_raw_replay_pipelined_us'))} |")
    L.append("")
    L.append("## Checks (bitwise against eager of the same library; wrapper counters)")
    L.append("")
    L.append("| config | " + " | ".join(k.replace("autocudagraph", "acg") for k, _ in VARIANTS) + " | Paddle raw | torch graphed | torch raw |")
    L.append("|---|" + "---|" * (len(VARIANTS) + 3))
    for r in rows:
        cells = []
        for k, _ in VARIANTS:
            st = r.get(f"{k}_stats") or {}
            cells.append(f"bitwise {fmt(r.get(k + '_bitwise_vs_eager'))}; {st.get('captures')} capture, "
                         f"{st.get('replays')} replays, {st.get('fallbacks')} eager")
        cells += [fmt(r.get("raw_replay_bitwise_vs_eager")), fmt(r.get("torch_graphed_bitwise_vs_eager")),
                  fmt(r.get("torch_raw_replay_bitwise_vs_eager"))]
        L.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    problems = [(r["config"], k, v) for r in rows for k, v in r.items() if k.endswith(("_error", "_warning"))]
    if problems:
        L.append("")
        L.append("## Problems")
        L.append("")
        for cfg, k, v in problems:
            v = str(v)
            L.append(f"- {cfg} {k}: {v if len(v) <= 400 else v[:400] + ' ...'}")
    L.append("")
    L.append("## Targets (issue 4)")
    L.append("")
    for r in rows:
        if r["config"] not in LAUNCH_BOUND:
            continue
        q = ratio(r.get("autocudagraph_us"), r.get("raw_replay_us"))
        s = ratio(r.get("paddle_eager_us"), r.get("autocudagraph_us"))
        L.append(f"- {r['config']}: autocudagraph / raw replay = {fmt(q)} (target <= 1.10: "
                 f"{'-' if q is None else ('met' if q <= 1.10 else 'MISSED')}); eager / autocudagraph = {fmt(s)} "
                 f"(target >= 5: {'-' if s is None else ('met' if s >= 5 else 'MISSED')})")
        a, raw, tg, tr = (r.get(k) for k in ("autocudagraph_us", "raw_replay_us", "torch_graphed_us", "torch_raw_replay_us"))
        if None not in (a, raw, tg, tr):
            L.append(f"  - overhead over raw replay: autocudagraph {a - raw:.1f} us vs make_graphed_callables "
                     f"{tg - tr:.1f} us (target smaller: {'met' if a - raw < tg - tr else 'MISSED'})")
    profiles = [r["autocudagraph_profile"] for r in rows if r.get("autocudagraph_profile")]
    if profiles:
        L.append("")
        L.append("Host profiles of the default autocudagraph step (cProfile): " + ", ".join(profiles))
    with open(os.path.join(out_dir, "benchmarks.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    print("\n".join(L))


def main():
    parser = argparse.ArgumentParser(description="autocudagraph benchmark")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda")
    parser.add_argument("--out-dir", help="where benchmarks.md/.json go (default docs/ for cuda, a temp dir for simulate)")
    parser.add_argument("--quick", action="store_true", help="few steps: check that everything runs")
    parser.add_argument("--steps", type=int, help="timed steps per measurement (default 200, --quick 20)")
    parser.add_argument("--warmup", type=int, help="warmup steps (default 20, --quick 3)")
    parser.add_argument("--configs", help="comma-separated config names (default all)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds per measurement (default 2, --quick 1)")
    parser.add_argument("--profile", action="store_true",
                        help="also write out-dir/profile_CONFIG.txt: cProfile of autocudagraph's host side")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-timeout", type=int, default=240)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-configs", help=argparse.SUPPRESS)
    parser.add_argument("--tf32", default="1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 20 if args.quick else 200
    if args.warmup is None:
        args.warmup = 3 if args.quick else 20
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.torch_worker:
        torch_worker(args)
        return 0
    t0 = time.perf_counter()
    configs = CONFIGS
    if args.configs:
        configs = [c for c in CONFIGS if c[0] in args.configs.split(",")]
    if args.backend != "cuda":
        configs = [(n, l, min(w, SMOKE_WIDTH), b) for n, l, w, b in configs]
        args.no_torch = True
    out_dir = args.out_dir or (os.path.join(REPO, "docs") if args.backend == "cuda" else tempfile.mkdtemp(prefix="bench_smoke_"))
    args.out_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    info, rows = paddle_side(args, configs)
    if args.backend == "cuda":
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            pass
        tinfo = torch_side(args, configs, info.get("paddle_tf32", True))
        for row in rows:
            row.update(tinfo.get("rows", {}).get(row["config"], {}))
        info.update({k: v for k, v in tinfo.items() if k != "rows"})
    for row in rows:
        for k in JSON_KEYS:
            row.setdefault(k, None)
    write_report(out_dir, info, rows, args, time.perf_counter() - t0)
    print(f"wrote {out_dir}/benchmarks.md and benchmarks.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
