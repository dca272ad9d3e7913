"""A later call of a chain is served only under the key it would get itself (NOTE [ Chains of graphed
calls ] in chains/chain.py): non-tensor arguments compared by value as the key compares them, never by
object identity alone. A config dict passed to every Layer and changed in place between two calls of one
chain, a numpy buffer refilled between them, or a tensor argument that starts to need grad between them,
selects the graph of the new value (or a new capture), as a call alone would.

Matmul-only (gpu_safe): tools/gpu_check.py runs these on a GPU, bitwise against eager.
"""

import numpy as np
import paddle

from testkit.harness import MatmulOnlyCase, for_each_backend

from testkit.common import normal

from .test_chains import WIDTH, ChainCase, chained, masked_stack

STEPS = 12


class Selecting(paddle.nn.Layer):
    """y = x @ w or x @ v, chosen by a Python value read from a non-tensor argument (baked into a graph)."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([WIDTH, WIDTH], dtype="float32")
        self.v = self.create_parameter([WIDTH, WIDTH], dtype="float32")

    def forward(self, x, choice):
        which = int(choice[0]) if isinstance(choice, np.ndarray) else choice["which"]
        return paddle.matmul(x, self.v if which else self.w)


def selecting_stack():
    return paddle.nn.LayerList([Selecting() for _ in range(4)])


@for_each_backend
class ChainKeyCases(ChainCase, MatmulOnlyCase):
    """Arguments changed in place between two calls of one chain."""

    def tensor(self, array, grad=False):
        return MatmulOnlyCase.tensor(self, array, grad)

    def run_changed(self, make, change, reset):
        """Each step: Layers 0 and 1 with ``choice`` as made, then ``change(choice, k)`` in place, then
        Layers 2 and 3 with the same object; ``reset`` puts it back first."""
        held = {}

        def step(model, test, x, dy, k):
            choice = held.setdefault(id(model), make())
            reset(choice)
            h = model[1](model[0](x, choice), choice)
            change(choice, k)
            h = model[3](model[2](h, choice), choice)
            h.backward(dy)
            return test.results(model, x, h)

        return self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))], factory=selecting_stack)

    def test_a_config_dict_changed_in_place_between_chained_calls(self):
        def change(cfg, k):
            if k >= 5 and k % 2:
                cfg["which"] = 1

        model = self.run_changed(lambda: {"which": 0}, change, lambda cfg: cfg.update(which=0))
        # Steps 4-11 chain Layers 0 and 1; step 5 breaks the chain at Layer 2 (its key differs), and the
        # link into it is seen again before it is used again, which the odd steps keep breaking; Layer 2
        # heads a chain of its own into Layer 3 on the steps between.
        self.assertEqual(chained(model), [0, 8, 1, 4])
        for layer in model[2:]:
            stats = layer.forward.stats()
            self.assertEqual(stats["captures"], 2, layer.forward.explain())  # one graph per value

    def test_a_numpy_buffer_refilled_between_chained_calls(self):
        def change(arr, k):
            if k >= 5 and k % 2:
                arr[0] = 1

        def reset(arr):
            arr[0] = 0

        model = self.run_changed(lambda: np.zeros([1], dtype="int64"), change, reset)
        self.assertEqual(chained(model), [0, 8, 1, 4])

    def test_an_equal_value_in_a_new_object_keeps_the_chain(self):
        """By value, not by identity: a fresh dict with the same contents for every call still chains."""
        def step(model, test, x, dy, k):
            h = x
            for layer in model:
                h = layer(h, {"which": 0})
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))], factory=selecting_stack)
        self.assertEqual(chained(model), [0] + [STEPS - 4] * 3)

    def test_a_tensor_argument_that_starts_to_need_grad_between_chained_calls(self):
        """The same tensor object passed to every Layer, its stop_gradient flipped between two calls of one
        chain (a key part read from the tensor: KeyMaker.is_key_of): the later calls get keys of their own."""
        values, held = normal(7)(WIDTH, WIDTH), {}

        def step(model, test, x, dy, k):
            mask = held.setdefault(id(model), self.tensor(values))
            mask.stop_gradient = True
            h = model[1](model[0](x, mask), mask)
            if k >= 5 and k % 2:
                mask.stop_gradient = False
            h = model[3](model[2](h, mask), mask)
            h.backward(dy)
            got = test.results(model, x, h, extra=[None if mask.grad is None else mask.grad.numpy()])
            mask.clear_gradient(False)
            return got

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))], factory=masked_stack)
        self.assertEqual(chained(model), [0, 8, 1, 4])
        for layer in model[2:]:
            self.assertEqual(layer.forward.stats()["captures"], 2, layer.forward.explain())
