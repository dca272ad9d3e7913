"""Call patterns that real model code uses: containers that keep
their type in and out, graphed forwards along a class hierarchy, static and class methods, and the
signature a graphed callable presents (Paddle's reentrant recompute binds arguments against it).

Every graphed result is compared bit for bit with an eager run, and every phase is pinned with
the counters, so that no test can pass by running eagerly.
"""

import collections
import dataclasses
import inspect
import typing

import numpy as np
import paddle
from paddle.distributed.fleet.utils import recompute

from paddlefleet.cudagraph import autocudagraph

from testkit.harness import BackendCase, clone_leaf, for_each_backend, grads_of, params_of, twin_layers


# ---------------------------------------------------------------------------- containers
class ModelOutput(collections.OrderedDict):
    """Written like PaddleNLP's / PaddleFormers' ModelOutput: a dataclass subclass of OrderedDict
    whose non-None fields are also items, kept in step by __setitem__ / __setattr__."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, k):
        if isinstance(k, str):
            return dict(self.items())[k]
        return self.to_tuple()[k]

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name, value):
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: typing.Optional[paddle.Tensor] = None
    logits: paddle.Tensor = None
    hidden_states: typing.Optional[typing.Tuple[paddle.Tensor, ...]] = None
    attentions: typing.Optional[typing.Tuple[paddle.Tensor, ...]] = None


class AttrDict(collections.OrderedDict):
    """A batch / output dict whose keys also read as attributes (BatchEncoding style)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Parts(list):
    pass


class Pair(tuple):
    pass


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Stats:
    mean: paddle.Tensor
    count: int


@dataclasses.dataclass(frozen=True)
class FrozenStats:
    total: paddle.Tensor
    scale: float = 1.0


class Head(paddle.nn.Layer):
    """Returns one container of every kind, nested. A chain: each tensor feeds at most two
    consumers (see the report of this branch: a tensor feeding three or more outputs can get its
    grad summed in another order than eager's, with or without containers)."""

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        logits = paddle.tanh(h)
        a = logits * 2.0
        c = a + 1.0
        p = c * 3.0
        q = p - 1.0
        half = q * 0.5
        y = paddle.tanh(half)
        mean = y.mean(0)
        total = mean.sum()
        return (
            CausalLMOutput(logits=logits, loss=total * 0.1, hidden_states=(x, h)),
            AttrDict(a=a, b=None),
            collections.OrderedDict(c=c),
            Parts([p, "tag"]),
            Pair((q, 7)),
            Point(x=half, y=y),
            Stats(mean=mean, count=3),
            FrozenStats(total=total, scale=0.5),
        )


def assert_same(test, actual, expected, what="value"):
    """Same types at every level, tensors bit for bit, other leaves equal."""
    test.assertIs(type(actual), type(expected), what)
    if isinstance(expected, paddle.Tensor):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy(), err_msg=what, strict=True)
    elif isinstance(expected, dict):
        test.assertEqual(list(dict.keys(actual)), list(dict.keys(expected)), what)
        for k in dict.keys(expected):
            assert_same(test, dict.__getitem__(actual, k), dict.__getitem__(expected, k), f"{what}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        test.assertEqual(len(actual), len(expected), what)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(test, a, e, f"{what}[{i}]")
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(test, getattr(actual, f.name), getattr(expected, f.name), f"{what}.{f.name}")
    else:
        test.assertEqual(actual, expected, what)


def tensor_sum(value):
    """The sum of every tensor leaf (for a backward through all of them)."""
    if isinstance(value, paddle.Tensor):
        return value.sum()
    if isinstance(value, dict):
        parts = [tensor_sum(v) for v in dict.values(value)]
    elif isinstance(value, (list, tuple)):
        parts = [tensor_sum(v) for v in value]
    elif dataclasses.is_dataclass(value):
        parts = [tensor_sum(getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return None
    parts = [p for p in parts if p is not None]
    return paddle.add_n(parts) if parts else None


@for_each_backend
class ContainerTest(BackendCase):
    def test_output_containers_keep_their_type(self):
        model, ref = twin_layers(Head)
        self.graphed(model, warmup_steps=1)
        phases = [dict(warmup_calls=1), dict(captures=1)] + [dict(replays=1)] * 3
        for step, phase in enumerate(phases):
            x = paddle.randn([3, 4])
            x.stop_gradient = False
            x_e = clone_leaf(x)
            with model.forward.counters.expect(**phase):
                out = model(x)
            want = ref(x_e)
            assert_same(self, out, want, f"call {step}")
            # What user code does with such outputs.
            self.assertIs(out[0].logits, dict.__getitem__(out[0], "logits"))
            self.assertEqual(list(out[0].keys()), ["loss", "logits", "hidden_states"])
            self.assertIsNone(out[0].attentions)
            assert_same(self, out[0][1], want[0][1], "ModelOutput integer index")
            assert_same(self, out[1].a, want[1].a, "attribute of an OrderedDict subclass")
            assert_same(self, out[5].y, want[5].y, "namedtuple field")
            tensor_sum(out).backward()
            tensor_sum(want).backward()
            self.assertBitwise(x.grad, x_e.grad, f"input grad, call {step}")
            self.assertBitwise(grads_of(model), grads_of(ref), f"param grads, call {step}")

    def test_input_containers_keep_their_type(self):
        w = paddle.randn([4, 4])
        w.stop_gradient = False
        w_e = clone_leaf(w)
        seen = []

        def step(batch, point, stats, parts):
            seen.append(tuple(type(v) for v in (batch, point, stats, parts)))
            h = paddle.matmul(batch.input_ids, batch["w"]) * stats.scale
            return h + point.x * parts[0] + stats.total

        f = self.graphed(step, warmup_steps=1)
        kinds = (AttrDict, Point, FrozenStats, Parts)
        phases = [dict(warmup_calls=1), dict(captures=1)] + [dict(replays=1)] * 3
        for i, phase in enumerate(phases):
            x = paddle.randn([2, 4])
            x.stop_gradient = False
            x_e = clone_leaf(x)
            p, t = paddle.randn([2, 4]), paddle.randn([4])
            args = (Point(x=p, y=None), FrozenStats(total=t, scale=0.5), Parts([paddle.randn([2, 4])]))
            with f.counters.expect(**phase):
                y = f(AttrDict(input_ids=x, w=w), *args)
            y_e = step(AttrDict(input_ids=x_e, w=w_e), *args)
            self.assertBitwise(y, y_e, f"call {i}")
            y.sum().backward()
            y_e.sum().backward()
            self.assertBitwise(x.grad, x_e.grad, f"grad of batch.input_ids, call {i}")
            self.assertBitwise(w.grad, w_e.grad, f"grad of batch['w'], call {i}")
        # warmup, capture (and every simulated replay) saw the caller's types, then the eager reference.
        self.assertTrue(len(seen) >= 3 + len(phases) - 1, seen)
        self.assertEqual(set(seen), {kinds})
        self.assertEqual(f.stats()["keys"], 1)


# ---------------------------------------------------------------------------- class hierarchy
def hierarchy(decorate):
    """``Base`` and ``Sub`` whose forwards are both decorated; Sub's calls super().forward()."""

    class Base(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        @decorate
        def forward(self, x):
            return paddle.tanh(self.fc(x))

    class Sub(Base):
        def __init__(self):
            super().__init__()
            self.out = paddle.nn.Linear(4, 4)

        @decorate
        def forward(self, x):
            return self.out(super().forward(x)) * 2.0

    return Base, Sub


@for_each_backend
class HierarchyTest(BackendCase):
    def test_graphed_forward_in_a_base_class_and_a_subclass(self):
        Base, Sub = hierarchy(lambda fn: self.graphed(fn, warmup_steps=1))
        _, EagerSub = hierarchy(lambda fn: fn)
        model, ref = Sub(), EagerSub()
        ref.set_state_dict(model.state_dict())
        outer, inner = model.forward, super(Sub, model).forward
        self.assertIsNot(outer, inner, "each decorated function has its own wrapper per instance")
        phases = [dict(warmup_calls=1), dict(captures=1)] + [dict(replays=1)] * 3
        for step, phase in enumerate(phases):
            x = paddle.randn([2, 4])
            with outer.counters.expect(**phase):
                y = model(x)
            y_e = ref(x)
            self.assertBitwise(y, y_e, f"call {step}")
            y.sum().backward()
            y_e.sum().backward()
            self.assertBitwise(grads_of(model), grads_of(ref), f"grads, call {step}")
        # The inner call ran as any graphed call inside another capture: eagerly, inside the outer graph.
        stats = inner.stats()
        self.assertEqual((stats["warmup_calls"], stats["captures"]), (1, 0))
        self.assertIn("called inside another capture", stats["eager_reasons"])
        # A Base instance of its own graphs Base.forward.
        base = Base()
        for _ in range(3):
            base(paddle.randn([2, 4]))
        self.assertEqual((base.forward.stats()["captures"], base.forward.stats()["replays"]), (1, 1))


# ---------------------------------------------------------------------------- static and class methods
@for_each_backend
class StaticAndClassMethodTest(BackendCase):
    def _classes(self):
        graphed = lambda fn: self.graphed(fn, warmup_steps=0)  # noqa: E731

        class Ops:
            scale = 2.0

            @staticmethod
            @graphed
            def static_below(x, w):
                return paddle.matmul(x, w)

            @graphed
            @staticmethod
            def static_above(x, w):
                return paddle.matmul(x, w) + 1.0

            @classmethod
            @graphed
            def class_below(cls, x):
                return x * cls.scale

            @graphed
            @classmethod
            def class_above(cls, x):
                return x * cls.scale + 1.0

        class MoreOps(Ops):
            scale = 3.0

        return Ops, MoreOps

    def test_static_methods_have_one_graph_per_function(self):
        Ops, _ = self._classes()
        ops = Ops()
        for name, extra in (("static_below", 0.0), ("static_above", 1.0)):
            w = paddle.randn([4, 4])
            for i in range(4):
                x = paddle.randn([2, 4])
                fn = getattr(Ops, name) if i % 2 else getattr(ops, name)
                self.assertBitwise(fn(x, w), paddle.matmul(x, w) + extra, f"{name} call {i}")
                self.assertFalse([k for k in getattr(x, "__dict__", {}) if "autocudagraph" in k], "a tensor taken as self")
            stats = getattr(Ops, name).stats()
            self.assertEqual((stats["captures"], stats["replays"], stats["keys"]), (1, 3, 1), name)
            self.assertEqual(getattr(ops, name).stats(), stats, "the class and its instances share the wrapper")

    def test_class_methods_have_one_graph_per_class(self):
        Ops, MoreOps = self._classes()
        for name, extra in (("class_below", 0.0), ("class_above", 1.0)):
            for cls in (Ops, MoreOps):
                for i in range(3):
                    x = paddle.randn([2, 4])
                    fn = getattr(cls, name) if i % 2 else getattr(cls(), name)
                    self.assertBitwise(fn(x), x * cls.scale + extra, f"{cls.__name__}.{name} call {i}")
                stats = getattr(cls, name).stats()
                self.assertEqual((stats["captures"], stats["replays"]), (1, 2), f"{cls.__name__}.{name}")

    def test_a_method_has_no_class_level_stats(self):
        Base, _ = hierarchy(lambda fn: self.graphed(fn))
        with self.assertRaisesRegex(TypeError, r"graphed per instance.*obj\.forward\.stats\(\)"):
            Base.forward.stats()


# ---------------------------------------------------------------------------- signature and recompute
class Block(paddle.nn.Layer):
    """A block with several arguments, as decoder layers have."""

    def __init__(self):
        super().__init__()
        self.q = paddle.nn.Linear(8, 8)
        self.o = paddle.nn.Linear(8, 8)

    def forward(self, x, mask, scale=0.5, residual=True):
        h = paddle.tanh(self.q(x)) * mask * scale
        h = self.o(h)
        return h + x if residual else h


class Stack(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(), Block()])

    def forward(self, x, mask):
        for block in self.blocks:
            x = recompute(block, x, mask)  # reentrant: binds (x, mask) against block.forward's signature
        return x


class Decorated:
    @autocudagraph
    def method(self, x, mask=None, *, flag=False):
        return x


@for_each_backend
class SignatureTest(BackendCase):
    def test_signature_is_that_of_what_is_wrapped_bound_where_it_is_bound(self):
        layer = self.graphed(Block())
        self.assertEqual(str(inspect.signature(layer.forward)), str(inspect.signature(Block().forward)))
        self.assertEqual(str(inspect.signature(layer.forward)), "(x, mask, scale=0.5, residual=True)")
        self.assertEqual(str(inspect.signature(Decorated().method)), "(x, mask=None, *, flag=False)")
        self.assertEqual(str(inspect.signature(Decorated.method)), "(self, x, mask=None, *, flag=False)")
        plain = self.graphed(lambda x, w=None: x)
        self.assertEqual(str(inspect.signature(plain)), "(x, w=None)")
        bound = inspect.signature(layer.forward).bind(paddle.ones([1]), paddle.ones([1]))
        self.assertEqual(list(bound.arguments), ["x", "mask"])

    def test_recompute_around_graphed_layers_with_several_arguments(self):
        model, ref = twin_layers(Stack)
        for block in model.blocks:
            self.graphed(block, warmup_steps=1)
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters())
        opt_e = paddle.optimizer.AdamW(learning_rate=0.01, parameters=ref.parameters())
        mask = (paddle.rand([4, 8]) > 0.3).astype("float32")
        steps = 5
        for step in range(steps):
            x = paddle.randn([4, 8])
            x.stop_gradient = False
            x_e = clone_leaf(x)
            loss, loss_e = (model(x, mask) ** 2).mean(), (ref(x_e, mask) ** 2).mean()
            loss.backward()
            loss_e.backward()
            self.assertBitwise(loss, loss_e, f"loss step {step}")
            self.assertBitwise(x.grad, x_e.grad, f"input grad step {step}")
            self.assertBitwise(grads_of(model), grads_of(ref), f"grads step {step}")
            opt.step()
            opt_e.step()
            opt.clear_grad()
            opt_e.clear_grad()
            self.assertBitwise(params_of(model), params_of(ref), f"params step {step}")
        for block in model.blocks:
            # Two keys per block: recompute's forward (no grad) and its re-run in backward (grad);
            # each warms up once, is captured once and then replays.
            stats = block.forward.stats()
            self.assertEqual((stats["keys"], stats["warmup_calls"], stats["captures"], stats["replays"]),
                             (2, 2, 2, 2 * (steps - 2)))
