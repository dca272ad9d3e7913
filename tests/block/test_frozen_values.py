"""Python values a replay would freeze, seen: a plain attribute of a graphed Layer or of any
sublayer changed after capture (NOTE [ Layer attributes a replay freezes ] in guards/layer_attrs.py),
the Layer tree's structure changed in place (a sublayer swapped through ``_sub_layers`` or a
LayerDict, ``LayerList.append``, a forward hook added or removed), alone and in a chain of graphed
layers, a parameter of a whole step frozen or unfrozen, a plain attribute of a Layer a step calls.

Matmul-only (MatmulOnlyCase: conftest marks them ``gpu_safe``, tools/gpu_check.py runs them on a
GPU): explicit ``y.backward(dy)``, every output and grad bitwise against an eager twin after every
step (the step cases with testkit's differential checker).
"""

import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from testkit.common import MatLayer, MatMLP, build
from testkit.differential import Trainee, differential_run
from testkit.harness import BackendCase, MatmulOnlyCase, for_each_backend, normal, release_grads
from testkit.step_gpu import MatmulSGD


class Flagged(paddle.nn.Layer):
    """``x @ w1``, then ``@ w2`` only while ``self.extra`` (a flag read in forward)."""

    def __init__(self):
        super().__init__()
        self.w1 = self.create_parameter([8, 8], dtype="float32")
        self.w2 = self.create_parameter([8, 8], dtype="float32")
        self.extra = False

    def forward(self, x):
        y = paddle.matmul(x, self.w1)
        if self.extra:
            y = paddle.matmul(y, self.w2)
        return y


class Twice(paddle.nn.Layer):
    """``x @ w``, once or ``self.times`` times (a curriculum switch on a sublayer)."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([8, 8], dtype="float32")
        self.times = 1

    def forward(self, x):
        for _ in range(self.times):
            x = paddle.matmul(x, self.w)
        return x


class Counting(Flagged):
    """Flagged that counts its calls in a plain attribute (``self.calls += 1`` in forward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class KeepingLast(Flagged):
    """Flagged that keeps its latest output (``self.last = y``: a new tensor on every call)."""

    def forward(self, x):
        y = super().forward(x)
        self.last = y
        return y


class CachingShape(Flagged):
    """Flagged that writes ``self.shape = tuple(x.shape)`` on every call (the value it held)."""

    def forward(self, x):
        self.shape = tuple(x.shape)
        return super().forward(x)


class LazyWidth(Flagged):
    """Flagged that makes ``self.width`` on its first call (lazy initialisation)."""

    def __init__(self):
        super().__init__()
        self.width = None
        self.made = 0

    def forward(self, x):
        if self.width is None:
            self.width = x.shape[-1]
            self.made += 1
        return super().forward(x)


class Outer(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.inner = Twice()
        self.w = self.create_parameter([8, 8], dtype="float32")

    def forward(self, x):
        return paddle.matmul(self.inner(x), self.w)


class CountingOuter(Outer):
    """Outer that counts its calls in a plain attribute (``self.steps += 1`` in forward)."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return super().forward(x)


class _TwinSteps(MatmulOnlyCase):
    """Twins called step by step, with a change applied to both at one step."""

    def run_twins(self, graphed, eager, steps, change_at, change):
        """Calls both twins on one batch per step, ``change(layer)`` applied to both before step
        ``change_at``; compares outputs and every grad; returns the warnings."""
        draw = normal(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(steps):
                if k == change_at:
                    change(graphed)
                    change(eager)
                xn, dyn = draw(4, 8), draw(4, 8)
                outs, grads = [], []
                for fn, layer in ((graphed, graphed), (eager, eager)):
                    x = self.tensor(xn, grad=True)
                    y = fn(x)
                    y.backward(self.tensor(dyn))
                    outs.append(y)
                    grads.append([x.grad] + [p.grad for p in layer.parameters()])
                self.assertBitwise(outs[0], outs[1], f"step {k} y")
                self.assertBitwise(grads[0], grads[1], f"step {k} grads")
                release_grads(graphed, eager)
        return [str(w.message) for w in caught]


@for_each_backend
class LayerAttributeCases(_TwinSteps):
    def test_flag_read_in_forward_changed_after_capture_captures_again(self):
        """``model.extra = True`` after capture: the key is captured again (a replay would skip the
        second matmul), with a warning naming the attribute and both values."""
        graphed, eager = self.twins(Flagged, 41)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, lambda m: setattr(m, "extra", True))
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any("attribute 'extra' of Flagged" in m and "False -> True" in m for m in messages), messages)

    def test_sublayer_attribute_changed_after_capture_captures_again(self):
        """``model.inner.times = 2`` (a sublayer's curriculum switch) after capture: captured again."""
        graphed, eager = self.twins(Outer, 42)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, lambda m: setattr(m.inner, "times", 2))
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any("attribute 'times' of Outer.inner" in m and "1 -> 2" in m for m in messages), messages)

    def run_refused(self, factory, seed, attribute, steps=10):
        """Runs twins of ``factory`` whose forward writes ``attribute`` on every call: refused at the
        capture on every backend (a GPU replay would not write it), every call eager's; returns the
        warnings."""
        graphed, eager = self.twins(factory, seed)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, steps, None, None)
        self.assertCounters(graphed.forward, captures=0, replays=0, warmup_calls=2, eager=steps - 2, graphs=0)
        refused = [m for m in messages if f"changes attribute '{attribute}' of {factory.__name__}" in m]
        self.assertEqual(len(refused), 1, messages)
        self.assertIn("Keep such state outside the graphed function", refused[0])
        self.assertIn("in place", refused[0])
        self.assertIn(f"changes attribute '{attribute}'", graphed.forward.explain())
        return graphed, eager, refused[0]

    def test_an_attribute_changed_by_every_call_is_refused_at_capture(self):
        """``self.calls += 1`` in forward: a GPU replay runs no Python, so the count would stop at the
        capture's value; the capture is refused on every backend (the capture's write put back), every
        call runs eagerly, and the count is eager's."""
        graphed, eager, message = self.run_refused(Counting, 44, "calls")
        self.assertIn("(2 -> 3, at ", message)
        self.assertIn("tensor buffer updated in place", message)
        self.assertIn("test_frozen_values.py", message)
        self.assertEqual((graphed.calls, eager.calls), (10, 10))

    def test_a_new_tensor_kept_by_every_call_is_refused_at_capture(self):
        """``self.last = y`` in forward: a new tensor on every call, which a replay would not assign."""
        graphed, eager, _ = self.run_refused(KeepingLast, 46, "last")
        self.assertBitwise(graphed.last, eager.last, "last")

    def test_an_idempotent_cache_written_by_every_call_replays(self):
        """``self.shape = tuple(x.shape)`` on every call writes the value it held: captured, replayed."""
        graphed, eager = self.twins(CachingShape, 47)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        self.run_twins(graphed, eager, 6, None, None)
        self.assertCounters(graphed.forward, captures=1, replays=4, eager=0)
        self.assertEqual(graphed.shape, (4, 8))

    def test_an_attribute_made_lazily_in_warmup_replays(self):
        """``if self.width is None: self.width = x.shape[-1]``: made by the warmup call, left alone by
        the capture: captured, replayed."""
        graphed, eager = self.twins(LazyWidth, 48)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        self.run_twins(graphed, eager, 6, None, None)
        self.assertCounters(graphed.forward, captures=1, replays=4, eager=0)
        self.assertEqual((graphed.width, graphed.made), (8, 1))

    def test_an_attribute_made_lazily_by_the_capture_call_warms_up_again(self):
        """``warmup_steps=0``: the capture call makes ``self.width``, which one capture cannot tell from a
        per-call write; that call runs as a warmup call, and the next capture leaves it alone."""
        graphed, eager = self.twins(LazyWidth, 49)
        autocudagraph(graphed, backend=self.backend, warmup_steps=0)
        messages = self.run_twins(graphed, eager, 6, None, None)
        self.assertCounters(graphed.forward, warmup_calls=1, captures=1, replays=4, eager=0)
        self.assertEqual((graphed.width, graphed.made), (8, 1))
        self.assertFalse([m for m in messages if "changes attribute" in m], messages)

    def test_a_cache_reset_between_calls_and_made_again_by_the_capture_replays(self):
        """``model.width = None`` between calls (a cache reset): the key is captured again, that capture
        makes the cache again and warms the key up once more; then it replays."""
        graphed, eager = self.twins(LazyWidth, 50)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        self.run_twins(graphed, eager, 8, 4, lambda m: setattr(m, "width", None))
        self.assertCounters(graphed.forward, warmup_calls=2, captures=2, replays=4, eager=0)
        self.assertEqual((graphed.made, eager.made), (2, 2))

    def test_an_attribute_changed_outside_before_every_call_runs_eagerly_after_three_captures_again(self):
        """``model.seen += 1`` between calls (outside the function), read by nothing the graph runs: the
        key is captured again 3 times in a row without a replay, then runs eagerly for good, with one
        warning and the attribute and its values in explain()."""
        graphed, eager = self.twins(Flagged, 44)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        draw = normal(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(10):
                for layer in (graphed, eager):
                    layer.seen = k
                xn = draw(4, 8)
                self.assertBitwise(graphed(self.tensor(xn)), eager(self.tensor(xn)), f"step {k}")
        messages = [str(w.message) for w in caught]
        self.assertCounters(graphed.forward, captures=4, recaptures=3, replays=0, eager=5, graphs=0)
        endless = [m for m in messages if "runs eagerly from now on" in m]
        self.assertEqual(len(endless), 1, messages)
        self.assertIn("attribute 'seen' of Flagged changed before every call", endless[0])
        self.assertIn("tensor buffer updated in place", endless[0])
        self.assertIn("attribute 'seen' of Flagged changed before every call", graphed.forward.explain())

    def test_an_attribute_changed_between_replays_keeps_its_graphs(self):
        """A flag flipped every second step: each value replays once before the next change, so the key
        keeps capturing again and never falls back."""
        graphed, eager = self.twins(Flagged, 45)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        draw = normal(6)
        for k in range(12):
            for layer in (graphed, eager):
                layer.extra = k % 4 >= 2
            xn = draw(4, 8)
            self.assertBitwise(graphed(self.tensor(xn)), eager(self.tensor(xn)), f"step {k}")
        self.assertCounters(graphed.forward, captures=6, recaptures=5, replays=5, eager=0)

    def test_a_value_set_back_replays(self):
        """A flag set and set back before the next call changes nothing the graph read: it replays."""
        graphed, eager = self.twins(Flagged, 43)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)

        def flip_and_back(m):
            m.extra = True
            m.extra = False

        self.run_twins(graphed, eager, 5, 3, flip_and_back)
        self.assertCounters(graphed.forward, captures=1, replays=3, eager=0)


class Stacked(paddle.nn.Layer):
    """Two MatLayers in a LayerList and one in a LayerDict, called in order."""

    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([MatLayer(8, 8) for _ in range(2)])
        self.named = paddle.nn.LayerDict({"last": MatLayer(8, 8)})

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.named["last"](x)


def detach_input(layer, inputs):
    return (inputs[0].detach(),)


def apply_weight_first(layer, inputs):
    return (paddle.matmul(inputs[0], layer.w),)


def fresh_layer():
    return build(lambda: MatLayer(8, 8), 77)


@for_each_backend
class LayerStructureCases(_TwinSteps):
    """The tree's structure changed after capture without ``__setattr__``: the key is captured
    again, each call bitwise eager's (never the capture's backward), with a warning naming it."""

    def check_change(self, change, expected):
        graphed, eager = self.twins(Stacked, 44)
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, change)
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any(expected in m for m in messages), messages)

    def test_a_sublayer_swapped_through_sub_layers_captures_again(self):
        def change(m):
            m.layers._sub_layers["1"] = fresh_layer()

        self.check_change(change, "attribute 'sub_layers['1']' of Stacked.layers")

    def test_a_layer_dict_entry_replaced_captures_again(self):
        def change(m):
            m.named["last"] = fresh_layer()

        self.check_change(change, "attribute 'sub_layers['last']' of Stacked.named")

    def test_a_layer_appended_to_a_layer_list_gets_its_grad(self):
        def change(m):
            m.layers.append(fresh_layer())

        self.check_change(change, "attribute 'sub_layers (order)' of Stacked.layers")

    def test_a_forward_pre_hook_added_after_capture_captures_again(self):
        def change(m):
            m.layers[1].register_forward_pre_hook(detach_input)

        self.check_change(change, "attribute 'forward_pre_hooks (order)' of Stacked.layers.1")

    def test_a_forward_hook_removed_after_capture_captures_again(self):
        graphed, eager = self.twins(Stacked, 45)
        handles = [m.layers[0].register_forward_post_hook(lambda layer, i, out: out.detach()) for m in (graphed, eager)]
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        messages = self.run_twins(graphed, eager, 6, 3, lambda m: handles[0 if m is graphed else 1].remove())
        self.assertCounters(graphed.forward, captures=2, replays=3, eager=0)
        self.assertTrue(any("forward_post_hooks" in m and "Stacked.layers.0" in m for m in messages), messages)


class TimesLayer(Twice):
    """Twice with another width check: ``x @ w`` ``self.times`` times (a chain member)."""


@for_each_backend
class ChainedAttributeCases(MatmulOnlyCase):
    """Chained calls (NOTE [ Chains of graphed calls ] in chains/chain.py) run every check an alone
    call runs: a member's attribute or structure changed after the chain formed is seen."""

    def run_chain(self, factory, change, steps=8, change_at=5):
        graphed, eager = self.twins(lambda: paddle.nn.LayerList([factory() for _ in range(4)]), 46)
        for layer in graphed:
            autocudagraph(layer, backend=self.backend, warmup_steps=1)
        draw = normal(6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(steps):
                if k == change_at:
                    change(graphed)
                    change(eager)
                xn, dyn = draw(4, 8), draw(4, 8)
                outs, grads = [], []
                for model in (graphed, eager):
                    x = self.tensor(xn, grad=True)
                    h = x
                    for layer in model:
                        h = layer(h)
                    h.backward(self.tensor(dyn))
                    outs.append(h)
                    grads.append([x.grad] + [p.grad for p in model.parameters()])
                self.assertBitwise(outs[0], outs[1], f"step {k} y")
                self.assertBitwise(grads[0], grads[1], f"step {k} grads")
                release_grads(graphed, eager)
        self.assertGreater(graphed[2].forward.stats()["chained_calls"], 0, "no chain formed")
        return graphed, [str(w.message) for w in caught]

    def test_a_flag_of_a_later_member_changed_after_the_chain_formed(self):
        graphed, messages = self.run_chain(Flagged, lambda m: setattr(m[2], "extra", True))
        self.assertEqual(graphed[2].forward.stats()["captures"], 2)
        self.assertTrue(any("attribute 'extra' of Flagged" in m for m in messages), messages)

    def test_a_curriculum_switch_of_a_later_member_changed_after_the_chain_formed(self):
        graphed, messages = self.run_chain(TimesLayer, lambda m: setattr(m[1], "times", 2))
        self.assertEqual(graphed[1].forward.stats()["captures"], 2)
        self.assertTrue(any("attribute 'times' of TimesLayer" in m for m in messages), messages)

    def test_a_forward_pre_hook_on_a_later_member_added_after_the_chain_formed(self):
        graphed, messages = self.run_chain(TimesLayer, lambda m: m[3].register_forward_pre_hook(apply_weight_first))
        self.assertEqual(graphed[3].forward.stats()["captures"], 2)
        self.assertTrue(any("forward_pre_hooks" in m for m in messages), messages)


class ScaledDropout(paddle.nn.Layer):
    """``dropout(x @ w * self.scale)``: a plain attribute and a sublayer's rate read in forward."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([8, 8], dtype="float32")
        self.scale = 1.0
        self.drop = paddle.nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(paddle.matmul(x, self.w) * self.scale)


@for_each_backend
class ChainedDropoutCases(BackendCase):
    """Chained calls see a scale or a dropout rate changed after the chain formed, as alone calls do."""

    def run_chain(self, change, steps=8, change_at=5):
        graphed, eager = (build(lambda: paddle.nn.LayerList([ScaledDropout() for _ in range(4)]), 47)
                          for _ in range(2))
        for layer in graphed:
            self.graphed(layer, warmup_steps=1)
        draw = normal(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(steps):
                if k == change_at:
                    change(graphed)
                    change(eager)
                xn, dyn = draw(4, 8), draw(4, 8)
                got = []
                for model in (graphed, eager):
                    paddle.seed(100 + k)
                    x = paddle.to_tensor(xn, stop_gradient=False)
                    h = x
                    for layer in model:
                        h = layer(h)
                    h.backward(paddle.to_tensor(dyn))
                    got.append([h, x.grad] + [p.grad for p in model.parameters()])
                self.assertBitwise(got[0], got[1], f"step {k}")
                release_grads(graphed, eager)
        self.assertGreater(graphed[2].forward.stats()["chained_calls"], 0, "no chain formed")
        return graphed, [str(w.message) for w in caught]

    def test_a_scale_of_a_later_member_changed_after_the_chain_formed(self):
        graphed, messages = self.run_chain(lambda m: setattr(m[1], "scale", 0.5))
        self.assertEqual(graphed[1].forward.stats()["captures"], 2)
        self.assertTrue(any("attribute 'scale' of ScaledDropout" in m and "1.0 -> 0.5" in m for m in messages), messages)

    def test_a_dropout_rate_of_a_later_member_changed_after_the_chain_formed(self):
        graphed, messages = self.run_chain(lambda m: setattr(m[2].drop, "p", 0.6))
        self.assertEqual(graphed[2].forward.stats()["captures"], 2)
        self.assertTrue(any("attribute 'p' of ScaledDropout.drop" in m for m in messages), messages)


def scaled(x):
    return paddle.matmul(x, x) * paddle.to_tensor(0.1)  # a fill of the default dtype


@for_each_backend
class DefaultDtypeCases(BackendCase):
    def test_the_default_dtype_changed_after_capture_captures_again(self):
        """``paddle.set_default_dtype('float64')`` after capture: ``to_tensor(0.1)`` is a float64 fill
        eagerly, the capture's float32 fill on a GPU replay: the key is captured again, bitwise."""
        graphed = self.graphed(scaled, warmup_steps=1)
        draw = normal(8)
        self.addCleanup(paddle.set_default_dtype, paddle.get_default_dtype())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(6):
                if k == 3:
                    paddle.set_default_dtype("float64")
                xn = draw(4, 4)
                outs = [fn(paddle.to_tensor(xn)) for fn in (graphed, scaled)]
                self.assertBitwise(outs[0], outs[1], f"step {k}")
        self.assertCounters(graphed, captures=2, replays=3, eager=0)
        messages = [str(w.message) for w in caught]
        self.assertTrue(any("default dtype" in m and "float32 -> float64" in m for m in messages), messages)


@for_each_backend
class StepValueCases(MatmulOnlyCase):
    def build_step(self, factory=lambda: MatMLP([8, 8, 8, 8])):
        def make():
            model = build(factory, 17)
            opt = MatmulSGD(model.parameters(), 0.125)

            def step(x, dy):
                y = model(x)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            return Trainee(step, {"model": model})

        return make

    def batches(self, n):
        draw = normal(9)
        return [(self.tensor(draw(4, 8)), self.tensor(draw(4, 8))) for _ in range(n)]

    def run_step(self, build, steps, change):
        wrappers = []

        def graph(trainee):
            wrappers.append(autocudagraph_step(trainee.step, optimizers=[], warmup_steps=1, backend=self.backend))
            return wrappers[0]

        def after_step(i, eager, graphed):
            change(i, eager.objects["model"])
            change(i, graphed.objects["model"])

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(build, self.batches(steps), graph, after_step=after_step)
        return wrappers[0], [str(w.message) for w in caught]

    def test_freezing_a_parameter_captures_the_step_again(self):
        """``p.stop_gradient = True`` on the first layer after step 2, back to False after step 5:
        each change warms the step up and captures it again, with a message naming the parameter; every output,
        parameter and grad bitwise against eager after every step (a replay would keep training
        the frozen layer)."""
        names = []

        def change(i, model):
            p = model.layers[0].w
            names.append(p.name)
            if i == 2:
                p.stop_gradient = True
            elif i == 5:
                p.stop_gradient = False

        step, messages = self.run_step(self.build_step(), 9, change)
        self.assertCounters(step, captures=3, replays=3, eager=0)
        graphed_name = names[1]
        self.assertTrue(any(f"parameter {graphed_name} was frozen (stop_gradient False -> True)" in m
                            for m in messages), messages)
        self.assertTrue(any(f"parameter {graphed_name} was unfrozen" in m for m in messages), messages)

    def test_layer_attribute_the_step_reads_captures_again(self):
        """A sublayer's plain attribute changed between steps (``model.inner.times = 2``): the step
        warms up and is captured again, bitwise against eager."""
        def change(i, model):
            if i == 2:
                model.inner.times = 2

        step, messages = self.run_step(self.build_step(Outer), 6, change)
        self.assertCounters(step, captures=2, replays=2, eager=0)
        self.assertTrue(any("attribute 'times' of Outer.inner" in m for m in messages), messages)

    def test_an_attribute_changed_after_every_step_runs_the_step_eagerly(self):
        """A step counter kept as a plain attribute (``model.inner.seen = i`` after every step): the step
        warms up and is captured again 3 times in a row without a replay, then runs eagerly for good."""
        def change(i, model):
            model.inner.seen = i

        step, messages = self.run_step(self.build_step(Outer), 12, change)
        self.assertCounters(step, captures=4, replays=0, eager=4)
        self.assertEqual(len([m for m in messages if "runs eagerly from now on" in m]), 1, messages)
        self.assertIn("attribute 'seen' of Outer.inner changed before every call", step.explain())

    def test_a_model_attribute_the_step_changes_is_refused_at_capture(self):
        """The model's forward counts steps in a plain attribute (``self.steps += 1``): a whole step
        whose capture changes it is refused on every backend (a GPU replay would not count), every
        step eager's, the count eager's."""
        models = {}

        def change(i, model):
            models.setdefault(i, []).append(model)

        step, messages = self.run_step(self.build_step(CountingOuter), 6, change)
        self.assertCounters(step, captures=0, replays=0)
        self.assertEqual(len([m for m in messages if "changes attribute 'steps' of" in m]), 1, messages)
        self.assertIn("changes attribute 'steps'", step.explain())
        self.assertEqual([m.steps for m in models[5]], [6, 6])


class SetItemScalarTest(unittest.TestCase):
    """``t[i] = v`` with a Python scalar runs in C++ without a ``_C_ops`` call: the value is a kernel
    argument a GPU replay keeps from its capture. The simulated backend traces it as an op (block
    replays and whole steps alike) and runs eagerly where it changes; a numpy value is a host copy,
    refused (tests/block/test_capture_failures.py's setitem_numpy)."""

    def test_a_scalar_written_with_setitem_that_changes_runs_eagerly_on_simulate(self):
        knob = [1.0]

        def fill_row(x):
            t = x * 1.0
            t[1] = knob[0]
            return t

        graphed = autocudagraph(fill_row, backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                knob[0] = 1.0 if i < 3 else float(i)
                x = paddle.ones([3, 2])
                np.testing.assert_array_equal(graphed(x).numpy(), fill_row(x).numpy(), strict=True)
        stats = graphed.stats()
        # Call 3's replay sees the new value before it hands anything out and runs eagerly; so does call 4.
        self.assertEqual((stats["captures"], stats["replays"]), (1, 1), graphed.explain())
        messages = " ".join(str(c.message) for c in caught)
        self.assertIn("Tensor.__setitem__", messages)
        self.assertIn("On a GPU this replay would reuse the capture's", messages)

    def test_a_whole_step_whose_setitem_scalar_changes_is_refused_at_capture(self):
        knob = [1.0]
        w = paddle.create_parameter([2, 2], "float32")
        opt = paddle.optimizer.SGD(0.1, parameters=[w])

        def step(x):
            t = paddle.matmul(x, w)
            t[0] = knob[0]
            loss = t.sum()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        graphed = autocudagraph_step(step, optimizers=[opt], backend="simulate", warmup_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                knob[0] = float(i)
                graphed(paddle.ones([2, 2]))
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())
        self.assertIn("Tensor.__setitem__", graphed.explain())
