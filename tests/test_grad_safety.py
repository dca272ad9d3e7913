"""Grad and output safety of the fast paths, bitwise against eager:

* outputs that are views of another output or of an input (a slice, a transpose, a reshape, an
  unsqueeze): their values and the grads through them (NOTE [ Strided static outputs ]);
"""

import unittest

import numpy as np
import paddle
from parameterized import parameterized

from testkit.harness import BackendCase, backend_classes, parameterized_class


def _h(x, w):
    return paddle.matmul(x, w)


VIEW_OUTPUTS = {
    "slice": lambda x, w: (lambda h: (h, h[:, :3]))(_h(x, w)),
    "slice_only": lambda x, w: _h(x, w)[:, 1:4],
    "transpose": lambda x, w: (lambda h: (h, h.t()))(_h(x, w)),
    "reshape": lambda x, w: (lambda h: (h, h.reshape([-1])))(_h(x, w)),
    "unsqueeze": lambda x, w: (lambda h: (h.unsqueeze(0), h))(_h(x, w)),
    "view_of_input": lambda x, w: (_h(x, w), x[1:], x.t()),
    "twice": lambda x, w: (lambda v: (v, v))(_h(x, w).t()),
}


@parameterized_class(backend_classes())
class ViewOutputsTest(BackendCase):
    @parameterized.expand([(f"{name}_clone{c}", name, c) for name in VIEW_OUTPUTS for c in (True, False)])
    def test_outputs_that_are_views_and_their_grads_equal_eager(self, _, name, clone_outputs):
        fn = VIEW_OUTPUTS[name]
        graphed = self.graphed(fn, warmup_steps=1, clone_outputs=clone_outputs)
        w0 = np.random.RandomState(9).standard_normal((4, 6)).astype("float32")
        ws = [paddle.to_tensor(w0, stop_gradient=False) for _ in range(2)]
        for i in range(5):
            xs = np.random.RandomState(i).standard_normal((3, 4)).astype("float32")
            got = []
            for f, w in ((fn, ws[0]), (graphed, ws[1])):
                x = paddle.to_tensor(xs, stop_gradient=False)
                out = f(x, w)
                out = list(out) if isinstance(out, (tuple, list)) else [out]
                values = [o.numpy().copy() for o in out]
                # A different weight per output: a grad summed in another order would show.
                loss = paddle.zeros([])
                for k, o in enumerate(out):
                    loss = loss + (o * float(k + 1) / 3.0).sum()
                loss.backward()
                got.append((values, x.grad.numpy(), w.grad.numpy()))
            self.assertBitwise(got[1], got[0], f"{name} call {i}")
        stats = graphed.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (1, 3), graphed.explain())


if __name__ == "__main__":
    unittest.main()
