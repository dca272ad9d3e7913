"""The GPU tools run end to end on the CPU (their smoke modes), so a change to the package that
breaks one fails here, not on the next GPU run. Each runs as a script, as on a GPU host."""

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import paddle
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(*argv, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PADDLEFLEET_CUDAGRAPH_BACKEND"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", argv[0]), *argv[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


#: A few gpu_safe cases from three of the tool's modules (a whole test, a process that must exit 0, a chain):
#: the suite itself runs every gpu_safe case on the simulated backend; here the tool's own work is checked
#: (its pytest child, the JSON lines it reads back, the report it writes).
GPU_CHECK_CASES = "test_eager_matmul_matches_numpy or test_failed_captures_leave_a_process_that_exits_0 or " \
                  "test_two_forwards_before_their_backwards"


def test_gpu_check_runs_the_gpu_safe_cases_and_reports_them(tmp_path):
    out = tmp_path / "gpu_check.md"
    rc, log = run_tool("gpu_check.py", "--backend", "simulate", "--cases", GPU_CHECK_CASES, "--out", str(out))
    assert rc == 0, log[-3000:]
    text = out.read_text()
    assert "| **PASSED** |" in text and "**FAILED**" not in text and "**ERROR**" not in text, text[-3000:]
    assert "test_eager_matmul_matches_numpy" in text and "values bitwise equal" in text
    for case in ("test_failed_captures_leave_a_process_that_exits_0", "test_two_forwards_before_their_backwards"):
        assert re.search(rf"{case}.*\| \*\*PASSED\*\* \|", text), (case, text[-3000:])


def test_gpu_check_runs_every_module_with_gpu_safe_cases():
    """Every test module pytest collects gpu_safe cases from (conftest marks subclasses of MatmulOnlyCase) is
    one gpu_check runs: read from pytest's own collection, not from the tool's search of the sources."""
    env = {k: v for k, v in os.environ.items() if k != "PADDLEFLEET_CUDAGRAPH_BACKEND"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu_safe", "-p",
                           "no:cacheprovider", "tests"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    marked = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert "tests/core/test_grad_nodes.py" in marked and "tests/chains/test_chains.py" in marked, proc.stdout[-3000:]
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
    assert marked <= set(gpu_check.gpu_safe_modules()), sorted(marked - set(gpu_check.gpu_safe_modules()))


@functools.lru_cache(maxsize=None)
def bench_smoke():
    """One smoke run of bench.py over the two configs the tests below check: (exit status, log, rows, report text)."""
    out_dir = tempfile.mkdtemp(prefix="bench_smoke_")
    atexit.register(shutil.rmtree, out_dir, True)
    rc, log = run_tool("bench.py", "--smoke", "--configs", "mlp16x512_b16_4blocks,mlp32x1024_b32_perlayer",
                       "--no-torch", "--out-dir", out_dir)
    rows = json.loads(open(os.path.join(out_dir, "benchmarks.json")).read()) if rc == 0 else None
    text = open(os.path.join(out_dir, "benchmarks.md")).read() if rc == 0 else None
    return rc, log, rows, text


def bench_rows(config):
    rc, log, rows, _ = bench_smoke()
    assert rc == 0, log[-3000:]
    assert [r["config"] for r in rows] == ["mlp16x512_b16_4blocks"] * 2 + ["mlp32x1024_b32_perlayer"] * 2, rows
    return [r for r in rows if r["config"] == config]


def test_bench_smoke_writes_one_checked_row_per_config_and_mode():
    rows = bench_rows("mlp16x512_b16_4blocks")
    assert [(r["config"], r["mode"]) for r in rows] == [("mlp16x512_b16_4blocks", m) for m in ("throughput", "latency")]
    for row in rows:
        for key in ("paddle_eager_us", "autocudagraph_us", "raw_replay_us", "wrapper_host_us"):
            assert row[key] is not None and row[key] > 0, (key, row["why_null"])
        for key in ("autocudagraph_clone_param_grads_false_us", "torch_eager_us", "torch_graphed_us"):
            assert key in row
        for name in ("autocudagraph", "autocudagraph_clone_param_grads_false", "raw_replay"):
            assert row["checks"][name].startswith("bitwise equal"), row["checks"]
        assert row["counters"]["autocudagraph"]["captures"] == 4 and row["counters"]["autocudagraph"]["eager"] == 0
        assert row["torch_eager_us"] is None and "--no-torch" in row["why_null"]["torch_eager"]
    assert "SMOKE RUN" in bench_smoke()[3]


def test_bench_smoke_refuses_to_write_into_docs():
    rc, log = run_tool("bench.py", "--smoke", "--out-dir", os.path.join(REPO, "docs"))
    assert rc != 0 and "a smoke run writes only under" in log, log[-2000:]


@functools.lru_cache(maxsize=None)
def host_breakdown_smoke():
    """One smoke run of host_breakdown.py for the tests below: (its report text, its JSON)."""
    return host_breakdown_run()


def host_breakdown_run():
    """A smoke run of host_breakdown.py: (its report text, its JSON)."""
    out_dir = tempfile.mkdtemp(prefix="host_breakdown_")
    atexit.register(shutil.rmtree, out_dir, True)
    out = os.path.join(out_dir, "host.md")
    rc, log = run_tool("host_breakdown.py", "--smoke", "--out", out)
    assert rc == 0, log[-3000:]
    with open(out) as md, open(out[:-3] + ".json") as js:
        return md.read(), json.load(js)


def test_host_breakdown_times_every_piece_including_the_wrappers_own():
    text, data = host_breakdown_smoke()
    rows = [line.split("|")[1:4] for line in text.splitlines() if line.startswith("| ") and "host us" not in line]
    pieces = {name.strip(): us.strip() for name, _, us in rows}
    # A private name that a refactor moved shows as "n/a (...)": update Internals in tools/host_breakdown.py.
    private = [name for name, who, _ in rows if who.strip().startswith("ours") or "replay()" in name]
    assert len(private) >= 11, private
    for name in private:
        assert not pieces[name.strip()].startswith("n/a"), (name, pieces[name.strip()])
    assert float(pieces["graphed step: forward call + backward + release grads"]) > 0
    calls = data["layer_call_us"]
    assert [c["parameters"] for c in calls] == [4, 6], calls
    for c in calls:
        assert c["layer_call_us"] > 0 and c["counters"]["replays"] > 0 and c["counters"]["eager_calls"] == 0, c
        whose = {p["whose"] for p in c["pieces"]}
        assert {"ours", "Paddle"} <= whose and all(p["us"] is not None for p in c["pieces"]), c["pieces"]
        assert abs(sum(p["share"] for p in c["pieces"]) - 1) < 0.01, c["pieces"]
        # NOTE [ Call stages ] in tools/host_breakdown.py: every probe found its private name, and the stages
        # (medians each) add up to about the instrumented call.
        stages = c["stages"]
        assert len(stages) == 14 and all(st["us"] is not None and st["us"] >= 0 for st in stages), stages
    # The stages' medians come from different repetitions, so a machine that stalls during one stage's (another
    # process on the other core) can push their sum off the call's: the tool runs again, up to twice, and the
    # closest run must hold.
    off = stages_off(calls)
    for _ in range(2):
        if off[0] < 0.25:
            break
        off = min(off, stages_off(host_breakdown_run()[1]["layer_call_us"]))
    assert off[0] < 0.25, off


def test_host_breakdown_times_a_chained_call_stage_by_stage():
    text, _ = host_breakdown_smoke()
    section = text.split("## A chained call's forward, stage by stage", 1)
    assert len(section) == 2, text[-3000:]
    rows = re.findall(r"^\| ([^|]+) \| [^|]+ \| ([\d.]+) \|$", section[1].split("\n## ", 1)[0], re.M)
    # every probe found its private name (NOTE [ Host breakdown internals ]): nine stages, each a number
    assert len(rows) == 9, section[1][:3000]
    assert any(name.startswith("input copy") for name, _ in rows) and all(float(us) >= 0 for _, us in rows), rows
    served = re.search(r"each served by the chain \((\d+) chained calls in all\)", section[1])
    assert served and int(served.group(1)) > 0, section[1][:1000]


def stages_off(calls):
    """(how far the stages' sum is from the instrumented call, at worst over ``calls``; the stages and total)."""
    return max((abs(sum(st["us"] for st in c["stages"]) / c["stages_total_us"] - 1), repr(c["stages"]),
                c["stages_total_us"]) for c in calls)


# ----------------------------------------------------------------------------- every tool on a CPU
#: Tools that run on a CPU by design (no --backend): not asked for a GPU below. cpu_host_time.py times
#: host work; real_models_report.py writes docs/reports/real_models.md on the simulated backend;
#: simulate_cost.py times a simulated call against eager.
CPU_TOOLS = ["cpu_host_time.py", "readme_table.py", "real_models_report.py", "simulate_cost.py"]
TOOLS = sorted(name for name in os.listdir(os.path.join(REPO, "tools")) if name.endswith(".py") and name not in CPU_TOOLS)
SIZED = {"step_gpu_check.py": "--width", "host_breakdown.py": "--layers", "real_models_bench.py": "--steps",
         "bench.py": "--steps", "memory_timeline.py": "--steps"}


#: Runs each ``[script, *args]`` of the JSON list in argv[1] as ``python script *args`` would (``__main__``, its
#: argv, its folder first on sys.path), one after the other in this one process, and prints ``[[output, exit
#: status], ...]`` as JSON. Paddle is imported once instead of once per script (a second each).
_RUN_SCRIPTS = """
import contextlib, io, json, os, runpy, sys, traceback
rest = sys.path[1:]
results = []
for argv in json.loads(sys.argv[1]):
    out, rc = io.StringIO(), 0
    sys.argv, sys.path[:] = list(argv), [os.path.dirname(argv[0])] + rest
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                rc = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                rc = 1
        except BaseException:
            traceback.print_exc()
            rc = 1
    results.append([out.getvalue(), rc])
sys.stdout.write("\\nRESULTS " + json.dumps(results))
"""


def run_scripts_in_one_process(argvs, timeout=300):
    """Runs several scripts under tools/, each as ``python tools/<script>`` would, in one fresh process (each
    only imports Paddle and exits; every tool of TOOLS also runs as its own process in a smoke test below):
    ``{argv: (output, exit status)}``."""
    env = {k: v for k, v in os.environ.items() if k != "PADDLEFLEET_CUDAGRAPH_BACKEND"}
    runs = [[os.path.join(REPO, "tools", argv[0]), *argv[1:]] for argv in argvs]
    proc = subprocess.run([sys.executable, "-c", _RUN_SCRIPTS, json.dumps(runs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {argv: tuple(result) for argv, result in zip(argvs, json.loads(proc.stdout.rsplit("\nRESULTS ", 1)[1]))}


def test_every_tool_is_listed():
    assert TOOLS == ["bench.py", "dist_gpu_check.py", "gpu_check.py", "host_breakdown.py", "memory_timeline.py",
                     "real_models_bench.py", "rng_gpu_check.py", "step_gpu_check.py"], \
        "a new tool: add it to the CPU checks below"


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="checks what a tool says on a CPU build of Paddle")
def test_every_tool_asked_for_the_gpu_on_a_cpu_says_so_and_exits_2():
    results = run_scripts_in_one_process([(tool,) for tool in TOOLS])
    for (tool,), (log, rc) in results.items():
        assert rc == 2, (tool, rc, log[-2000:])
        assert f"tools/{tool}: no GPU here" in log and "use --backend simulate" in log, (tool, log[-2000:])
        assert "Traceback" not in log, (tool, log[-2000:])


@functools.lru_cache(maxsize=None)
def help_of_every_script():
    """``{(script, "--help"): (output, exit status)}`` for every script under tools/ (TOOLS among them)."""
    return run_scripts_in_one_process([(script, "--help") for script in SCRIPTS])


def test_every_tool_shows_its_smoke_defaults_in_help():
    results = help_of_every_script()
    for tool in TOOLS:
        log, rc = results[(tool, "--help")]
        assert rc == 0 and "--backend" in log, (tool, log[-2000:])
        if tool in SIZED:  # e.g. "(default 512; 32 with --backend simulate)"
            assert "--backend simulate)" in " ".join(log.split()), (tool, log)


#: Every script under tools/ a user may run: the tools, the CPU tools and the probes.
SCRIPTS = sorted(os.path.relpath(os.path.join(d, n), os.path.join(REPO, "tools"))
                 for d, _, names in os.walk(os.path.join(REPO, "tools")) if os.path.basename(d) != "benchmark"
                 for n in names if n.endswith(".py"))


def options_without_help(text):
    """The options and arguments an argparse --help lists with no description."""
    lines, missing, listing = text.splitlines(), [], False
    for i, line in enumerate(lines):
        if re.match(r"^\S.*:$", line):  # a section: "options:", "positional arguments:", ...
            listing = line.startswith(("options", "optional arguments", "positional arguments"))
            continue
        m = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
        if not listing or m is None or m.group(2):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^ {4,}\S", following):  # a description on the next line, further indented
            missing.append(m.group(1))
    return missing


def test_options_without_help_are_found():
    text = "usage: x\n\noptions:\n  -h, --help  show this\n  --bare\n  --long-name-here LONG_NAME_HERE\n" \
           "                   described below\n  --other N\n"
    assert options_without_help(text) == ["--bare", "--other N"]


def test_every_tool_and_probe_answers_help_with_every_option_described():
    assert "probes/interleaved_pipeline_probe.py" in SCRIPTS and "cpu_host_time.py" in SCRIPTS, SCRIPTS
    results = help_of_every_script()
    for (script, _), (log, rc) in results.items():
        assert rc == 0 and "Traceback" not in log and "usage:" in log, (script, rc, log[-2000:])
        assert options_without_help(log) == [], (script, options_without_help(log), log)


def test_reused_views_probe_smoke_reuses_views_and_stays_bitwise():
    rc, log = run_tool("probes/reused_views_probe.py", "--smoke", timeout=300)
    assert rc == 0, log[-3000:]
    rows = re.findall(r"^\| (views reused|views made every backward) \| [\d.]+ \([\d.]+\) \| (\d+) \| (\d+) \| (\w+) \|$",
                      log, re.M)
    assert len(rows) == 4 and all(ok == "yes" for *_, ok in rows), log[-3000:]
    for name, made, reused, _ in rows:  # the reused run makes each layer's views once per buffer set, then reuses them
        assert (int(reused) > int(made)) if name == "views reused" else int(reused) == 0, (name, made, reused)


def test_per_layer_floor_probe_smoke_times_every_runner_bitwise():
    rc, log = run_tool("probes/per_layer_floor_probe.py", "--smoke", timeout=300)
    assert rc == 0, log[-3000:]
    runners = ("paddle_eager", "autocudagraph", "autocudagraph_launched_copies", "autocudagraph_unchained",
               "autocudagraph_step", "raw_replay", "raw_per_layer", "raw_per_layer_copies")
    for name in runners:  # both realistic configs, shrunk: a row and a bitwise check each
        assert len(re.findall(rf"^\| {name} \| [\d,]+ \| [\d,]+ \|", log, re.M)) == 2, (name, log[-3000:])
        assert log.count(f"- {name}: bitwise equal to eager: yes") == 2, (name, log[-3000:])


def test_stacks_probe_smoke_stays_bitwise_with_and_without_stacks():
    rc, log = run_tool("probes/stacks_probe.py", "--smoke", timeout=300)
    assert rc == 0, log[-3000:]
    found = re.findall(r"^Bitwise equal to eager before and after timing: (\w+); parameters with stacked grads "
                       r"\(stacked runner\): (\d+), without: (\d+);", log, re.M)
    assert len(found) == 2 and all(ok == "True" and int(on) > 0 and int(off) == 0 for ok, on, off in found), log[-3000:]
    assert len(re.findall(r"^\| (frees grads|accumulates) \| (throughput|latency) \|", log, re.M)) == 8, log[-3000:]


def test_step_gpu_check_smoke_defaults_are_small():
    rc, log = run_tool("step_gpu_check.py", "--backend", "simulate", timeout=120)
    assert rc == 0, log[-3000:]
    assert "MatMLP 4 x 32, batch 8" in log and log.count("bitwise equal to eager") == 3, log[-3000:]
    # The refused_capture case refuses on purpose: its warning is labelled, not a RuntimeWarning that reads like a failure.
    assert "RuntimeWarning" not in log, log[-3000:]
    assert re.search(r"\n    expected refusal: autocudagraph_step\(EmaMatmulStep\): capture of key .* failed: "
                     r"CaptureError: autocudagraph_step: the step reads a host value that changes between steps", log), log


def test_rng_gpu_check_smoke_runs_every_case():
    rc, log = run_tool("rng_gpu_check.py", "--backend", "simulate", timeout=120)
    assert rc == 0, log[-3000:]
    assert log.count("[PASS]") == 5 and "[FAIL]" not in log, log[-3000:]
    assert "RuntimeWarning" not in log and "    warning: " not in log, log[-3000:]
    assert re.search(r"\[PASS\] paddle.rand inside the function \(refused\).*\n    expected refusal: "
                     r"autocudagraph\(<lambda>\): capture of key .* failed: CaptureError: .*random kernel 'uniform'", log), log


def test_memory_timeline_dry_run_records_every_phase_and_the_pool_model(tmp_path):
    out = tmp_path / "memory_timeline.md"
    rc, log = run_tool("memory_timeline.py", "--dry-run", "--out", str(out), timeout=120)
    assert rc == 0, log[-3000:]
    data = json.loads((tmp_path / "memory_timeline.json").read_text())
    runners = data["results"]["xformer24x1024_b32_perlayer"]
    assert [r["runner"] for r in runners] == ["paddle eager", "autocudagraph",
                                              "autocudagraph eager_if_slower=False"], runners
    phases = [row["phase"] for row in runners[1]["rows"]]
    layers = 8  # the smoke config: one graphed Layer per layer
    assert phases[:3] == ["start (cache released)", "model built", f"step 1: {layers} warmup"], phases
    assert phases[3:3 + 2 * layers] == [f"capture: layer {i}, {what}" for i in range(layers)
                                        for what in ("forward", "backward")], phases
    assert phases[3 + 2 * layers:] == [f"step 2: {layers} captured", f"step 3: {layers} replayed",
                                       f"step 4: {layers} replayed"], phases
    stats = runners[1]["stats"]
    assert stats["captures"] == layers and stats["replays"] == 2 * layers, stats
    # No device memory on the CPU: readings are None, the simulated pool model gives the pools.
    assert all(row["memory_reserved"] is None for row in runners[1]["rows"])
    assert stats["pool_bytes"] > 0 and stats["memory"]["pool"] == stats["pool_bytes"], stats
    assert "| capture: layer 7, backward |" in out.read_text()


def test_real_models_bench_smoke_reports_bitwise_with_replays():
    rc, log = run_tool("real_models_bench.py", "--backend", "simulate", "--models", "resnet18", timeout=120)
    assert rc == 0, log[-3000:]
    assert "resnet18" in log and "bitwise yes (8 block replays)" in log, log[-3000:]


def test_dist_gpu_check_reports_a_case_it_cannot_run_as_skip_not_pass():
    rc, log = run_tool("dist_gpu_check.py", "--backend", "simulate", "--cases",
                       "forward_only_in_place_all_reduce,all_reduce_in_graph_compute_stream", timeout=180)
    assert rc == 0, log[-3000:]
    assert "- **SKIP** `all_reduce_in_graph_compute_stream`: gloo has no compute-stream all_reduce" in log, log[-3000:]
    assert "- **PASS** `forward_only_in_place_all_reduce`" in log, log[-3000:]
    assert "Overall: PASS (1 passed, 0 failed, 1 skipped)" in log, log[-3000:]


def test_bench_smoke_per_layer_config_records_peak_memory_start_up_and_capture_ms():
    rows = bench_rows("mlp32x1024_b32_perlayer")
    assert [(r["config"], r["mode"]) for r in rows] == [("mlp32x1024_b32_perlayer", m) for m in ("throughput", "latency")]
    for row in rows:
        assert row["per_layer"] and row["blocks"] == row["layers"] == 8  # shrunk for the CPU, still one Layer each
        assert row["checks"]["autocudagraph"].startswith("bitwise equal"), row["checks"]
        assert row["counters"]["autocudagraph"]["captures"] == 8 and row["counters"]["autocudagraph"]["eager"] == 0
        assert row["autocudagraph_clone_outputs_false_us"] is None and "are timed on the configs of 1 and 4 blocks" in \
            row["why_null"]["autocudagraph_clone_outputs_false"]
        for name in ("paddle_eager", "autocudagraph", "raw_replay"):
            assert name in row["peak_bytes"] and row["peak_bytes"][name] is None  # no device memory on the CPU
            assert row["startup_ms"][name] > 0
        assert row["capture_ms"]["autocudagraph"]["keys"] == 8 and row["capture_ms"]["autocudagraph"]["total_ms"] > 0
        assert row["checks"]["autocudagraph_step"].startswith("bitwise equal"), row["checks"]
        assert row["counters"]["autocudagraph_step"]["captures"] == 1 and row["capture_ms"]["autocudagraph_step"]["keys"] == 1
        # NOTE [ What a key holds ] in core/memory.py: the static buffers on the CPU (no pools to measure)
        assert row["held_bytes"]["autocudagraph"] > 0 and row["held_bytes"]["autocudagraph_step"] > 0, row["held_bytes"]
    text = bench_smoke()[3]
    assert "Start-up, captures and peak memory" in text and "start-up of 8 graphed layers" in text
    assert "## Memory targets" in text and "| | held by graphs MiB |" in text


def test_bench_memory_rows_judge_each_runner_against_its_target():
    sys.path[:0] = [os.path.join(REPO, "tools")]
    try:
        from benchmark import report
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
    mib = 2**20
    row = {"mode": "throughput", "config": "xformer24x1024_b32_perlayer", "per_layer": True, "realistic": True,
           "blocks": 24, "pool_sharing": False,
           "peak_bytes": {"paddle_eager": 1000 * mib, "autocudagraph": 1300 * mib, "autocudagraph_step": 1400 * mib,
                          "raw_replay": 1100 * mib},
           "held_bytes": {"autocudagraph": 700 * mib, "autocudagraph_step": 600 * mib},
           "pool_bytes": {"autocudagraph": 650 * mib, "autocudagraph_step": 590 * mib}}
    [line] = report._memory_targets([row])
    assert "autocudagraph (default) 1.3x (<= 1.4: met)" in line, line
    assert "autocudagraph_step (whole step) 1.4x (<= 1.3: MISSED)" in line, line
    assert "raw replay (floor) 1.1x;" in line and "held by graphs 700.0 MiB per layer" in line, line
    [shared] = report._memory_targets([dict(row, pool_sharing=True)])
    assert "1.3x (<= 1.15: MISSED)" in shared, shared


def test_bench_peak_on_paddle_without_a_peak_counter_counts_what_a_release_gave_back(monkeypatch):
    sys.path[:0] = [os.path.join(REPO, "tools")]
    try:
        from benchmark import paddle_runs
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
    reserved = [100]
    stand_in = type("Cuda", (), {})()
    stand_in.memory_reserved = lambda *a: reserved[0]
    stand_in.memory_allocated = lambda *a: 0
    stand_in.empty_cache = lambda: reserved.__setitem__(0, 150)  # what stays reserved: the graphs' pools
    monkeypatch.setattr(paddle.device, "cuda", stand_in)
    memory = paddle_runs.DeviceMemory(True)
    memory.start()
    reserved[0] = 400  # the eager warmup's peak, then a capture releases its cache
    with memory.watching():
        paddle.device.cuda.empty_cache()
    assert paddle.device.cuda.empty_cache is not None and reserved[0] == 150
    assert memory.peak() == 400 - 150  # base after the first release was 150


def test_host_breakdown_has_the_per_layer_and_whole_step_rows():
    text = host_breakdown_smoke()[0]
    for name in ("per-layer step: 4 graphed layers", "per layer call", "each call alone (chain_calls=False)",
                 "per-layer step, eagerly", "whole-step graph (autocudagraph_step)"):
        line = next(line for line in text.splitlines() if name in line)
        assert float(line.split("|")[3]) > 0, line


def test_simulate_cost_times_a_simulated_call_against_eager():
    rc, log = run_tool("simulate_cost.py", "--calls", "5")
    assert rc == 0, log[-3000:]
    assert "forward+backward" in log and "eager calls 0" in log and "ratio" in log, log[-2000:]


def test_cpu_host_time_times_the_per_layer_and_whole_step_host_work():
    rc, log = run_tool("cpu_host_time.py", "--layers", "4", "--width", "8", "--steps", "3", "--block", "3x8x2")
    assert rc == 0, log[-3000:]
    assert "us per layer call" in log and "whole-step graph" in log and "host us per forward call" in log, log[-2000:]
    assert "graphed block of 3x8x2" in log and "grad hand-out" in log and "n/a" not in log, log[-2000:]
    # Each eager-call row runs for the reason it names (a row whose wrapper graphed instead would time a replay).
    assert "(max_graphs=0: no key may hold graphs" in log and "every key of this wrapper was slower" in log, log[-2000:]
    assert "a key refused under max_graphs=1 (max_graphs reached)" in log, log[-2000:]
    checks = re.search(r"in Python: 32 parameters [\d.]+ against [\d.]+ us; 256 parameters [\d.]+ against", log)
    assert checks, log[-2000:]  # both step sizes timed both ways (step_check_rows)
