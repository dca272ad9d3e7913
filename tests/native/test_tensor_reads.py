"""The compiled tensor reads (NOTE [ Compiled tensor reads ] in native/__init__.py) answer exactly what the Python
reads answer, or None where they cannot tell; keys, the eager front path and the parameter-address check decide the
same with them and without them; a graphed layer trains bitwise eager's either way; and the loader says why where
the module cannot be built or loaded, or fails under ``require``."""

import contextlib
import os
import tempfile
import unittest
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, native
from paddlefleet.cudagraph.core.keys import KeyMaker
from paddlefleet.cudagraph.core.layers import ParamSet
from paddlefleet.cudagraph.core.call import positional_spec
from paddlefleet.cudagraph.errors import CudaGraphError
from paddlefleet.cudagraph.io.static_inputs import key_meta

from testkit.common import device, normal
from testkit.harness import MatmulOnlyCase, for_each_backend

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
SHAPES = ((), (3,), (2, 5), (2, 3, 4), (1, 2, 3, 1, 2), (0, 3))


def loaded():
    """The compiled module, or a skip where this machine cannot build it (CI sets require: it fails there)."""
    native.load()
    active, why = native.status()
    if not active:
        raise unittest.SkipTest(f"compiled tensor reads unavailable here: {why}")
    return native.reads


def tensors():
    """``[(label, tensor)]``: every dtype and rank the key reads, both stop_gradient values, views, a parameter; made
    on the CPU (a GPU may lack this Paddle's kernels: DeviceTensorReadsTest copies them over)."""
    with device("cpu"):
        return _tensors()


def _tensors():
    out = []
    for dtype in DTYPES:
        for shape in SHAPES:
            t = paddle.zeros(list(shape), "float32").astype(dtype)
            out.append((f"{dtype}{list(shape)}", t))
    x = paddle.to_tensor(np.arange(24, dtype="float32").reshape(6, 4), stop_gradient=False)
    out += [("float32 stop_gradient=False", x), ("a row slice", x[1:3]), ("an element", x[2, 1]),
            ("a parameter", paddle.create_parameter([3, 2], "float32"))]
    y = paddle.zeros([2, 6], "float32")
    y.reshape_([3, 4])  # its meta changed in place
    out.append(("reshaped in place", y))
    return out


class CompiledReadsTest(unittest.TestCase):
    """The module against the Python reads, tensor by tensor."""

    def setUp(self):
        self.reads = loaded()

    def test_meta_is_the_python_key_part_of_every_tensor(self):
        for label, t in tensors():
            with self.subTest(label):
                got = self.reads.meta(t)
                if 0 in t.shape:  # a zero-size tensor holds no memory: not initialized, left to Python
                    self.assertIsNone(got)
                    self.assertIsNone(self.reads.match((t,), (key_meta(t),)))
                    continue
                self.assertEqual(got, key_meta(t))
                self.assertIs(type(got[0]), tuple)
                self.assertEqual([type(v) for v in got[0]], [int] * len(got[0]))
                self.assertEqual(self.reads.metas([t, t]), (got, got))
                self.assertEqual(self.reads.data_ptr(t), t.data_ptr())

    def test_what_it_cannot_read_is_left_to_python(self):
        p = paddle.create_parameter([3, 2], "float32")
        p._clear_data()  # uninitialized: its place raises in Python
        cases = [("uninitialized", p), ("empty (paddle.Tensor())", paddle.Tensor()),
                 ("4-D (layout autotune may permute its shape)", paddle.zeros([1, 2, 3, 4]))]
        for label, t in cases:
            with self.subTest(label):
                self.assertIsNone(self.reads.meta(t))
                self.assertIsNone(self.reads.metas([paddle.zeros([2]), t]))
                self.assertIsNone(self.reads.match((t,), (((1,), 0, "cpu", True),)))
                if label.startswith("4-D"):
                    self.assertEqual(self.reads.data_ptr(t), t.data_ptr())
                else:  # no memory: Python gives None or 0 by Paddle version, so the module does not answer
                    self.assertIsNone(self.reads.data_ptr(t))
                    self.assertIn(t.data_ptr(), (None, 0))
        self.assertIsNone(self.reads.meta("not a tensor"))
        self.assertIsNone(self.reads.match([paddle.zeros([2])], (((2,), 5, "cpu", True),)))  # not a tuple

    def test_match_answers_each_part(self):
        x = paddle.zeros([2, 3], "float32")
        x.stop_gradient = False
        meta = key_meta(x)
        other_dtype = key_meta(paddle.zeros([2, 3], "float64"))[1]
        cases = [(meta, True), (((2, 4),) + meta[1:], False), (((2, 3, 1),) + meta[1:], False),
                 (((2,),) + meta[1:], False), ((meta[0], other_dtype) + meta[2:], False),
                 (meta[:2] + (0,) + meta[3:], False), (meta[:3] + (True,), False), (meta + ("host",), False),
                 (meta[:3], False)]
        for want, same in cases:
            with self.subTest(want):
                self.assertIs(self.reads.match((x,), (want,)), same)
        self.assertIs(self.reads.match((x, x), (meta,)), False)  # another number of tensors
        self.assertIs(self.reads.match((), ()), True)

    def test_moved_answers_as_the_python_check(self):
        layer = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.Linear(4, 2))
        cases = [("unchanged", lambda: None),
                 ("stop_gradient flipped", lambda: setattr(layer[1].weight, "stop_gradient", True)),
                 ("replaced", lambda: setattr(layer[0], "bias", paddle.create_parameter([4], "float32",
                                                                                       is_bias=True))),
                 ("freed", lambda: layer[1].bias._clear_data())]
        for label, change in cases:
            with self.subTest(label):
                params = ParamSet([layer])
                change()
                with native.disabled():
                    want = params.moved()
                self.assertEqual(params.moved(), want)
                if label == "unchanged":
                    self.assertIsNone(want)
                else:
                    self.assertIsNotNone(want)
                    self.assertEqual(self.reads.moved(params._compiled_homes) is None, label == "freed")


class StepWalksTest(unittest.TestCase):
    """``ptrs_hold`` and ``flags_hold`` (a whole step's replay checks) against the list comparisons they replace."""

    def setUp(self):
        self.reads = loaded()

    def test_each_tensor_and_each_change(self):
        readable = [t for _, t in tensors() if 0 not in t.shape]
        ptrs = [t.data_ptr() for t in readable]
        flags = [t.stop_gradient for t in readable]
        self.assertIs(self.reads.ptrs_hold(tuple(readable), ptrs), True)
        self.assertIs(self.reads.ptrs_hold(readable, ptrs), True)  # a list of tensors too
        self.assertIs(self.reads.flags_hold(tuple(readable), flags), True)
        for i in (0, len(readable) // 2, len(readable) - 1):
            with self.subTest(i=i):
                other = list(ptrs)
                other[i] += 4
                self.assertIs(self.reads.ptrs_hold(readable, other), False)
                flipped = list(flags)
                flipped[i] = not flipped[i]
                self.assertIs(self.reads.flags_hold(readable, flipped), False)
        self.assertIs(self.reads.ptrs_hold(readable, ptrs[:-1]), False)  # another length
        self.assertIs(self.reads.flags_hold(readable, flags[:-1]), False)
        self.assertIs(self.reads.ptrs_hold((), []), True)

    def test_what_it_cannot_read_is_left_to_python(self):
        x = paddle.zeros([2, 3])
        p = paddle.create_parameter([3, 2], "float32")
        p._clear_data()  # no memory: Python's data_ptr() is None or 0 by Paddle version
        self.assertIsNone(self.reads.ptrs_hold((x, p), [x.data_ptr(), p.data_ptr()]))
        self.assertIs(self.reads.ptrs_hold((x, p), [x.data_ptr() + 4, p.data_ptr()]), False)  # one differs
        self.assertIsNone(self.reads.ptrs_hold((x,), (x.data_ptr(),)))  # not a list
        self.assertIsNone(self.reads.ptrs_hold((x,), [float(x.data_ptr())]))
        self.assertIsNone(self.reads.flags_hold((x,), [1]))  # not a bool: compared in Python
        with self.assertRaises(AttributeError):  # as list(map(attrgetter("stop_gradient"), ...)) raises
            self.reads.flags_hold((x, "not a tensor"), [True, True])


class EmptyLikeEachTest(unittest.TestCase):
    """``empty_like_each`` makes what ``_C_ops.empty(t.shape, t.dtype, t.place)`` makes for each tensor, or leaves the
    whole list to Python."""

    def setUp(self):
        self.reads = loaded()

    def test_each_tensor_as_empty_makes_it(self):
        like = [t for _, t in tensors() if 0 not in t.shape]
        made = self.reads.empty_like_each(like)
        self.assertIs(type(made), list)
        self.assertEqual(len(made), len(like))
        for t, got in zip(like, made):
            with self.subTest(f"{t.dtype}{t.shape}"):
                want = paddle._C_ops.empty(t.shape, t.dtype, t.place)
                self.assertIs(type(got), type(want))
                self.assertEqual(key_meta(got), key_meta(want))
                self.assertTrue(got._is_initialized())
                self.assertNotEqual(got.data_ptr(), t.data_ptr())
                got.copy_(t, False)  # its own memory, written as any tensor's
                np.testing.assert_array_equal(got.numpy(), t.numpy())
                self.assertIsInstance(got.name, str)
        self.assertEqual(len({t.data_ptr() for t in made}), len(made))
        self.assertEqual(self.reads.empty_like_each([]), [])

    def test_what_it_cannot_make_is_left_to_python(self):
        p = paddle.create_parameter([3, 2], "float32")
        p._clear_data()
        x = paddle.zeros([2, 3])
        cases = [("a tuple", (x,)), ("not a tensor", [x, 3]), ("zero-size", [x, paddle.zeros([0, 3])]),
                 ("uninitialized", [p]), ("4-D (layout autotune may permute its shape)", [paddle.zeros([1, 2, 3, 4])])]
        for label, arg in cases:
            with self.subTest(label):
                self.assertIsNone(self.reads.empty_like_each(arg))


class HandOutReadsTest(unittest.TestCase):
    """versions / unchanged / freed_unchanged (GradPlan's checks of the views it handed out, NOTE [ Reused aliases ]
    and NOTE [ Freed aliases re-pointed ] in grads/hand_out_plan.py) against the same reads in Python."""

    def setUp(self):
        self.reads = loaded()
        self.stack = paddle.to_tensor(np.arange(24, dtype="float32").reshape(3, 8))
        self.views = list(paddle.unbind(self.stack))

    def python(self, views):
        return ([v.data_ptr() for v in views], [v._inplace_version() for v in views])

    def test_versions(self):
        self.views[1].scale_(2.0)  # an in-place op: that view's counter (a stack's views may share one)
        self.assertEqual(self.reads.versions(self.views), [v._inplace_version() for v in self.views])
        self.assertEqual(self.reads.versions(tuple(self.views)), [v._inplace_version() for v in self.views])
        self.assertEqual(self.reads.versions([paddle.Tensor()]), [paddle.Tensor()._inplace_version()])
        self.assertIsNone(self.reads.versions([self.views[0], "not a tensor"]))

    def test_unchanged_as_in_python(self):
        from paddlefleet.cudagraph.grads import hand_out_plan

        def bump(views):
            views[2].scale_(1.0)

        def free(views):
            views[0]._clear_data()

        def reshape(views):
            views[1].reshape_([2, 4])

        for label, change in (("untouched", None), ("changed in place", bump), ("freed", free),
                              ("reshaped in place", reshape)):
            with self.subTest(label):
                views = list(paddle.unbind(paddle.to_tensor(np.ones([3, 8], "float32"))))
                ptrs, versions = self.python(views)
                if change is not None:
                    change(views)
                with native.disabled():
                    want = hand_out_plan._unchanged((views, ptrs, versions))
                self.assertIs(want, change is None)
                self.assertIs(hand_out_plan._unchanged((views, ptrs, versions)), want)
                # a freed view's data_ptr() is None or 0 by Paddle version: left to Python
                self.assertIs(self.reads.unchanged(views, ptrs, versions), None if change is free else want)
        ptrs, versions = self.python(self.views)
        self.assertIs(self.reads.unchanged(self.views, [p + 4 for p in ptrs], versions), False)  # another address
        self.assertIsNone(self.reads.unchanged(self.views, [None] * 3, versions))
        self.assertIsNone(self.reads.unchanged([paddle.Tensor()], [0], [0]))  # no memory: data_ptr() None or 0
        self.assertIsNone(self.reads.unchanged(["not a tensor"], ptrs, versions))

    def test_freed_unchanged(self):
        ptrs, versions = self.python(self.views)
        self.assertIs(self.reads.freed_unchanged(self.views, versions), False)  # not freed
        for v in self.views:
            v._clear_data()
        self.assertIs(self.reads.freed_unchanged(self.views, versions), True)
        self.assertIs(self.reads.freed_unchanged(self.views, [versions[0] + 1] + versions[1:]), False)
        self.assertIs(self.reads.freed_unchanged(self.views + [paddle.Tensor()], versions + [0]), True)
        self.assertIsNone(self.reads.freed_unchanged(self.views + ["not a tensor"], versions + [0]))
        self.assertIsNone(self.reads.freed_unchanged(self.views, versions[:1]))


class KeysWithAndWithoutTest(unittest.TestCase):
    """KeyMaker's keys and is_key_of, made with the module and in Python, are the same."""

    def setUp(self):
        loaded()
        self.keys = KeyMaker(lambda x, y: None, None, bound=False, layers=[])

    def key(self, args):
        return self.keys.key(args, {}, args, positional_spec(args, {}))

    def test_the_same_keys_and_answers(self):
        calls = [(a, b) for (_, a) in tensors()[::5] for (_, b) in tensors()[1::7]]
        calls.append((paddle.zeros([1, 2, 3, 4]), paddle.zeros([2])))  # a tensor left to Python
        for args in calls:
            with native.disabled():
                want = self.key(args)
            self.assertEqual(self.key(args), want)
            spec = positional_spec(args, {})
            for other in calls[:12]:
                with native.disabled():
                    answer = self.keys.is_key_of(want, spec, other)
                self.assertEqual(self.keys.is_key_of(want, spec, other), answer, (args, other))
            self.assertTrue(self.keys.is_key_of(want, spec, args))

    def test_an_uninitialized_argument_raises_as_in_python(self):
        p = paddle.create_parameter([3, 2], "float32")
        p._clear_data()
        with native.disabled():
            with self.assertRaises(Exception) as python:
                self.key((p, p))
        with self.assertRaises(type(python.exception)):
            self.key((p, p))


class CallOfKeyTest(unittest.TestCase):
    """key_of (the tensors, grad mode, autocast and the Layers' training flags of a call against a key, in one
    compiled call) answers as the Python reads answer, through KeyMaker.is_key_of and is_call_of alike."""

    def setUp(self):
        loaded()
        self.layers = [paddle.nn.Linear(2, 2), paddle.nn.Linear(2, 2)]
        self.keys = KeyMaker(lambda *a: None, None, bound=False, layers=self.layers)

    def key(self, args):
        return self.keys.key(args, {}, args, positional_spec(args, {}))

    def answers(self, key, args):
        """is_key_of and is_call_of of ``args`` against ``key``, with the module and in Python."""
        spec = positional_spec(args, None)
        with native.disabled():
            python = (self.keys.is_key_of(key, spec, args), self.keys.is_call_of(key, args))
        return (self.keys.is_key_of(key, spec, args), self.keys.is_call_of(key, args)), python

    def assert_answer(self, key, args, expected, label):
        compiled, python = self.answers(key, args)
        self.assertEqual(compiled, python, label)
        self.assertEqual(compiled, (expected, expected), label)

    def test_each_part_of_the_call(self):
        from paddlefleet.cudagraph.guards.host_marks import mark_host

        x, y = paddle.zeros([2, 3]), paddle.ones([4])
        key = self.key((x, y))
        self.assert_answer(key, (x, y), True, "the call the key was made from")
        self.assert_answer(key, (paddle.zeros([2, 3]), paddle.zeros([4])), True, "other tensors, same metadata")
        self.assert_answer(key, (x,), False, "fewer arguments")
        self.assert_answer(key, (x, y, y), False, "more arguments")
        self.assert_answer(key, (x, 1.0), False, "a number for a tensor")
        self.assert_answer(key, (x, paddle.zeros([5])), False, "another shape")
        self.assert_answer(key, (x, paddle.zeros([4], "float64")), False, "another dtype")
        z = paddle.zeros([4])
        z.stop_gradient = False
        self.assert_answer(key, (x, z), False, "stop_gradient")
        self.assert_answer(key, (y, x), False, "the arguments swapped")
        with paddle.no_grad():
            self.assert_answer(key, (x, y), False, "grad mode off")
            self.assert_answer(self.key((x, y)), (x, y), True, "a key made with grad mode off")
        with tracer_set(list(paddle.base.core.AmpLevel.__members__.values())[-1], "bfloat16"):
            self.assert_answer(key, (x, y), False, "another autocast level")
        self.layers[1].eval()
        self.assert_answer(key, (x, y), False, "a Layer in eval mode")
        evaluating = self.key((x, y))
        self.layers[1].train()
        self.assert_answer(evaluating, (x, y), False, "a key made in eval mode")
        self.keys.track([paddle.nn.Linear(2, 2)])  # a capture added a Layer: a key made before lacks its flag
        self.assert_answer(key, (x, y), False, "a key without the added Layer's flag")
        self.assert_answer(self.key((x, y)), (x, y), True, "a key with it")
        four = paddle.zeros([1, 2, 3, 4])  # left to Python by the module: the same answers
        self.assert_answer(self.key((x, four)), (x, paddle.zeros([1, 2, 3, 4])), True, "a 4-D tensor")
        marked = mark_host(paddle.zeros([4]))  # keyed by value: never a part of a key of tensors by metadata
        self.assert_answer(key, (x, marked), False, "a tensor marked host")

    def test_every_tensor_against_every_key(self):
        calls = [(t,) for _, t in tensors()[::3]]
        for args in calls:
            key = self.key(args)
            for other in calls:
                compiled, python = self.answers(key, other)
                self.assertEqual(compiled, python, (args, other))
            self.assertEqual(self.answers(key, args)[0], (True, True))

    def test_a_layer_without_its_flag_raises_as_in_python(self):
        x = paddle.zeros([2])
        key = self.key((x,))
        del self.layers[0].training
        with native.disabled():
            with self.assertRaises(AttributeError):
                self.keys.is_call_of(key, (x,))
        with self.assertRaises(AttributeError):
            self.keys.is_call_of(key, (x,))


@contextlib.contextmanager
def tracer_set(level, dtype):
    """The tracer's autocast level and dtype set inside (as paddle.amp.auto_cast sets them on a GPU build)."""
    tracer = paddle.base.framework._dygraph_tracer()
    saved = tracer._amp_level, tracer._amp_dtype
    tracer._amp_level, tracer._amp_dtype = level, dtype
    try:
        yield
    finally:
        tracer._amp_level, tracer._amp_dtype = saved


class _Entry:
    """A stand-in entry with what refused_again reads."""

    def __init__(self, phase, graphs, last_used, pending):
        self.phase, self.graphs, self.last_used, self._pending = phase, graphs, last_used, pending

    def backward_pending(self):
        return self._pending


class RefusedAgainTest(unittest.TestCase):
    """refused_again (the front door's read of Places.refused_again for a key refused under max_graphs) answers as
    Places.refused_again answers and remembers the call as it does, over entries of every phase, with and without
    graphs, called before and after the refused key's calls, with a backward pending or not."""

    def test_every_case_as_places_answers(self):
        import collections
        import random

        from paddlefleet.cudagraph.core.budgets import Places
        from paddlefleet.cudagraph.core.entry import Phase

        reads = loaded()
        rng = random.Random(0)
        phases = list(Phase)
        answers = collections.Counter()
        for case in range(600):
            entries = collections.OrderedDict()
            for i in range(rng.randint(0, 4)):
                entries[("k", i)] = _Entry(rng.choice(phases), rng.choice([None, object()]), rng.randint(0, 9),
                                           rng.random() < 0.3)
            ticks = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 2)))
            key, tick, max_graphs = ("refused",), rng.randint(5, 12), rng.randint(0, 4)
            waited = [Places(), Places()]
            for places in waited:
                places._waiting[("other",)] = (1,)
                if ticks:
                    places._waiting[key] = ticks
                places._waiting[("last",)] = (2, 3)
            python = waited[0].refused_again(entries, key, tick, max_graphs)
            compiled = reads.refused_again(waited[1].waiting(), entries, key, tick, max_graphs, Phase.WARMUP,
                                           Phase.REPLAY)
            answers[python] += 1
            self.assertIs(compiled, python, case)
            self.assertEqual(list(waited[1].waiting().items()), list(waited[0].waiting().items()), case)
        self.assertGreater(min(answers[True], answers[False]), 50, answers)  # both answers seen often
        with self.assertRaises(TypeError):
            reads.refused_again([], {}, ("refused",), 1, 1, Phase.WARMUP, Phase.REPLAY)
        for broken in ((), [1]):
            with self.assertRaises(TypeError):
                reads.refused_again({("refused",): broken}, {}, ("refused",), 1, 1, Phase.WARMUP, Phase.REPLAY)
        failing = _Entry(Phase.REPLAY, object(), 0, False)
        failing.backward_pending = lambda: 1 / 0
        with self.assertRaises(ZeroDivisionError):
            reads.refused_again({("refused",): (1, 2)}, {"f": failing}, ("refused",), 3, 1, Phase.WARMUP,
                                Phase.REPLAY)


def python_state():
    from paddlefleet.cudagraph.core.state import amp_state

    return paddle.is_grad_enabled(), amp_state()


class CallStateReadsTest(unittest.TestCase):
    """state(): grad mode and autocast, read from Paddle's tracer in C++, against paddle.is_grad_enabled() and
    amp_state(); keys made and compared with it and in Python are the same."""

    def setUp(self):
        self.reads = loaded()
        self.assertIsNotNone(native.state_read)
        self.levels = list(paddle.base.core.AmpLevel.__members__.values())

    def test_every_grad_mode_level_and_dtype(self):
        for grad in (True, False):
            for level in self.levels:
                for dtype in ("float16", "bfloat16", "float32"):
                    with self.subTest(grad=grad, level=level, dtype=dtype), paddle.set_grad_enabled(grad), \
                            tracer_set(level, dtype):
                        self.assertEqual(native.state_read(), python_state())
        with paddle.no_grad():
            self.assertEqual(native.state_read(), python_state())
            self.assertIs(native.state_read()[0], False)
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):  # whatever it sets on this build
            self.assertEqual(native.state_read(), python_state())
        self.assertEqual(native.state_read(), python_state())

    def test_each_thread_reads_its_own_state(self):
        import threading

        seen = {}

        def other():
            with paddle.no_grad():
                seen["other"] = (native.state_read(), python_state())

        with tracer_set(self.levels[-1], "bfloat16"):
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            here = (native.state_read(), python_state())
        self.assertEqual(seen["other"][0], seen["other"][1])
        self.assertIs(seen["other"][0][0], False)
        self.assertEqual(here[0], here[1])
        self.assertIs(here[0][0], True)

    def test_no_dygraph_tracer_is_left_to_python(self):
        paddle.enable_static()
        try:
            self.assertIsNone(native.state_read())
        finally:
            paddle.disable_static()
        self.assertEqual(native.state_read(), python_state())

    def test_keys_and_answers_with_and_without(self):
        keys = KeyMaker(lambda x: None, None, bound=False, layers=[])
        x = paddle.zeros([2, 3])
        args, spec = (x,), positional_spec((x,), {})
        made = []
        for grad in (True, False):
            for level in self.levels[:2]:
                with paddle.set_grad_enabled(grad), tracer_set(level, "bfloat16"):
                    with native.disabled():
                        want = keys.key(args, {}, args, spec)
                    self.assertEqual(keys.key(args, {}, args, spec), want)
                    made.append((grad, level, want))
        for grad, level, key in made:
            with paddle.set_grad_enabled(grad), tracer_set(level, "bfloat16"):
                for _, _, other in made:
                    with native.disabled():
                        answer = keys.is_key_of(other, spec, args)
                    self.assertIs(keys.is_key_of(other, spec, args), answer)
                    self.assertIs(answer, other is key)

    def test_a_module_that_reads_another_state_is_not_used(self):
        class Wrong:
            def setup_state(self, global_var):
                return True

            def state(self):
                return (not paddle.is_grad_enabled(), (0, "float32"))

        class Unbound(Wrong):
            def setup_state(self, global_var):
                return False

        self.assertIn("the compiled read of grad mode and autocast gave", native._check_state(Wrong()))
        core = paddle.base.core
        amp_level = core.AmpLevel
        del core.AmpLevel  # a Paddle without the enum: checked at its current level only
        try:
            self.assertIsNone(native._check_state(self.reads))
            self.assertIn("the compiled read of grad mode and autocast gave", native._check_state(Wrong()))
        finally:
            core.AmpLevel = amp_level
        self.assertIn("lacks a getter", native._check_state(Unbound()))
        self.assertIsNone(native._check_state(self.reads))


class _Trains:
    """A graphed two-Layer model with matmuls only trains bitwise eager's, the compiled reads on or off; its grads
    freed after every step (``zero``: zeroed, where the views of the last backward are reused)."""

    zero = False

    def train(self, compiled):
        paddle.seed(0)
        graphed, eager = self.twins(lambda: paddle.nn.Sequential(paddle.nn.Linear(8, 8, bias_attr=False),
                                                                 paddle.nn.Linear(8, 4, bias_attr=False)), 3)
        for layer in graphed:
            autocudagraph(layer, backend=self.backend, warmup_steps=1, eager_if_slower=False)
        draw = normal(5)
        context = native.disabled() if not compiled else contextlib.nullcontext()
        with context:
            for step in range(6):
                x, dy = self.tensor(draw(4, 8)), self.tensor(draw(4, 4))
                for model in (graphed, eager):
                    model(x).backward(dy)
                self.assertBitwise([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()],
                                   f"step {step}")
                for model in (graphed, eager):
                    for p in model.parameters():
                        p.clear_gradient(self.zero)
        counters = graphed[0].forward.stats()
        self.assertGreater(counters["replays"], 0, counters)
        plans = graphed[0].forward.entry().graphs.current.plans()
        reused = sum(p.views_reused for p in plans) if self.zero else sum(p.views_repointed for p in plans)
        self.assertGreater(reused, 0, "the views of an earlier backward were handed out again")

    def test_with_the_compiled_reads(self):
        loaded()
        self.train(True)

    def test_with_the_python_reads(self):
        self.train(False)


@for_each_backend
class TrainsTest(_Trains, MatmulOnlyCase):
    pass


@for_each_backend
class ZeroedTrainsTest(_Trains, MatmulOnlyCase):
    kernels = "all"  # clear_gradient(True): Paddle's fill kernel
    zero = True


class DeviceTensorReadsTest(MatmulOnlyCase):
    """GPU tensors read as Python reads them (place key: the device id), where a GPU is present."""

    backend = "cuda"

    def test_gpu_tensors(self):
        reads = loaded()
        if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
            self.skipTest("no GPU")
        for label, t in tensors():
            with self.subTest(label):
                g = t.cuda()  # a copy, no kernel
                if 0 in t.shape:  # no memory: left to Python
                    self.assertIsNone(reads.meta(g))
                    continue
                self.assertEqual(reads.meta(g), key_meta(g))
                self.assertIs(reads.match((g,), (key_meta(t),)), False)  # the CPU tensor's key
                self.assertIs(reads.match((g,), (key_meta(g),)), True)
                self.assertIs(reads.ptrs_hold((g,), [g.data_ptr()]), True)
                self.assertIs(reads.ptrs_hold((g,), [t.data_ptr()]), False)  # the CPU tensor's address
                self.assertIs(reads.flags_hold((g,), [g.stop_gradient]), True)


@contextlib.contextmanager
def fresh_load(**env):
    """Inside: the process as before its first wrapper (nothing loaded), with ``env`` set; the module in use and the
    loader's state are put back after."""
    saved_reads, saved_state_read, saved_state = native.reads, native.state_read, dict(native._state)
    native.reads = native.state_read = None
    native._state.update(loaded=False, why="not loaded yet")
    try:
        with mock.patch.dict(os.environ, env):
            yield
    finally:
        native.reads, native.state_read = saved_reads, saved_state_read
        native._state.clear()
        native._state.update(saved_state)


def first_wrapper():
    """Makes a wrapper (its __init__ loads the module) and returns native.status()."""
    autocudagraph(paddle.nn.Linear(2, 2))
    return native.status()


class LoaderTest(unittest.TestCase):
    """What the first wrapper of a process does about the module: off, built, failed, required."""

    def test_off_keeps_python_reads(self):
        with fresh_load(PADDLEFLEET_CUDAGRAPH_NATIVE="0"):
            self.assertEqual(first_wrapper(), (False, "PADDLEFLEET_CUDAGRAPH_NATIVE=0: tensor reads in Python"))
            self.assertIsNone(native.reads)

    def test_a_bad_value_names_the_variable_and_the_values(self):
        with fresh_load(PADDLEFLEET_CUDAGRAPH_NATIVE="yes"):
            with self.assertRaisesRegex(ValueError, "PADDLEFLEET_CUDAGRAPH_NATIVE='yes': expected one of 0, 1, "
                                                    "require"):
                first_wrapper()

    def test_a_failed_build_falls_back_with_its_reason_or_fails_under_require(self):
        with tempfile.TemporaryDirectory() as cache:
            failing = dict(PADDLEFLEET_CACHE_DIR=cache, CXX="false")  # a "compiler" that exits 1
            with fresh_load(PADDLEFLEET_CUDAGRAPH_NATIVE="1", **failing):
                active, why = first_wrapper()
                self.assertFalse(active)
                self.assertTrue(why.startswith("compiling tensor_reads.cc failed (exit 1)"), why)
            with fresh_load(PADDLEFLEET_CUDAGRAPH_NATIVE="require", **failing):
                with self.assertRaisesRegex(CudaGraphError, r"PADDLEFLEET_CUDAGRAPH_NATIVE=require, but the compiled "
                                                            r"tensor reads are unavailable: compiling tensor_reads.cc "
                                                            r"failed \(exit 1\)"):
                    first_wrapper()
            self.assertEqual(os.listdir(os.path.join(cache, "native")), [], "no partial file left behind")

    def test_built_into_an_empty_cache_then_loaded_from_it(self):
        loaded()  # this machine can build it
        with tempfile.TemporaryDirectory() as cache:
            for _ in range(2):
                with fresh_load(PADDLEFLEET_CUDAGRAPH_NATIVE="require", PADDLEFLEET_CACHE_DIR=cache):
                    self.assertEqual(first_wrapper(), (True, None))
                    x = paddle.zeros([2, 3])
                    self.assertEqual(native.reads.meta(x), key_meta(x))
            built = os.listdir(os.path.join(cache, "native"))
            self.assertEqual(len(built), 1, built)
            self.assertTrue(built[0].startswith("_tensor_reads-"), built)


if __name__ == "__main__":
    unittest.main()
