"""The capture-failure matrix: every reason a capture is refused or fails x {block, whole step} x
{simulate, cuda}. Each case expects what eager gives: every output, grad and parameter bitwise equal
to an eager twin, no exception (except the function's own, which reaches the caller once), no capture
left open, and a process that exits 0 (the subprocess cases; an abort at exit is how a capture left
open shows on a GPU).

The cases are matmul-only (NOTE [ Kernel-less GPUs ] in testkit/common.py): tools/gpu_check.py runs
them on a real GPU. A case whose eager run needs more of Paddle's kernels says so and is skipped, with
that reason, on a GPU whose Paddle lacks them. Numpy arguments (NOTE [ Numpy arguments ] in
io/nested.py) are tested at the end.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import types
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import CudaGraphError, autocudagraph_step, is_capturing
from paddlefleet.cudagraph.backends import cuda as cuda_backend
from paddlefleet.cudagraph.backends import cuda_driver
from paddlefleet.cudagraph.backends.host_guard import host_guard
from paddlefleet.cudagraph.backends.host_marks import is_marked_host
from paddlefleet.cudagraph.backends import is_own_error, own_error
from paddlefleet.cudagraph.errors import CaptureError
from testkit.common import MatMLP, build, cuda_skip_reason
from testkit.differential import Trainee, assert_same_state, differential_run, state_of
from testkit.harness import RECORD, MatmulOnlyCase, backend_variants, normal
from testkit.step_gpu import MatmulSGD

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = np.full((8, 8), 0.25, "float32")  # host data the functions read


class Boom(ValueError):
    """The function's own exception."""


def _scalar(y, u, v):
    # u: [1, 4], v: [8, 1]: gemms (a vector matmul runs Paddle's own reduction kernel), then a 0-D view
    return paddle.reshape(paddle.matmul(paddle.matmul(u, y), v), [])


def _host_tensor():
    return paddle.to_tensor(HOST, place=paddle.CPUPlace())


_LEAVES = {}


def _closure_leaf():
    """A leaf needing grad that the function uses without receiving it (made at the first, eager, call)."""
    device = paddle.get_device()
    if device not in _LEAVES:
        _LEAVES[device] = paddle.to_tensor(HOST, stop_gradient=False)
    return _LEAVES[device]


_KNOB = [1.0]  # a host value the training loop changes between steps (StepFailures.check)


def _changing_host_value(y, u, v):
    return paddle.matmul(y, paddle.full([8, 8], _KNOB[0]))  # its value is a kernel argument


def _set_value_numpy(y, u, v):
    t = paddle.zeros([8, 8])
    t.set_value(HOST)
    return paddle.matmul(y, t)


# name -> (inject(y, u, v) -> tensor like y, what the refusal names, backends, kernels the eager run needs).
# Each inject does one thing a capture cannot take, then returns a tensor computed from y by matmuls.
CASES = {
    "numpy": (lambda y, u, v: (y.numpy(), y)[1], "Tensor.numpy()", ("simulate", "cuda"), "matmul"),
    "item": (lambda y, u, v: (_scalar(y, u, v).item(), y)[1], "Tensor.item()", ("simulate", "cuda"), "matmul"),
    "float": (lambda y, u, v: (float(_scalar(y, u, v)), y)[1], "Tensor.__float__()", ("simulate", "cuda"), "matmul"),
    "bool": (lambda y, u, v: (bool(_scalar(y, u, v)), y)[1], "Tensor.__bool__()", ("simulate", "cuda"), "matmul"),
    "int": (lambda y, u, v: (int(_scalar(y, u, v)), y)[1], "Tensor.__int__()", ("simulate", "cuda"), "matmul"),
    "cpu": (lambda y, u, v: (y.cpu(), y)[1], "Tensor.cpu()", ("simulate", "cuda"), "matmul"),
    "print": (lambda y, u, v: (print(y.numpy().shape), y)[1], "Tensor.numpy()", ("simulate", "cuda"), "matmul"),
    "print_tensor": (lambda y, u, v: (print(y), y)[1], "Tensor.numpy()", ("simulate", "cuda"), "matmul"),
    "to_tensor_numpy": (lambda y, u, v: paddle.matmul(y, paddle.to_tensor(HOST)), "paddle.to_tensor() of a numpy array",
                        ("simulate", "cuda"), "matmul"),
    "to_tensor_host_tensor": (lambda y, u, v: paddle.matmul(y, paddle.to_tensor(_host_tensor())),
                              "paddle.to_tensor() of a host tensor", ("simulate", "cuda"), "matmul"),
    "cuda_of_host_tensor": (lambda y, u, v: paddle.matmul(y, _host_tensor().cuda()), "Tensor.cuda()", ("cuda",),
                            "matmul"),
    "assign_numpy": (lambda y, u, v: paddle.matmul(y, paddle.assign(HOST)), "paddle.assign() of a numpy array",
                     ("simulate", "cuda"), "all"),
    "synchronize": (lambda y, u, v: (paddle.device.cuda.synchronize(), y)[1], "synchronize()", ("cuda",), "matmul"),
    "value_shaped_op": (lambda y, u, v: y + 0 * paddle.nonzero(y).shape[0], "paddle.nonzero()", ("simulate", "cuda"),
                        "all"),
    "random_kernel": (lambda y, u, v: y + 0 * paddle.rand([1]), "random kernel", ("cuda",), "all"),
    "set_value_numpy": (_set_value_numpy, "Tensor.set_value() of a numpy array", ("simulate", "cuda"), "all"),
    "closure_leaf_needing_grad": (lambda y, u, v: paddle.matmul(y, _closure_leaf()), "neither arguments nor "
                                  "parameters", ("simulate", "cuda"), "all"),  # the leaf's grads add up
    "changing_host_value": (_changing_host_value, "host value that changes", ("simulate", "cuda"), "all"),
}


class FailureCase(MatmulOnlyCase):
    """Helpers shared by the block and the step matrix."""

    #: Cases that are not refusals of this kind of call (``{name: why}``).
    not_here = {}

    def setUp(self):
        super().setUp()
        ctx = warnings.catch_warnings(record=True)
        self.caught = ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("always")

    def case(self, name):
        if name in self.not_here:
            self.skipTest(self.not_here[name])
        inject, names, backends, kernels = CASES[name]
        if self.backend not in backends:
            self.skipTest(f"{name}: not a refusal on the {self.backend} backend (its eager run differs there)")
        if self.backend == "cuda" and kernels == "all":
            reason = cuda_skip_reason("all")
            if reason:
                self.skipTest(f"{name}: its eager run needs Paddle's own kernels: {reason}")
        return inject, names

    def assertClean(self):
        """No capture left open, in our flag and in Paddle's."""
        self.assertFalse(is_capturing())
        if self.backend == "cuda":
            from paddle.base import core

            self.assertFalse(core.is_cuda_graph_capturing(), "Paddle still believes a capture is open")

    def assertFellBack(self, wrapper, names):
        stats = wrapper.stats()
        self.assertEqual(stats["captures"], 0, wrapper.explain())
        reasons = " ".join(stats["eager_reasons"])
        self.assertIn(names, reasons, wrapper.explain())
        RECORD.notes.append(f"refused naming {names}: captures=0, eager calls={stats['eager_calls']}")

    def assertHealthy(self):
        """A fresh wrapper captures and replays after the failure: nothing was left behind."""
        def mm(x, w):
            return paddle.matmul(x, w)

        g = self.graphed(mm, warmup_steps=1)
        draw = normal(99)
        for _ in range(3):
            x, w = self.tensor(draw(4, 8)), self.tensor(draw(8, 8))
            self.assertBitwise(g(x, w), mm(x, w), "a later wrapper")
        stats = g.stats()
        self.assertEqual((stats["captures"], stats["replays"]), (1, 1), g.explain())
        RECORD.notes.append("then a new wrapper captured and replayed")


class BlockFailures(FailureCase):
    """A graphed function ``inject(x @ w)``: every call and every grad equals eager's."""

    not_here = {"changing_host_value": "a block bakes Python values in at capture (docs/guides/limitations.md); "
                                       "verify_replays checks them"}

    def check(self, name):
        inject, names = self.case(name)

        def f(x, w, u, v):
            return inject(paddle.matmul(x, w), u, v)

        g = self.graphed(f, warmup_steps=1)
        draw = normal(5)
        for k in range(4):
            arrays = [draw(4, 8), draw(8, 8), draw(1, 4), draw(8, 1)]
            dy = draw(4, 8)
            outs, grads = [], []
            for fn in (g, f):
                x, w = self.tensor(arrays[0], grad=True), self.tensor(arrays[1], grad=True)
                y = fn(x, w, self.tensor(arrays[2]), self.tensor(arrays[3]))
                y.backward(self.tensor(dy))
                outs.append(y)
                grads.append([x.grad, w.grad])
            self.assertBitwise(outs[0], outs[1], f"{name} call {k} y")
            self.assertBitwise(grads[0], grads[1], f"{name} call {k} grads")
            self.assertClean()
        self.assertFellBack(g, names)
        self.assertHealthy()

    def test_function_error_reaches_the_caller_once(self):
        """The function's own exception during the capture call is raised to the caller once (not re-run);
        the key captures on its next call and replays equal to eager."""
        calls = []

        def f(x, w):
            calls.append(1)
            if len(calls) == 2:
                raise Boom("the function's own error")
            return paddle.matmul(x, w)

        g = self.graphed(f, warmup_steps=1)
        draw = normal(6)
        x, w = self.tensor(draw(4, 8)), self.tensor(draw(8, 8))
        g(x, w)
        with self.assertRaisesRegex(Boom, "the function's own error"):
            g(x, w)
        self.assertEqual(len(calls), 2, "the failing call ran the function once")
        self.assertClean()
        for _ in range(3):
            self.assertBitwise(g(x, w), paddle.matmul(x, w), "after the error")
        self.assertEqual(g.stats()["captures"], 1, g.explain())
        self.assertFalse([w for w in self.caught if "Boom" in str(w.message)], "reported as a capture failure")


class NestedCallError(MatmulOnlyCase):
    def test_function_error_after_a_nested_graphed_call_reaches_the_caller_once(self):
        """A graphed call inside the function (it runs eagerly there) does not make the function's own
        exception look like a refusal of the capture."""
        calls = []

        def inner(x, w):
            return paddle.matmul(x, w)

        nested = self.graphed(inner, warmup_steps=0)

        def outer(x, w):
            calls.append(1)
            y = nested(x, w)
            if len(calls) == 2:
                raise Boom("after the nested call")
            return y

        g = self.graphed(outer, warmup_steps=1)
        draw = normal(12)
        x, w = self.tensor(draw(4, 8)), self.tensor(draw(8, 8))
        g(x, w)
        with self.assertRaisesRegex(Boom, "after the nested call"):
            g(x, w)
        self.assertEqual(len(calls), 2, "not re-run")
        self.assertBitwise(g(x, w), inner(x, w))


class StepFailures(FailureCase):
    """A whole training step (a MatMLP, an explicit dy, a matmul-made SGD update) with ``inject``
    after the forward: every output and all model state (testkit.differential) equals eager's."""

    not_here = {"random_kernel": "a whole step keeps random kernels (docs/guides/train_step.md); blocks refuse them on cuda",
                "closure_leaf_needing_grad": "a whole step runs its own backward: any leaf gets its grad as in eager"}

    #: Cases refused only once the step has run (the capture's trace is compared at its end): their
    #: update goes through paddle.optimizer.SGD in optimizers=, which a refused simulated capture takes back.
    refused_at_the_end = ("changing_host_value",)

    def build(self, inject, paddle_sgd=False):
        def make():
            model = build(lambda: MatMLP([8, 8, 8]), 11)
            if paddle_sgd:
                opt = paddle.optimizer.SGD(0.125, parameters=model.parameters())
            else:
                opt = MatmulSGD(model.parameters(), 0.125)

            def step(x, u, v, dy):
                y = inject(model(x), u, v)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y

            objects = {"model": model, "opt": opt} if paddle_sgd else {"model": model}
            return Trainee(step, objects)

        return make

    def batches(self, n=4):
        draw = normal(7)
        return [tuple(self.tensor(a) for a in (draw(4, 8), draw(1, 4), draw(8, 1), draw(4, 8))) for _ in range(n)]

    def check(self, name):
        inject, names = self.case(name)
        wrappers = []

        late = name in self.refused_at_the_end

        def graph(trainee):
            optimizers = [trainee.objects["opt"]] if late else []
            wrappers.append(autocudagraph_step(trainee.step, optimizers=optimizers, warmup_steps=1,
                                               backend=self.backend))
            return wrappers[0]

        def after_step(*_):
            self.assertClean()
            _KNOB[0] += 1.0

        _KNOB[0] = 1.0
        eager, _ = differential_run(self.build(inject, paddle_sgd=late), self.batches(), graph, after_step=after_step)
        RECORD.notes.append(f"4 steps: outputs and {len(state_of(eager.objects))} state entries bitwise equal "
                            "after each (testkit.differential)")
        self.assertFellBack(wrappers[0], names)
        self.assertHealthy()

    def test_function_error_reaches_the_caller_once(self):
        """The step's own exception during its capture call is raised to the caller once; the next step
        captures, and all state stays equal to an eager twin that raised at the same step."""
        def raising_at_step_1():
            calls = []

            def inject(y, u, v):
                calls.append(1)
                if len(calls) == 2:  # step 1: the graphed twin's capture call
                    raise Boom("the step's own error")
                return y

            return inject

        eager, graphed = self.build(raising_at_step_1())(), self.build(raising_at_step_1())()
        step = autocudagraph_step(graphed.step, optimizers=[], warmup_steps=1, backend=self.backend)
        for i, batch in enumerate(self.batches(5)):
            results = []
            for fn in (eager.step, step):
                try:
                    results.append(fn(*batch))
                except Boom:
                    results.append("raised")
            self.assertBitwise(results[1], results[0], f"step {i} output")
                # Both twins raised at step 1 before their update: the capture left no trace either.
            assert_same_state(state_of(graphed.objects), state_of(eager.objects), f"after step {i}")
            self.assertClean()
        self.assertEqual(step.stats()["captures"], 1, step.explain())


def _matrix_test(name):
    def test(self):
        self.check(name)

    _, names, backends, kernels = CASES[name]
    need = " (needs Paddle's own kernels on a GPU)" if kernels == "all" else ""
    test.__doc__ = f"{name}: refused ({names}) on {', '.join(backends)}, every result equal to eager{need}."
    return test


for _name in CASES:
    setattr(BlockFailures, f"test_{_name}", _matrix_test(_name))
    setattr(StepFailures, f"test_{_name}", _matrix_test(_name))


# ----------------------------------------------------------------------------- a fresh process
_SCRIPT = textwrap.dedent('''
    import sys, warnings
    import numpy.random
    import numpy as np
    import paddle
    from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
    from testkit.common import device
    warnings.simplefilter("ignore")
    backend = sys.argv[1]
    A = np.full((8, 8), 0.25, "float32")
    with device("gpu" if backend == "cuda" else "cpu"):
        def f(x, w):
            y = paddle.matmul(x, w)
            y.numpy()
            return paddle.matmul(y, paddle.to_tensor(A))
        g = autocudagraph(f, backend=backend, warmup_steps=1)
        s = autocudagraph_step(f, optimizers=[], backend=backend, warmup_steps=1)
        x = paddle.to_tensor(np.ones((4, 8), "float32"))
        w = paddle.to_tensor(np.eye(8, dtype="float32"))
        for wrapper in (g, s):
            for _ in range(4):
                assert wrapper(x, w).numpy().tobytes() == f(x, w).numpy().tobytes()
            assert wrapper.stats()["captures"] == 0, wrapper.explain()
    print("CONTAINED")
''')


# A capture broken on the device itself: the guard is switched off in the child, so the host read
# and the host-to-device copy reach CUDA inside the capture (error 900/906 on a GPU), and NOTE
# [ Ending a broken capture ] in backends/cuda.py must leave Paddle and the stream usable.
_BROKEN_SCRIPT = textwrap.dedent('''
    import contextlib, sys, warnings
    import numpy.random
    import numpy as np
    import paddle
    from paddlefleet.cudagraph import autocudagraph
    from paddlefleet.cudagraph.backends import cuda as cuda_backend
    from testkit.common import device
    warnings.simplefilter("ignore")
    cuda_backend.host_guard = lambda *args, **kwargs: contextlib.nullcontext()  # the guard off
    A = np.full((8, 8), 0.25, "float32")
    with device("gpu"):
        def read(x, w):
            y = paddle.matmul(x, w)
            y.numpy()
            return paddle.matmul(y, w)
        def copy(x, w):
            return paddle.matmul(paddle.matmul(x, w), paddle.to_tensor(A))
        x = paddle.to_tensor(np.ones((4, 8), "float32"))
        w = paddle.to_tensor(np.eye(8, dtype="float32") * 0.5)
        for f in (read, copy):
            g = autocudagraph(f, backend="cuda", warmup_steps=1)
            for _ in range(4):
                assert g(x, w).numpy().tobytes() == f(x, w).numpy().tobytes()
            assert g.stats()["captures"] == 0, g.explain()
        ok = autocudagraph(lambda x, w: paddle.matmul(x, w), backend="cuda", warmup_steps=1)
        for _ in range(4):  # a later capture in the same process still works
            assert ok(x, w).numpy().tobytes() == paddle.matmul(x, w).numpy().tobytes()
        assert ok.stats()["replays"] == 2, ok.explain()
    print("CONTAINED")
''')


class ProcessExit(MatmulOnlyCase):
    def test_failed_captures_leave_a_process_that_exits_0(self):
        """A host read and a host copy inside a block and a whole step, in a fresh process: results equal
        eager, and the process exits 0 (a capture left open aborts it at exit on a GPU)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, self.backend], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        tail = (proc.stdout + proc.stderr)[-3000:]
        self.assertEqual(proc.returncode, 0, tail)
        self.assertIn("CONTAINED", proc.stdout, tail)
        RECORD.notes.append("results equal eager, no capture, exit code 0")

    def test_a_capture_broken_on_the_device_is_ended_and_the_process_exits_0(self):
        """With the host guard off in a fresh process, a host read and a host copy reach CUDA inside the
        capture and break it on the device: each capture is ended, results equal eager, a later key still
        captures and replays, and the process exits 0."""
        if self.backend != "cuda":
            self.skipTest("needs a device capture to break; the simulated backend's refusals are the rows above")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)
        proc = subprocess.run([sys.executable, "-c", _BROKEN_SCRIPT], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        tail = (proc.stdout + proc.stderr)[-3000:]
        self.assertEqual(proc.returncode, 0, tail)
        self.assertIn("CONTAINED", proc.stdout, tail)
        RECORD.notes.append("broken on the device, ended, results equal eager, later capture works, exit code 0")


# ----------------------------------------------------------------------------- the guard itself
class HostGuardTest(unittest.TestCase):
    """NOTE [ Host access during capture ] in backends/host_guard.py, directly."""

    def entry_points(self):
        tensor = {name: paddle.Tensor.__dict__.get(name) for name in dir(paddle.Tensor)}
        modules = [(m, n, m.__dict__.get(n)) for m in (paddle, paddle.tensor, paddle.tensor.creation)
                   for n in ("to_tensor", "assign")]
        return tensor, modules, paddle.device.__dict__.get("synchronize")

    def test_everything_patched_is_restored_also_after_a_refusal(self):
        before = self.entry_points()
        with self.assertRaises(CaptureError):
            with host_guard(is_marked_host):
                paddle.ones([2]).numpy()
        self.assertEqual(self.entry_points(), before)

    def test_other_threads_are_not_checked(self):
        t, seen = paddle.ones([2]), {}
        with host_guard(is_marked_host):
            worker = threading.Thread(target=lambda: seen.setdefault("values", t.numpy().tolist()))
            worker.start()
            worker.join()
            with self.assertRaises(CaptureError):
                t.numpy()
        self.assertEqual(seen, {"values": [1.0, 1.0]}, "a thread that is not capturing reads as usual")

    def test_host_tensors_made_inside_are_host_and_never_copied_to_the_device(self):
        with host_guard(is_marked_host):
            host = paddle.to_tensor(HOST, place=paddle.CPUPlace())
            self.assertTrue(is_marked_host(host))
            self.assertEqual(host.numpy().tobytes(), HOST.tobytes(), "reading host memory is host work")
            for copy in (lambda: paddle.to_tensor(host), lambda: paddle.ones([8, 8]).copy_(host, False),
                         lambda: paddle.assign(host, output=paddle.ones([8, 8])), lambda: host.to("gpu")):
                with self.assertRaisesRegex(CaptureError, "copies host data to the device"):
                    copy()
            device = paddle.to_tensor(paddle.ones([2]))  # device to device: no host involved
            self.assertFalse(is_marked_host(device))


# ----------------------------------------------------------------------------- a broken CUDA capture
class _FakeCuda:
    """Paddle's capture state and one stream's capture status, as NOTE [ Ending a broken capture ] reads
    them: Paddle's end_capture fails on a stream whose capture is not active and then keeps capturing."""

    def __init__(self):
        self.paddle_capturing, self.stream, self.resets = False, cuda_driver.NONE, 0
        world = self

        class Graph:
            def __init__(self, place=None, mode=None, pool_id=None):
                pass

            def capture_begin(self):
                world.paddle_capturing, world.stream = True, cuda_driver.ACTIVE

            def capture_end(self):
                world.end()

            def reset(self):
                world.resets += 1

        class Core:
            @staticmethod
            def end_capture():
                world.end()
                return Graph()

        self.graphs = types.SimpleNamespace(CUDAGraph=Graph)
        self.core = Core

    def end(self):
        if self.stream != cuda_driver.ACTIVE:
            self.stream = cuda_driver.NONE
            raise OSError("(External) CUDA error(901), operation failed due to a previous error during capture.")
        self.paddle_capturing, self.stream = False, cuda_driver.NONE

    def patches(self):
        driver = {"capture_status": lambda stream: self.stream,
                  "end_stream_capture": lambda stream: setattr(self, "stream", cuda_driver.NONE) or True,
                  "begin_stream_capture": lambda stream: setattr(self, "stream", cuda_driver.ACTIVE) or True,
                  "clear_last_error": lambda: None}
        return [mock.patch.object(cuda_backend, "_core_graph_class", lambda: (self.graphs, self.core)),
                mock.patch.object(cuda_backend, "_paddle_capturing", lambda: self.paddle_capturing),
                mock.patch.object(cuda_backend, "_stream_handle", lambda place: 1234)] + [
            mock.patch.object(cuda_driver, name, fn) for name, fn in driver.items()]


class BrokenCudaCapture(unittest.TestCase):
    """NOTE [ Ending a broken capture ] in backends/cuda.py, against a stand-in for Paddle and the driver
    (the real thing runs in tools/gpu_check.py): whatever broke a capture, Paddle is left not capturing."""

    def capture(self, body):
        """Captures ``body(fake)`` on a stand-in; returns ``(fake, the exception raised or None)``."""
        fake = _FakeCuda()
        with contextlib.ExitStack() as stack:
            for patch in fake.patches():
                stack.enter_context(patch)
            try:
                cuda_backend._CudaGraph(None, None).capture(lambda: body(fake))
            except Exception as err:  # noqa: BLE001 - the test inspects it
                return fake, err
        return fake, None

    def test_a_cuda_error_that_invalidated_the_capture_is_contained_and_ended(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED
            raise OSError("(External) CUDA error(906), operation would make the legacy stream depend on a "
                          "capturing blocking stream")

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertRegex(str(error), "invalidated on the device.*CUDA error\\(906\\)")
        self.assertFalse(fake.paddle_capturing, "Paddle left believing a capture is open")
        self.assertEqual(fake.stream, cuda_driver.NONE)
        self.assertEqual(fake.resets, 1, "the capturing graph handed back by the restarted capture was reset")

    def test_a_capture_that_fails_to_end_is_ended(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED  # broken without an error until the end
            return []

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertFalse(fake.paddle_capturing)

    def test_the_functions_own_error_during_a_broken_capture_is_a_capture_failure(self):
        def body(fake):
            fake.stream = cuda_driver.INVALIDATED
            raise own_error(RuntimeError("(External) CUDA error(900), operation not permitted when stream is "
                                         "capturing"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertFalse(fake.paddle_capturing)

    def test_the_functions_own_error_on_an_intact_capture_is_handed_on(self):
        def body(fake):
            raise own_error(Boom("the function's own error"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, Boom)
        self.assertTrue(is_own_error(error))
        self.assertFalse(fake.paddle_capturing)
        self.assertEqual(fake.resets, 1, "the partial graph was ended and reset")

    def test_a_wrong_stream_handle_cannot_break_a_valid_capture(self):
        def body(fake):
            paddle.to_tensor(HOST)  # refused: the capture Paddle holds is still valid

        fake = _FakeCuda()
        with contextlib.ExitStack() as stack:
            for patch in fake.patches():
                stack.enter_context(patch)
            # The driver reports another stream than Paddle's: not capturing.
            stack.enter_context(mock.patch.object(cuda_driver, "capture_status", lambda stream: cuda_driver.NONE))
            with self.assertRaisesRegex(CaptureError, "paddle.to_tensor"):
                cuda_backend._CudaGraph(None, None).capture(lambda: body(fake))
        self.assertEqual((fake.paddle_capturing, fake.resets), (False, 1), "Paddle's own end ended it")

    def test_a_host_read_is_refused_before_it_reaches_cuda(self):
        def body(fake):
            paddle.to_tensor(np.ones([2], "float32"))

        fake, error = self.capture(body)
        self.assertIsInstance(error, CaptureError)
        self.assertIn("paddle.to_tensor() of a numpy array", str(error))
        self.assertEqual((fake.paddle_capturing, fake.resets), (False, 1), "ended cleanly, not broken")


# ----------------------------------------------------------------------------- numpy arguments
class StepFailureAfterBackward(MatmulOnlyCase):
    """A whole step whose capture fails after its backward bound the grads (NOTE [ What a failed
    recording capture leaves ] in step/rollback.py)."""

    def _step(self, model, fail):
        opt = MatmulSGD(model.parameters(), 1e-2)

        def step(x, dy):
            y = model(x)
            y.backward(dy)
            if fail[0]:
                y.numpy()  # refused during the capture: after the backward, before the update
            opt.step()
            opt.clear_grad()
            return y
        return step

    def _run(self):
        draw = normal(31)
        xs = [self.tensor(draw(4, 16)) for _ in range(3)]
        dys = [self.tensor(draw(4, 16, scale=0.1)) for _ in range(3)]
        eager_model, graphed_model = self.twins(lambda: MatMLP([16, 32, 16]), 5)
        fail = [True]
        eager = self._step(eager_model, [False])
        graphed = autocudagraph_step(self._step(graphed_model, fail), optimizers=[], warmup_steps=1,
                                     backend=self.backend)
        for i in range(6):
            fail[0] = i < 2  # the first capture fails; the next one (a re-capture is not made: eager) holds
            x, dy = xs[i % 3], dys[i % 3]
            self.assertBitwise(graphed(x, dy), eager(x, dy), f"step {i} output")
            for k, (a, e) in enumerate(zip(graphed_model.parameters(), eager_model.parameters())):
                self.assertBitwise(a, e, f"step {i} parameter {k}")
                self.assertIsNone(a.grad, f"step {i} parameter {k}: a grad left by the failed capture")
        return graphed

    def test_grads_bound_by_a_failed_capture_are_taken_back(self):
        """The capture fails after backward() bound grads to the parameters: the eager run that
        replaces it starts from eager's grads (None), so every parameter equals eager's."""
        graphed = self._run()
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())

    def test_a_recording_capture_leaves_no_grad_either(self):
        """The same through a backend whose capture does not execute (as CUDA's): the grads its Python
        bound are taken back although no value changed."""
        if self.backend != "simulate":
            self.skipTest("the stand-in for a recording capture is the simulated backend")
        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        with mock.patch.object(SimulatedBackend, "capture_executes", False):
            graphed = self._run()
        self.assertEqual(graphed.stats()["captures"], 0, graphed.explain())


class GradAssignment(MatmulOnlyCase):
    """NOTE [ Assigning a grad during capture ] in backends/host_guard.py."""

    def test_assigning_a_grad_inside_a_whole_step_is_refused_and_stays_eager_exact(self):
        """p.grad = t inside the step is refused at capture on both backends (a GPU fails it with
        CUDA error 906); every step equals eager."""
        draw = normal(41)
        x, dy = self.tensor(draw(4, 16)), self.tensor(draw(4, 16, scale=0.1))

        def make(model):
            def step(x, dy):
                params = list(model.parameters())
                grads = paddle.grad([model(x)], params, [dy])
                for p, g in zip(params, grads):
                    p.grad = g
                out = params[0].grad.clone()  # a copy: the grad itself is released below
                for p in params:
                    p.clear_gradient(False)
                return out
            return step

        eager_model, graphed_model = self.twins(lambda: MatMLP([16, 32, 16]), 6)
        eager = make(eager_model)
        graphed = autocudagraph_step(make(graphed_model), optimizers=[], warmup_steps=1, backend=self.backend)
        for i in range(4):
            self.assertBitwise(graphed(x, dy), eager(x, dy), f"step {i}")
        stats = graphed.stats()
        self.assertEqual(stats["captures"], 0, graphed.explain())
        self.assertTrue(any("p.grad = tensor" in r for r in stats["eager_reasons"]), stats["eager_reasons"])


class NumpyArguments(MatmulOnlyCase):
    """NOTE [ Numpy arguments ] in io/nested.py: an array argument keys the graph by value."""

    @staticmethod
    def branchy(x, w, flag):
        y = paddle.matmul(x, w)
        return paddle.matmul(y, w) if flag[0] > 0 else y  # host data read at capture, baked into the graph

    def calls(self, g, flags):
        draw = normal(8)
        x, w = self.tensor(draw(4, 8)), self.tensor(draw(8, 8))
        for k, flag in enumerate(flags):
            self.assertBitwise(g(x, w, flag), self.branchy(x, w, flag), f"call {k} with {flag.tolist()}")

    def test_buffer_refilled_in_place_selects_the_graph_of_its_contents(self):
        """One numpy buffer refilled between calls: each content gets its own graph; none replays a graph
        captured with other contents."""
        g = self.graphed(self.branchy, warmup_steps=1)
        buf = np.array([1], "int64")

        def refilled():
            for value in [1, 1, 1, 0, 0, 0, 1]:
                buf[0] = value
                yield buf

        self.calls(g, refilled())
        self.assertCounters(g, keys=2, captures=2, replays=3)

    def test_fresh_arrays_reusing_freed_ids_select_by_value(self):
        """A fresh array per call (freed ids are reused): equal contents share a graph, others get theirs."""
        g = self.graphed(self.branchy, warmup_steps=1)
        self.calls(g, (np.array([v], "int64") for v in [1, 1, 1, 0, 0, 0, 1]))
        self.assertCounters(g, keys=2, captures=2, replays=3)

    def test_large_array_argument_is_refused_naming_it(self):
        """A numpy argument too large to key by value raises, naming the argument and the fix."""
        g = self.graphed(lambda x, table: paddle.matmul(x, x), warmup_steps=0)
        x = self.tensor(np.ones((2, 2), "float32"))
        with self.assertRaisesRegex(CudaGraphError, "argument 'table' is a numpy array with 2048 elements.*Pass it "
                                                    "as a tensor"):
            g(x, np.zeros(2048, "float32"))
        self.assertEqual(g.stats()["keys"], 0)


for _base in (BlockFailures, NestedCallError, StepFailures, ProcessExit, NumpyArguments, StepFailureAfterBackward,
              GradAssignment):
    globals().update(backend_variants(_base))
del (FailureCase, BlockFailures, NestedCallError, StepFailures, ProcessExit, NumpyArguments, StepFailureAfterBackward,
     GradAssignment, _base, _name)
