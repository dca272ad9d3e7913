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
                         "tests/block/test_frozen_values.py::LayerAttributeCases::"
                         "test_flag_read_in_forward_changed_after_capture_captures_again",
                         "tests/guards/test_dataflow.py::ChainedMemberTest"),
    "which tensor an op reads": ("tests/guards/test_dataflow.py::WhichTensorTest",
                                 "tests/step/test_step_dataflow.py::SimulatedStepDataflowTest"),
    "indexing": ("tests/guards/test_dataflow.py::IndexedInCppTest",
                 "tests/guards/test_dataflow.py::NeverWriteTheCallersTensorTest"),
    "the backward's Python": ("tests/guards/test_dataflow.py::BackwardPythonTest",),
    "Python values returned": ("tests/guards/test_dataflow.py::ReturnedPythonValuesTest",),
    "Layer structure": ("tests/block/test_frozen_values.py::LayerStructureCases",
                        "tests/block/test_frozen_values.py::ChainedAttributeCases"),
    "stop_gradient": ("tests/block/test_frozen_values.py::StepValueCases::test_freezing_a_parameter_captures_the_step_again",
                      "tests/step/test_step_dataflow.py::OutsideTensorFrozenTest"),
    "the default dtype": ("tests/block/test_frozen_values.py::DefaultDtypeCases",),
    "random draws": ("tests/block/test_capture_failures.py",
                     "tests/block/test_safety.py::CaptureFailureTest::test_a_forward_rewinding_the_rng_before_a_draw_is_refused"),
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
