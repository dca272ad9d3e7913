"""End-to-end check of autocudagraph's cuda backend on a real GPU: the suite's matmul-only cases.

On a GPU host with a GPU build of Paddle (README.md, "Install on a GPU")::

    python tools/gpu_check.py --out docs/reports/gpu_check.md

CPU smoke test of the same script (the same cases on the simulated backend)::

    python tools/gpu_check.py --backend simulate --out /tmp/gpu_check.md

It runs the suite's cases marked ``gpu_safe``, from every test module that defines a ``MatmulOnlyCase``
(found by ``gpu_safe_modules``; among them tests/integration/test_gpu_safe.py: matmul-only, every result
bitwise against eager, phases pinned with the wrapper's counters; tests/block/test_capture_failures.py: every
reason a capture is refused or fails - host reads, host-to-device copies, syncs, the function's own
exception - in a block and in a whole step, each equal to eager with no capture left open, and a fresh
process that must exit 0; tests/chains/test_chains.py: chains of graphed layers and paddle.grad through
graphed calls; tests/block/test_frozen_values.py: a Layer attribute changed after capture, one the
function changes on every call (refused at capture, as on simulate), a parameter frozen and unfrozen in a
whole step; tests/backends/test_refusals.py: rows of the refusal table whose
GPU behaviour matters - a stream wait refused, ``int(paddle.shape(x)[0])`` captured, ``p.grad = t`` captured as an
in-place copy; tests/step/test_step_dataflow.py: a closure tensor that is no Parameter frozen after a whole
step's capture; tests/grads/test_grad_stacks.py: stacked parameter grads under every hand-out policy, the views
a backward hands out reused by the next while untouched and made again once freed, and the
pool bytes of a key whose four 1 MiB grads share one stack, in the case's notes; tests/core/test_grad_nodes.py:
a dropped graphed model gives its memory back; tests/core/test_capture_session.py: the collector paused
during a capture) with
PADDLEFLEET_CUDAGRAPH_BACKEND set to the backend, in a child pytest process that reports each case
as it ends (conftest's ``--results-jsonl``). If the child dies (a CUDA error inside a capture can
abort the process), the case that was running is recorded as an error and the rest run in a new
child. The report has the run's facts, what this GPU's Paddle can run, and a row per case; cases a
GPU cannot run (an option this version lacks, a kernel this GPU's Paddle lacks) are listed as
skipped with the reason.

Exit code: 0 when every case that ran passed and at least one ran, 1 otherwise, 2 when asked for
the cuda backend where there is no GPU.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paddlefleet.cudagraph.options import ENV_BACKEND  # noqa: E402
from testkit.cli import BACKEND_HELP, require_gpu  # noqa: E402
from testkit.common import check_smoke_path, cuda_skip_reason, device, host_tensor  # noqa: E402
from testkit.common import info_lines, run_info, short, write_generated  # noqa: E402



def gpu_safe_modules(root=REPO):
    """The test modules that define matmul-only cases (a ``MatmulOnlyCase`` subclass: conftest marks
    them ``gpu_safe``), found by their text so that a new module is never left out of the GPU run."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(root, "tests")):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    if re.search(r"class \w+\([^)]*MatmulOnlyCase", fh.read()):
                        found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return found


RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


# ----------------------------------------------------------------------------- running the cases
def run_child(backend, results, keyword, done, timeout):
    """One pytest child over the gpu_safe cases not in ``done``; returns (exit code, stderr tail)."""
    # Only pytest's own plugins: a GPU host's Python carries many (jaxtyping, hypothesis, ...), built
    # for its numpy, while Paddle 2.6 runs with numpy 1.26 first on PYTHONPATH.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **{ENV_BACKEND: backend})
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu_safe", f"--rootdir={REPO}",
           f"--results-jsonl={results}", *gpu_safe_modules()]
    if keyword:
        cmd += ["-k", keyword]
    for nodeid in sorted(done):
        cmd += ["--deselect", nodeid]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return "timeout", f"timed out after {timeout} s: " + (err.stderr or b"")[-1500:].decode(errors="replace")
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def read_results(path):
    """``{nodeid: row}`` from the child's JSON lines; a case that started but has no result maps to None."""
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path) as fh:
        for line in fh:
            event = json.loads(line)
            nodeid = event["nodeid"]
            if event["event"] == "start":
                rows.setdefault(nodeid, None)
                continue
            outcome = "error" if event["outcome"] == "failed" and event["when"] != "call" else event["outcome"]
            event["outcome"] = outcome
            old = rows.get(nodeid)
            if old is None or RANK[outcome] > RANK[old["outcome"]]:
                rows[nodeid] = event
    return rows


def run_cases(backend, keyword, timeout, restarts=5):
    """Runs every gpu_safe case once, in as many children as crashes need; returns rows in run order."""
    fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="gpu_check_")
    os.close(fd)
    try:
        rows, notes = {}, []
        for _ in range(restarts + 1):
            rc, tail = run_child(backend, path, keyword, set(rows), timeout)
            rows.update({n: r for n, r in read_results(path).items() if rows.get(n) is None})
            crashed = [n for n, r in rows.items() if r is None]
            for nodeid in crashed:
                rows[nodeid] = {"nodeid": nodeid, "outcome": "error", "backend": backend, "duration": 0,
                                "compared": 0, "notes": [], "doc": "",
                                "message": f"the process died while this case ran (exit {rc}):\n{tail}"}
            if rc not in (0, 1, 5) and not crashed:
                notes.append(f"pytest exited {rc} outside any case:\n{tail}")
            if not crashed:
                break
        return list(rows.values()), notes
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- facts of this GPU
def gpu_facts():
    """What this GPU's Paddle can run, and facts about its CUDA-graph API and Place objects."""
    lines = [f"- Paddle kernels: matmul and copies {'run' if cuda_skip_reason('matmul') is None else 'do NOT run'}; "
             f"all kernels: {cuda_skip_reason('all') or 'run'}"]
    try:
        from paddle.device.cuda import graphs

        with device("gpu"):
            a, b = host_tensor([1.0]), host_tensor([1.0])
        core_graph = getattr(graphs, "CoreCUDAGraph", None)
        names = ("begin_capture", "begin_capture_with_pool_id", "gen_new_memory_pool_id")
        found = [n for n in names if core_graph is not None and hasattr(core_graph, n)]
        lines.append(f"- core.CUDAGraph has {found or 'none of ' + str(list(names))}")
        lines.append(f"- Place: `a.place == b.place` for two tensors on one device is {a.place == b.place}, "
                     f"str equal {str(a.place) == str(b.place)}, hash equal {hash(a.place) == hash(b.place)}")
    except Exception as err:  # noqa: BLE001 - the report still says what it could
        lines.append(f"- CUDA-graph API / Place: ? ({short(err)})")
    return lines


# ----------------------------------------------------------------------------- report
def md(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def describe(row):
    name = row["nodeid"].split("::", 1)[-1]
    return f"`{name}`" + (f": {row['doc']}" if row.get("doc") else "")


def detail(row):
    if row["outcome"] == "passed":
        text = f"{row['compared']} values bitwise equal"
        return "; ".join([text] + row["notes"])
    if row["outcome"] == "skipped":
        return row["message"]
    first = [line for line in row["message"].splitlines() if line.strip()]
    errors = [line for line in first if line.startswith("E ")]
    return " ".join((errors or first)[:3])[:400]


def render(head, rows, notes):
    out = list(head) + ["| case | result | details |", "|---|---|---|"]
    out += [f"| {md(describe(r))} | **{r['outcome'].upper()}** | {md(detail(r))} |" for r in rows]
    ran = [r for r in rows if r["outcome"] != "skipped"]
    passed = [r for r in ran if r["outcome"] == "passed"]
    out += ["", f"**{len(passed)} of {len(ran)} cases that ran passed; {len(rows) - len(ran)} skipped "
                f"(reasons in the table).**"]
    bad = [r for r in ran if r["outcome"] != "passed"]
    if bad or notes:
        out += ["", "## Failures"]
        for r in bad:
            out += ["", f"### {r['nodeid']} ({r['outcome']})", "", "```", r["message"].rstrip(), "```"]
        for note in notes:
            out += ["", "```", note.rstrip(), "```"]
    ok = bool(passed) and not bad and not notes
    return out, ok


def main():
    parser = argparse.ArgumentParser(description="autocudagraph end-to-end check: the suite's gpu_safe cases")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    parser.add_argument("--out", help="write the report here (markdown; text above its generated-text mark is kept)")
    parser.add_argument("-k", "--cases", help="pytest -k expression: run only matching cases")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest child")
    args = parser.parse_args()
    require_gpu("tools/gpu_check.py", args.backend)
    os.environ.pop(ENV_BACKEND, None)
    cuda = args.backend == "cuda"
    if args.out and not cuda:
        try:
            check_smoke_path(args.out, "tools/gpu_check.py")
        except ValueError as err:
            raise SystemExit(str(err)) from None
    title = "autocudagraph end-to-end check (cuda backend)" if cuda else \
        "SMOKE RUN of tools/gpu_check.py (simulated backend on the CPU): not a GPU result"
    head = [f"# {title}", ""] + info_lines(run_info(cuda, REPO))
    if cuda:
        head += gpu_facts()
    head += [f"- cases: `pytest -m gpu_safe {' '.join(gpu_safe_modules())}` with {ENV_BACKEND}={args.backend} "
             "(matmul-only suite cases, NOTE [ Kernel-less GPUs ] in testkit/common.py)", ""]
    print("\n".join(head), flush=True)
    rows, notes = run_cases(args.backend, args.cases, args.timeout)
    rows = [r for r in rows if r.get("backend") == args.backend]
    report, ok = render(head, rows, notes)
    print("\n".join(report[len(head):]))
    if args.out and all(r["outcome"] == "skipped" for r in rows):
        print(f"not writing {args.out}: no case ran here", file=sys.stderr)
    elif args.out:
        write_generated(args.out, report, "tools/gpu_check.py", smoke=not cuda)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
