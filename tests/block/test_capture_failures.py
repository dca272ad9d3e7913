"""The capture-failure matrix: every reason a capture is refused or fails x {block, whole step} x
{simulate, cuda}; the whole step's half is tests/step/test_step_capture_failures.py, the host guard's
own tests are in tests/backends/. Each case expects what eager gives: every output, grad and parameter bitwise equal
to an eager twin, no exception (except the function's own, which reaches the caller once), no capture
left open, and a process that exits 0 (the subprocess cases; an abort at exit is how a capture left
open shows on a GPU).

The cases are matmul-only (NOTE [ Kernel-less GPUs ] in testkit/common.py): tools/gpu_check.py runs
them on a real GPU. A case whose eager run needs more of Paddle's kernels says so and is skipped, with
that reason, on a GPU whose Paddle lacks them. Numpy arguments (NOTE [ Numpy arguments ] in
io/nested.py) are tested at the end.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import CudaGraphError, is_capturing
from paddlefleet.cudagraph.guards.host_guard import constructor_guarded
from testkit.common import cuda_skip_reason
from testkit.harness import RECORD, MatmulOnlyCase, backend_variants, normal

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


def _setitem_numpy(y, u, v):
    t = paddle.zeros([8, 8])
    t[1] = HOST[0]
    return paddle.matmul(y, t)


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
    "print_tensor": (lambda y, u, v: (print(y), y)[1], "print(t), str(t) or repr(t) of a device tensor",
                     ("simulate", "cuda"), "matmul"),
    "fstring_tensor": (lambda y, u, v: (f"{y}", y)[1], "an f-string or format() of a device tensor",
                       ("simulate", "cuda"), "matmul"),
    "to_tensor_numpy": (lambda y, u, v: paddle.matmul(y, paddle.to_tensor(HOST)), "paddle.to_tensor() of a numpy array",
                        ("simulate", "cuda"), "matmul"),
    "to_tensor_host_tensor": (lambda y, u, v: paddle.matmul(y, paddle.to_tensor(_host_tensor())),
                              "paddle.to_tensor() of a host tensor", ("simulate", "cuda"), "matmul"),
    "cuda_of_host_tensor": (lambda y, u, v: paddle.matmul(y, _host_tensor().cuda()), "Tensor.cuda()", ("cuda",),
                            "matmul"),
    "tensor_constructor_numpy": (lambda y, u, v: paddle.matmul(y, paddle.Tensor(HOST)), "paddle.Tensor() of a numpy "
                                 "array", ("simulate", "cuda"), "matmul"),
    "assign_numpy": (lambda y, u, v: paddle.matmul(y, paddle.assign(HOST)), "paddle.assign() of a numpy array",
                     ("simulate", "cuda"), "all"),
    "synchronize": (lambda y, u, v: (paddle.device.cuda.synchronize(), y)[1], "synchronize()", ("cuda",), "matmul"),
    "raw_tensor_numpy": (lambda y, u, v: (np.array(y.get_tensor()), y)[1], "np.array() of Tensor.get_tensor()",
                         ("simulate", "cuda"), "matmul"),
    "value_raw_tensor_numpy": (lambda y, u, v: (np.array(y.value().get_tensor()), y)[1],
                               "np.array() of Tensor.get_tensor()", ("simulate", "cuda"), "matmul"),
    "value_shaped_op": (lambda y, u, v: y + 0 * paddle.nonzero(y).shape[0], "paddle.nonzero()", ("simulate", "cuda"),
                        "all"),
    "random_kernel": (lambda y, u, v: y + 0 * paddle.rand([1]), "random kernel", ("simulate", "cuda"), "all"),
    "set_value_numpy": (_set_value_numpy, "Tensor.set_value() of a numpy array", ("simulate", "cuda"), "all"),
    "setitem_numpy": (_setitem_numpy, "Tensor.__setitem__() of a numpy array", ("simulate", "cuda"), "all"),
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
        if name == "tensor_constructor_numpy" and not constructor_guarded():
            self.skipTest("this Paddle's Tensor constructor is a C slot that cannot be wrapped (Paddle 2.6): "
                          "paddle.Tensor(array) is not refused here")
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


def _matrix_test(name):
    def test(self):
        self.check(name)

    _, names, backends, kernels = CASES[name]
    need = " (needs Paddle's own kernels on a GPU)" if kernels == "all" else ""
    test.__doc__ = f"{name}: refused ({names}) on {', '.join(backends)}, every result equal to eager{need}."
    return test


for _name in CASES:
    setattr(BlockFailures, f"test_{_name}", _matrix_test(_name))


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
        # eager_if_slower=False: a fresh process times calls on a GPU, and eager samples before the capture would
        # keep these four calls from reaching it (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py).
        g = autocudagraph(f, backend=backend, warmup_steps=1, eager_if_slower=False)
        s = autocudagraph_step(f, optimizers=[], backend=backend, warmup_steps=1)
        x = paddle.to_tensor(np.ones((4, 8), "float32"))
        w = paddle.to_tensor(np.eye(8, dtype="float32"))
        for wrapper in (g, s):
            for _ in range(4):
                assert wrapper(x, w).numpy().tobytes() == f(x, w).numpy().tobytes()
            assert wrapper.stats()["captures"] == 0, wrapper.explain()
            assert wrapper.stats()["eager_reasons"].get("capture failed") == 1, wrapper.stats()["eager_reasons"]
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
            g = autocudagraph(f, backend="cuda", warmup_steps=1, eager_if_slower=False)  # no eager samples: see above
            for _ in range(4):
                assert g(x, w).numpy().tobytes() == f(x, w).numpy().tobytes()
            assert g.stats()["captures"] == 0, g.explain()
        ok = autocudagraph(lambda x, w: paddle.matmul(x, w), backend="cuda", warmup_steps=1, eager_if_slower=False)
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


# ----------------------------------------------------------------------------- numpy arguments
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

    def test_large_array_argument_is_the_users_choice_under_dispatch_key_fn(self):
        """With dispatch_key_fn the user's key selects the graph: a numpy argument too large to key by
        value is not refused, and the calls capture once and replay."""
        g = self.graphed(lambda x, table: paddle.matmul(x, x), warmup_steps=1,
                         dispatch_key_fn=lambda bound: "one")
        x, table = self.tensor(np.ones((2, 2), "float32")), np.zeros(2048, "float32")
        for _ in range(4):
            self.assertBitwise(g(x, table), paddle.matmul(x, x))
        self.assertCounters(g, keys=1, captures=1, replays=2)


for _base in (BlockFailures, NestedCallError, ProcessExit, NumpyArguments):
    globals().update(backend_variants(_base))
# FailureCase stays (it has no tests of its own): tests/step/test_step_capture_failures.py builds on it.
del (BlockFailures, NestedCallError, ProcessExit, NumpyArguments, _base, _name)
