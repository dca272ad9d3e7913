"""What a user reads: the package logger (one INFO line per capture, off by default) and explain()."""

import logging
import re
import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step

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


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


if __name__ == "__main__":
    unittest.main()
