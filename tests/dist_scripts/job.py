"""What the two-rank workers (fleet_worker.py, step_worker.py, data_parallel_job.py running both) share: running their cases and
reporting one ``RESULT {json}`` line per case, which tests/integration/test_distributed.TwoRankJob reads.

A case returns its detail (compared across ranks by the test), or raises (reported with the
traceback; the next case still runs). A case that cannot run on this Paddle is reported skipped
with the reason, the same on both ranks.
"""

import json
import traceback


def report(result):
    print("RESULT " + json.dumps(result), flush=True)


def run_cases(cases, rank, only=(), skip=None):
    """Runs ``cases`` (functions named ``case_<name>``) and returns the exit status (1 when one failed).

    Args:
        only: names to run (all when empty).
        skip: ``name -> reason or None``: cases to report as skipped instead of running.
    """
    failed = 0
    for case in cases:
        name = case.__name__[len("case_"):]
        if only and name not in only:
            continue
        reason = skip(name) if skip is not None else None
        if reason is not None:
            report({"case": name, "rank": rank, "ok": True, "skipped": reason})
            continue
        try:
            result = {"case": name, "rank": rank, "ok": True, "detail": case()}
        except Exception as err:  # reported, and the next case still runs
            failed += 1
            result = {"case": name, "rank": rank, "ok": False, "detail": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()}
        report(result)
    return 1 if failed else 0
