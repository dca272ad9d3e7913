"""docs/reports/real_models.md stays true: every row is run again (simulated backend) and must give the
committed line; rows that cannot run here (PaddleFormers not importable) are skipped with the reason."""

import os
import unittest

from testkit.real_models_report import HEADER, ROWS, parse_rows, render, run_row

REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "docs", "reports", "real_models.md")


class RealModelsReportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(REPORT) as fh:
            cls.text = fh.read()
        cls.lines = parse_rows(cls.text)

    def test_the_report_is_the_generated_one_with_a_row_per_run(self):
        self.assertIn(HEADER, self.text)
        self.assertEqual(len(self.lines), len(ROWS))
        self.assertEqual(self.text, render(self.lines), "the text around the table is render()'s")
        for row, line in zip(ROWS, self.lines):
            self.assertTrue(line.startswith(f"| {row.model} | {row.graphed} | {row.run} |"), line)
            self.assertIn("| yes |", line, "every row the report lists trains bitwise like eager")

    def test_every_row_gives_what_the_report_says(self):
        for row, line in zip(ROWS, self.lines):
            with self.subTest(model=row.model, graphed=row.graphed):
                reason = row.needs() if row.needs else None
                if reason:
                    self.skipTest(reason)
                self.assertEqual(run_row(row), line)


if __name__ == "__main__":
    unittest.main()
