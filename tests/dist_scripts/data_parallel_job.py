"""One two-rank launch for the data-parallel checks: fleet_worker.py's cases, then step_worker.py's.

Both workers initialise the same job (data parallel degree 2, Fleet where its DistributedStrategy
works here); launching each alone paid for the launcher, two Paddle imports and the gloo set-up
twice. tests/integration/test_distributed.py (TestFleetTwoProcesses) and tests/step/test_train_step.py
(DataParallelWholeStepTest) read their cases from this one launch's ``RESULT`` lines. The exit
status is 1 when a case of either failed.
"""

import os
import sys

import numpy.random  # noqa: F401  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise, docs/guides/compat.md)

sys.path.insert(0, os.environ.get("PADDLEFLEET_ROOT", os.getcwd()))
import fleet_worker  # noqa: E402  (this script's folder is on sys.path)
import step_worker  # noqa: E402
from job import run_cases  # noqa: E402


def main():
    rank, no_fleet = fleet_worker.init()
    step_worker.RANK, step_worker.FLEET_UNAVAILABLE = rank, no_fleet
    fleet_skip = (lambda name: no_fleet if name in fleet_worker.NEEDS_FLEET else None) if no_fleet else None
    step_skip = (lambda name: no_fleet if name in step_worker.NEEDS_FLEET else None) if no_fleet else None
    failed = run_cases(fleet_worker.CASES, rank, skip=fleet_skip)
    failed |= run_cases(step_worker.CASES, rank, skip=step_skip)
    sys.exit(failed)


if __name__ == "__main__":
    main()
