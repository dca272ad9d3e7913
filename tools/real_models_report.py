"""Writes docs/reports/real_models.md: every real model we run, what is graphed, replays, bitwise.

From the repository root, on a CPU (simulated backend; PaddleFormers rows need
``pip install --no-deps -r requirements-real-models.txt``)::

    python tools/real_models_report.py --out docs/reports/real_models.md

tests/integration/test_real_models_report.py reruns the rows and checks the committed report.
Exit code: 0 when every row ran and was bitwise, 1 otherwise.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.real_models_report import ROWS, render, run_row  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/reports/real_models.md", help="where to write the report")
    args = parser.parse_args(argv)
    lines, ok = [], True
    for row in ROWS:
        reason = row.needs() if row.needs else None
        if reason:
            sys.stderr.write(f"cannot run {row.model} / {row.graphed}: {reason}\n")
            return 1
        line = run_row(row)
        ok = ok and "| yes |" in line
        lines.append(line)
        sys.stdout.write(line + "\n")
    with open(args.out, "w") as fh:
        fh.write(render(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
