"""The GPU tools run end to end on the CPU (their smoke modes), so a change to the package that
breaks one fails here, not on the next GPU run. Each runs as a script, as on a GPU host."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(*argv, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PADDLEFLEET_CUDAGRAPH_BACKEND"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", argv[0]), *argv[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_gpu_check_runs_the_gpu_safe_cases_and_reports_them(tmp_path):
    out = tmp_path / "gpu_check.md"
    rc, log = run_tool("gpu_check.py", "--backend", "simulate", "--out", str(out))
    assert rc == 0, log[-3000:]
    text = out.read_text()
    assert "| **PASSED** |" in text and "**FAILED**" not in text and "**ERROR**" not in text, text[-3000:]
    assert "test_eager_matmul_matches_numpy" in text and "values bitwise equal" in text


def test_bench_smoke_writes_one_checked_row_per_config_and_mode(tmp_path):
    rc, log = run_tool("bench.py", "--smoke", "--configs", "mlp16x512_b16_4blocks", "--no-torch", "--out-dir", str(tmp_path))
    assert rc == 0, log[-3000:]
    rows = json.loads((tmp_path / "benchmarks.json").read_text())
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
    assert "SMOKE RUN" in (tmp_path / "benchmarks.md").read_text()


def test_bench_smoke_refuses_to_write_into_docs():
    rc, log = run_tool("bench.py", "--smoke", "--out-dir", os.path.join(REPO, "docs"))
    assert rc != 0 and "a smoke run writes only under" in log, log[-2000:]


def test_host_breakdown_times_every_piece_including_the_wrappers_own(tmp_path):
    out = tmp_path / "host.md"
    rc, log = run_tool("host_breakdown.py", "--smoke", "--out", str(out))
    assert rc == 0, log[-3000:]
    rows = [line.split("|")[1:4] for line in out.read_text().splitlines() if line.startswith("| ") and "host us" not in line]
    pieces = {name.strip(): us.strip() for name, _, us in rows}
    # A private name that a refactor moved shows as "n/a (...)": update Internals in tools/host_breakdown.py.
    private = [name for name, who, _ in rows if who.strip().startswith("ours") or "replay()" in name]
    assert len(private) >= 11, private
    for name in private:
        assert not pieces[name.strip()].startswith("n/a"), (name, pieces[name.strip()])
    assert float(pieces["graphed step: forward call + backward + release grads"]) > 0


def test_bench_smoke_per_layer_config_records_peak_memory_start_up_and_capture_ms(tmp_path):
    rc, log = run_tool("bench.py", "--smoke", "--configs", "mlp32x1024_b32_perlayer", "--no-torch", "--out-dir", str(tmp_path))
    assert rc == 0, log[-3000:]
    rows = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [(r["config"], r["mode"]) for r in rows] == [("mlp32x1024_b32_perlayer", m) for m in ("throughput", "latency")]
    for row in rows:
        assert row["per_layer"] and row["blocks"] == row["layers"] == 8  # shrunk for the CPU, still one Layer each
        assert row["checks"]["autocudagraph"].startswith("bitwise equal"), row["checks"]
        assert row["counters"]["autocudagraph"]["captures"] == 8 and row["counters"]["autocudagraph"]["eager"] == 0
        assert row["autocudagraph_clone_outputs_false_us"] is None and "options are timed" in \
            row["why_null"]["autocudagraph_clone_outputs_false"]
        for name in ("paddle_eager", "autocudagraph", "raw_replay"):
            assert name in row["peak_bytes"] and row["peak_bytes"][name] is None  # no device memory on the CPU
            assert row["startup_ms"][name] > 0
        assert row["capture_ms"]["autocudagraph"]["keys"] == 8 and row["capture_ms"]["autocudagraph"]["total_ms"] > 0
        assert row["checks"]["autocudagraph_step"].startswith("bitwise equal"), row["checks"]
        assert row["counters"]["autocudagraph_step"]["captures"] == 1 and row["capture_ms"]["autocudagraph_step"]["keys"] == 1
    text = (tmp_path / "benchmarks.md").read_text()
    assert "Start-up, captures and peak memory" in text and "start-up of 8 graphed layers" in text


def test_host_breakdown_has_the_per_layer_and_whole_step_rows(tmp_path):
    out = tmp_path / "host.md"
    rc, log = run_tool("host_breakdown.py", "--smoke", "--out", str(out))
    assert rc == 0, log[-3000:]
    text = out.read_text()
    for name in ("per-layer step: 4 graphed layers", "per graphed layer call", "whole-step graph (autocudagraph_step)"):
        line = next(line for line in text.splitlines() if name in line)
        assert float(line.split("|")[3]) > 0, line


def test_cpu_host_time_times_the_per_layer_and_whole_step_host_work():
    rc, log = run_tool("cpu_host_time.py", "--layers", "4", "--width", "8", "--steps", "3")
    assert rc == 0, log[-3000:]
    assert "us per layer call" in log and "whole-step graph" in log and "host us per forward call" in log, log[-2000:]
