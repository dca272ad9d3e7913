"""Speed paths, each bitwise against eager on every backend that runs here.

* ``clone_param_grads="auto"`` (the default): grads handed out as aliases, copied only where a
  later replay could overwrite a tensor someone still holds (NOTE [ Grad hand-out ]). Fleet's own
  consumers stay correct over several steps with accumulation: plain ``p.grad`` accumulation
  (tests/grads/test_training.py GradAccumulationTest covers from zero and from None), a hook that
  stores its grad, Fleet's ``MixPrecisionLayer`` main_grad hook (it frees what it is handed);
  DataParallel runs in tests/integration/test_distributed.py.
* ``accumulate_in_graph=True``: grads added into ``p.grad`` / ``p.main_grad`` inside the graph
  (NOTE [ Accumulation inside the graph ]).
The counters (``grad_copies``) pin that no needless copy is made.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
import unittest
import unittest.mock
import warnings

import numpy as np
import paddle
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer
from parameterized import parameterized

from paddlefleet.cudagraph import CudaGraphError, autocudagraph

from paddlefleet.cudagraph.grads.stacks import stacks_as_grads_arrive
from testkit.harness import BackendCase, for_each_backend, grads_of, params_of, twin_layers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Chain(paddle.nn.Layer):
    """Matmuls only (Hopper GPUs with Paddle 2.6.2 run its cuBLAS and copies, nothing else)."""

    def __init__(self, width=8, depth=3):
        super().__init__()
        self.ws = paddle.nn.ParameterList(
            [self.create_parameter([width, width]) for _ in range(depth)]
        )

    def forward(self, x):
        for w in self.ws:
            x = paddle.matmul(x, w)
        return x


def batches(n, shape=(4, 8), seed=3, grad=False):
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        t = paddle.to_tensor(rs.standard_normal(shape).astype("float32"))
        t.stop_gradient = not grad
        out.append(t)
    return out


def mse(y):
    return (y * y).mean()


def free_grads(model):
    """``clear_gradients(set_to_zero=False)``, spelled so that Paddle 2.6 has it too."""
    for p in model.parameters():
        p.clear_gradient(False)


def opt_state(opt, params):
    """Every optimizer accumulator, in parameter order (names differ between twins)."""
    return {name: [table[p.name].numpy() for p in params if p.name in table]
            for name, table in sorted(opt._accumulators.items())}


def train(model, xs, micro, set_to_zero, opt_cls=paddle.optimizer.AdamW, mix=False):
    """micro-batches per step, AdamW; a log of losses, input grads, grads and states per step."""
    params = list(model.parameters())
    opt = opt_cls(learning_rate=0.01, parameters=params)
    if mix:
        opt = MixPrecisionOptimizer(opt)
    log = []
    for s in range(len(xs) // micro):
        for x in xs[s * micro:(s + 1) * micro]:
            x = x.detach()
            x.stop_gradient = False
            loss = mse(model(x))
            loss.backward()
            log += [loss, x.grad]
        log.append([p.main_grad.numpy() for p in params] if mix else grads_of(model))
        opt.step()
        opt.clear_grad(set_to_zero=set_to_zero)
        log.append(params_of(model))
    log.append(opt_state(opt._inner_opt if mix else opt, params))
    return log


@for_each_backend
class AutoPolicyTest(BackendCase):
    @parameterized.expand([("set_to_zero", True), ("free", False)])
    def test_default_hands_out_aliases_and_copies_only_adopted_grads_once(self, _, set_to_zero):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0)
        xs = batches(12)
        self.assertBitwise(train(graphed, xs, 2, set_to_zero), train(eager, xs, 2, set_to_zero))
        stats = graphed.forward.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (1, 11, 0))
        graphs = graphed.forward.entry().graphs.current
        # Accumulation adopts the first micro-batch's buffer as p.grad: the second micro-batch of
        # the first step moves it out (3 copies), then the second buffer set takes over.
        self.assertEqual(stats["grad_copies"], 3)
        self.assertEqual(len(graphs.plans()), 2)
        self.assertIn("3 copied before a replay would overwrite a grad still held, 2 set(s) of grad buffers", graphed.forward.explain())

    def test_grads_freed_before_every_backward_need_no_copy_and_one_buffer_set(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0)
        xs = batches(6)
        self.assertBitwise(train(graphed, xs, 1, False), train(eager, xs, 1, False))
        graphs = graphed.forward.entry().graphs.current
        self.assertEqual((graphed.forward.stats()["grad_copies"], len(graphs.plans())), (0, 1))

    def test_a_hook_that_stores_its_grad_sees_eager_values_and_only_that_grad_is_copied(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0)
        kept = {}
        for name, model in (("eager", eager), ("graphed", graphed)):
            kept[name] = []
            model.ws[1].register_hook(kept[name].append)
        xs = batches(8)
        for set_to_zero in (True, False):
            got = train(graphed, xs, 2, set_to_zero)
            want = train(eager, xs, 2, set_to_zero)
            self.assertBitwise(got, want)
        # Eager frees (set_to_zero=False) or zeroes the first micro-batch's grad, which became
        # p.grad; the others keep their values. The graphed run does the same.
        state = {name: [(t._is_initialized(), t.numpy() if t._is_initialized() else None) for t in ts]
                 for name, ts in kept.items()}
        self.assertBitwise(state["graphed"], state["eager"], "stored grads")
        self.assertEqual(len(kept["graphed"]), 16)
        # One parameter of three has the hook: 16 copies for it, plus the one-time moves of the
        # other two when their p.grad was first adopted.
        self.assertEqual(graphed.forward.stats()["grad_copies"], 16 + 2)

    def test_a_hook_registered_after_capture_and_removed_again_switches_copies(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0)
        xs = batches(8)
        keep_e, keep_g = [], []
        for step in range(4):  # two micro-batches per step; the hook is on for steps 1 and 2
            if step == 1:
                handles = [eager.ws[0].register_hook(keep_e.append), graphed.ws[0].register_hook(keep_g.append)]
            if step == 3:
                for h in handles:
                    h.remove()
            for model in (eager, graphed):
                for x in xs[2 * step:2 * step + 2]:
                    mse(model(x)).backward()
                free_grads(model)
        # The first micro-batch's grad became p.grad and was freed with it, in both runs; the
        # second one's stays as its backward made it.
        self.assertEqual([t._is_initialized() for t in keep_g], [False, True, False, True])
        self.assertEqual([t._is_initialized() for t in keep_e], [False, True, False, True])
        self.assertBitwise([keep_g[1].numpy(), keep_g[3].numpy()], [keep_e[1].numpy(), keep_e[3].numpy()])
        # Copies for ws[0] while hooked (4 backwards); the other parameters' adopted grads are
        # moved out once, before the second buffer set exists.
        self.assertEqual(graphed.forward.stats()["grad_copies"], 4 + 3)

    @parameterized.expand([(f"{name}_{'zero' if z else 'free'}", options, z)
                           for name, options in (("auto", {}), ("in_graph", {"accumulate_in_graph": True}))
                           for z in (True, False)])
    def test_mix_precision_main_grad_with_accumulation_matches_eager(self, _, options, set_to_zero):
        # MixPrecisionLayer's hook adds each grad into main_grad and frees the tensor it is
        # handed: an alias, never the static buffer (or, in the graph, the same add).
        eager, graphed = twin_layers(Chain)
        eager_mix, graphed_mix = MixPrecisionLayer(eager, dtype="float16"), MixPrecisionLayer(graphed, dtype="float16")
        self.graphed(graphed, warmup_steps=0, **options)
        xs = batches(12)
        got = train(graphed_mix, xs, 3, set_to_zero, mix=True)  # freed: MixPrecisionOptimizer _clear()s main_grad
        want = train(eager_mix, xs, 3, set_to_zero, mix=True)
        self.assertBitwise(got, want)
        stats = graphed.forward.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["grad_copies"]), (1, 11, 0))
        for p in graphed.parameters():
            self.assertIsNone(p.grad)


class Mixed(paddle.nn.Layer):
    """Two same-shape weights (one stack of grads) and one of its own shape (a single grad), matmuls only."""

    def __init__(self):
        super().__init__()
        self.ws = paddle.nn.ParameterList([self.create_parameter([8, 8]) for _ in range(2)])
        self.out = self.create_parameter([8, 4])

    def forward(self, x):
        for w in self.ws:
            x = paddle.matmul(x, w)
        return paddle.matmul(x, self.out)


def touch_grads(model, step):
    """What a training loop may do to the grads autograd adopted, one thing per step (the same to eager's)."""
    params = list(model.parameters())
    if step % 4 == 1:
        for p in params:
            paddle.assign(p.grad * 0.5, output=p.grad)  # in place: Paddle counts it
    elif step % 4 == 2:
        params[0].clear_gradient(False)  # frees the storage of every handle to that grad
        params[2].clear_gradient(False)
    elif step % 4 == 3:
        g = params[1].grad  # reshaped in place and back again: the same metadata, counted twice
        paddle.assign(g.reshape([64]), output=g)
        paddle.assign(g.reshape([8, 8]), output=g)


def reshape_after_step(model, step):
    """After the optimizer read them, a grad left reshaped in place (its storage kept): the next backward's grad
    replaces it as p.grad (eager: the zeroed grad is assigned over; freed: it is gone)."""
    if step % 4 == 3:
        g = list(model.parameters())[1].grad
        paddle.assign(g.reshape([64]), output=g)


@for_each_backend
class ReusedAliasTest(BackendCase):
    """NOTE [ Reused aliases ] in grads/hand_out_plan.py: the views a backward hands out are handed out again
    while each is unchanged, and made again where anything touched them; bitwise eager's either way."""

    def run_both(self, steps, touch, set_to_zero, graphed_under=contextlib.nullcontext):
        """Eager's log and the graphed twin's (its loop run under ``graphed_under()``), and the graphed key's plans."""
        eager, graphed = twin_layers(Mixed)
        self.graphed(graphed, warmup_steps=0)
        logs = []
        for model in (eager, graphed):
            opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
            with graphed_under() if model is graphed else contextlib.nullcontext():
                logs.append(self.steps(model, opt, steps, touch, set_to_zero))
        plans = graphed.forward.entry().graphs.current.plans()
        return logs, plans

    @staticmethod
    def steps(model, opt, steps, touch, set_to_zero):
        """Steps of two micro-batches each, SGD; the grads and the parameters after every step."""
        log = []
        for step, x in enumerate(batches(steps)):
            for micro in range(2):
                mse(model(x * (micro + 1.0))).backward()
            if touch:
                touch_grads(model, step)
            log.append(grads_of(model))
            opt.step()
            if touch:
                reshape_after_step(model, step)
            opt.clear_grad(set_to_zero=set_to_zero)
            log.append(params_of(model))
        return log

    @parameterized.expand([("zero", True), ("free", False)])
    def test_untouched_grads_reuse_the_views_of_the_last_backward(self, _, set_to_zero):
        (want, got), plans = self.run_both(6, False, set_to_zero)
        self.assertBitwise(got, want)
        made, reused = sum(p.views_made for p in plans), sum(p.views_reused for p in plans)
        repointed = sum(p.views_repointed for p in plans)
        # Views kept per stack and for the single grads together: a stack where grads are stacked as they arrive
        # (Paddle 3), else (2.6: NOTE [ Stacks after paddle.grad only for copied grads ]) the singles alone.
        kept = 2 if stacks_as_grads_arrive() else 1
        self.assertEqual(made + reused + repointed, kept * 6 * 2, "12 backwards")
        if set_to_zero:  # zeroed grads keep their storage: after the first step, every view reused
            self.assertLessEqual(made, 3 * kept, "per buffer set, one more accumulated")
            self.assertEqual(repointed, 0)
        else:  # a freed p.grad empties the view it adopted; the second micro-batch's views are reused
            self.assertGreaterEqual(reused, kept * 5, (made, reused, repointed))
            # NOTE [ Freed aliases re-pointed ]: once each buffer set has handed out two sets of views, the freed
            # views of the hand-out before the last are filled again instead of made
            self.assertEqual((made, repointed), (kept * 4, kept * 3), (made, reused, repointed))

    @parameterized.expand([("zero", True), ("free", False)])
    def test_touched_grads_get_views_made_again(self, _, set_to_zero):
        (want, got), plans = self.run_both(8, True, set_to_zero)
        self.assertBitwise(got, want)
        made = sum(p.views_made for p in plans)
        self.assertGreaterEqual(made, 8, "every step touched some grad: views made again")

    @parameterized.expand([("no_check", lambda kept: True, False),
                           ("address_only", lambda kept: all(v.data_ptr() == p for v, p in zip(*kept[:2])), True)])
    def test_without_the_check_a_touched_view_is_handed_out_as_it_was(self, _, unchanged, set_to_zero):
        """Each part of the check keeps some touched grad right: with none (a freed grad's emptied view handed out)
        or with the address alone (a grad reshaped in place handed out in its new shape), the run fails."""
        from paddlefleet.cudagraph.grads import hand_out_plan

        def unchecked():
            return unittest.mock.patch.object(hand_out_plan, "_unchanged", unchanged)

        try:
            (want, got), _ = self.run_both(8, True, set_to_zero, graphed_under=unchecked)
        except Exception:  # noqa: BLE001 - the graphed loop's (eager's ran before, unpatched): a wrong grad handed out
            return
        with self.assertRaises(AssertionError):
            self.assertBitwise(got, want)


@for_each_backend
class AccumulateInGraphTest(BackendCase):
    @parameterized.expand([(f"micro{m}_{'zero' if z else 'free'}", m, z) for m in (1, 2, 3) for z in (True,)])
    def test_grads_accumulate_in_the_graph_bitwise_like_eager(self, _, micro, set_to_zero):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=1, accumulate_in_graph=True)
        xs = batches(12)
        self.assertBitwise(train(graphed, xs, micro, set_to_zero), train(eager, xs, micro, set_to_zero))
        stats = graphed.forward.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["recaptures"], stats["grad_copies"]),
                         (1, 10, 0, 0))
        self.assertIn("grads of 3 parameter(s) accumulated in the graph", graphed.forward.explain())

    def test_parameters_leave_the_bridge_and_their_hooks_do_not_run(self):
        graphed = Chain()
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        calls = []
        graphed.ws[0].register_hook(lambda g: calls.append(1))
        x = batches(1)[0]
        for _ in range(3):
            mse(graphed(x)).backward()
        self.assertEqual(calls, [], "hooks of in-graph parameters do not run (documented)")
        graphs = graphed.forward.entry().graphs.current
        self.assertEqual(graphs.backward.bridged, [])
        self.assertIsNotNone(graphs.backward.anchor, "nothing else needs grad: the anchor runs the backward")

    def test_first_grad_equal_to_minus_zero_stays_minus_zero(self):
        class Scale(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.w = self.create_parameter([4])

            def forward(self, x):
                return x * self.w

        eager, graphed = twin_layers(Scale)
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        x = paddle.zeros([4])
        for model in (eager, graphed):
            model(x).backward(paddle.to_tensor([-1.0, 1.0, -2.0, 0.0]))
        self.assertBitwise(graphed.w.grad, eager.w.grad)
        self.assertTrue(np.signbit(eager.w.grad.numpy()[0]), "the case needs a -0.0 grad")

    def test_freed_accumulators_are_put_back_by_the_next_backward_without_a_recapture(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        xs = batches(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(graphed, xs, 1, False)
        self.assertBitwise(got, train(eager, xs, 1, False))
        stats = graphed.forward.stats()
        self.assertEqual((stats["captures"], stats["recaptures"], stats["replays"], stats["eager_calls"]), (1, 0, 4, 0))
        self.assertFalse([w for w in caught if "autocudagraph" in str(w.message)])
        self.assertEqual([p.grad for p in graphed.parameters()], [None] * 3, "freed grads stay None, as in eager")

    def test_accumulator_freed_between_forward_and_backward_is_assigned_as_in_eager(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        x = batches(1)[0]
        for model in (eager, graphed):
            mse(model(x)).backward()
            y = mse(model(x))
            free_grads(model)
            y.backward()
        self.assertBitwise(grads_of(graphed), grads_of(eager))
        self.assertEqual(graphed.forward.stats()["replays"], 1)

    def test_accumulator_rebound_between_forward_and_backward_raises(self):
        graphed = Chain()
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        x = batches(1)[0]
        mse(graphed(x)).backward()
        y = mse(graphed(x))
        w = graphed.ws[1]
        w.grad_ = w.grad.detach().clone()  # another tensor: the graph cannot add into it
        # Paddle re-raises an error from a PyLayer backward as OSError, with our message.
        with self.assertRaisesRegex((CudaGraphError, OSError), "was rebound to another tensor between the forward"):
            y.backward()

    def test_a_failed_capture_takes_back_the_accumulators_it_made(self):
        class HostSyncInBackward(paddle.autograd.PyLayer):
            @staticmethod
            def forward(ctx, x):
                return x * 1.0

            @staticmethod
            def backward(ctx, dy):
                dy.numpy()  # a host sync: refused by a capture
                return dy

        class Net(Chain):
            def forward(self, x):
                return HostSyncInBackward.apply(super().forward(x))

        eager, graphed = twin_layers(Net)
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        x = batches(1)[0]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            y = graphed(x)
        self.assertEqual([p.grad for p in graphed.parameters()], [None] * 3, "accumulators left behind")
        mse(y).backward()
        mse(eager(x)).backward()
        self.assertBitwise(grads_of(graphed), grads_of(eager))
        self.assertEqual(graphed.forward.stats()["captures"], 0)

    def test_input_grads_still_flow_through_the_bridge(self):
        eager, graphed = twin_layers(Chain)
        self.graphed(graphed, warmup_steps=0, accumulate_in_graph=True)
        for x in batches(3, grad=True):
            x_e = x.detach()
            x_e.stop_gradient = False
            mse(graphed(x)).backward()
            mse(eager(x_e)).backward()
            self.assertBitwise(x.grad, x_e.grad)
        self.assertBitwise(grads_of(graphed), grads_of(eager))

    def test_refused_under_data_parallel(self):
        class FakeDataParallel(paddle.DataParallel):
            def __init__(self, layers):  # no process group: only what the detection reads
                paddle.nn.Layer.__init__(self)
                self._layers = layers

        model = Chain()
        wrapper = FakeDataParallel(model)
        self.graphed(model, warmup_steps=0, accumulate_in_graph=True)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            mse(model(batches(1)[0])).backward()
        stats = model.forward.stats()
        self.assertEqual(stats["captures"], 0)
        self.assertIn("would not be all-reduced", model.forward.explain())
        for p in model.parameters():
            self.assertIsNotNone(p.grad, "the eager fallback still gives grads")
        del wrapper


class LayersBuiltBeforeTheFirstWrapperTest(unittest.TestCase):
    def test_hooks_registered_before_the_first_wrapper_are_counted_by_paddle(self):
        # NOTE [ Grad consumers ]: the registry's wrappers come with the first wrapper; Paddle's hook ids
        # tell it which parameters had hooks it never saw.
        script = textwrap.dedent(
            """
            import paddle
            from paddlefleet.cudagraph import autocudagraph
            from paddlefleet.cudagraph.grads import hook_registry
            kept = []
            plain = paddle.nn.Linear(4, 4)  # built after the import, before any wrapper: no hooks
            hooked = paddle.nn.Linear(4, 4)
            hooked.weight.register_hook(lambda g: kept.append(g))  # unseen: registered before any wrapper
            removed = paddle.nn.Linear(4, 4)
            removed.weight._remove_grad_hook(removed.weight._register_grad_hook(lambda g: None))
            layers = {"plain": plain, "hooked": hooked, "removed": removed}
            for layer in layers.values():
                autocudagraph(layer, backend="simulate", warmup_steps=0)
            late = paddle.nn.Linear(4, 4)
            late.bias.register_hook(lambda g: kept.append(g))  # seen: registered after the first wrapper
            layers["late"] = autocudagraph(late, backend="simulate", warmup_steps=0)
            for layer in layers.values():
                for _ in range(3):
                    layer(paddle.randn([2, 4])).sum().backward()
                    layer.clear_gradients()
            print(" ".join(f"{name}={layer.forward.stats()['grad_copies']}" for name, layer in layers.items()))
            print(hook_registry.describe(hooked.weight))
            print(hook_registry.describe(plain.weight))
            """
        )
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        counts, hooked, plain = out.stdout.strip().splitlines()[-3:]
        counts = dict(item.split("=") for item in counts.split())
        # grad_copies counts the hand-out copies and the one-time move of each adopted grad (a parameter
        # whose grad is handed out as an alias the first time: NOTE [ Moving an adopted grad ]).
        self.assertEqual(counts["plain"], "2", "no hooks: aliases (2 one-time moves), though built before the "
                                               "first wrapper")
        self.assertEqual(counts["hooked"], "4", "the weight's hook was registered before the first wrapper: Paddle "
                                                "counted it, so its grad is copied at each of 3 backwards (+1 move)")
        self.assertEqual(counts["removed"], "4", "a hook registered and removed unseen still counts (unknown)")
        self.assertEqual(counts["late"], "4", "the bias's hook went through the registry: copied 3 times (+1 move)")
        self.assertIn("hooks unknown", hooked)
        self.assertEqual(plain, "None")
