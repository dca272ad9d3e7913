"""The fidelity table (guards/fidelity.py): docs/guides/fidelity.md is rendered from it, and every row is shown
by tests that exist."""

import os
import re
import unittest

from paddlefleet.cudagraph.guards import fidelity

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tests that show each row (on the simulated backend; tools/gpu_check.py runs the matmul-only ones on a GPU).
TESTS = {
    "scalar arguments": ("tests/block/test_frozen_values.py::SetItemScalarTest",
                         "tests/block/test_frozen_values.py::LayerAttributeCases"),
    "which tensor an op reads": ("tests/block/test_frozen_values.py::LayerAttributeCases",),
    "indexing": ("tests/block/test_frozen_values.py::SetItemScalarTest",),
    "the backward's Python": ("tests/block/test_frozen_values.py::LayerAttributeCases",),
    "Python values returned": ("tests/block/test_frozen_values.py::LayerAttributeCases",),
    "Layer structure": ("tests/block/test_frozen_values.py::LayerAttributeCases",),
    "stop_gradient": ("tests/block/test_frozen_values.py::StepValueCases",),
    "the default dtype": ("tests/core/test_key_parts.py",),
    "random draws": ("tests/block/test_capture_failures.py",),
    "host reads and copies": ("tests/backends/test_host_guard.py",),
    "host side effects": ("tests/guards/test_python_output.py::PythonOutputTest",
                          "tests/block/test_frozen_values.py::LayerAttributeCases"),
}


def _exists(test_id):
    path, _, rest = test_id.partition("::")
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        return False
    text = open(full, encoding="utf-8").read()
    return all(re.search(rf"^\s*(class|def) {re.escape(part)}\b", text, re.M) for part in rest.split("::") if part)


class FidelityTableTest(unittest.TestCase):
    def test_the_guide_page_is_rendered_from_the_table(self):
        with open(os.path.join(REPO, "docs", "guides", "fidelity.md"), encoding="utf-8") as fh:
            self.assertEqual(fh.read(), fidelity.render(),
                             "docs/guides/fidelity.md is out of date: write fidelity.render() to it")

    def test_every_row_names_tests_that_exist(self):
        names = [r.name for r in fidelity.ROWS]
        self.assertEqual(sorted(names), sorted(TESTS), "each row of the table has its tests here, and no others")
        missing = [t for ts in TESTS.values() for t in ts if not _exists(t)]
        self.assertEqual(missing, [])


if __name__ == "__main__":
    unittest.main()
