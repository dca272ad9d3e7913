"""NOTE [ One table of refusals ] in guards/refusals.py: the table, its guide page, each row raised
by the guard that owns it, the tests that show each row on both backends (ROW_TESTS), and the rows
whose cases live here, on both backends (the matmul-only ones also run on a GPU:
tools/gpu_check.py). Every refused case checks eager's results bit for bit, the message's words
and fix from the table, and that the warning names this file's line, never a frame of Paddle or
of an installed package."""

import contextlib
import importlib
import os
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph.guards import refusals
from paddlefleet.cudagraph.backends.simulated import SimulatedBackend
from paddlefleet.cudagraph.guards import location
from testkit.common import MatMLP, build
from testkit.differential import Trainee, differential_run, step_grapher
from testkit.harness import RECORD, BackendCase, MatmulOnlyCase, clone_leaf, for_each_backend, normal
from testkit.step_gpu import MatmulSGD, MatmulStep
from paddlefleet.cudagraph import autocudagraph_step

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.abspath(__file__)


_FAILURES = "tests/block/test_capture_failures.py"
_STEP_FAILURES = "tests/step/test_step_capture_failures.py"
_GUARD_TESTS = "tests/backends/test_host_guard.py"
_MATRIX = ((_FAILURES, "BlockFailures"), (_STEP_FAILURES, "StepFailures"))
_REFUSALS = "tests/backends/test_refusals.py"

#: Per row of the table, the pytest ids (``path::Class::test``) that show it on both backends.
ROW_TESTS = {
    'host read': tuple(f"{path}::{c}::test_{n}" for path, c in _MATRIX
              for n in ("numpy", "item", "float", "bool", "int", "cpu", "print_tensor")),
    'raw tensor read': tuple(f"{path}::{c}::test_{n}" for path, c in _MATRIX
              for n in ("raw_tensor_numpy", "value_raw_tensor_numpy"))
        + (f"{_GUARD_TESTS}::HostGuardTest::test_raw_tensor_reads_and_writes_are_guarded",),
    'host-to-device copy': tuple(f"{path}::{c}::test_{n}" for path, c in _MATRIX
              for n in ("to_tensor_numpy", "to_tensor_host_tensor", "tensor_constructor_numpy", "assign_numpy",
                        "set_value_numpy", "setitem_numpy")),
    'device synchronize': (f"{_FAILURES}::BlockFailures::test_synchronize", f"{_STEP_FAILURES}::StepFailures::test_synchronize",
         f"{_GUARD_TESTS}::HostGuardTest::test_stream_and_event_waits_are_refused"),
    'stream or event wait': (f"{_GUARD_TESTS}::HostGuardTest::test_stream_and_event_waits_are_refused",
         f"{_REFUSALS}::StreamWait::test_waiting_for_the_current_stream_is_refused"),
    'grad assigned': (f"{_STEP_FAILURES}::GradAssignment::test_assigning_a_grad_inside_a_whole_step_is_refused_and_stays_eager_exact",
         f"{_REFUSALS}::GradAssignedInPlace::test_a_grad_assigned_in_place_is_captured_and_bitwise",
         f"{_REFUSALS}::ClipGradNorm::test_clip_grad_norm_in_a_whole_step_is_captured_and_bitwise"),
    'shape from tensor values': (f"{_FAILURES}::BlockFailures::test_value_shaped_op", f"{_STEP_FAILURES}::StepFailures::test_value_shaped_op"),
    'index with a device tensor': ("tests/block/test_footguns.py::FootgunTest::test_ops_whose_output_shape_depends_on_tensor_values_run_eagerly",
         f"{_REFUSALS}::DeviceIndex::test_indexing_with_a_device_tensor_is_refused"),
    'random kernel other than dropout': ("tests/block/test_footguns.py::RecordingCaptureTest::"
         "test_random_kernels_other_than_dropout_run_eagerly_on_cuda",
         f"{_FAILURES}::BlockFailures::test_random_kernel"),
    'recompute with dropout': ("tests/block/test_footguns.py::RecordingCaptureTest::test_recompute_with_dropout_runs_eagerly_on_cuda",
         "tests/grads/test_training.py::RecomputeTest::test_layer_calling_recompute_with_dropout_runs_eagerly_like_eager"),
    'RNG rewound in the function': ("tests/block/test_safety.py::CaptureFailureTest::"
         "test_a_forward_rewinding_the_rng_before_a_draw_is_refused",),
    'tracker dropout without state indices': ("tests/block/test_footguns.py::RecordingCaptureTest::"
         "test_tracker_dropout_inside_the_function_runs_eagerly_without_state_indices",),
    'double backward': (f"{_REFUSALS}::DoubleBackward::test_paddle_grad_with_create_graph_is_refused_by_name",
         f"{_REFUSALS}::DoubleBackward::"
         "test_paddle_grad_with_create_graph_is_refused_by_name_under_a_recording_capture"),
    'leaf that would lose its grad': (f"{_FAILURES}::BlockFailures::test_closure_leaf_needing_grad",
         "tests/block/test_footguns.py::FootgunTest::test_closure_tensor_requiring_grad_runs_eagerly"),
    'input written in place': ("tests/block/test_footguns.py::FootgunTest::test_function_writing_its_input_runs_eagerly",
         "tests/step/test_adopted_inputs.py::AdoptedInputWrittenInPlaceTest::"
         "test_an_input_written_in_place_and_passed_anew_each_call_is_refused"),
    "grad into a step's argument": tuple(f"{_REFUSALS}::ArgumentGrad::test_{n}" for n in (
        "a_batch_requiring_grad_is_refused_and_gets_eagers_grad",
        "the_same_batch_requiring_grad_on_every_step_is_refused",
        "a_batch_computed_before_the_step_is_refused_and_its_layer_gets_eagers_grads",
        "a_parameter_passed_as_an_argument_is_refused_by_this_row")),
    'paddle.amp.GradScaler in a whole step': ("tests/step/test_train_step.py::WholeStepRefusalsTest::test_paddle_grad_scaler_is_refused_by_name",
         f"{_REFUSALS}::PaddleScaler::test_a_scaler_paddle_disabled_is_refused_as_on_a_gpu",
         f"{_REFUSALS}::PaddleScaler::test_a_scaler_paddle_disabled_is_refused_under_a_recording_capture"),
    'grads freed at the end of an accumulation window': (f"{_REFUSALS}::FreedGrads::test_freeing_grads_at_the_end_of_a_window_is_named",),
    'host value that changes between steps': (f"{_STEP_FAILURES}::StepFailures::test_changing_host_value",),
    'Layer attribute changed by the call': tuple(
        f"tests/block/test_frozen_values.py::{c}::test_{n}" for c, n in (
            ("LayerAttributeCases", "an_attribute_changed_by_every_call_is_refused_at_capture"),
            ("LayerAttributeCases", "a_new_tensor_kept_by_every_call_is_refused_at_capture"),
            ("StepValueCases", "a_model_attribute_the_step_changes_is_refused_at_capture"))),
}


class TableTest(unittest.TestCase):
    def test_the_guide_page_is_rendered_from_the_table(self):
        path = os.path.join(REPO, "docs", "guides", "refusals.md")
        with open(path) as fh:
            current = fh.read()
        self.assertEqual(current, refusals.render(),
                         "docs/guides/refusals.md is out of date: write refusals.render() to it")

    def test_every_row_names_tests_that_exist(self):
        names = [r.name for r in refusals.REFUSALS]
        self.assertEqual(len(names), len(set(names)), names)
        self.assertEqual(sorted(ROW_TESTS), sorted(names))
        for r in refusals.REFUSALS:
            self.assertTrue(ROW_TESTS[r.name], r.name)
            for test_id in ROW_TESTS[r.name]:
                path, *parts = test_id.split("::")
                self.assertTrue(os.path.exists(os.path.join(REPO, path)), test_id)
                module = importlib.import_module(path[:-3].replace("/", "."))
                cls, test = parts
                # A class run on every backend may live in its module as its variants only.
                classes = [getattr(module, cls)] if hasattr(module, cls) else [
                    getattr(module, f"{cls}_{b}", None) for b in ("simulate", "cuda")]
                for found in classes:
                    if found is None or not hasattr(found, test):
                        self.fail(f"{r.name}: {test_id} does not exist")



class _Refused:
    """Helpers of the refused cases."""

    def recording(self):
        """A capture that only records: the cuda backend's own, or on the simulated backend its
        stand-in (``capture_executes=False``), which takes the recording capture's paths (what a
        failed capture leaves, RNG) while it still runs the function."""
        if self.backend == "cuda":
            return contextlib.nullcontext()
        return mock.patch.object(SimulatedBackend, "capture_executes", False)

    def setUp(self):
        super().setUp()
        ctx = warnings.catch_warnings(record=True)
        self.caught = ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("always")

    def assertRefusedAsTheTableSays(self, wrapper, name, inside=True):
        """``wrapper`` captured nothing; each capture-failed warning carries the row's message and fix,
        points at the caller's line (this repository's code, never Paddle's or an installed package's)
        and, for a refusal raised inside the function, names its line in this file."""
        r = refusals.row(name)
        self.assertEqual(wrapper.stats()["captures"], 0, wrapper.explain())
        failed = [w for w in self.caught if "capture of key" in str(w.message)]
        self.assertTrue(failed, [str(w.message) for w in self.caught])
        for w in failed:
            text = str(w.message)
            self.assertIn(r.message, text)
            self.assertIn(r.fix, text)
            self.assertTrue(os.path.abspath(w.filename).startswith(REPO + os.sep), w.filename)
            self.assertFalse(location._is_library(w.filename), w.filename)
            self.assertNotIn("site-packages", text)
            if inside:
                self.assertIn(f"(at {HERE}:", text)
        RECORD.notes.append(f"refused as the table's row {name!r} says")


class _NoWait:
    """A stream handle with nothing to wait for (a CPU build has no device stream)."""

    def synchronize(self):
        return None


def _stream(backend):
    if backend == "cuda":
        return paddle.device.current_stream()
    stream = paddle.device.Stream.__new__(paddle.device.Stream)
    stream.stream_base = _NoWait()
    return stream


def linear_sgd_scaler(seed, n_in, n_out):
    """``(Linear, its SGD, a paddle.amp.GradScaler)``, seeded."""
    paddle.seed(seed)
    model = paddle.nn.Linear(n_in, n_out)
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Paddle's "can only be enabled on CUDAPlace" on a CPU
        scaler = paddle.amp.GradScaler(init_loss_scaling=8.0)
    return model, opt, scaler


@for_each_backend
class StreamWait(_Refused, MatmulOnlyCase):
    def test_waiting_for_the_current_stream_is_refused(self):
        """stream.synchronize() inside a graphed function: refused, every call and grad equal to eager."""
        stream = _stream(self.backend)

        def f(x, w):
            y = paddle.matmul(x, w)
            stream.synchronize()
            return paddle.matmul(y, w)

        g = self.graphed(f, warmup_steps=1)
        draw = normal(3)
        for k in range(4):
            a, b, dy = draw(4, 8), draw(8, 8), draw(4, 8)
            outs, grads = [], []
            for fn in (g, f):
                x, w = self.tensor(a, grad=True), self.tensor(b, grad=True)
                y = fn(x, w)
                y.backward(self.tensor(dy))
                outs.append(y)
                grads.append([x.grad, w.grad])
            self.assertBitwise(outs[0], outs[1], f"call {k}")
            self.assertBitwise(grads[0], grads[1], f"call {k} grads")
        self.assertRefusedAsTheTableSays(g, "stream or event wait")


@for_each_backend
class ShapeRead(MatmulOnlyCase):
    def test_int_of_a_paddle_shape_entry_is_captured(self):
        """int(paddle.shape(x)[0]) reads a host tensor on a GPU: captured and replayed on both backends."""
        def f(x, w):
            n = int(paddle.shape(x)[0])
            return paddle.reshape(paddle.matmul(x, w), [n, -1])

        g = self.graphed(f, warmup_steps=1)
        draw = normal(4)
        for k in range(4):
            x, w = self.tensor(draw(4, 8)), self.tensor(draw(8, 8))
            self.assertBitwise(g(x, w), f(x, w), f"call {k}")
        self.assertCounters(g, captures=1, replays=2, eager=0)


@for_each_backend
class DeviceIndex(_Refused, BackendCase):
    def test_indexing_with_a_device_tensor_is_refused(self):
        """x[t] with a 0-D device tensor: refused (Paddle reads t on the host); indexing with a
        paddle.shape entry (a host tensor) is captured."""
        def by_device(x, t):
            return x[t] * 2.0

        def by_shape(x):
            return x[: paddle.shape(x)[0] - 1] * 2.0

        g, h = self.graphed(by_device, warmup_steps=1), self.graphed(by_shape, warmup_steps=1)
        for k in range(3):
            x, t = paddle.randn([4, 3]), paddle.to_tensor(k % 4)
            self.assertBitwise(g(x, t), by_device(x, t), f"call {k}")
            self.assertBitwise(h(x), by_shape(x), f"call {k}")
        self.assertRefusedAsTheTableSays(g, "index with a device tensor")
        self.assertCounters(h, captures=1, replays=1, eager=0)


@for_each_backend
class DoubleBackward(_Refused, BackendCase):
    def test_paddle_grad_with_create_graph_is_refused_by_name(self):
        """The message names create_graph (not leaves that are neither arguments nor parameters); every
        output and grad equals eager's."""
        self.check_double_backward(contextlib.nullcontext())

    def test_paddle_grad_with_create_graph_is_refused_by_name_under_a_recording_capture(self):
        self.check_double_backward(self.recording())

    def check_double_backward(self, capture_kind):
        def f(x, w):
            u = (paddle.matmul(x, w) ** 2).sum()
            (gx,) = paddle.grad(u, x, create_graph=True)
            return gx * 1.0

        g = self.graphed(f, warmup_steps=1)
        for k in range(3):
            x, w = paddle.randn([4, 3]), paddle.randn([3, 3])
            x.stop_gradient = w.stop_gradient = False
            x_e, w_e = clone_leaf(x), clone_leaf(w)
            with capture_kind:
                y = g(x, w)
            y_e = f(x_e, w_e)
            y.sum().backward()
            y_e.sum().backward()
            self.assertBitwise([y, x.grad, w.grad], [y_e, x_e.grad, w_e.grad], f"call {k}")
        self.assertRefusedAsTheTableSays(g, "double backward")
        self.assertNotIn("neither arguments nor parameters", " ".join(g.stats()["eager_reasons"]))

    def test_create_graph_whose_grads_need_no_grad_is_captured(self):
        """Under no_grad for the result (detached grads), paddle.grad(create_graph=True) is an ordinary op."""
        def f(x, w):
            x = x.detach()
            x.stop_gradient = False
            (gx,) = paddle.grad((paddle.matmul(x, w) ** 2).sum(), x, create_graph=False)
            return gx

        g = self.graphed(f, warmup_steps=1)
        w = paddle.randn([3, 3])
        for k in range(3):
            x = paddle.randn([4, 3])
            self.assertBitwise(g(x, w), f(x, w), f"call {k}")
        self.assertCounters(g, captures=1, replays=1, eager=0)


def _matmul_step(assign_grads):
    """A MatMLP step with an explicit dy and a matmul SGD; ``assign_grads`` rebinds every p.grad
    to (0.5 I) @ p.grad before the update (a matmul, then Paddle's grad setter)."""
    def make():
        model = build(lambda: MatMLP([8, 8, 8]), 17)
        params = list(model.parameters())
        opt = MatmulSGD(params, 0.125)
        half = paddle.to_tensor(np.eye(8, dtype="float32") * 0.5)

        def step(x, dy):
            y = model(x)
            y.backward(dy)
            if assign_grads:
                for p in params:
                    p.grad = paddle.matmul(half, p.grad)
            opt.step()
            opt.clear_grad()
            return y

        return Trainee(step, {"model": model})

    return make


@for_each_backend
class GradAssignedInPlace(MatmulOnlyCase):
    def test_a_grad_assigned_in_place_is_captured_and_bitwise(self):
        """p.grad = t onto a grad of t's shape is Paddle's in-place copy: captured, and model state
        equals eager after every step."""
        steps = []

        graph = step_grapher(steps, warmup_steps=1, backend=self.backend)

        draw = normal(21)
        batches = [(self.tensor(draw(4, 8)), self.tensor(draw(4, 8, scale=0.1))) for _ in range(5)]
        differential_run(_matmul_step(True), batches, graph)
        self.assertCounters(steps[0], captures=1, replays=3, eager=0)


@for_each_backend
class ClipGradNorm(BackendCase):
    def test_clip_grad_norm_in_a_whole_step_is_captured_and_bitwise(self):
        """paddle.nn.utils.clip_grad_norm_ (Paddle 2.6 assigns p.grad, 3.x multiplies in place) and SGD:
        captured, every step equal to eager."""
        def make():
            paddle.seed(5)
            model = paddle.nn.Linear(6, 4)
            opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())

            def step(x):
                loss = model(x).square().mean()
                loss.backward()
                paddle.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
                opt.step()
                opt.clear_grad()
                return loss

            return Trainee(step, {"model": model, "opt": opt})

        steps = []

        graph = step_grapher(steps, warmup_steps=1, backend=self.backend)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(make, [paddle.randn([3, 6]) for _ in range(5)], graph)
        # Two warmup steps: the first makes the optimizer's learning-rate tensor.
        self.assertCounters(steps[0], warmup_calls=2, captures=1, replays=2, eager=0)
        self.assertFalse([w for w in caught if "capture of key" in str(w.message)], [str(w.message) for w in caught])


@for_each_backend
class PaddleScaler(_Refused, BackendCase):
    def test_a_scaler_paddle_disabled_is_refused_as_on_a_gpu(self):
        """paddle.amp.GradScaler() inside a whole step is refused whether Paddle enabled it (a GPU) or
        turned it off (a CPU place): both backends say what a GPU says."""
        self.check_scaler(contextlib.nullcontext())

    def test_a_scaler_paddle_disabled_is_refused_under_a_recording_capture(self):
        """The same through a recording capture: the grads its backward bound are taken back."""
        self.check_scaler(self.recording())

    def check_scaler(self, capture_kind):
        def make():
            model, opt, scaler = linear_sgd_scaler(6, 6, 4)

            def step(x):
                loss = model(x).square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.clear_grad()
                return loss

            return Trainee(step, {"model": model, "opt": opt})

        steps = []

        graph = step_grapher(steps, warmup_steps=1, backend=self.backend)

        with capture_kind:
            differential_run(make, [paddle.randn([3, 6]) for _ in range(4)], graph)
        self.assertRefusedAsTheTableSays(steps[0], "paddle.amp.GradScaler in a whole step")


@for_each_backend
class ArgumentGrad(_Refused, MatmulOnlyCase):
    """A whole step whose backward reaches one of its tensor arguments: eagerly the grad goes to the caller's
    tensor, in the capture to the argument's buffer. Refused as the table's row says, every step equal to
    eager's, the arguments' grads included; ``paddle.grad`` of an argument and an argument the backward does
    not reach are captured."""

    def check_batches(self, same_batch):
        """MatmulStep (update, grads released) given a batch requiring grad, a new one per step or the same one
        (its grad released between steps, as a fill or add kernel may not run on the GPU): output, parameters and
        the batch's grad bitwise against eager after every step."""
        draw = normal(23)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())
        graphed = autocudagraph_step(MatmulStep(model, 0.1), optimizers=[], warmup_steps=1, backend=self.backend)
        eager = MatmulStep(twin, 0.1)
        xg = xe = None
        for k in range(5):
            if xg is None or not same_batch:
                xn = draw(4, 8)
                xg, xe = self.tensor(xn, grad=True), self.tensor(xn, grad=True)
            else:
                xg.clear_gradient(False)
                xe.clear_gradient(False)
            dyn = draw(4, 8)
            self.assertBitwise(graphed(xg, self.tensor(dyn)), eager(xe, self.tensor(dyn)), f"step {k} output")
            self.assertIsNotNone(xe.grad)
            self.assertBitwise(xg.grad, xe.grad, f"step {k} grad of the batch")
            self.assertBitwise(list(model.parameters()), list(twin.parameters()), f"step {k} parameters")
        self.assertRefusedAsTheTableSays(graphed, "grad into a step's argument", inside=False)
        self.assertIn("argument(s) 'x'", " ".join(str(w.message) for w in self.caught))

    def test_a_batch_requiring_grad_is_refused_and_gets_eagers_grad(self):
        self.check_batches(same_batch=False)

    def test_the_same_batch_requiring_grad_on_every_step_is_refused(self):
        self.check_batches(same_batch=True)

    def test_a_batch_computed_before_the_step_is_refused_and_its_layer_gets_eagers_grads(self):
        """x = pre(raw) outside the step, step(x, dy): eagerly the step's backward goes on through x into pre's
        parameters; the capture's would stop at x's buffer. Refused; pre's grads bitwise against eager."""
        draw = normal(26)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())
        pre, pre_twin = MatMLP([8, 8]), MatMLP([8, 8])
        pre_twin.set_state_dict(pre.state_dict())
        graphed = autocudagraph_step(MatmulStep(model, 0.1), optimizers=[], warmup_steps=1, backend=self.backend)
        eager = MatmulStep(twin, 0.1)
        for k in range(5):
            rawn, dyn = draw(4, 8), draw(4, 8)
            self.assertBitwise(graphed(pre(self.tensor(rawn)), self.tensor(dyn)),
                               eager(pre_twin(self.tensor(rawn)), self.tensor(dyn)), f"step {k} output")
            self.assertIsNotNone(pre_twin.parameters()[0].grad)
            self.assertBitwise([p.grad for p in pre.parameters()], [p.grad for p in pre_twin.parameters()],
                               f"step {k} grads of the Layer before the step")
            self.assertBitwise(list(model.parameters()), list(twin.parameters()), f"step {k} parameters")
            for p in pre.parameters() + pre_twin.parameters():
                p.clear_gradient(False)
        self.assertRefusedAsTheTableSays(graphed, "grad into a step's argument", inside=False)

    def test_a_parameter_passed_as_an_argument_is_refused_by_this_row(self):
        """step(x, dy, w) with w a parameter the step updates: eagerly its grad is the parameter's, in the capture
        the buffer's (the update would skip it). Refused by this row, not as a host value that changes (the capture
        reads the parameter through its buffer where the warmup read it as an argument)."""
        draw = normal(24)
        model, twin = MatMLP([8, 8]), MatMLP([8, 8])
        twin.set_state_dict(model.state_dict())

        def make(m):
            [w] = m.parameters()
            opt = MatmulSGD([w], 0.1)

            def step(x, dy, weight):
                y = paddle.matmul(x, weight)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            return step, w

        (graphed_fn, wg), (eager, we) = make(model), make(twin)
        graphed = autocudagraph_step(graphed_fn, optimizers=[], warmup_steps=1, backend=self.backend)
        for k in range(5):
            xn, dyn = draw(4, 8), draw(4, 8)
            self.assertBitwise(graphed(self.tensor(xn), self.tensor(dyn), wg),
                               eager(self.tensor(xn), self.tensor(dyn), we), f"step {k} output")
            self.assertBitwise(wg, we, f"step {k} parameter")
        self.assertRefusedAsTheTableSays(graphed, "grad into a step's argument", inside=False)
        texts = " ".join(str(w.message) for w in self.caught)
        self.assertIn("argument(s) 'weight'", texts)
        self.assertNotIn("host value", texts)

    def test_paddle_grad_of_an_argument_and_an_argument_not_reached_are_captured(self):
        """A step returning paddle.grad of its batch (a saliency map), and one given a second tensor requiring grad
        its backward does not reach: captured, replayed, bitwise against eager, the arguments left without grads."""
        draw = normal(25)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())

        def make(m):
            def step(x, dy, unused):
                y = m(x)
                (gx,) = paddle.grad([y], [x], [dy])
                return y, gx

            return step

        graphed = autocudagraph_step(make(model), optimizers=[], warmup_steps=1, backend=self.backend)
        eager = make(twin)
        for k in range(5):
            xn, dyn, un = draw(4, 8), draw(4, 8), draw(4, 8)
            args_g = (self.tensor(xn, grad=True), self.tensor(dyn), self.tensor(un, grad=True))
            args_e = (self.tensor(xn, grad=True), self.tensor(dyn), self.tensor(un, grad=True))
            self.assertBitwise(graphed(*args_g), eager(*args_e), f"step {k} output")
            self.assertBitwise([t.grad for t in args_g], [t.grad for t in args_e], f"step {k} grads of the arguments")
            self.assertBitwise([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()],
                               f"step {k} grads of the parameters")
        self.assertCounters(graphed, captures=1, replays=3, eager=0)
        self.assertFalse([w for w in self.caught if "capture of key" in str(w.message)],
                         [str(w.message) for w in self.caught])


@for_each_backend
class FreedGrads(_Refused, BackendCase):
    def test_freeing_grads_at_the_end_of_a_window_is_named(self):
        """Accumulation over two micro-batches, grads freed with clear_grad(set_to_zero=False) when the
        optimizer steps: both keys run eagerly naming the clear, its line and the fix; state equals eager."""
        def make():
            paddle.seed(7)
            model = paddle.nn.Linear(4, 4)
            opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())

            def step(x, boundary):
                loss = model(x).square().mean()
                loss.backward()
                if boundary:
                    opt.step()
                    opt.clear_grad(set_to_zero=False)
                return loss

            return Trainee(step, {"model": model, "opt": opt})

        steps = []

        graph = step_grapher(steps, warmup_steps=1, backend=self.backend)

        differential_run(make, [(paddle.randn([2, 4]), i % 2 == 1) for i in range(10)], graph)
        self.assertRefusedAsTheTableSays(steps[0], "grads freed at the end of an accumulation window", inside=False)
        texts = " ".join(str(w.message) for w in self.caught)
        self.assertIn(f"(at {HERE}:", texts)  # the line of the freeing clear
        self.assertNotIn("Create parameters", texts)


class UserLineTest(unittest.TestCase):
    def test_frames_of_installed_packages_are_never_the_users_line(self):
        """A wrapper generated in an installed package (Paddle 2.6 runs clip_grad_norm_ through the
        decorator package) is skipped: the user's own line is named."""
        fake = os.path.join(os.path.dirname(os.__file__), "site-packages", "decorator", "__init__.py")
        namespace = {}
        exec(compile("def fun(f):\n    return f()\n", fake, "exec"), namespace)

        def boom():
            raise RuntimeError("refused")

        try:
            namespace["fun"](boom)
        except RuntimeError as err:
            where = location.user_location(err.__traceback__)
        self.assertEqual(where, f"{HERE}:{boom.__code__.co_firstlineno + 1} in boom")

    def test_an_installed_package_is_named_where_no_user_frame_is_on_the_stack(self):
        fake = os.path.join(os.path.dirname(os.__file__), "site-packages", "somelib", "model.py")
        namespace = {}
        exec(compile("def forward():\n    raise RuntimeError('refused')\n", fake, "exec"), namespace)
        try:
            namespace["forward"]()
        except RuntimeError as err:
            tb = err.__traceback__.tb_next  # from the package's frame on: no frame of this file
            self.assertEqual(location.user_location(tb), f"{fake}:2 in forward")


if __name__ == "__main__":
    unittest.main()
