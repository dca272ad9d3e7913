"""Matmul-only cases: what a GPU without Paddle's arithmetic kernels can check, bitwise against eager.

Every class here derives from MatmulOnlyCase: conftest marks its tests ``gpu_safe``; CI runs them
on the simulated backend, and ``tools/gpu_check.py`` runs them on the cuda backend of a real GPU
and writes docs/reports/gpu_check.md. Each case keeps NOTE [ Kernel-less GPUs ]
(paddlefleet/cudagraph/testing.py): matmul chains, numpy-made parameters, explicit loss grads,
grads released with ``clear_gradient(False)``. A case that needs more (accumulation adds) says so
and is skipped, with that reason, on a GPU whose Paddle lacks the kernel. This module does not use
the parameterized package, which a bare GPU host may lack.

The ten cases of the former tools/gpu_check.py are here: sanity -> test_eager_matmul_matches_numpy;
function with tensor args; Layer method; Layer instance; mixed stop_gradient; nested IO; several keys
with max_graphs=2; no_grad then grad calls; clone_outputs=False + clone_param_grads=False;
verify_replays=3. Speed options get one case each, generated from SPEED_OPTIONS and skipped (with
the reason) where this version's GraphOptions lacks the option.
"""

import collections
import contextlib
import dataclasses
import typing
import unittest.mock
import warnings

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.errors import CudaGraphError
from testkit.common import SPEED_OPTIONS, MatMLP, close_error, cuda_skip_reason, option_unsupported

from testkit.harness import RECORD, hooked_params, MatmulOnlyCase, backend_variants, grads_of, normal, release_grads


def mm(x, w):
    return paddle.matmul(x, w)


def released_step(model):
    """A training step of ``model``: ``y = model(x)``, ``y.backward(dy)``, its grads released; returns y."""
    def step(x, dy):
        y = model(x)
        y.backward(dy)
        release_grads(model)
        return y
    return step


class TwinCase(MatmulOnlyCase):
    """Runs a graphed callable and its eager twin on the same values and compares every result."""

    def both(self, graphed, eager, make, dy, what, layers=()):
        """``make()`` returns ``(args, leaves)``, fresh per side; each side runs ``y = fn(*args)`` and
        ``y.backward(dy)``. Compares y, the leaves' grads and the grads of ``layers`` (graphed, eager);
        returns the two outputs."""
        outs, grads = [], []
        for fn in (graphed, eager):
            args, leaves = make()
            y = fn(*args)
            y.backward(self.tensor(dy))
            outs.append(y)
            grads.append([t.grad for t in leaves])
        self.assertBitwise(outs[0], outs[1], f"{what} y")
        self.assertBitwise(grads[0], grads[1], f"{what} input grads")
        if layers:
            self.assertBitwise(grads_of(layers[0]), grads_of(layers[1]), f"{what} parameter grads")
        return outs

    def leaves(self, *arrays):
        """``make()`` result for leaf inputs that all need grad."""
        args = tuple(self.tensor(a, grad=True) for a in arrays)
        return args, args

    def layer_steps(self, graphed, eager, steps, batch, seed, release=True):
        """``steps`` calls of two twin Layers on one random batch each; grads released after each
        step unless ``release`` is False (then they accumulate)."""
        draw = normal(seed)
        din = graphed.parameters()[0].shape[0]
        dout = graphed.parameters()[-1].shape[1]
        for k in range(steps):
            xn, dyn = draw(batch, din), draw(batch, dout)
            self.both(graphed, eager, lambda: self.leaves(xn), dyn, f"step {k}", layers=(graphed, eager))
            if release:
                release_grads(graphed, eager)

    def require_all_kernels(self, why):
        if self.backend == "cuda":
            reason = cuda_skip_reason("all")
            if reason:
                self.skipTest(f"{why}: {reason}")


class KernelCases(TwinCase):
    def test_eager_matmul_matches_numpy(self):
        """Eager matmul forward and backward agree with numpy float64 (to 2e-2: TF32 allowed), a repeated
        matmul and a device copy keep the bits: the kernels every other case relies on."""
        draw = normal(1)
        xn, wn, dyn = draw(16, 64), draw(64, 32), draw(16, 32)
        (x, w), _ = self.leaves(xn, wn)
        y = paddle.matmul(x, w)
        y.backward(self.tensor(dyn))
        errors = [close_error(y, xn.astype("float64") @ wn), close_error(x.grad, dyn.astype("float64") @ wn.T),
                  close_error(w.grad, xn.T.astype("float64") @ dyn)]
        self.assertLess(max(errors), 2e-2, f"relative errors of y, x.grad, w.grad against numpy: {errors}")
        self.assertBitwise(paddle.matmul(x, w), y, "the same matmul again")
        self.assertBitwise(y.clone(), y, "a device copy")
        RECORD.notes.append(f"max relative error vs float64 {max(errors):.2g} "
                            f"({'TF32-like' if max(errors) > 2e-5 else 'FP32-like'})")


class CallCases(TwinCase):
    def test_function_with_tensor_args(self):
        """A graphed function of two leaf tensors: outputs and both grads over 5 steps; outputs
        (cloned by default) keep their values after later replays."""
        g = self.graphed(mm)
        draw, held = normal(2), []
        for k in range(5):
            xn, wn, dyn = draw(8, 32), draw(32, 16), draw(8, 16)
            ya, yb = self.both(g, mm, lambda: self.leaves(xn, wn), dyn, f"step {k}")
            held.append((ya, yb.numpy()))
        for k, (ya, ref) in enumerate(held):
            self.assertBitwise(ya, ref, f"step {k} y read after later replays")
        self.assertCounters(g, captures=1, replays=3, eager=0)

    def test_method_instances_keep_their_own_graphs(self):
        """A decorated Layer method on two instances: each instance captures its own graph."""
        backend = self.backend

        class Net(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w1 = self.create_parameter([16, 32], dtype="float32")
                self.w2 = self.create_parameter([32, 8], dtype="float32")

            def forward(self, x):  # the eager twin
                return paddle.matmul(paddle.matmul(x, self.w1), self.w2)

            @autocudagraph(backend=backend)
            def step(self, x):
                return paddle.matmul(paddle.matmul(x, self.w1), self.w2)

        pairs = [self.twins(Net, 30 + i) for i in range(2)]
        draw = normal(3)
        for k in range(4):
            for i, (gnet, enet) in enumerate(pairs):
                xn, dyn = draw(4, 16), draw(4, 8)
                self.both(gnet.step, enet, lambda: self.leaves(xn), dyn, f"step {k} net {i}", layers=(gnet, enet))
                release_grads(gnet, enet)
        self.assertIsNot(pairs[0][0].step, pairs[1][0].step)
        for gnet, _ in pairs:
            self.assertCounters(gnet.step, captures=1, replays=2, eager=0)

    def test_layer_instance_graphed_in_place(self):
        """A Layer instance of 4 matmul layers: output, input grad and every parameter grad over 6
        steps; the eager output also checked against numpy."""
        dims = [24, 48, 40, 32, 16]
        g, e = self.twins(lambda: MatMLP(dims), 40)
        self.graphed(g)
        self.layer_steps(g, e, steps=6, batch=8, seed=4)
        xn = normal(5)(8, dims[0])
        ref = xn.astype("float64")
        for p in e.parameters():
            ref = ref @ p.numpy().astype("float64")
        self.assertLess(close_error(e(self.tensor(xn)), ref), 2e-2, "eager MatMLP against numpy")
        self.assertCounters(g.forward, captures=1, replays=4, eager=0)

    def test_inputs_with_mixed_stop_gradient(self):
        """Inputs that are a non-leaf needing grad, a constant and a leaf: grads reach the non-leaf's
        leaf and the leaf; the constant gets none."""
        def f(a, b, c):
            return paddle.matmul(paddle.matmul(a, b), c)

        g = self.graphed(f)
        draw = normal(5)
        for k in range(5):
            a0n, mn, bn, cn, dyn = draw(6, 10), draw(10, 12), draw(12, 14), draw(14, 4), draw(6, 4)

            def make():
                a0, m, b, c = self.tensor(a0n, True), self.tensor(mn), self.tensor(bn), self.tensor(cn, True)
                return (paddle.matmul(a0, m), b, c), (a0, m, b, c)

            self.both(g, f, make, dyn, f"step {k}")
        self.assertCounters(g, captures=1, replays=3, eager=0)

    def test_nested_dict_and_list_io_with_a_non_tensor_leaf(self):
        """Dict/list inputs and outputs with a non-tensor value in each: structure, values and grads."""
        def f(batch):
            w1, w2 = batch["ws"]
            return {"out": [mm(batch["x"], w1), mm(batch["z"], w2)], "tag": ("nested", batch["n"])}

        g = self.graphed(f)
        draw = normal(6)
        for k in range(5):
            arrays = [draw(4, 8), draw(5, 6), draw(8, 3), draw(6, 7)]
            dys = [draw(4, 3), draw(5, 7)]
            results = []
            for fn in (g, f):
                x, z, w1, w2 = (self.tensor(a, grad=i != 1) for i, a in enumerate(arrays))
                out = fn({"x": x, "z": z, "ws": [w1, w2], "n": 3})
                paddle.autograd.backward(out["out"], [self.tensor(d) for d in dys])
                results.append((out, [x.grad, z.grad, w1.grad, w2.grad]))
            self.assertBitwise(results[0], results[1], f"step {k} (outputs, grads of x, z, w1, w2)")
        self.assertCounters(g, captures=1, replays=3, eager=0)


class KeyCases(TwinCase):
    def test_keys_beyond_max_graphs_run_eagerly(self):
        """Three batch sizes with max_graphs=2: two keys replay, the third runs eagerly with one warning
        and the reason counted."""
        dims = [16, 24, 8]
        g, e = self.twins(lambda: MatMLP(dims), 70)
        self.graphed(g, max_graphs=2)
        draw, rounds = normal(7), 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(rounds):
                for bs in (4, 8, 12):
                    xn, dyn = draw(bs, dims[0]), draw(bs, dims[-1])
                    self.both(g, e, lambda: ((self.tensor(xn),), ()), dyn, f"round {k} batch {bs}", layers=(g, e))
                    release_grads(g, e)
        stats = self.assertCounters(g.forward, captures=2, replays=2 * (rounds - 2), eager=rounds, graphs=2)
        self.assertEqual(stats["eager_reasons"].get("max_graphs reached"), rounds, stats["eager_reasons"])
        self.assertTrue(any("max_graphs" in str(w.message) for w in caught), "no max_graphs warning")

    def test_a_repeating_batch_size_takes_the_place_of_one_not_called_since(self):
        """max_graphs=2: batch 4, then 8, three times each (warmup, capture, replay), then 12 six times: 12
        runs eagerly twice, then takes the place of 4 (its graphs released), warms up, captures and replays
        twice; 4 again: eager twice, then in the place of 8, captured again without warmup and replayed.
        Every call bitwise against eager."""
        dims = [16, 24, 8]
        g, e = self.twins(lambda: MatMLP(dims), 75)
        self.graphed(g, max_graphs=2)
        draw = normal(12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for k, bs in enumerate([4] * 3 + [8] * 3 + [12] * 6 + [4] * 4):
                xn, dyn = draw(bs, dims[0]), draw(bs, dims[-1])
                self.both(g, e, lambda: ((self.tensor(xn),), ()), dyn, f"call {k} batch {bs}", layers=(g, e))
                release_grads(g, e)
        stats = self.assertCounters(g.forward, captures=4, recaptures=1, replays=5, eager=4, graphs=2)
        self.assertEqual((stats["evictions"], stats["eager_reasons"]), (2, {"max_graphs reached": 4}))

    def test_a_key_that_fell_back_runs_eagerly_beside_a_replaying_key(self):
        """Batch 4 warms up, captures and replays; batch 8's capture is refused (a stand-in refusal), so its key
        falls back; then the two alternate: batch 4 replays, batch 8 runs eagerly, from the front of the call once
        its key is known (NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py). Every call bitwise
        against eager, forward and backward."""
        dims = [16, 24, 8]
        g, e = self.twins(lambda: MatMLP(dims), 90)
        self.graphed(g)
        wrapper, draw = g.forward, normal(15)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for k, bs in enumerate([4] * 3 + [8, 8] + [4, 8] * 4):
                xn, dyn = draw(bs, dims[0]), draw(bs, dims[-1])
                refused = k == 4  # batch 8's capture call
                with unittest.mock.patch.object(wrapper._body, "capture", side_effect=CudaGraphError("refused by the "
                                                "test")) if refused else contextlib.nullcontext():
                    self.both(g, e, lambda: ((self.tensor(xn),), ()), dyn, f"call {k} batch {bs}", layers=(g, e))
                release_grads(g, e)
        stats = self.assertCounters(g.forward, captures=1, replays=1 + 4, eager=1 + 4, graphs=1)
        self.assertEqual(stats["eager_reasons"], {"capture failed": 1,
                                                  "key fell back: CudaGraphError: refused by the test": 4})
        self.assertIsNotNone(wrapper._known_eager)

    def test_the_verdict_weighs_real_forwards_and_backwards_and_leaves_no_hook(self):
        """eager_if_slower on real timing (the suite turns it off elsewhere): three one-Layer wrappers called
        in a chain for 24 steps, every step bitwise against eager whatever each key's verdict. Where replays are
        timed (cuda) every key is judged on its forward and backward host times (the backward's end seen on
        its Layer's parameters: NOTE [ Graphed calls that cannot pay ] in core/host_cost.py); on simulate
        nothing is timed. Either way no timing hook is left on a parameter afterwards."""
        from paddlefleet.cudagraph.core import host_cost

        dims = [32, 32]
        pairs = [self.twins(lambda: MatMLP(dims * 2), 70 + k) for k in range(3)]
        graphed, eager = [g for g, _ in pairs], [e for _, e in pairs]
        draw = normal(16)
        with unittest.mock.patch("paddlefleet.cudagraph.core.entry.measured", host_cost.measured), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a key judged slower warns
            for g in graphed:
                self.graphed(g)
            for k in range(24):
                xn, dyn = draw(4, dims[0]), draw(4, dims[-1])
                ys, grads = [], []
                for layers in (graphed, eager):
                    h = self.tensor(xn)
                    for layer in layers:
                        h = layer(h)
                    h.backward(self.tensor(dyn))
                    ys.append(h)
                    grads.append([grads_of(layer) for layer in layers])
                self.assertBitwise(ys[0], ys[1], f"step {k} y")
                self.assertBitwise(grads[0], grads[1], f"step {k} parameter grads")
                for g, e in pairs:
                    release_grads(g, e)
        for g in graphed:
            [entry] = g.forward.entries().values()
            cost = entry.host_cost
            if self.backend == "cuda":
                self.assertIn(cost.verdict, ("graphed", "eager"), g.forward.explain())
                self.assertIsNotNone(cost.backward_us, g.forward.explain())  # both sides' backwards were timed
                RECORD.notes.append(f"{cost.verdict}: {cost.describe()}")
            else:
                self.assertEqual((cost.verdict, cost.backward_us), ("not timed", None))
            self.assertIsNone(cost.backward)
            self.assertEqual(hooked_params(g.parameters()), {})

    def test_calls_whose_outputs_get_no_backward_take_no_new_slot(self):
        """Three training calls, then calls of another key (inputs without grad) whose outputs get no backward
        (evaluation without no_grad): with each output freed at the next call but one, the key warms up,
        captures and takes a second slot; with the outputs kept, two calls replay the free slots and the
        other two run eagerly rather than fill max_inflight slots. Values bitwise against eager."""
        dims = [16, 16, 16]
        g, e = self.twins(lambda: MatMLP(dims), 85)
        self.graphed(g)
        self.layer_steps(g, e, steps=3, batch=4, seed=13)
        draw = normal(14)
        for kept in (False, True):
            held = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for k in range(4):
                    xn = draw(4, dims[0])
                    ya, yb = g(self.tensor(xn)), e(self.tensor(xn))
                    self.assertBitwise(ya, yb, f"kept={kept} call {k}")
                    if kept:
                        held.append(ya)
        stats = self.assertCounters(g.forward, captures=1 + 2, replays=1 + 3, eager=2, slots=1 + 2)
        self.assertEqual(list(stats["eager_reasons"].values()), [2])
        self.assertTrue(any("paddle.no_grad()" in str(w.message) for w in caught), [str(w.message) for w in caught])

    def test_no_grad_calls_get_their_own_key(self):
        """no_grad calls capture a forward-only graph under their own key; later grad calls capture
        another and get every grad."""
        dims = [12, 20, 6]
        g, e = self.twins(lambda: MatMLP(dims), 80)
        self.graphed(g)
        draw = normal(8)
        for k in range(4):
            xn = draw(5, dims[0])
            with paddle.no_grad():
                ya, yb = g(self.tensor(xn, grad=True)), e(self.tensor(xn, grad=True))
            self.assertBitwise(ya, yb, f"no_grad call {k}")
            self.assertTrue(ya.stop_gradient, f"no_grad call {k}: output needs grad")
        self.layer_steps(g, e, steps=3, batch=5, seed=9)
        self.assertCounters(g.forward, captures=2, replays=(4 - 2) + (3 - 2), eager=0, keys=2)

    def test_no_clones_static_outputs_and_grads(self):
        """clone_outputs=False with clone_param_grads=False: static buffers handed out, values equal
        eager when read before the next replay."""
        dims = [32, 32, 32, 32]
        g, e = self.twins(lambda: MatMLP(dims), 90)
        self.graphed(g, clone_outputs=False, clone_param_grads=False)
        self.layer_steps(g, e, steps=6, batch=8, seed=9)
        self.assertCounters(g.forward, captures=1, replays=4, eager=0)

    def test_verify_replays_every_verified_call_matches(self):
        """verify_replays=3: three replays compared with eager re-runs, none mismatching, none disabled."""
        dims = [32, 32, 32]
        g, e = self.twins(lambda: MatMLP(dims), 95)
        self.graphed(g, verify_replays=3)
        self.layer_steps(g, e, steps=6, batch=8, seed=11)
        stats = self.assertCounters(g.forward, captures=1, replays=4, eager=0)
        self.assertEqual((stats.get("verified_replays"), stats.get("verify_mismatches")), (3, 0))


class SpeedOptionCases(TwinCase):
    """One case per speed option (SPEED_OPTIONS), added below."""

    def check_option(self, option):
        reason = option_unsupported(option.options)
        if reason:
            self.skipTest(reason)
        if option.keeps_grads:
            self.require_all_kernels("accumulating parameter grads needs Paddle's add kernel")
        dims = [32, 32, 32, 32]
        g, e = self.twins(lambda: MatMLP(dims), 100)
        self.graphed(g, **option.options)
        if option.keeps_grads:
            self.layer_steps(g, e, steps=3, batch=8, seed=12, release=False)
            for p in g.parameters() + e.parameters():
                p.clear_gradient()  # zeroed in place: accumulators are kept, not freed
            self.layer_steps(g, e, steps=3, batch=8, seed=13, release=False)
        else:
            self.layer_steps(g, e, steps=6, batch=8, seed=12)
        self.assertCounters(g.forward, captures=1, replays=4, eager=0)


def _option_case(option):
    def test(self):
        self.check_option(option)

    kept = "accumulated over micro-batches, zeroed in place" if option.keeps_grads else "released after each step"
    test.__doc__ = f"Speed option {option.options}: 6 steps bitwise equal to eager, grads {kept}."
    test.__name__ = f"test_option_{option.name}"
    return test


for _option in SPEED_OPTIONS:
    setattr(SpeedOptionCases, f"test_option_{_option.name}", _option_case(_option))

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Weights:
    w: paddle.Tensor
    n: int = 1


@dataclasses.dataclass
class LMOutput(collections.OrderedDict):
    """ModelOutput-style (PaddleNLP / PaddleFormers): an OrderedDict dataclass whose non-None fields
    are also items."""

    logits: typing.Optional[paddle.Tensor] = None
    loss: typing.Optional[paddle.Tensor] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


class PatternCases(TwinCase):
    """Call patterns of real model code (tests/core/test_patterns.py), matmul-only."""

    def test_containers_keep_their_type_in_and_out(self):
        """A ModelOutput-style dict subclass out (attribute access), a namedtuple and a frozen dataclass
        in: their types survive warmup, capture and replays; values and grads equal eager."""
        def head(pair, stats):
            h = paddle.matmul(pair.x, stats.w)
            return LMOutput(logits=paddle.matmul(h, pair.y), loss=None)

        g = self.graphed(head)
        draw = normal(8)
        for k in range(4):
            xn, wn, dyn = draw(4, 8), draw(8, 8), draw(4, 8)
            outs = []
            for fn in (g, head):
                x, w = self.tensor(xn, grad=True), self.tensor(wn, grad=True)
                out = fn(Point(x, w), Weights(w=w, n=3))
                self.assertIsInstance(out, LMOutput)
                out.logits.backward(self.tensor(dyn))
                outs.append((out.logits, out["logits"], x.grad, w.grad))
            self.assertBitwise(outs[0], outs[1], f"step {k}")
        self.assertCounters(g, captures=1, replays=2, eager=0)
        self.assertIsInstance(g(Point(self.tensor(xn), self.tensor(wn)), Weights(w=self.tensor(wn), n=3)), LMOutput)

    def test_base_and_subclass_forward_both_graphed(self):
        """@autocudagraph on Base.forward and Sub.forward, Sub calling super().forward(): no recursion,
        each keeps its own wrapper; the inner call runs inside the outer graph."""
        backend = self.backend

        class Base(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([8, 8], dtype="float32")

            @autocudagraph(backend=backend, warmup_steps=1)
            def forward(self, x):
                return paddle.matmul(x, self.w)

        class Sub(Base):
            @autocudagraph(backend=backend, warmup_steps=1)
            def forward(self, x):
                return paddle.matmul(super().forward(x), self.w)

        class Eager(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([8, 8], dtype="float32")

            def forward(self, x):
                return paddle.matmul(paddle.matmul(x, self.w), self.w)

        g, e = self.twins(Sub, 60), self.twins(Eager, 60)[0]
        self.layer_steps(g[0], e, steps=5, batch=4, seed=9)
        self.assertIsNot(type(g[0]).forward, Base.forward)
        self.assertCounters(g[0].forward, captures=1, replays=3, eager=0)

    def test_static_method_graphed(self):
        """@staticmethod over @autocudagraph: the first tensor is an argument, not ``self``; stats() on the
        class and on an instance are the same wrapper's."""
        backend = self.backend

        class Ops:
            @staticmethod
            @autocudagraph(backend=backend, warmup_steps=1)
            def chain(x, w):
                return paddle.matmul(paddle.matmul(x, w), w)

        def chain(x, w):
            return paddle.matmul(paddle.matmul(x, w), w)

        draw = normal(10)
        for k in range(4):
            xn, wn, dyn = draw(4, 8), draw(8, 8), draw(4, 8)
            self.both(Ops().chain, chain, lambda: self.leaves(xn, wn), dyn, f"step {k}")
        self.assertIs(Ops.chain, Ops().chain)
        self.assertCounters(Ops.chain, captures=1, replays=2, eager=0)

    def test_a_whole_step_leaves_paddles_ops_unwrapped_where_replays_run_no_python(self):
        """The step's warmup and capture runs are traced (NOTE [ Traced entry points ] in guards/traced_ops.py);
        on cuda the trace's wrappers are taken back after them, so every later op of the process runs Paddle's
        own function; the simulated backend re-runs the step under a trace at every replay and keeps them."""
        from paddlefleet.cudagraph import autocudagraph_step
        from paddlefleet.cudagraph.guards import traced_ops

        g, e = self.twins(lambda: MatMLP([64, 128, 64]), 151)

        graphed = autocudagraph_step(released_step(g), optimizers=[], warmup_steps=2, backend=self.backend)
        eager = released_step(e)
        draw = normal(16)
        for k in range(5):
            xn, dyn = draw(16, 64), draw(16, 64)
            self.assertBitwise(graphed(self.tensor(xn), self.tensor(dyn)), eager(self.tensor(xn), self.tensor(dyn)),
                               f"step {k}")
        self.assertEqual((graphed.stats()["captures"], graphed.stats()["replays"]), (1, 2))
        self.assertEqual(traced_ops.installed(), self.backend == "simulate")
        matmul = traced_ops.original(paddle._C_ops, "matmul")
        self.assertEqual(paddle._C_ops.matmul is matmul, self.backend != "simulate")

    def test_graphed_layer_presents_the_signature_it_wraps(self):
        """inspect.signature of a graphed Layer's forward has no ``self`` (recompute binds against it)."""
        import inspect

        class Two(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([8, 8], dtype="float32")

            def forward(self, x, y, scale=1):
                return paddle.matmul(x, self.w) if scale else paddle.matmul(y, self.w)

        layer = self.graphed(Two())
        self.assertEqual(list(inspect.signature(layer.forward).parameters), ["x", "y", "scale"])


class PipelineCases(TwinCase):
    """Slots (NOTE [ Slots ] in block/slots.py): two matmul-only stages, four micro-batches in flight."""

    def run_schedule(self, stages, order, draw, what):
        """Runs ``order`` (("F" | "B", micro-batch)) over two stages for each twin: stage 1 reads a
        detached copy of stage 0's output, a backward runs ``y.backward(dy)`` then stage 0's output
        backward with that copy's grad; the grads are compared and released after each backward
        (no accumulation add)."""
        batches = {m: (draw(4, 16), draw(4, 16)) for _, m in order if _ == "F"}
        got = []
        for s0, s1 in stages:
            live, side = {}, []
            for kind, m in order:
                if kind == "F":
                    h = s0(self.tensor(batches[m][0]))
                    recv = h.detach()
                    recv.stop_gradient = False
                    live[m] = (h, recv, s1(recv))
                    continue
                h, recv, y = live.pop(m)
                y.backward(self.tensor(batches[m][1]))
                h.backward(recv.grad)
                side.append([y, recv.grad, grads_of(s0), grads_of(s1)])
                release_grads(s0, s1)
            got.append(side)
        self.assertBitwise(got[0], got[1], what)

    def test_slots_gpipe_and_1f1b_match_eager(self):
        dims = [16, 32, 16]
        (g0, e0), (g1, e1) = self.twins(lambda: MatMLP(dims), 120), self.twins(lambda: MatMLP(dims), 121)
        self.graphed(g0)
        self.graphed(g1)
        draw = normal(12)
        gpipe = [("F", m) for m in range(4)] + [("B", m) for m in range(4)]
        one_f_one_b = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
        for k in range(3):
            self.run_schedule([(g0, g1), (e0, e1)], gpipe, draw, f"GPipe step {k}")
        for k in range(2):
            self.run_schedule([(g0, g1), (e0, e1)], one_f_one_b, draw, f"1F1B step {k}")
        # 20 calls per stage: one warmup, four captures (a slot each: GPipe has four in flight), replays.
        for stage in (g0, g1):
            stats = self.assertCounters(stage.forward, captures=4, replays=20 - 1 - 4, eager=0, slots=4)
            self.assertEqual(stats["slot_captures"], 3)



class _Tied(paddle.nn.Layer):
    """A graphed block whose weight is used again, eagerly, by the head; ``spare`` is never used."""

    def __init__(self):
        super().__init__()
        self.block = MatMLP([16, 16])
        self.spare = self.create_parameter([16, 16], dtype="float32")

    def forward(self, x):
        h = self.block(x)
        return paddle.matmul(h, self.block.layers[0].w, transpose_y=True)


class GradSafetyCases(TwinCase):
    """Grads of the fast paths (tests/grads/test_grad_safety.py). They accumulate grads: Paddle's add kernel."""

    def _steps(self, g, e, micro, seed):
        draw = normal(seed)
        for k in range(3):
            for m in range(micro):
                xn, dyn = draw(8, 16), draw(8, 16)
                for model in (g, e):
                    model(self.tensor(xn)).backward(self.tensor(dyn))
                self.assertBitwise(grads_of(g), grads_of(e), f"step {k} micro-batch {m} grads")
            release_grads(g, e)

    def test_accumulate_in_graph_tied_weight_and_unused_parameter(self):
        """accumulate_in_graph=True: a weight also used eagerly after the block goes through autograd
        (eager's sum order), an unused parameter keeps grad None, freed grads are put back."""
        self.require_all_kernels("accumulating parameter grads needs Paddle's add kernel")
        g, e = self.twins(_Tied, 30)
        self.graphed(g.block, warmup_steps=2, accumulate_in_graph=True)
        self._steps(g, e, micro=2, seed=31)
        self.assertIsNone(g.spare.grad)
        self.assertCounters(g.block.forward, captures=2, recaptures=1, eager=0)

    def test_held_grad_handle_tracks_p_grad(self):
        """clone_param_grads="auto": ``h = p.grad`` after micro-batch 1 is still p.grad after 2 and 3."""
        self.require_all_kernels("accumulating parameter grads needs Paddle's add kernel")
        g, e = self.twins(lambda: MatMLP([16, 16, 16]), 32)
        self.graphed(g, warmup_steps=0)
        draw = normal(33)
        for k in range(2):
            held = None
            for m in range(3):
                xn, dyn = draw(8, 16), draw(8, 16)
                for model in (g, e):
                    model(self.tensor(xn)).backward(self.tensor(dyn))
                if m == 0:
                    held = [[p.grad for p in model.parameters()] for model in (g, e)]
            for model, handles in zip((g, e), held):
                for p, h in zip(model.parameters(), handles):
                    self.assertEqual(h.data_ptr(), p.grad.data_ptr(), f"step {k}: the handle left p.grad")
            self.assertBitwise([h.numpy() for h in held[0]], [h.numpy() for h in held[1]], f"step {k} handles")
            release_grads(g, e)


class _Scratch(paddle.nn.Layer):
    """Its forward frees a temporary the size of a parameter grad (a product of the detached weights it never
    returns): in a pool shared with the backward, a grad buffer may sit there (NOTE [ Sharing a pool safely ])."""

    def __init__(self):
        super().__init__()
        self.w1 = self.create_parameter([32, 32], dtype="float32")
        self.w2 = self.create_parameter([32, 32], dtype="float32")

    def forward(self, x):
        scratch = paddle.matmul(self.w1.detach(), self.w2.detach())  # freed before the forward ends
        del scratch
        return paddle.matmul(paddle.matmul(x, self.w1), self.w2)


class MemoryCases(TwinCase):
    """NOTE [ What a key holds ] in core/memory.py: each key's bytes by component, on a GPU measured per
    graph (its pool, the allocator cache released before it: NOTE [ Allocator cache before a capture ])."""

    def check_footprint(self, wrapper):
        """Each key's components add up to what max_bytes counts; on cuda its pools were measured and
        hold at least its static outputs and grads. Returns the keys' components."""
        memory = list(wrapper.stats()["key_memory"].values())
        self.assertTrue(memory, wrapper.explain())
        for mem in memory:
            if self.backend == "cuda":
                self.assertIsNotNone(mem["pool"], wrapper.explain())
                self.assertGreaterEqual(mem["pool"], mem["outputs"] + mem["grads"], wrapper.explain())
                self.assertEqual(mem["held"], mem["inputs"] + mem["grad_outputs"] + mem["pool"])
            else:
                self.assertEqual(mem["held"], mem["inputs"] + mem["outputs"] + mem["grad_outputs"] + mem["grads"])
        return memory

    def test_per_layer_keys_account_for_their_pools_and_the_released_cache(self):
        dims = [64, 256, 64]
        pairs = [self.twins(lambda: MatMLP(dims), 140 + i) for i in range(4)]
        for g, _ in pairs:
            self.graphed(g, warmup_steps=1)
        draw = normal(14)
        for k in range(4):
            xn, dyn = draw(32, 64), draw(32, 64)
            outs = []
            for side in (0, 1):
                x = self.tensor(xn, grad=True)
                h = x
                for pair in pairs:
                    h = pair[side](h)
                h.backward(self.tensor(dyn))
                outs.append([h, x.grad] + [grads_of(pair[side]) for pair in pairs])
                release_grads(*[pair[side] for pair in pairs])
            self.assertBitwise(outs[0], outs[1], f"step {k}")
        memory = [m for g, _ in pairs for m in self.check_footprint(g.forward)]
        released = sum(m["cache_released"] for m in memory)
        if self.backend == "cuda":
            self.assertGreater(released, 0, "the eager warmup left cached blocks that the first capture released")
        RECORD.notes.append(f"held {sum(m['held'] for m in memory)} B, pools {sum(m['pool'] or 0 for m in memory)} B, "
                            f"cache released {released} B, reserved now {paddle.device.cuda.memory_reserved() if self.backend == 'cuda' else '-'} B")

    def test_grads_accumulated_as_aliases_survive_the_next_forward(self):
        """clone_param_grads="auto": p.grad aliases the backward's buffers across micro-batches; the next
        forward's temporaries must not land there (its backward keeps a pool of its own where pools are shared)."""
        self.require_all_kernels("accumulating parameter grads needs Paddle's add kernel")
        g, e = self.twins(_Scratch, 160)
        self.graphed(g, warmup_steps=1)
        draw = normal(16)
        for k in range(3):
            for m in range(3):
                xn, dyn = draw(8, 32), draw(8, 32)
                for model in (g, e):
                    model(self.tensor(xn)).backward(self.tensor(dyn))
                self.assertBitwise(grads_of(g), grads_of(e), f"step {k} micro-batch {m} accumulated grads")
            release_grads(g, e)
        self.assertCounters(g.forward, captures=1, eager=0)

    def test_a_whole_step_accounts_for_its_pool(self):
        from paddlefleet.cudagraph import autocudagraph_step

        g, e = self.twins(lambda: MatMLP([64, 256, 64]), 150)

        graphed = autocudagraph_step(released_step(g), optimizers=[], warmup_steps=1, backend=self.backend)
        eager = released_step(e)
        draw = normal(15)
        for k in range(4):
            xn, dyn = draw(32, 64), draw(32, 64)
            self.assertBitwise(graphed(self.tensor(xn), self.tensor(dyn)), eager(self.tensor(xn), self.tensor(dyn)),
                               f"step {k}")
        self.assertBitwise(grads_of(g), grads_of(e), "grads (released)")
        [mem] = self.check_footprint(graphed)
        RECORD.notes.append(f"whole step held {mem['held']} B, pool {mem['pool']} B, cache released {mem['cache_released']} B")


for _base in (KernelCases, CallCases, KeyCases, SpeedOptionCases, PatternCases, PipelineCases, GradSafetyCases,
              MemoryCases):
    globals().update(backend_variants(_base))
del (TwinCase, KernelCases, CallCases, KeyCases, SpeedOptionCases, PatternCases, PipelineCases, GradSafetyCases,
     MemoryCases, _base, _option)
