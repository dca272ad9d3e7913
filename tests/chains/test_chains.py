"""Chains of graphed calls (NOTE [ Chains of graphed calls ] in chains/chain.py): a model graphed
layer by layer, each layer given the previous one's output, replayed through one autograd bridge.

Every case trains a graphed twin and an eager twin on the same batches; testkit.differential
compares each step's results (outputs, the input's grad, every hook's and retained grad) and all
parameters and grads bit for bit after every step. The stats show whether calls were chained.
"""

import gc
import weakref
from unittest import mock

import paddle

from paddlefleet.cudagraph import CudaGraphError, native
from paddlefleet.cudagraph.block import partial_grad
from paddlefleet.cudagraph.chains import chain as chain_module
from paddlefleet.cudagraph.chains.table import TABLE
from testkit.common import MatLayer, build, eager_calls, normal
from testkit.differential import Trainee, differential_run
from testkit.harness import BackendCase, MatmulOnlyCase, for_each_backend, release_grads

WIDTH, LAYERS, BATCH = 8, 4, 4


def stack(n=LAYERS, layer=None):
    return paddle.nn.LayerList([(layer or (lambda: MatLayer(WIDTH, WIDTH)))() for _ in range(n)])


def chained(model):
    """Chained calls of every layer of ``model``."""
    return [layer.forward.stats()["chained_calls"] for layer in model]


def widths_apart():
    """Layers whose outputs differ in shape: 8 -> 16 -> 8 -> 16 -> 8."""
    return paddle.nn.LayerList([MatLayer(*((WIDTH, 2 * WIDTH) if i % 2 == 0 else (2 * WIDTH, WIDTH)))
                                for i in range(LAYERS)])


class ChainCase(BackendCase):
    """Builds twins, runs a step function on both, compares them."""

    steps = 8
    graphed_ref = staticmethod(lambda: None)

    @property
    def graphed_model(self):
        """The graphed twin of the running run_twins (a step may act on it alone), held weakly."""
        return self.graphed_ref()

    def run_twins(self, step, batches, factory=stack, seed=0, **options):
        """``step(model, test, *batch)`` on an eager and a graphed twin; returns the graphed model."""
        made = {}

        def build_twin():
            model = build(factory, seed)
            return Trainee(lambda *batch: step(model, self, *batch), {"model": model})

        def graph(trainee):
            model = made["graphed"] = trainee.objects["model"]
            self.graphed_ref = weakref.ref(model)
            for layer in model:
                self.graphed(layer, **options)
            return trainee.step

        differential_run(build_twin, batches, graph)
        return made["graphed"]

    def run_with_another_input(self, step):
        """run_twins of ``step(model, test, x, dy, z, k)`` (z: another input needing grad, k: the step)."""
        draw = normal(3)
        batches = [b + (self.tensor(draw(BATCH, WIDTH), grad=True), k) for k, b in enumerate(self.batches())]
        return self.run_twins(step, batches)

    def batches(self, n=None, extra=()):
        draw = normal(1)
        return [(self.tensor(draw(BATCH, WIDTH), grad=True), self.tensor(draw(BATCH, WIDTH))) + tuple(extra)
                for _ in range(n or self.steps)]

    def tensor(self, array, grad=False):
        t = paddle.to_tensor(array, stop_gradient=not grad)
        return t

    def results(self, model, x, h, extra=()):
        """What a step returns to compare: output, input grad, parameter grads (then released)."""
        got = [h.numpy(), None if x.grad is None else x.grad.numpy()] + list(extra)
        got += [None if p.grad is None else p.grad.numpy() for p in model.parameters()]
        x.clear_gradient(False)
        release_grads(model)
        return got


def forward_backward(model, test, x, dy, depth=None):
    h = x
    for layer in list(model)[:depth]:
        h = layer(h)
    h.backward(dy)
    return test.results(model, x, h)


@for_each_backend
class ChainMatmulCases(ChainCase, MatmulOnlyCase):
    """Cases a GPU without Paddle's arithmetic kernels runs (matmuls and copies only)."""

    def tensor(self, array, grad=False):
        return MatmulOnlyCase.tensor(self, array, grad)

    def test_layers_given_one_another_output_chain_bitwise(self):
        model = self.run_twins(forward_backward, self.batches())
        self.assertEqual(chained(model)[0], 0)  # the first call of a chain starts it
        self.assertTrue(all(n >= 4 for n in chained(model)[1:]), chained(model))
        for layer in model:
            self.assertEqual(eager_calls(layer.forward.stats()), 0, layer.forward.explain())
        self.assertIn("chained calls", model[1].forward.explain())

    def test_the_head_makes_the_later_outputs_in_one_compiled_call(self):
        native.load()
        reads = native.reads
        if reads is None:
            self.skipTest(f"compiled tensor reads unavailable here: {native.status()[1]}")
        with mock.patch.object(reads, "empty_like_each", wraps=reads.empty_like_each) as made:
            model = self.run_twins(forward_backward, self.batches(), factory=widths_apart)
        self.assertEqual(chained(model)[3], 4)
        self.assertEqual({len(call.args[0]) for call in made.call_args_list}, {LAYERS - 1})
        self.assertGreaterEqual(made.call_count, 4)

    def test_layers_chain_bitwise_with_their_outputs_made_in_python(self):
        with native.disabled():
            model = self.run_twins(forward_backward, self.batches(), factory=widths_apart)
        self.assertEqual(chained(model)[3], 4)

    def test_an_early_exit_breaks_the_chain_and_it_resumes(self):
        depths = [4, 4, 4, 2, 4, 1, 4, 4, 3, 4, 4, 4]
        batches = [b + (d,) for b, d in zip(self.batches(len(depths)), depths)]
        model = self.run_twins(forward_backward, batches)  # parameters of layers not called keep None grads
        self.assertEqual(chained(model)[3], 3)
        for layer in model:
            self.assertEqual(eager_calls(layer.forward.stats()), 0, layer.forward.explain())

    def test_a_parameter_written_between_two_calls_is_read_when_its_call_comes(self):
        draw = normal(5)
        new = [draw(WIDTH, WIDTH) for _ in range(self.steps)]

        def step(model, test, x, dy, k):
            h = model[1](model[0](x))
            model[2].w.set_value(new[k])  # a copy into the parameter: its inplace version does not change
            paddle.assign(test.tensor(new[k]), output=model[3].w)
            h = model[3](model[2](h))
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())])
        self.assertEqual(chained(model)[3], 4)

    def test_another_tensor_in_place_of_the_previous_output_breaks_the_chain(self):
        def step(model, test, x, dy, k):
            h = model[1](model[0](x))
            if k % 3 == 2:
                h = paddle.assign(h)  # the same values, another tensor
            h = model[3](model[2](h))
            h.backward(dy)
            return test.results(model, x, h)

        self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(9))])

    def test_a_forward_without_backward_leaves_nothing_pending(self):
        def step(model, test, x, dy, k):
            h = x
            for layer in model:
                h = layer(h)
            if k == 4:  # the result dropped without a backward
                return [h.numpy()]
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())])
        for layer in model:
            self.assertEqual(eager_calls(layer.forward.stats()), 0, layer.forward.explain())
        self.assertEqual(list(TABLE.runs), [])

    def test_a_backward_from_an_intermediate_output_reaches_the_layers_below_it(self):
        def step(model, test, x, dy):
            outs, h = [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            outs[1].backward(dy)
            return test.results(model, x, outs[1])

        self.run_twins(step, self.batches())

    def test_two_forwards_before_their_backwards(self):
        def step(model, test, x, dy):
            ends = []
            for micro in (x, paddle.assign(x)):
                h = micro
                for layer in model:
                    h = layer(h)
                ends.append(h)
            ends[1].backward(dy)
            ends[0].backward(dy)
            return test.results(model, x, ends[0], [ends[1].numpy()])

        self.run_twins(step, self.batches())

    def test_a_member_called_again_before_a_backward_from_an_intermediate_output(self):
        """The last member is called alone between the chain run and its backward."""
        def step(model, test, x, dy, z, k):
            outs, h = [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            if k < 5:  # the chain forms
                h.backward(dy)
                return test.results(model, x, h)
            y = model[3](z)
            outs[2].backward(dy)
            y.backward(dy)
            extra = [y.numpy(), z.grad.numpy()]
            z.clear_gradient(False)
            return test.results(model, x, outs[2], extra)

        self.run_with_another_input(step)

    def test_a_hook_removed_before_the_backward(self):
        def step(model, test, x, dy):
            h = x
            for i, layer in enumerate(model):
                h = layer(h)
                if i == 1:
                    h.register_hook(lambda g: g * 100.0).remove()
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model)[3], self.steps - 4)  # warmup, capture, two calls that confirm the link

    def test_a_member_reset_before_a_backward_from_an_intermediate_output(self):
        def step(model, test, x, dy, k):
            outs, h = [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            if k >= 5 and model is test.graphed_model:
                model[1].forward.reset()  # its graphs released while the run waits
            outs[1].backward(dy)
            return test.results(model, x, outs[1])

        self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())])

    def test_chain_calls_false_replays_every_call_alone(self):
        model = self.run_twins(forward_backward, self.batches(), chain_calls=False)
        self.assertEqual(chained(model), [0] * LAYERS)

    def test_outputs_handed_out_as_static_buffers(self):
        model = self.run_twins(forward_backward, self.batches(), clone_outputs=False)
        self.assertEqual(chained(model)[3], 4)

    def test_handed_out_outputs_keep_their_values_after_later_runs(self):
        kept = []

        def step(model, test, x, dy):
            outs, h = [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            h.backward(dy)
            if model is test.graphed_model:
                kept.append((outs, [o.numpy() for o in outs]))
            return test.results(model, x, h)

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model)[3], 4)
        for k, (outs, values) in enumerate(kept):
            self.assertBitwise([o.numpy() for o in outs], values, f"outputs of step {k}, read at the end")

    def test_outputs_of_other_shapes_are_handed_out_one_by_one(self):
        model = self.run_twins(forward_backward, self.batches(), factory=widths_apart)
        self.assertEqual(chained(model)[3], 4)
        self.assertEqual(chained(model)[3], 4)

    def test_the_same_layer_twice_in_a_step(self):
        def step(model, test, x, dy):
            h = x
            for layer in [model[0], model[1], model[0], model[2], model[3]]:
                h = layer(h)
            h.backward(dy)
            return test.results(model, x, h)

        self.run_twins(step, self.batches())

    def test_other_arguments_the_same_objects_as_the_first_calls(self):
        draw = normal(7)
        masks = [self.tensor(draw(WIDTH, WIDTH)) for _ in range(2)]

        def step(model, test, x, dy, k):
            h = x
            for i, layer in enumerate(model):
                mask = masks[1] if (k == 5 and i == 2) else masks[0]
                h = layer(h, mask)
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())], factory=masked_stack)
        self.assertEqual(chained(model)[3], 3)

    def test_a_member_that_falls_back_for_good_is_no_link_of_a_chain(self):
        """Layer 1's key falls back after the chain formed: from then on the head replays alone without building
        a chain at each call to find that out (a link to a key that runs eagerly for good leads nowhere), and
        layers 2 and 3 chain on, every step bitwise."""
        built, members = [], chain_module._members

        def step(model, test, x, dy, k):
            if k == 6 and model is test.graphed_model:
                [entry] = model[1].forward.entries().values()
                entry.fall_back("by the test")
            if k == 7:
                built.clear()  # step 6 builds the chain of layers 2 and 3
            return forward_backward(model, test, x, dy)

        with mock.patch.object(chain_module, "_members", lambda *a: built.append(a[1].label) or members(*a)):
            model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(12))])
        self.assertEqual(built, [])
        self.assertEqual(model[1].forward.stats()["eager_reasons"], {"key fell back: by the test": 6})
        # Steps 4-5 chain all four; from step 6 layer 2 heads a chain of 2 and 3 (a head's call is not counted).
        self.assertEqual(chained(model), [0, 2, 2, 8], [layer.forward.explain() for layer in model])

    def test_without_grad_calls_replay_alone(self):
        def step(model, test, x, dy):
            with paddle.no_grad():
                h = x
                for layer in model:
                    h = layer(h)
            return [h.numpy()]

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model), [0] * LAYERS)


@for_each_backend
class PartialGradCases(ChainCase, MatmulOnlyCase):
    """paddle.grad through graphed calls (NOTE [ paddle.grad through a graphed call ] in
    block/partial_grad.py): on a GPU bitwise, on the simulated backend refused before Paddle starts,
    and later grads still right."""

    def tensor(self, array, grad=False):
        return MatmulOnlyCase.tensor(self, array, grad)

    def grad_step(self, wrt):
        def step(model, test, x, dy):
            h1 = model[1](model[0](x))
            h = model[3](model[2](h1))
            (g,) = paddle.grad([h], [{"x": x, "h1": h1, "w": model[2].w}[wrt]], [dy])
            return [h.numpy(), g.numpy()]

        return step

    def refused(self):
        """The message a paddle.grad through a waiting graphed forward is refused with here, or None."""
        return "on the simulated backend" if self.backend == "simulate" else None

    def check(self, wrt):
        if self.refused():
            with self.assertRaisesRegex(CudaGraphError, self.refused()):
                self.run_twins(self.grad_step(wrt), self.batches(), chain_calls=False)
            return
        model = self.run_twins(self.grad_step(wrt), self.batches(), chain_calls=False)
        self.assertEqual(eager_calls(model[0].forward.stats()), 0)

    def test_paddle_grad_of_the_input(self):
        self.check("x")

    def test_paddle_grad_of_an_intermediate_output(self):
        self.check("h1")

    def test_paddle_grad_of_a_parameter(self):
        if not self.refused() and not partial_grad.one_slot():
            self.skipTest("Paddle 2.6 keeps one grad edge per list argument: a graphed call before the parameter's "
                          "Layer cannot tell that paddle.grad cuts its input (docs/guides/limitations.md)")
        self.check("w")

    def test_backward_after_a_refused_paddle_grad(self):
        model = self.run_twins(forward_backward, self.batches(3))
        if self.refused():
            x = self.tensor(normal(4)(BATCH, WIDTH), grad=True)
            h = model[1](model[0](x))
            with self.assertRaises(CudaGraphError):
                paddle.grad([h], [x], [paddle.assign(x)])
        self.run_twins(forward_backward, self.batches(4))


class MaskedMat(paddle.nn.Layer):
    """y = (x @ w) @ mask: a second argument that needs no grad."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([WIDTH, WIDTH], dtype="float32")

    def forward(self, x, mask):
        return paddle.matmul(paddle.matmul(x, self.w), mask)


def masked_stack():
    return paddle.nn.LayerList([MaskedMat() for _ in range(LAYERS)])


class Block(paddle.nn.Layer):
    """Linear, GELU, dropout (random numbers drawn when the call comes)."""

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(WIDTH, WIDTH)
        self.drop = paddle.nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(paddle.nn.functional.gelu(self.fc(x)))


@for_each_backend
class ChainAutogradCases(ChainCase):
    """Intermediate outputs used outside the chain, hooks, retain_grads, paddle.grad, dropout."""

    def test_an_intermediate_output_with_a_consumer_outside_the_chain(self):
        def step(model, test, x, dy):
            h1 = model[1](model[0](x))
            h = model[3](model[2](h1))
            paddle.autograd.backward([h, h1 * 3.0], [dy, dy])
            return test.results(model, x, h)

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model)[3], 4)

    def test_hooks_on_an_intermediate_output_see_its_whole_grad(self):
        def step(model, test, x, dy, k):
            kept = []
            h1 = model[1](model[0](x))
            h1.register_hook(lambda g: g * 2.0)
            h1.register_hook(lambda g: kept.append(g))
            removed = h1.register_hook(lambda g: g * 100.0)
            removed.remove()
            h = model[3](model[2](h1))
            if k % 2:
                paddle.autograd.backward([h, h1 * 0.5], [dy, dy])
            else:
                h.backward(dy)
            return test.results(model, x, h, [g.numpy() for g in kept])

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())])
        self.assertEqual(chained(model)[3], 4)

    def test_hooks_and_retained_grads_with_a_member_called_again_before_the_backward(self):
        def step(model, test, x, dy, z, k):
            kept, outs, h = [], [], x
            for layer in model:
                h = layer(h)
                outs.append(h)
            if k < 5:  # the chain forms
                h.backward(dy)
                return test.results(model, x, h)
            outs[1].register_hook(lambda g: g * 2.0)
            outs[1].register_hook(lambda g: kept.append(g))
            outs[0].retain_grads()
            y = model[3](z)  # the last member alone while the run waits
            paddle.autograd.backward([h, outs[2] * 0.5], [dy, dy])
            y.backward(dy)
            extra = [y.numpy(), z.grad.numpy(), outs[0].grad.numpy()] + [g.numpy() for g in kept]
            z.clear_gradient(False)
            return test.results(model, x, h, extra)

        self.run_with_another_input(step)

    def test_retained_grads_of_intermediate_outputs(self):
        def step(model, test, x, dy):
            outs, h = [], x
            for layer in model:
                h = layer(h)
                h.retain_grads()
                outs.append(h)
            h.backward(dy)
            return test.results(model, x, h, [o.grad.numpy() for o in outs])

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model)[3], 4)

    def test_paddle_grad_of_an_output_the_next_call_took_raises_naming_the_option(self):
        model = build(stack, 0)
        for layer in model:
            self.graphed(layer)
        draw = normal(2)
        for k in range(6):
            x = self.tensor(draw(BATCH, WIDTH), grad=True)
            h1 = model[0](x)
            h = model[2](model[1](h1))
            if chained(model)[1] == 0:
                h.backward(self.tensor(draw(BATCH, WIDTH)))
                release_grads(model)
                continue
            with self.assertRaisesRegex(CudaGraphError, "chain_calls=False"):
                paddle.grad([h], [h1], [self.tensor(draw(BATCH, WIDTH))])
            return
        self.fail("never chained")


    def test_dropout_draws_when_each_call_comes(self):
        def step(model, test, x, dy, k):
            paddle.seed(100 + k)  # each twin's step draws from the same state
            h = x
            for layer in model:
                h = layer(h)
                paddle.nn.functional.dropout(x, 0.5)  # a draw between the calls
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())],
                               factory=lambda: stack(layer=Block))
        self.assertEqual(chained(model)[3], 4)

    def test_batch_norm_statistics_move_once_per_call(self):
        def step(model, test, x, dy, depth):
            return forward_backward(model, test, x, dy, depth)

        depths = [4, 4, 4, 4, 2, 4, 4, 3]
        model = self.run_twins(step, [b + (d,) for b, d in zip(self.batches(), depths)],
                               factory=lambda: stack(layer=lambda: paddle.nn.BatchNorm1D(WIDTH)))
        self.assertEqual(chained(model)[3], 2)

    def test_a_training_flag_changed_between_calls(self):
        def step(model, test, x, dy, k):
            paddle.seed(100 + k)
            h = model[1](model[0](x))
            model[2].train() if k % 3 else model[2].eval()
            h = model[3](model[2](h))
            h.backward(dy)
            model[2].train()
            return test.results(model, x, h)

        self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(9))],
                       factory=lambda: stack(layer=Block))

    def test_double_backward_through_a_chain_raises(self):
        model = build(stack, 0)
        for layer in model:
            self.graphed(layer)
        draw = normal(3)
        for _ in range(5):
            x = self.tensor(draw(BATCH, WIDTH), grad=True)
            h = model[3](model[2](model[1](model[0](x))))
            if chained(model)[3] == 0:
                h.backward(self.tensor(draw(BATCH, WIDTH)))
                continue
            # On the simulated backend and Paddle 2.6 paddle.grad is refused first (PartialGradCases).
            with self.assertRaisesRegex(CudaGraphError, "create_graph=True|paddle.grad while"):
                paddle.grad([h.sum()], [x], create_graph=True)
            return
        self.fail("never chained")

    def test_runs_are_freed_with_their_outputs(self):
        model = self.run_twins(forward_backward, self.batches())
        gc.collect()
        self.assertEqual(list(TABLE.runs), [])
        self.assertEqual(chained(model)[3], 4)

    def test_a_chained_model_is_freed_when_dropped(self):
        import weakref

        model = self.run_twins(forward_backward, self.batches())
        self.assertEqual(chained(model)[3], 4)
        refs = [weakref.ref(layer) for layer in model]
        del model
        gc.collect()
        self.assertEqual([r() for r in refs], [None] * LAYERS)


@for_each_backend
class ChainGradCases(ChainCase):
    """Grads that stay between steps, copy policies, a key that cannot join, a member dropped or reset."""

    def accumulate(self, model, test, x, dy, k):
        """Two micro-batches per step, grads kept between them (they are released every other step)."""
        h = x
        for layer in model:
            h = layer(h)
        h.backward(dy)
        got = [h.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in model.parameters()]
        x.clear_gradient(False)
        if k % 2:
            release_grads(model)
        return got

    def test_grads_accumulated_across_micro_batches(self):
        batches = [b + (k,) for k, b in enumerate(self.batches(10))]
        for policy in ("auto", True, False):
            model = self.run_twins(self.accumulate, batches, clone_param_grads=policy)
            self.assertEqual(chained(model)[3], 6, policy)

    def test_a_key_that_cannot_join_splits_the_chain(self):
        def graph_mixed(trainee):
            model = trainee.objects["model"]
            for i, layer in enumerate(model):
                self.graphed(layer, accumulate_in_graph=(i == 2))
            return trainee.step

        def build_twin():
            model = build(stack, 0)
            return Trainee(lambda x, dy, k: self.accumulate(model, self, x, dy, k), {"model": model})

        eager, graphed = differential_run(build_twin, [b + (k,) for k, b in enumerate(self.batches())], graph_mixed)
        counts = chained(graphed.objects["model"])
        self.assertEqual(counts[1], 4, counts)
        self.assertEqual(counts[2:], [0, 0])

    def test_a_member_reset_or_evicted_between_steps(self):
        def step(model, test, x, dy, k):
            if k == 4 and model is test.graphed_model:
                model[3].forward.reset()  # between steps
            h = model[1](model[0](x))
            if k == 7 and model is test.graphed_model:
                model[2].forward.reset()  # between two calls of a chain
            h = model[3](model[2](h))
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(12))])
        self.assertEqual(chained(model)[3], 1)
        self.assertEqual(model[3].forward.stats()["captures"], 1)  # captured again after its reset

    def test_a_residual_add_between_layers_keeps_calls_alone(self):
        def step(model, test, x, dy):
            h = x
            for layer in model:
                h = h + layer(h)
            h.backward(dy)
            return test.results(model, x, h)

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model), [0] * LAYERS)
