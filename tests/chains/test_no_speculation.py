"""A chain computes nothing ahead of its calls (NOTE [ Chains of graphed calls ] in chains/chain.py).

Each case is a way a chain that computed later members' outputs at its first call, or re-ran their
forwards at backward time, gave other numbers than eager:

- state a member reads outside its parameters (a dict or list attribute, a module global, a closure)
  changed in place between two calls of one chain, and a parameter loaded from numpy in place;
- an irregular run (an auxiliary loss on an intermediate output, hooks and ``retain_grads()`` on any
  output, the last one included) whose members' state is refilled before the backward, and
  members' in-place side effects that must happen once per call;
- side effects of calls that never come (an early exit).

Every case trains a graphed twin and an eager twin on the same batches; testkit.differential compares
their outputs, grads, parameters and buffers bit for bit after every step, and the chained-call counts
are pinned, so the calls were served by chains.
"""

import numpy as np
import paddle

from testkit.common import normal
from testkit.differential import Trainee, differential_run
from testkit.harness import for_each_backend

from .test_chains import BATCH, WIDTH, ChainCase, chained

STEPS = 12
#: The first step whose call counts are compared (Counting.counted).
COUNTED = 2

#: What a member reads through a module global (one tensor per twin: the twins are built apart).
_GLOBAL = {}


def _mutations():
    """``mutate(t, k)``: the in-place writes a user makes to a tensor between two calls."""
    return [
        lambda t, k: t.fill_(0.25 * k),
        lambda t, k: t.add_(paddle.full(t.shape, 0.5, t.dtype)),
        lambda t, k: t.__setitem__((slice(None), slice(0, 2)), paddle.full([t.shape[0], 2], -1.5 + k, t.dtype)),
        lambda t, k: paddle.assign(paddle.to_tensor(normal(11 + k)(*t.shape)), output=t),
        lambda t, k: t.uniform_(-1.0, 1.0),
    ]


class Reader(paddle.nn.Layer):
    """y = x @ w + t, where ``t`` is a tensor the Layer reads from ``source`` (not a parameter)."""

    def __init__(self, kind):
        super().__init__()
        self.w = self.create_parameter([WIDTH, WIDTH], dtype="float32")
        self.kind = kind
        self.settle()

    def settle(self):
        """(Re)makes the held tensor, zeros, on the current device (build() moves only parameters)."""
        t = paddle.zeros([BATCH, WIDTH])  # on the current device: settle() runs again in the first step
        if self.kind == "dict":
            self.extra = {"t": t}
        elif self.kind == "list":
            self.extra = [t]
        elif self.kind == "global":
            _GLOBAL[id(self)] = t
            self.extra = None
        else:  # a closure
            self.extra = None
            self.read = (lambda held: (lambda: held))(t)

    def held(self):
        if self.kind == "dict":
            return self.extra["t"]
        if self.kind == "list":
            return self.extra[0]
        if self.kind == "global":
            return _GLOBAL[id(self)]
        return self.read()

    def forward(self, x):
        return paddle.matmul(x, self.w) + self.held()


class Counting(paddle.nn.Layer):
    """y = tanh(x @ w + mask): counts its calls in a tensor of a dict attribute (an in-place side
    effect of forward; no buffer, so the checker sees it only through what a step returns) and reads
    a mask from the same dict."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([WIDTH, WIDTH], dtype="float32")
        self.state = {}

    def settle(self):
        self.state["mask"] = paddle.zeros([BATCH, WIDTH])
        self.state["calls"] = paddle.zeros([1])

    def calls(self):
        return float(self.state["calls"].numpy()[0])

    def counted(self, k):
        """The call counter from step COUNTED on, zeroed there: a simulated capture runs the capture
        call's forward twice for a tensor outside the Layer's parameters and buffers (a CUDA capture
        runs its kernels once, at the replay), so counts start after the capture step."""
        if k == COUNTED:
            self.state["calls"].fill_(0.0)
        return [self.state["calls"].numpy()] if k >= COUNTED else []

    def forward(self, x):
        self.state["calls"].add_(paddle.ones([1]))
        return paddle.tanh(paddle.matmul(x, self.w) + self.state["mask"])


@for_each_backend
class NoSpeculationCases(ChainCase):
    """Each case passes only when every later call of a chain replays its own forward when it comes."""

    def reader_run(self, kind):
        mutations = _mutations()

        def step(model, test, x, dy, k):
            if k == 0:
                for layer in model:
                    layer.settle()
            paddle.seed(300 + k)  # uniform_ draws the same in both twins
            h = model[1](model[0](x))
            mutations[k % len(mutations)](model[2].held(), k)  # between two calls of one chain
            h = model[3](model[2](h))
            h.backward(dy)
            return test.results(model, x, h, [model[2].held().numpy()])

        batches = [b + (k,) for k, b in enumerate(self.batches(STEPS))]
        return self.run_twins(step, batches, factory=lambda: paddle.nn.LayerList([Reader(kind) for _ in range(4)]))

    def check_reader(self, kind):
        model = self.reader_run(kind)
        # warmup, capture and two calls that confirm the links: the chain serves the last 8 steps.
        self.assertEqual(chained(model), [0, STEPS - 4, STEPS - 4, STEPS - 4])

    def test_a_tensor_in_a_dict_attribute_changed_between_calls(self):
        self.check_reader("dict")

    def test_a_tensor_in_a_list_attribute_changed_between_calls(self):
        self.check_reader("list")

    def test_a_module_global_changed_between_calls(self):
        self.check_reader("global")

    def test_a_closure_tensor_changed_between_calls(self):
        self.check_reader("closure")

    def test_a_parameter_loaded_from_numpy_between_calls(self):
        """paddle.assign(numpy_array, output=p) bumps no inplace version (Paddle's assign_value_)."""
        draw = normal(12)
        new = [draw(WIDTH, WIDTH) for _ in range(STEPS)]

        def step(model, test, x, dy, k):
            h = model[1](model[0](x))
            paddle.assign(new[k], output=model[2].w)
            h = model[3](model[2](h))
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))])
        self.assertEqual(chained(model), [0, STEPS - 4, STEPS - 4, STEPS - 4])

    def test_an_irregular_run_with_state_refilled_before_its_backward(self):
        """Auxiliary loss on an intermediate output, a hook on the last output, retain_grads() on
        another, each member's mask refilled after the forward: the backward uses what the forward
        read, and each member's call counter moves once per call."""
        def step(model, test, x, dy, k):
            if k == 0:
                for layer in model:
                    layer.settle()
            paddle.seed(400 + k)
            calls = [c for layer in model for c in layer.counted(k)]
            kept, outs, h = [], [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            h.register_hook(lambda g: kept.append(g * 1.0))
            h.register_hook(lambda g: g * 0.5)
            outs[0].retain_grads()
            if k % 2:
                outs[2].retain_grads()
            for layer in model:  # the next batch's masks, before this batch's backward
                layer.state["mask"].uniform_(-0.5, 0.5)
            paddle.autograd.backward([h, outs[1] * 0.25], [dy, dy])
            retained = [outs[0].grad.numpy()] + ([outs[2].grad.numpy()] if k % 2 else [])
            return test.results(model, x, h, retained + [g.numpy() for g in kept] + calls)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))],
                               factory=lambda: paddle.nn.LayerList([Counting() for _ in range(4)]))
        # The auxiliary loss on the second Layer's output bars the link into the third (NOTE [ Outputs with
        # consumers outside the chain ] in chains/links.py): Layers 0-1 and 2-3 chain.
        self.assertEqual(chained(model), [0, STEPS - 4, 0, STEPS - 4])
        self.assertEqual([layer.calls() for layer in model], [STEPS - COUNTED] * 4)

    def test_an_early_exit_leaves_later_members_untouched(self):
        """A per-layer call counter reads [1, 0, 0] more after a step that calls only the first Layer."""
        depths = [3] * 6 + [1, 3, 3, 2, 3]
        counts = []
        steps = iter(k for k in range(len(depths)) for _ in range(2))  # each step runs in both twins

        def step(model, test, x, dy, depth):
            if not model[0].state:
                for layer in model:
                    layer.settle()
            k = next(steps)
            calls = [c for layer in model for c in layer.counted(k)]
            h = x
            for layer in list(model)[:depth]:
                h = layer(h)
            h.backward(dy)
            return test.results(model, x, h, calls)

        def after(i, eager, graphed):
            counts.append([layer.calls() for layer in graphed.objects["model"]])

        def build_twin():
            model = paddle.nn.LayerList([Counting() for _ in range(3)])
            for p in model.parameters():
                p.set_value(normal(0)(*p.shape, scale=0.3))
            return Trainee(lambda *batch: step(model, self, *batch), {"model": model})

        def graph(trainee):
            for layer in trainee.objects["model"]:
                self.graphed(layer)
            return trainee.step

        batches = [b + (d,) for b, d in zip(self.batches(len(depths)), depths)]
        _, graphed = differential_run(build_twin, batches, graph, after_step=after)
        exit_step = depths.index(1)
        moved = np.subtract(counts[exit_step], counts[exit_step - 1]).tolist()
        self.assertEqual(moved, [1.0, 0.0, 0.0])
        # Chained from step 4; after the exit the link into the second Layer is confirmed again (steps
        # 7 and 8) while the second Layer heads a chain of its own; the exit at depth 2 breaks the last link.
        self.assertEqual(chained(graphed.objects["model"]), [0, 4, 4])
