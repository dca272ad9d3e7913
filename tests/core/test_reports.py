"""What a user reads: the package logger (one INFO line per capture, off by default) and explain()."""

import logging
import os
import re
import unittest
from unittest import mock

import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step, explain_model, report_model
from paddlefleet.cudagraph.core.keys import Key, StateKey
from paddlefleet.cudagraph.core.explain import _plain_key as plain_key, distinct_labels
from paddlefleet.cudagraph.options import ENV_BACKEND

LOGGER = "paddlefleet.cudagraph"


class LoggerTest(unittest.TestCase):
    def test_the_package_logger_starts_at_warning(self):
        self.assertEqual(logging.getLogger(LOGGER).level, logging.WARNING)

    def test_a_capture_logs_one_info_line_with_its_key_and_milliseconds(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1)
        with self.assertLogs(LOGGER, level=logging.INFO) as logs:
            for _ in range(4):
                layer(paddle.randn([2, 4])).sum().backward()
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertRegex(logs.records[0].getMessage(), r"^autocudagraph\(Linear\.forward\): captured key "
                                                       r"\(input: float32\[2, 4\]\) in \d+\.\d ms on simulate$")

    def test_a_whole_step_capture_logs_its_line_too(self):
        model = paddle.nn.Linear(4, 4)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())

        @autocudagraph_step(optimizers=[opt], backend="simulate")
        def step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        with self.assertLogs(LOGGER, level=logging.INFO) as logs:
            for _ in range(4):
                step(paddle.randn([2, 4]))
        captured = [r.getMessage() for r in logs.records if "captured key" in r.getMessage()]
        self.assertEqual(len(captured), 1, logs.output)
        self.assertTrue(re.match(r"autocudagraph_step\(step\): captured key .* in \d+\.\d ms on simulate$",
                                 captured[0]), captured)

    def test_nothing_is_logged_at_the_default_level(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1)
        handler = _Recorder()
        logging.getLogger(LOGGER).addHandler(handler)
        try:
            for _ in range(3):
                layer(paddle.randn([2, 4]))
        finally:
            logging.getLogger(LOGGER).removeHandler(handler)
        self.assertEqual((layer.stats()["captures"], handler.records), (1, []))


def _key_lines(text):
    return [line.strip() for line in text.splitlines() if line.strip().startswith("key ")]


class ExplainTest(unittest.TestCase):
    def test_keys_that_differ_in_grad_mode_or_training_say_what_differs(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1)
        x = paddle.randn([2, 4])
        for _ in range(3):
            layer(x).sum().backward()
            with paddle.no_grad():
                layer(x)
        layer.eval()
        for _ in range(3):
            layer(x)
        lines = _key_lines(layer.explain())
        labels = [line.split(": graphed;")[0] for line in lines]
        self.assertEqual(labels, ["key (input: float32[2, 4])", "key (input: float32[2, 4]) [no_grad]",
                                  "key (input: float32[2, 4]) [eval]"], lines)

    def test_keys_alike_in_everything_shown_are_numbered(self):
        state = StateKey(True, None, (True,))
        rows = [{"label": "(x: float32[2])", "key": plain_key(Key(False, (i,), state))} for i in range(3)]
        self.assertEqual(distinct_labels(rows), ["(x: float32[2])", "(x: float32[2]) #2", "(x: float32[2]) #3"])
        amp = [{"label": "(x)", "key": plain_key(Key(False, (), StateKey(True, level, ())))}
               for level in ((0, None), (1, "float16"))]
        self.assertEqual(distinct_labels(amp), ["(x) [no amp]", "(x) [amp level 1, float16]"])

    def test_words_a_user_knows_and_a_rounded_capture_time(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1)
        for _ in range(3):
            layer(paddle.randn([2, 4])).sum().backward()
        text = layer.explain()
        self.assertIn("parameter grads handed to Paddle with clone_param_grads='auto': 0 copied when handed out", text)
        self.assertNotIn("adopted", text)
        self.assertRegex(text, r"captured in \d+\.\d{1,2} ms")
        [ms] = layer.stats()["capture_ms"].values()
        self.assertEqual(ms, round(ms, 2))

    def test_a_block_inside_a_whole_step_says_why_it_ran_eagerly_and_the_step_speaks_plainly(self):
        model = paddle.nn.Sequential(paddle.nn.Linear(4, 4))
        autocudagraph(model[0], backend="simulate")
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())

        @autocudagraph_step(optimizers=[opt], backend="simulate")
        def step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        for _ in range(6):
            step(paddle.randn([2, 4]))
        self.assertEqual(step.stats()["replays"], 3)
        # The calls a GPU sees: two warmup steps and the capture. Its replays run no Python, and the
        # simulated replays, which do, do not count as calls either.
        self.assertIn("eager: 3 of 3 calls ran eagerly; eager because called inside autocudagraph_step: the whole "
                      "step's graph holds its work", model[0].explain())
        self.assertIn("whole step, grads cleared inside the step (each call starts without grads)", step.explain())
        self.assertNotIn("grad slots", step.explain())

    def test_an_eager_backend_set_by_the_environment_names_the_variable(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4))
        with mock.patch.dict(os.environ, {ENV_BACKEND: "eager"}):
            layer(paddle.randn([2, 4]))
        self.assertIn(f"eager because backend is eager: the environment sets {ENV_BACKEND}=eager", layer.explain())
        plain = autocudagraph(paddle.nn.Linear(4, 4), backend="eager")
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop(ENV_BACKEND, None)
            plain(paddle.randn([2, 4]))
        self.assertIn("eager because backend is eager (backend='eager')", plain.explain())


class VerdictTest(unittest.TestCase):
    """explain() starts with a verdict, says each reason once, and names Layers by their place; report() is
    plain data."""

    def test_a_verdict_first_and_every_reason_once(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1,
                              dispatch_key_fn=lambda bound: None if bound.arguments["input"].shape[0] == 3 else 1)
        for rows in (2, 2, 2, 3, 3):
            layer(paddle.randn([rows, 4])).sum().backward()
        text = layer.explain()
        self.assertEqual(text.splitlines()[0], "autocudagraph(Linear.forward): graphed: 1 of 5 calls replayed a graph, "
                         "2 ran eagerly, 1 warmed up, 1 capture; speed not measured on simulate; eager because "
                         "dispatch_key_fn returned None")
        self.assertEqual(text.count("dispatch_key_fn returned None"), 1, text)
        self.assertNotIn("pool", text)  # not measured on simulate: nothing said
        self.assertNotIn("0 graph pool bytes", text)

    def test_a_key_that_fell_back_says_why_once(self):
        @autocudagraph(backend="simulate", warmup_steps=0)
        def host_read(x):
            return x * float(x.sum())

        for _ in range(3):
            host_read(paddle.randn([2, 2]))
        text = host_read.explain()
        self.assertTrue(text.startswith("autocudagraph(host_read): eager: 3 of 3 calls ran eagerly; eager for 2 "
                                        "reasons (below)"), text)
        self.assertEqual(text.count("Tensor.__float__()"), 1, text)
        self.assertIn("key (x: float32[2, 2]): eager from now on; 0 warmup calls, 0 captures, 0 replays on simulate; "
                      "why: CaptureError", text)
        self.assertIn("    2 x key fell back (why: on its key above)", text)

    def test_report_is_plain_data(self):
        layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=0)
        layer(paddle.randn([2, 4])).sum().backward()
        with paddle.no_grad():
            layer(paddle.randn([2, 4]))

        def plain(value):
            if isinstance(value, dict):
                return all(type(k) is str and plain(v) for k, v in value.items())
            if isinstance(value, list):
                return all(plain(v) for v in value)
            return value is None or type(value) in (str, int, float, bool)

        rows = layer.report()
        self.assertEqual(len(rows), 2)
        for row in rows:
            self.assertTrue(plain(row), row)
        self.assertEqual([row["key"]["grad_enabled"] for row in rows], [True, False])
        self.assertEqual(rows[0]["key"]["training"], [True])
        self.assertNotIn("Key(", repr(rows))

    def test_layers_are_named_by_their_place_in_the_model(self):
        model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.ReLU(), paddle.nn.Linear(4, 4))
        autocudagraph(model[0], backend="simulate")
        autocudagraph(model[2], backend="simulate")
        for _ in range(4):
            model(paddle.randn([2, 4])).sum().backward()
        text = explain_model(model)
        self.assertIn("autocudagraph(0: Linear.forward): graphed: 2 of 4 calls replayed a graph", text)
        self.assertIn("autocudagraph(2: Linear.forward): graphed: 2 of 4 calls replayed a graph", text)
        self.assertTrue(model[2].explain().startswith("autocudagraph(2: Linear.forward)"))  # from then on
        reports = report_model(model)
        self.assertEqual(sorted(reports), ["0", "2"])
        self.assertEqual(reports["2"][0]["replays"], 2)


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


if __name__ == "__main__":
    unittest.main()
