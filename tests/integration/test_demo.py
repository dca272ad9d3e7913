"""The demo command trains eagerly and graphed and reports bitwise equality."""

import contextlib
import io
import os
import re
import subprocess
import sys
import unittest

from unittest import mock

from paddlefleet.cudagraph.__main__ import main as command_main
from paddlefleet.cudagraph.demo import main as demo_main
from paddlefleet.cudagraph.demo.main import MIN_STEPS, run_demo

from testkit.harness import numpy_random_after_paddle_kills_the_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TestDemo(unittest.TestCase):
    def test_run_demo_matches_eager_and_prints_the_table(self):
        out = io.StringIO()
        self.assertEqual(run_demo(steps=4, out=out), 0, out.getvalue())
        text = out.getvalue()
        self.assertIn("eager loss", text)
        self.assertIn("graphed loss", text)
        self.assertEqual(len(re.findall(r"^ +\d+ +[-\d.]+ +[-\d.]+ +True$", text, re.M)), 4, text)  # no CPU timings
        self.assertNotIn("eager ms", text)
        self.assertIn("No timings: the simulated backend re-runs the Python of every call", text)
        self.assertIn("final parameters bitwise equal: True", text)
        self.assertIn("captures=1 replays=2", text)
        self.assertIn("final parameters bitwise equal: True", text.split("transformer block")[1])
        self.assertIn("the LR and the loss scale bitwise equal: True", text.split("whole step")[1])
        self.assertIn("whole-step graphs: warmup_calls=4 captures=2 replays=2 eager_calls=0", text)
        self.assertIn("Model: DemoModel, 4 residual MLP blocks", text)
        self.assertIn("RESULT: every step bitwise equal to eager (", text)

    def test_too_few_steps_is_refused_naming_the_minimum(self):
        self.assertEqual(MIN_STEPS, 4)
        for steps in (0, 1, 3, -2, True):
            with self.assertRaisesRegex(ValueError, r"needs --steps >= 4, got .*whole-step section replays only"):
                run_demo(steps=steps, out=io.StringIO())

    def test_no_result_is_claimed_for_a_run_that_never_replayed(self):
        out = io.StringIO()
        with mock.patch.object(demo_main, "_whole_step_section", return_value=(True, 0)):
            self.assertEqual(run_demo(steps=4, out=out), 1)
        text = out.getvalue()
        self.assertIn("RESULT: NOT CHECKED: whole step never replayed", text)
        self.assertNotIn("every step bitwise equal", text)

    def test_module_command_refuses_too_few_steps(self):
        # The command's own main, in this process (test_module_command runs the command as a process).
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as stop:
            command_main(["demo", "--steps", "0"])
        self.assertEqual(stop.exception.code, 2, err.getvalue())
        self.assertIn("the demo needs --steps >= 4, got 0", err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())

    def test_module_command(self):
        reason = numpy_random_after_paddle_kills_the_process()
        if reason:
            self.skipTest(reason)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, "-m", "paddlefleet.cudagraph", "demo", "--steps", "4"],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("RESULT: every step bitwise equal to eager", proc.stdout)


if __name__ == "__main__":
    unittest.main()
