"""NOTE [ Python output on replay ] (guards/python_output.py): print() and logging inside a graphed function run at
every simulated replay, where a GPU runs them once, at capture: one warning says so."""

import io
import logging
import os
import unittest
import warnings
from contextlib import redirect_stdout

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step

THIS_FILE = os.path.abspath(__file__)


def _line(marker):
    """The line of this file that ends with ``# <marker>``."""
    with open(THIS_FILE, encoding="utf-8") as fh:
        lines = [i for i, text in enumerate(fh, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def _ours(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("autocudagraph: ") and "inside a graphed "
            "function runs at every replay" in str(w.message)]


class PythonOutputTest(unittest.TestCase):
    def calls(self, fn, shapes, **options):
        graphed = autocudagraph(fn, backend="simulate", warmup_steps=1, **options)
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, redirect_stdout(out):
            warnings.simplefilter("always")
            results = [graphed(paddle.full(shape, float(i))) for i, shape in enumerate(shapes)]
        for (i, shape), got in zip(enumerate(shapes), results):
            np.testing.assert_array_equal(got.numpy(), fn.__wrapped__(paddle.full(shape, float(i))).numpy()
                                          if hasattr(fn, "__wrapped__") else (paddle.full(shape, float(i)) * 2).numpy())
        return graphed, _ours(caught), out.getvalue()

    def test_a_print_warns_once_naming_its_line(self):
        line = _line("print-line")

        def printing(x):
            print("step")  # print-line
            return x * 2

        graphed, messages, printed = self.calls(printing, [[2]] * 5 + [[3]] * 4)  # two keys, each captured
        self.assertEqual(graphed.stats()["captures"], 2)
        self.assertEqual(len(messages), 1, messages)
        self.assertIn(f"print() at {THIS_FILE}:{line} inside a graphed function runs at every replay on the simulated "
                      "backend", messages[0])
        self.assertIn("on a GPU it runs once, at capture", messages[0])
        self.assertEqual(printed.count("step"), 9 + 2, "on simulate it printed at every call (and at each capture)")

    def test_a_log_record_warns_and_a_filtered_one_does_not(self):
        log = logging.getLogger("tests.guards.user_model")
        log.addHandler(logging.NullHandler())
        log.propagate = False
        log.setLevel(logging.WARNING)
        line = _line("log-line")

        def logging_fn(x):
            log.warning("loss scale %s", 1.0)  # log-line
            log.debug("not shown at WARNING: a replay repeats nothing")
            return x * 2

        _, messages, _ = self.calls(logging_fn, [[2]] * 4)
        self.assertEqual(len(messages), 1, messages)
        self.assertIn(f"a logging call at {THIS_FILE}:{line}", messages[0])

    def test_a_function_without_output_does_not_warn(self):
        _, messages, _ = self.calls(lambda x: x * 2, [[2]] * 4)
        self.assertEqual(messages, [])

    def test_another_threads_print_during_a_capture_does_not_warn(self):
        import threading

        def say():
            print("another thread")  # user code, in a thread that is not capturing

        def with_a_thread(x):
            worker = threading.Thread(target=say)
            worker.start()
            worker.join()  # its print runs while this thread captures
            return x * 2

        _, messages, printed = self.calls(with_a_thread, [[2]] * 4)
        self.assertIn("another thread", printed)
        self.assertEqual(messages, [])

    def test_a_refused_capture_does_not_warn_about_replays(self):
        def printing_a_tensor(x):
            print("value", x)  # refused at capture: the key runs eagerly, as eager prints
            return x * 2

        graphed, messages, _ = self.calls(printing_a_tensor, [[2]] * 3)
        self.assertEqual(graphed.stats()["captures"], 0)
        self.assertEqual(messages, [])

    def test_a_whole_step_warns_too(self):
        paddle.seed(0)
        model = paddle.nn.Linear(4, 4)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        line = _line("step-print-line")

        def step(x):
            loss = model(x).mean()
            print("a step")  # step-print-line
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        graphed = autocudagraph_step(step, optimizers=[opt], backend="simulate")
        with warnings.catch_warnings(record=True) as caught, redirect_stdout(io.StringIO()):
            warnings.simplefilter("always")
            for i in range(5):
                graphed(paddle.full([2, 4], float(i)))
        self.assertEqual(graphed.stats()["captures"], 1)
        messages = _ours(caught)
        self.assertEqual(len(messages), 1, messages)
        self.assertIn(f"print() at {THIS_FILE}:{line}", messages[0])


if __name__ == "__main__":
    unittest.main()
