"""Each row of the refusal table (NOTE [ One table of refusals ] in guards/refusals.py) is raised by
the guard that owns it: a block or a whole step doing what the row says, on the simulated backend,
refuses its capture with a CaptureError made by that row (``ROW.error``), whose message carries the
row's words and fix; the rows a CPU cannot reach (a recompute's rewind, a tracker without state
indices) are raised by their guard, DrawGuard, from the draw it noted."""

import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from paddlefleet.cudagraph.backends import capture_open
from paddlefleet.cudagraph.errors import CaptureError
from paddlefleet.cudagraph.guards import refusals
from paddlefleet.cudagraph.guards.rng import DrawGuard
from tests.backends.test_refusals import _stream, linear_sgd_scaler


def _block(name):
    """``(function, arguments)`` of a block that does what row ``name`` refuses."""
    w = paddle.to_tensor(np.full((3, 3), 0.5, np.float32), stop_gradient=False)
    x = paddle.to_tensor(np.ones((2, 3), np.float32), stop_gradient=False)
    stream = _stream("simulate")
    counter = paddle.nn.Layer()
    counter.calls = 0
    bodies = {
        "host read": lambda x: x * float(x.sum()),
        "raw tensor read": lambda x: x * float(np.array(x.get_tensor()).sum()),
        "host-to-device copy": lambda x: x * paddle.to_tensor(np.ones(3, np.float32)),
        # Called only inside the capture: a CPU build's synchronize raises when run.
        "device synchronize": lambda x: (capture_open() and paddle.device.cuda.synchronize(), x * 2.0)[1],
        "stream or event wait": lambda x: (stream.synchronize(), x * 2.0)[1],
        "shape from tensor values": lambda x: paddle.nonzero(x),
        "random kernel other than dropout": lambda x: x * paddle.rand([3]),
        "double backward": lambda x: paddle.grad((x * x).sum(), x, create_graph=True)[0] * 1.0,
        "leaf that would lose its grad": lambda x: paddle.matmul(x, w),
        "input written in place": lambda x: x.scale_(2.0),
        "Layer attribute changed by the call": lambda x: (setattr(counter, "calls", counter.calls + 1), x * 2.0)[1],
    }
    if name == "index with a device tensor":
        return (lambda x, t: x[t] * 2.0), (x, paddle.to_tensor(1))
    if name == "input written in place":
        x = paddle.to_tensor(np.ones((2, 3), np.float32))
    return bodies[name], (x,)


def _step(name):
    """A whole step that does what row ``name`` refuses, and its argument."""
    model, opt, scaler = linear_sgd_scaler(3, 3, 3)
    counter = [0]

    def step(x):
        loss = model(x).square().mean()
        if name == "grad assigned":  # onto no grad: new grad storage
            (grad,) = paddle.grad([loss], [model.bias])
            model.bias.grad = grad
            out = model.bias.grad.clone()
            model.bias.clear_gradient(False)
            return out
        elif name == "paddle.amp.GradScaler in a whole step":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        elif name == "grad into a step's argument":  # x requires grad: the backward reaches it
            loss.backward()
        elif name == "host value that changes between steps":
            counter[0] += 1
            loss = loss * float(counter[0])
            loss.backward()
        else:  # grads freed at the end of an accumulation window: every other call steps
            loss.backward()
            counter[0] += 1
            if counter[0] % 2 == 0:
                opt.step()
                opt.clear_grad(set_to_zero=False)
            return loss
        opt.step()
        opt.clear_grad()
        return loss

    return step, opt


_STEP_ROWS = ("grad assigned", "paddle.amp.GradScaler in a whole step", "host value that changes between steps",
              "grads freed at the end of an accumulation window", "grad into a step's argument")
# row -> (the problem DrawGuard found, whether it guards a backward)
_GUARD_ROWS = {"recompute with dropout": ("after rewind", True), "RNG rewound in the function": ("after rewind", False),
               "tracker dropout without state indices": ("foreign state", False)}


class RowGuardTest(unittest.TestCase):
    def raised_rows(self, run):
        """The rows whose error() was called while ``run()`` ran, and the warnings it gave."""
        made = []
        original = refusals.Refusal.error

        def error(row, message):
            err = original(row, message)
            made.append(err)
            return err

        with mock.patch.object(refusals.Refusal, "error", error), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        return made, " ".join(str(w.message) for w in caught)

    def check_row(self, row, made, said):
        self.assertTrue(made, f"{row.name}: no row raised")
        self.assertIs(made[0].refusal, row, f"{row.name}: raised {getattr(made[0].refusal, 'name', None)!r}")
        self.assertIsInstance(made[0], CaptureError)
        for words in (row.message, row.fix):
            self.assertIn(words, str(made[0]), row.name)
            self.assertIn(words, said, row.name)

    def test_each_block_row_is_raised_by_its_guard(self):
        for row in refusals.REFUSALS:
            if row.name in _STEP_ROWS or row.name in _GUARD_ROWS:
                continue
            with self.subTest(row=row.name):
                fn, args = _block(row.name)
                graphed = autocudagraph(fn, warmup_steps=1, backend="simulate", chain_calls=False)
                made, said = self.raised_rows(lambda: [graphed(*args) for _ in range(3)])
                self.check_row(row, made, said)
                self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())

    def test_each_step_row_is_raised_by_its_guard(self):
        for name in _STEP_ROWS:
            row = refusals.row(name)
            with self.subTest(row=name):
                step, opt = _step(name)
                graphed = autocudagraph_step(step, optimizers=[opt], warmup_steps=1, backend="simulate")
                x = paddle.to_tensor(np.ones((2, 3), np.float32), stop_gradient=name != "grad into a step's argument")
                made, said = self.raised_rows(lambda: [graphed(x) for _ in range(6)])
                self.check_row(row, made, said)
                self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())

    def test_the_draw_rows_are_raised_by_the_draw_guard(self):
        for name, (kind, backward) in _GUARD_ROWS.items():
            row = refusals.row(name)
            with self.subTest(row=name):
                guard = DrawGuard(enabled=False, backward=backward)
                guard.problem = (kind, "dropout", "here.py:1 in f")
                with self.assertRaises(CaptureError) as raised:
                    guard.check()
                self.assertIs(raised.exception.refusal, row)
                self.assertIn(row.message, str(raised.exception))
                self.assertIn(row.fix, str(raised.exception))


if __name__ == "__main__":
    unittest.main()
