"""The demo command trains eagerly and graphed and reports bitwise equality."""

import io
import os
import subprocess
import sys
import unittest

from paddlefleet.cudagraph.demo.main import run_demo

from testkit.harness import numpy_random_after_paddle_kills_the_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestDemo(unittest.TestCase):
    def test_run_demo_matches_eager_and_prints_the_table(self):
        out = io.StringIO()
        self.assertEqual(run_demo(steps=4, out=out), 0, out.getvalue())
        text = out.getvalue()
        self.assertIn("eager loss", text)
        self.assertIn("graphed loss", text)
        self.assertEqual(text.count(" True "), 4, text)
        self.assertIn("final parameters bitwise equal: True", text)
        self.assertIn("captures=1 replays=2", text)
        self.assertIn("final parameters bitwise equal: True", text.split("transformer block")[1])
        self.assertIn("the LR and the loss scale bitwise equal: True", text.split("whole step")[1])
        self.assertIn("whole-step graphs: warmup_calls=4 captures=2 replays=2 eager_calls=0", text)

    def test_module_command(self):
        reason = numpy_random_after_paddle_kills_the_process()
        if reason:
            self.skipTest(reason)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, "-m", "paddlefleet.cudagraph", "demo", "--steps", "3"],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("RESULT: every step bitwise equal to eager", proc.stdout)


if __name__ == "__main__":
    unittest.main()
