"""Suite-wide switch: PADDLEFLEET_CUDAGRAPH_BACKEND=cuda runs the suite on the real backend.

Where the cuda backend cannot run (no CUDA build, or a GPU its Paddle has no kernels for) every
test is skipped with that reason; cases written matmul-only (MatmulOnlyCase, marked ``gpu_safe``)
need only cuBLAS matmuls and copies, so they still run on a GPU that lacks Paddle's other kernels.
Where it can, the backend-parameterised tests run their cuda variants, and tests written for the
simulated backend only (multi-process CPU jobs, CPU-specific behaviour) are skipped with the reason.

``--results-jsonl PATH`` appends one JSON line per test (start, then result, with what it compared
and pinned): tools/gpu_check.py builds docs/reports/gpu_check.md from it, and knows which test was running
if the process dies.
"""

import gc
import json
import os

import pytest

from paddlefleet.cudagraph.options import ENV_BACKEND

from testkit.harness import RECORD, BackendCase, MatmulOnlyCase, cuda_skip_reason


def pytest_addoption(parser):
    parser.addoption("--results-jsonl", default=None, help="append one JSON line per test to this file")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_safe: matmul-only case a GPU without Paddle's arithmetic kernels can run")


def pytest_collection_modifyitems(config, items):
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, MatmulOnlyCase):
            item.add_marker(pytest.mark.gpu_safe)
    if os.environ.get(ENV_BACKEND) != "cuda":
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, BackendCase):
            item.add_marker(pytest.mark.skip(reason=f"{ENV_BACKEND}=cuda: this test is written for the simulated backend"))
            continue
        reason = cuda_skip_reason(cls.kernels)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"{ENV_BACKEND}=cuda: {reason}"))


def pytest_collection_finish(session):
    """What is alive once the tests are collected (Paddle, the package, the test modules) lives as long as the
    process: it leaves the cyclic garbage collector's walks (``gc.freeze``). Every full collection walked all of
    it, and a capture's guards wrap a few thousand of Paddle's ops (each wrapper an object that lives through the
    capture), so full collections came every few captures: a third of the suite's time on Paddle 3.3.1 went into
    entering DrawGuard and InPlaceWrites, mostly in those walks. What a test makes is collected as before;
    ``gc.get_objects()`` (grads/accumulate.py's search for a DataParallel) does not list frozen objects, so a
    DataParallel made when a test module is imported would go unseen there (tests make theirs in the test)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _host_cost_unmeasured():
    """Whether a key stays graphed depends on host timing where replays are measured (cuda: NOTE
    [ Graphed calls that cannot pay ] in core/host_cost.py); tests pin exact counts, so keys are not
    timed here. The tests of that decision patch it back on and drive it with a stand-in clock."""
    from unittest import mock

    with mock.patch("paddlefleet.cudagraph.core.entry.measured", return_value=False):
        yield


def _emit(config, **row):
    path = config.getoption("--results-jsonl")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()


def pytest_runtest_setup(item):
    RECORD.__init__()
    _emit(item.config, event="start", nodeid=item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when != "call" and report.outcome == "passed":
        return
    message = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    elif report.failed:
        message = str(report.longrepr)[-4000:]
    doc = getattr(getattr(item, "obj", None), "__doc__", None) or ""
    _emit(item.config, event="result", nodeid=item.nodeid, when=report.when, outcome=report.outcome,
          duration=round(report.duration, 3), message=message, compared=RECORD.compared,
          notes=list(dict.fromkeys(RECORD.notes)), doc=" ".join(doc.split("\n\n")[0].split()),
          backend=getattr(getattr(item, "cls", None), "backend", None))
