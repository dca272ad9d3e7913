"""tools/benchmark/plot.py: the legend sits outside the panels (it never covers a bar, the
tallest included) and the y axis says lower is better; without matplotlib the plot is skipped
with the reason. Imports neither Paddle nor torch, as the plot's own process does."""

import json
import os
import subprocess
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

from benchmark import plot  # noqa: E402
from benchmark.timing import MODES  # noqa: E402

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # matplotlib is optional (the bench extra)
    plt = None


def rows():
    out = []
    for mode in MODES:
        for k, config in enumerate(("mlp16x512_b16", "mlp32x256_b8", "mlp8x4096_b64")):
            row = {"config": config, "mode": mode, "gpu": "test GPU", "paddle": "3.3.1", "smoke": True}
            for i, name in enumerate(plot.PLOTTED):
                row[f"{name}_us"] = 100.0 * (k + 1) * (len(plot.PLOTTED) - i)  # the tallest bars first, at the left
            out.append(row)
    return out


@unittest.skipIf(plt is None, "matplotlib is not installed (optional: pip install -e .[bench])")
class PlotLayoutTest(unittest.TestCase):
    def test_the_legend_covers_no_bar_and_the_axis_says_lower_is_better(self):
        fig = plot.draw(plt, rows())
        try:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
            self.assertEqual(len(legends), 1)
            box = legends[0].get_window_extent(renderer)
            bars = [p for ax in fig.axes for p in ax.patches]
            self.assertEqual(len(bars), len(MODES) * 3 * len(plot.PLOTTED))
            for bar in bars:
                self.assertFalse(box.overlaps(bar.get_window_extent(renderer)), "the legend covers a bar")
            for ax in fig.axes:
                self.assertFalse(box.overlaps(ax.get_window_extent(renderer)), "the legend sits inside a panel")
                self.assertIn("lower is better", ax.get_ylabel())
        finally:
            plt.close(fig)

    def test_main_writes_the_png(self):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src, png = os.path.join(tmp, "rows.json"), os.path.join(tmp, "plot.png")
            with open(src, "w") as fh:
                json.dump(rows(), fh)
            self.assertEqual(plot.main(src, png), 0)
            self.assertGreater(os.path.getsize(png), 1000)


@unittest.skipIf(plt is not None, "matplotlib is installed here: the skip path cannot be seen")
class PlotWithoutMatplotlibTest(unittest.TestCase):
    def test_the_plot_is_skipped_with_the_reason(self):
        code = "import sys; from benchmark.plot import main; sys.exit(main('unused.json', 'unused.png'))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              cwd=os.path.join(REPO, "tools"))
        self.assertEqual(proc.returncode, 3, proc.stderr)
        self.assertIn("skipped: matplotlib is not installed", proc.stdout)


if __name__ == "__main__":
    unittest.main()
