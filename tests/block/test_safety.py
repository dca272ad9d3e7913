"""Safety and diagnostics: contained capture failures, explain(), verification mode,
host (CPU) tensors in IO, input copies, the max_bytes budget and stale-output detection.

Every graphed result is compared with eager bit for bit; phases are pinned with the counters.
"""

import os
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle
from paddle.autograd import PyLayer
from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
from parameterized import parameterized

from paddlefleet.cudagraph import CudaGraphError, InputMismatchError, StaleOutputError, is_capturing
from paddlefleet.cudagraph.io import host_tensors as host
from paddlefleet.cudagraph.io.host_tensors import MAX_HOST_KEY_ELEMENTS, mark_host

from testkit.harness import add_tracker_state, BackendCase, clone_leaf, for_each_backend, grads_of, twin_layers

THIS_FILE = os.path.abspath(__file__)


class Block(paddle.nn.Layer):
    """Linear -> BatchNorm (running statistics) -> dropout (RNG) -> Linear."""

    def __init__(self, d=8, p=0.3):
        super().__init__()
        self.fc1 = paddle.nn.Linear(d, d)
        self.norm = paddle.nn.BatchNorm1D(d)
        self.drop = paddle.nn.Dropout(p)
        self.fc2 = paddle.nn.Linear(d, d)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(self.fc1(x))))


class ReadInBackward(PyLayer):
    @staticmethod
    def forward(ctx, y):
        return y * 2.0

    @staticmethod
    def backward(ctx, dy):
        return dy * float(dy.sum().item())  # a host read in the backward


class FailingBlock(Block):
    """A Block whose forward or backward reads a value to the host (fails to capture)."""

    def __init__(self, fail_in):
        super().__init__()
        self.fail_in = fail_in

    def forward(self, x):
        y = super().forward(x)
        if self.fail_in == "forward":
            y = y * float(y.sum().item())
        return ReadInBackward.apply(y)


class ScaledBlock(Block):
    """A Block whose output is scaled by a host tensor read at capture."""

    gate = {}

    def forward(self, x):
        return super().forward(x) * float(ScaledBlock.gate["scale"])  # host read


class TrackedScaledBlock(paddle.nn.Layer):
    """Dropout, called under a Fleet RNG tracker state (a tracker block inside a graphed function
    is refused on Paddle 2.6, whose generators keep no state indices), scaled by a host tensor read
    at capture."""

    STATE = "cg_safety_tracked"
    gate = {}

    def __init__(self, d=8):
        super().__init__()
        self.fc = paddle.nn.Linear(d, d)

    def forward(self, x):
        h = paddle.nn.functional.dropout(self.fc(x), 0.5)
        return h * float(TrackedScaledBlock.gate["scale"])  # host read


def mm(x, w):
    return paddle.matmul(x, w).tanh()


def mm_tagged(x, w, tag):
    return mm(x, w)


def data(*shape, seed=0, grad=False):
    t = paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype("float32"))
    t.stop_gradient = not grad
    return t


def buffers_of(layer):
    """Buffers and non-trainable parameters (BatchNorm keeps its running statistics there)."""
    state = {n: b.numpy() for n, b in layer.named_buffers()}
    state.update({n: p.numpy() for n, p in layer.named_parameters() if p.stop_gradient})
    assert state, "the layer has no state a forward writes"
    return state


def host_read_line(fn):
    """Line number of the line in ``fn``'s source marked ``# host read``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if "# host read" in line:
            return start + i
    raise AssertionError("no '# host read' marker")


class SafetyCase(BackendCase):
    def host(self, value, dtype=None):
        """A host tensor: on the CPU next to GPU tensors, marked on the simulated backend."""
        t = paddle.to_tensor(value, dtype=dtype, place=paddle.CPUPlace())
        return t if self.backend == "cuda" else mark_host(t)

    def caught(self):
        ctx = warnings.catch_warnings(record=True)
        log = ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("always")
        return log

    def runtime_warnings(self, log):
        return [w for w in log if issubclass(w.category, RuntimeWarning) and "autocudagraph" in str(w.message)]


# ---------------------------------------------------------------------------- 1. contained failures
def syncing_block(x, w):
    y = paddle.matmul(x, w)
    scale = float(y.mean().item())  # host read
    return y * scale


@for_each_backend
class CaptureFailureTest(SafetyCase):
    def test_host_sync_falls_back_with_one_warning_naming_the_users_line(self):
        f = self.graphed(syncing_block, warmup_steps=1)
        log = self.caught()
        w = data(8, 8, seed=1, grad=True)
        for i in range(4):
            x = data(4, 8, seed=i)
            self.assertBitwise(f(x, w), syncing_block(x, w), f"call {i}")
        warned = self.runtime_warnings(log)
        self.assertEqual(len(warned), 1, [str(w.message) for w in warned])
        message = str(warned[0].message)
        self.assertIn("Tensor.item()", message)
        self.assertIn(f"{THIS_FILE}:{host_read_line(syncing_block)} in syncing_block", message)
        # The warning points at the line that called the graphed function.
        self.assertEqual(os.path.abspath(warned[0].filename), THIS_FILE)
        stats = f.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["graphs"], stats["static_bytes"]), (0, 0, 0, 0))
        (row,) = f.report()
        self.assertEqual(row["phase"], "fallback")
        self.assertIn("syncing_block", row["fallback_reason"])
        self.assertEqual(stats["eager_reasons"], {"capture failed": 1, "key fell back: " + row["fallback_reason"]: 2})

    def test_a_forward_rewinding_the_rng_before_a_draw_is_refused(self):
        """R-Drop in a block: ``get_rng_state(); dropout; set_rng_state(); dropout``. A replay would
        re-seed the second dropout with a new offset (other masks than eager's): the capture is
        refused, and every call, with the random numbers that follow, is eager's."""
        def rdrop(x):
            state = paddle.get_rng_state()
            first = paddle.nn.functional.dropout(x, 0.5)
            paddle.set_rng_state(state)
            return first + paddle.nn.functional.dropout(x, 0.5)

        f = self.graphed(rdrop, warmup_steps=1)
        log = self.caught()
        for i in range(4):
            x = data(4, 8, seed=i)
            got = [paddle.seed(i) and None, f(x), paddle.rand([4])]
            want = [paddle.seed(i) and None, rdrop(x), paddle.rand([4])]
            self.assertBitwise(got, want, f"call {i}")
        (warned,) = self.runtime_warnings(log)
        self.assertIn("sets the RNG state and then runs the random kernel 'dropout'", str(warned.message))
        self.assertEqual(f.stats()["captures"], 0)

    @parameterized.expand([("forward",), ("backward",)])
    def test_failed_capture_leaks_no_state(self, fail_in):
        eager, graphed = twin_layers(lambda: FailingBlock(fail_in))
        # BatchNorm1D sets its _data_format on its first call, which would make the first capture a warmup
        # call (NOTE [ Attributes a capture writes ]): one eager call first, of both twins.
        for layer in (eager, graphed):
            with paddle.no_grad():
                Block.forward(layer, data(4, 8, seed=1))
        self.graphed(graphed, warmup_steps=0)
        for layer in (eager, graphed):
            for p in layer.parameters():
                p.grad = paddle.full_like(p, 0.5)
        handles = [p.grad for p in graphed.parameters()]
        originals = {
            name: paddle.Tensor.__dict__.get(name) for name in ("numpy", "item", "tolist", "__bool__", "__float__")
        }
        layer_call = paddle.nn.Layer.__call__
        log = self.caught()

        def step(layer):
            paddle.seed(11)
            x = data(4, 8, seed=3, grad=True)
            y = layer(x)
            y.sum().backward()
            return [y, x.grad, grads_of(layer), buffers_of(layer), paddle.rand([4])]

        want = step(eager)
        got = step(graphed)
        self.assertBitwise(got, want, "outputs, grads, buffers and the next random numbers")
        (warned,) = self.runtime_warnings(log)
        self.assertEqual(os.path.abspath(warned.filename), THIS_FILE, "points at the caller, past Layer.__call__")
        self.assertFalse(is_capturing())
        for name, fn in originals.items():
            self.assertIs(paddle.Tensor.__dict__.get(name), fn, name)
        self.assertIs(paddle.nn.Layer.__call__, layer_call)
        for p, handle in zip(graphed.parameters(), handles):
            self.assertEqual(p.grad.data_ptr(), handle.data_ptr(), "p.grad storage kept")
        self.assertEqual(graphed.forward.stats()["graphs"], 0)
        # Nothing left over breaks the next call or another wrapper's capture.
        self.assertBitwise(step(graphed), step(eager), "next call")
        other = self.graphed(mm, warmup_steps=0)
        x, w = data(4, 8), data(8, 8, seed=2)
        with other.counters.expect(captures=1, replays=1):
            self.assertBitwise([other(x, w), other(x, w)], [mm(x, w), mm(x, w)])

    def test_error_raised_by_the_function_reaches_the_caller(self):
        calls = []

        def strict(x):
            calls.append(x.shape[0])
            if x.shape[0] != 4:
                raise ValueError("strict wants 4 rows")
            return x * 2

        f = self.graphed(strict, warmup_steps=0)
        log = self.caught()
        with self.assertRaisesRegex(ValueError, "strict wants 4 rows") as raised:
            f(data(3, 2))
        self.assertEqual(calls, [3], "the function ran once, as in eager (not re-run after the failed capture)")
        self.assertIsNone(raised.exception.__context__, "raised as the function raised it, not inside our handler")
        (row,) = f.report()
        self.assertEqual(row["phase"], "warmup", "the key stays usable: its next call captures")
        self.assertEqual(self.runtime_warnings(log), [], "the function's own error is not a capture failure")
        self.assertFalse(is_capturing())
        with self.assertRaisesRegex(ValueError, "strict wants 4 rows"):
            f(data(3, 2))
        with f.counters.expect(captures=1, replays=1):
            self.assertBitwise([f(data(4, 2)), f(data(4, 2, seed=1))], [strict(data(4, 2)), strict(data(4, 2, seed=1))])


# ---------------------------------------------------------------------------- 2. explain
@for_each_backend
class ExplainTest(SafetyCase):
    def test_every_key_and_every_eager_call_is_explained(self):
        def block(x, w, mode="graph"):
            y = paddle.matmul(x, w)
            if x.shape[0] == 3:
                y = y * float(y.max().item())  # fails to capture for 3 rows
            return y

        def key_fn(bound):
            if bound.arguments["mode"] == "eager":
                return None
            return tuple(bound.arguments["x"].shape)

        f = self.graphed(block, warmup_steps=1, max_graphs=1, dispatch_key_fn=key_fn)
        self.caught()
        w = data(8, 8, grad=True)
        f(data(3, 8), w)  # warmup
        f(data(3, 8), w)  # capture fails
        f(data(3, 8), w)  # fell back (a key that fell back holds no graphs)
        for i in range(4):
            f(data(4, 8, seed=i), w)  # 1 warmup, 1 capture, 2 replays: x copied, w read in place
        f(data(5, 8), w)  # another key: max_graphs reached
        f(data(4, 8), w, mode="eager")  # no key
        rows = {row["label"]: row for row in f.report()}
        self.assertEqual(set(rows), {"dispatch key (4, 8)", "dispatch key (3, 8)"})
        ok, bad = rows["dispatch key (4, 8)"], rows["dispatch key (3, 8)"]
        self.assertEqual(
            [ok[k] for k in ("phase", "warmup_calls", "captures", "replays", "input_copies", "input_copies_skipped")],
            ["replay", 1, 1, 2, 2, 2],
        )
        self.assertGreater(ok["static_bytes"], 0)
        self.assertEqual([bad["phase"], bad["captures"], bad["static_bytes"]], ["fallback", 0, 0])
        self.assertIn("Tensor.item()", bad["fallback_reason"])
        text = f.explain()
        # A verdict first: the calls that replayed, ran eagerly and warmed up (stats()'s counts), why.
        self.assertTrue(text.startswith("autocudagraph(block): graphed: 2 of 9 calls replayed a graph, 4 ran "
                                        "eagerly, 2 warmed up, 1 capture; speed not measured on "), text)
        self.assertIn("; eager for 4 reasons (below)\n", text)
        self.assertIn(
            f"key dispatch key (4, 8): graphed; 1 warmup call, 1 capture, 2 replays on {self.backend}\n    "
            f"holds {ok['memory']['held']}: inputs {ok['memory']['inputs']}, outputs {ok['memory']['outputs']}",
            text,
        )
        self.assertIn("; input copies 2 made, 2 skipped\n", text)
        self.assertIn("key dispatch key (3, 8): eager from now on; 1 warmup call, 0 captures, 0 replays on "
                      f"{self.backend}; why: CaptureError: autocudagraph: Tensor.item()", text)
        self.assertEqual(f.stats()["eager_calls"], 4)
        self.assertIn("  eager calls: 4\n", text)
        for line in (
            "1 x capture failed",
            "1 x max_graphs reached",
            "1 x dispatch_key_fn returned None",
            "1 x key fell back (why: on its key above)",
        ):
            self.assertIn(line, text)
        self.assertEqual(text.count("Tensor.item()"), 1, text)  # every reason said once

    def test_default_key_label_names_arguments(self):
        f = self.graphed(mm)
        f(data(4, 8), data(8, 8, grad=True))
        (row,) = f.report()
        self.assertEqual(row["label"], "(x: float32[4, 8], w: float32[8, 8] grad)")


# ---------------------------------------------------------------------------- 3. verification
class HostScale(PyLayer):
    """y = x * s in forward; backward reads a host tensor (frozen by a graph at capture)."""

    box = {}

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, dy):
        return dy * float(HostScale.box["scale"])  # host read in the backward


@for_each_backend
class VerifyTest(SafetyCase):
    def test_matching_replays_pass_and_leave_training_untouched(self):
        eager, graphed = twin_layers(Block)
        self.graphed(graphed, warmup_steps=1, verify_replays=3)
        for layer in (eager, graphed):
            for p in layer.parameters():
                p.grad = paddle.full_like(p, 0.25)  # accumulated grads must stay exactly as eager
        log = self.caught()

        def train(layer):
            paddle.seed(5)
            out = []
            for i in range(6):
                x = data(4, 8, seed=i, grad=True)
                y = layer(x)
                (y * y).sum().backward()
                out.append([y, x.grad])
            return out + [grads_of(layer), buffers_of(layer), paddle.rand([3])]

        want = train(eager)
        with graphed.forward.counters.expect(captures=1, replays=4, verified_replays=3, verify_mismatches=0):
            got = train(graphed)
        self.assertBitwise(got, want, "outputs, input grads, accumulated param grads, buffers, RNG")
        self.assertEqual(self.runtime_warnings(log), [])
        self.assertEqual(graphed.forward.report()[0]["verified_replays"], 3)

    def test_branch_on_a_host_tensor_computed_outside_is_caught(self):
        gate = {"on": None}

        def block(x):
            if gate["on"]:  # host read: a GPU graph keeps the capture-time branch
                return x * 2.0
            return x * 3.0

        f = self.graphed(block, warmup_steps=0, verify_replays=4)
        log = self.caught()
        got, want = [], []
        for i, on in enumerate([True, True, False, False]):
            gate["on"] = self.host(on)  # computed outside the graphed function
            x = data(2, 3, seed=i)
            got.append(f(x))
            want.append(block(x))
        self.assertBitwise(got, want, "every call returns eager's result")
        stats = f.stats()
        self.assertEqual((stats["verified_replays"], stats["verify_mismatches"], stats["graphs"]), (3, 1, 0))
        (warned,) = self.runtime_warnings(log)
        self.assertIn("output 0 differs from an eager re-run (max abs difference", str(warned.message))
        self.assertEqual(stats["eager_reasons"]["verification found a mismatch"], 1)
        self.assertEqual(f.report()[0]["phase"], "fallback")

    def test_cpu_state_read_at_capture_is_caught_with_its_max_difference(self):
        step = self.host(1, "int64")

        def block(x):
            return x * int(step)  # host read of CPU state

        f = self.graphed(block, warmup_steps=1, verify_replays=5)
        log = self.caught()
        x = paddle.ones([2, 2])
        outs = []
        for _ in range(4):
            outs.append(f(x))
            step.add_(paddle.to_tensor(1, dtype="int64", place=step.place))
        self.assertBitwise(outs, [x * 1, x * 2, x * 3, x * 4])
        (warned,) = self.runtime_warnings(log)
        # The capture call (step 2) matched; the first replay (step 3) froze 2 instead of 3.
        self.assertIn("max abs difference 1)", str(warned.message))
        self.assertEqual(f.stats()["verify_mismatches"], 1)

    def test_grads_are_compared_too(self):
        HostScale.box["scale"] = self.host(1.0)

        def block(x, w):
            return HostScale.apply(paddle.matmul(x, w))

        f = self.graphed(block, warmup_steps=0, verify_replays=3)
        log = self.caught()
        w = data(3, 3, seed=9, grad=True)
        w_eager = clone_leaf(w)
        for i in range(3):
            HostScale.box["scale"] = self.host(float(i + 1))
            x, xe = data(2, 3, seed=i, grad=True), data(2, 3, seed=i, grad=True)
            y, ye = f(x, w), block(xe, w_eager)
            y.sum().backward()
            ye.sum().backward()
            self.assertBitwise([y, x.grad, w.grad], [ye, xe.grad, w_eager.grad], f"call {i}")
        (warned,) = self.runtime_warnings(log)
        self.assertIn("grad of input 'x' differs from an eager re-run", str(warned.message))
        self.assertEqual(f.stats()["verify_mismatches"], 1)

    def test_mismatch_leaves_rng_and_buffers_as_eager(self):
        eager, graphed = twin_layers(ScaledBlock)
        self.graphed(graphed, warmup_steps=0, verify_replays=2)
        self.caught()

        def run(layer):
            paddle.seed(1)
            out = []
            for i in range(3):
                ScaledBlock.gate["scale"] = self.host(float(i + 1))
                out.append(layer(data(4, 8, seed=i)).detach())  # no backward pending
            return out + [buffers_of(layer), paddle.rand([3])]

        self.assertBitwise(run(graphed), run(eager), "outputs, BatchNorm statistics, next random numbers")
        stats = graphed.forward.stats()
        self.assertEqual((stats["verified_replays"], stats["verify_mismatches"]), (2, 1))

    def test_mismatch_leaves_the_tracker_rng_as_eager(self):
        # The RNG snapshot taken before a verified call is restored twice on a mismatch (for the
        # eager re-run, then for the eager call that replaces the replay); the tracker's states
        # come back as eager left them. The graphed call runs inside the tracker block: a tracker
        # block inside the function is refused on Paddle 2.6 (no generator state indices).
        tracker = get_rng_state_tracker()
        start = add_tracker_state(self, TrackedScaledBlock.STATE, 4242)
        eager, graphed = twin_layers(TrackedScaledBlock)
        self.graphed(graphed, warmup_steps=0, verify_replays=2)
        self.caught()

        def run(layer):
            paddle.seed(1)
            tracker.set_states_tracker(dict(start))
            out = []
            for i in range(3):
                TrackedScaledBlock.gate["scale"] = self.host(float(i + 1))
                with tracker.rng_state(TrackedScaledBlock.STATE):
                    out.append(layer(data(4, 8, seed=i)).detach())
            with tracker.rng_state(TrackedScaledBlock.STATE):
                out.append(paddle.rand([4]))
            return out + [paddle.rand([3])]

        self.assertBitwise(run(graphed), run(eager), "outputs, tracker and default random numbers")
        stats = graphed.forward.stats()
        self.assertEqual((stats["verified_replays"], stats["verify_mismatches"]), (2, 1))



@for_each_backend
class OutsideWritesTest(SafetyCase):
    """NOTE [ RNG across capture ] in block/capture.py: a tensor the function updates in place outside
    its Layers' buffers is updated once per call, at the capture call too, as on a GPU."""

    def test_in_place_updates_outside_the_layers_apply_once_per_call(self):
        def make():
            return {"total": paddle.zeros([2]), "seen": paddle.ones([2]), "rows": paddle.zeros([3, 2]),
                    "last": paddle.zeros([2]), "window": paddle.zeros([4])}

        def updates(held):
            def accumulate(x):
                with paddle.no_grad():
                    held["total"].add_(x.sum(0))  # a dict attribute's tensor
                    held["seen"].scale_(0.5)
                    held["rows"][1] = x[0]  # __setitem__
                    paddle.assign(x[2], output=held["last"])
                    held["window"][1:3].add_(x[1])  # through a view made here
                return x * 2.0

            return accumulate

        state, eager_state = make(), make()
        accumulate, eager = updates(state), updates(eager_state)

        f = self.graphed(accumulate, warmup_steps=1)
        for i in range(4):
            x = data(3, 2, seed=i)
            self.assertBitwise(f(x), eager(x), f"call {i}")
            self.assertBitwise(list(state.values()), list(eager_state.values()), f"call {i}")
        self.assertEqual((f.stats()["captures"], f.stats()["replays"]), (1, 2))

    def test_running_statistics_outside_any_layer_move_once_per_call(self):
        """``F.batch_norm`` with running statistics that are no Layer's buffers: the kernel writes them
        under names without a trailing ``_`` (NOTE [ Kernels that write their inputs ] in
        guards/in_place_writes.py); the capture call moves them once, as eagerly."""
        def make():
            mean, var = paddle.zeros([2]), paddle.ones([2])

            def normed(x):
                return paddle.nn.functional.batch_norm(x, mean, var, training=True) * 2.0

            return normed, [mean, var]

        (normed, stats), (eager, eager_stats) = make(), make()
        f = self.graphed(normed, warmup_steps=1)
        for i in range(4):
            x = data(3, 2, seed=i)
            self.assertBitwise(f(x), eager(x), f"call {i}")
            self.assertBitwise(stats, eager_stats, f"call {i} running statistics")
        self.assertEqual((f.stats()["captures"], f.stats()["replays"]), (1, 2))


class RestoreRngTest(unittest.TestCase):
    def test_a_snapshot_restored_twice_keeps_its_tracker_states(self):
        """NOTE [ Restoring the tracker ] in core/state.py: Paddle 2.6's set_states_tracker adopts the
        dict it is given, so a tracker block that draws between two restores of one snapshot would
        write its advanced state into the snapshot; the second restore must still give the first's."""
        from paddlefleet.cudagraph.core import state

        tracker = get_rng_state_tracker()
        add_tracker_state(self, TrackedScaledBlock.STATE, 4243)
        snapshot = state.rng_snapshot()
        draws = []
        for _ in range(2):
            state.restore_rng(snapshot)
            with tracker.rng_state(TrackedScaledBlock.STATE):
                draws.append(paddle.rand([4]).numpy())
        np.testing.assert_array_equal(draws[0], draws[1], strict=True)

# ---------------------------------------------------------------------------- 4. host tensors
@for_each_backend
class HostIOTest(SafetyCase):
    def _block(self):
        def block(x, n):
            rows = int(n)  # host read: the graph bakes it in
            return x[:rows] * 2.0, self.host([rows * x.shape[1]])

        return block

    def test_cpu_input_is_part_of_the_key_by_value(self):
        block = self._block()
        f = self.graphed(block, warmup_steps=0)
        x = data(4, 3)
        got, want = [], []
        for rows in (2, 3, 2, 3, 2):
            n = self.host(rows, "int64")
            got.append(f(x, n))
            want.append(block(x, n))
        self.assertBitwise(got, want)
        stats = f.stats()
        self.assertEqual((stats["keys"], stats["captures"], stats["replays"]), (2, 2, 3))
        labels = sorted(row["label"] for row in f.report())
        self.assertEqual(labels, ["(x: float32[4, 3], n: int64[] on CPU = 2)", "(x: float32[4, 3], n: int64[] on CPU = 3)"])

    def test_cpu_input_is_never_copied(self):
        f = self.graphed(self._block(), warmup_steps=0)
        with f.counters.expect(captures=1, replays=2, input_copies=2, input_copies_skipped=2):
            for i in range(3):
                f(data(4, 3, seed=i), self.host(2, "int64"))

    def test_too_large_cpu_input_is_refused(self):
        f = self.graphed(lambda x, table: x * 2.0, warmup_steps=0)
        table = self.host([0.0] * (MAX_HOST_KEY_ELEMENTS + 1))
        with self.assertRaisesRegex(CudaGraphError, f"input 'table' is a CPU tensor with {MAX_HOST_KEY_ELEMENTS + 1} elements"):
            f(data(2, 2), table)
        self.assertEqual(f.stats()["keys"], 0)

    def test_cpu_output_is_returned_as_captured_as_a_copy(self):
        calls = {"n": 0}

        def block(x):
            calls["n"] += 1
            return x * 2.0, self.host([calls["n"]])  # host work runs at capture only

        f = self.graphed(block, warmup_steps=0, clone_outputs=False)
        first = f(data(2, 2))
        if self.backend != "cuda":
            # The simulated capture call's replay re-runs the function and sees the value a GPU would
            # freeze (NOTE [ Values a simulated replay reads ] in block/replay_fallback.py): the call runs
            # eagerly (the function's third run) and so does every later one.
            self.assertBitwise(first[1], paddle.to_tensor([3]))
            self.assertIn("a replay read other values than the capture", f.explain())
            return
        second = f(data(2, 2, seed=1))
        self.assertBitwise([first[1], second[1]], [paddle.to_tensor([1]), paddle.to_tensor([1])])
        self.assertEqual(str(second[1].place), str(paddle.CPUPlace()) if self.backend == "cuda" else str(second[1].place))
        first[1].add_(paddle.to_tensor([10], place=first[1].place))  # the caller's copy, not the graph's
        self.assertBitwise(f(data(2, 2, seed=2))[1], paddle.to_tensor([1]))

    def test_cpu_input_value_is_checked_under_dispatch_key_fn(self):
        block = self._block()
        f = self.graphed(block, warmup_steps=0, dispatch_key_fn=lambda bound: "one graph")
        x = data(4, 3)
        f(x, self.host(2, "int64"))
        f(x, self.host(2, "int64"))
        with self.assertRaisesRegex(InputMismatchError, r"CPU input 'n' holds 3 but the graph of this key was captured with 2"):
            f(x, self.host(3, "int64"))


class HostMaskTest(unittest.TestCase):
    """The CUDA-build rule, with stand-in places (this machine may have a CPU build)."""

    class Place:
        def __init__(self, gpu):
            self.gpu = gpu

        def is_gpu_place(self):
            return self.gpu

    def test_cpu_tensors_are_host_only_next_to_gpu_tensors(self):
        ts = [paddle.ones([1]) for _ in range(3)]
        gpu, cpu = self.Place(True), self.Place(False)
        with mock.patch.object(host, "_CUDA_BUILD", True):
            self.assertEqual(host.host_mask(ts, places=[gpu, cpu, gpu]), [False, True, False])
            self.assertIsNone(host.host_mask(ts, places=[cpu, cpu, cpu]), "an all-CPU call has no host tensors")
            self.assertIsNone(host.host_mask(ts, places=[gpu, gpu, gpu]))
            self.assertEqual(host.host_mask(ts, on_gpu=True, places=[cpu, gpu, gpu]), [True, False, False])
        with mock.patch.object(host, "_CUDA_BUILD", False):
            self.assertIsNone(host.host_mask(ts, places=[gpu, cpu, gpu]))
            self.assertEqual(host.host_mask([ts[0], mark_host(ts[1])]), [False, True])


# ---------------------------------------------------------------------------- 5. input copies
@for_each_backend
class InputCopiesTest(SafetyCase):
    def test_the_same_tensors_again_pay_no_copy(self):
        f = self.graphed(mm, warmup_steps=1)
        x, w = data(4, 8), data(8, 8, seed=1)
        f(x, w)
        with f.counters.expect(captures=1, replays=3, input_copies=0, input_copies_skipped=6):
            outs = [f(x, w) for _ in range(4)]
        self.assertBitwise(outs, [mm(x, w)] * 4)
        self.assertEqual(f.stats()["input_copies_skipped"], 6)

    def test_new_tensors_are_copied_and_counted(self):
        f = self.graphed(mm, warmup_steps=1)
        w = data(8, 8, seed=1)
        f(data(4, 8), w)
        with f.counters.expect(captures=1, replays=3, input_copies=3, input_copies_skipped=3):
            xs = [data(4, 8, seed=i) for i in range(4)]
            outs = [f(x, w) for x in xs]
        self.assertBitwise(outs, [mm(x, w) for x in xs])

    def test_in_place_updates_of_a_reused_tensor_are_seen(self):
        f = self.graphed(mm, warmup_steps=1)
        x, w = data(4, 8), data(8, 8, seed=1, grad=True)
        f(x, w)
        f(x, w)
        for i in range(3):
            x.copy_(data(4, 8, seed=10 + i), False)  # an input buffer the caller refills
            with paddle.no_grad():
                w.add_(paddle.full_like(w, 0.01))  # an optimizer step on a weight passed as argument
            with f.counters.expect(replays=1, input_copies=0):
                self.assertBitwise(f(x, w), mm(x, w), f"refill {i}")

    def test_another_tensor_where_the_graph_read_in_place_recaptures_and_keeps_the_old_one(self):
        f = self.graphed(mm, warmup_steps=1)
        x, w = data(4, 8), data(8, 8, seed=1)
        x_before = x.numpy()
        f(x, w)
        f(x, w)
        x2 = data(4, 8, seed=5)
        with f.counters.expect(captures=1, recaptures=1, replays=0):
            self.assertBitwise(f(x2, w), mm(x2, w))
        np.testing.assert_array_equal(x.numpy(), x_before)  # never overwritten
        x3 = data(4, 8, seed=6)
        with f.counters.expect(captures=0, replays=2, input_copies=2, input_copies_skipped=2):
            self.assertBitwise([f(x3, w), f(x, w)], [mm(x3, w), mm(x, w)])
        np.testing.assert_array_equal(x.numpy(), x_before)

    def test_copied_inputs_that_need_grad_record_nothing_in_autograd(self):
        # NOTE [ Copy-in without no_grad ]: the copy into a static buffer runs with grad enabled.
        f = self.graphed(mm, warmup_steps=1)
        w, w_eager = data(8, 8, seed=1, grad=True), data(8, 8, seed=1, grad=True)
        for seed in (7, 8):  # warmup, capture
            (f(data(4, 8, seed=seed, grad=True) * 2.0, w) * 3.0).sum().backward()
            (mm(data(4, 8, seed=seed, grad=True) * 2.0, w_eager) * 3.0).sum().backward()
        static = f.entry().graphs.current.static_inputs.buffers[0]
        version = static._inplace_version()
        for i in range(3):
            x, x_eager = data(4, 8, seed=i, grad=True), data(4, 8, seed=i, grad=True)
            with f.counters.expect(replays=1, input_copies=1):
                (f(x * 2.0, w) * 3.0).sum().backward()
            (mm(x_eager * 2.0, w_eager) * 3.0).sum().backward()
            self.assertBitwise([x.grad, w.grad], [x_eager.grad, w_eager.grad], f"call {i}")
        self.assertTrue(static.is_leaf)
        self.assertFalse(static.stop_gradient)
        self.assertIsNone(static.grad)
        self.assertEqual(static._inplace_version(), version)

    def test_adopted_input_grads_match_eager(self):
        f = self.graphed(mm, warmup_steps=1)
        w, w_eager = data(8, 8, seed=1, grad=True), data(8, 8, seed=1, grad=True)
        for i in range(4):
            x = data(4, 8, seed=i)
            f(x, w).sum().backward()
            mm(x, w_eager).sum().backward()
        self.assertBitwise(w.grad, w_eager.grad)
        self.assertEqual(f.stats()["replays"], 2)


# ---------------------------------------------------------------------------- 6. max_bytes
@for_each_backend
class MaxBytesTest(SafetyCase):
    def _bytes_per_key(self):
        probe = self.graphed(mm_tagged, warmup_steps=0)
        probe(data(4, 8), data(8, 8), "probe")
        return probe.stats()["held_bytes"]  # what max_bytes counts (static buffers outside the pools, pools)

    def test_least_recently_used_key_is_evicted_and_captured_again(self):
        per_key = self._bytes_per_key()
        f = self.graphed(mm_tagged, warmup_steps=0, max_bytes=2 * per_key)
        w = data(8, 8, seed=9)

        def call(tag, seed=0):  # one key per tag, the same bytes for each
            x = data(4, 8, seed=seed)
            self.assertBitwise(f(x, w, tag), mm(x, w), f"key {tag}")

        def phases():
            return {row["label"].split("tag=")[1][1]: row["phase"] for row in f.report()}

        with f.counters.expect(captures=2, evictions=0):
            call("a")
            call("b")
        self.assertEqual(f.stats()["held_bytes"], 2 * per_key)
        with f.counters.expect(captures=1, evictions=1):  # a third key evicts the least recently used
            call("c")
        self.assertEqual(phases(), {"a": "recapture", "b": "replay", "c": "replay"})
        with f.counters.expect(captures=0, replays=1):  # a kept key still replays
            call("b", seed=1)
        with f.counters.expect(captures=1, recaptures=1, evictions=1):  # back: captured again; c is now LRU
            call("a", seed=2)
        self.assertEqual(phases(), {"a": "replay", "b": "replay", "c": "recapture"})
        with f.counters.expect(captures=0, replays=1):
            call("a", seed=3)
        stats = f.stats()
        self.assertEqual((stats["graphs"], stats["evictions"]), (2, 2))
        self.assertLessEqual(stats["held_bytes"], 2 * per_key)
        self.assertEqual(sorted(row["evictions"] for row in f.report()), [0, 1, 1])
        self.assertIn("evicted 1 time to make room (max_graphs, max_bytes)", f.explain())

    def test_key_larger_than_the_budget_runs_eagerly(self):
        per_key = self._bytes_per_key()
        f = self.graphed(mm_tagged, warmup_steps=0, max_bytes=per_key - 1)
        log = self.caught()
        x, w = data(4, 8), data(8, 8)
        self.assertBitwise([f(x, w, "a"), f(x, w, "a")], [mm(x, w), mm(x, w)])
        (warned,) = self.runtime_warnings(log)
        self.assertIn(f"need {per_key} bytes (", str(warned.message))
        self.assertIn(f"more than max_bytes={per_key - 1}", str(warned.message))
        stats = f.stats()
        self.assertEqual((stats["graphs"], stats["static_bytes"]), (0, 0))
        self.assertEqual(f.report()[0]["phase"], "fallback")


# ---------------------------------------------------------------------------- 7. stale outputs
def double(x):
    return x * 2.0


@for_each_backend
class StaleOutputTest(SafetyCase):
    def _graphed(self, **extra):
        return self.graphed(double, warmup_steps=0, clone_outputs=False, check_stale_outputs=True, **extra)

    def test_passing_an_overwritten_output_to_a_graphed_call_raises(self):
        f = self._graphed()
        other = self.graphed(mm, warmup_steps=0)
        y1 = f(data(2, 3))
        y2 = f(data(2, 3, seed=1)); overwrite_line = _line()  # noqa: E702
        with self.assertRaises(StaleOutputError) as ctx:
            f(y1)
        message = str(ctx.exception)
        self.assertIn("output 0 of double from run #1", message)
        self.assertIn(f"run #2 of that graph, called at {THIS_FILE}:{overwrite_line}, overwrote it", message)
        self.assertIsInstance(ctx.exception, CudaGraphError)
        with self.assertRaises(StaleOutputError):
            other(y1, data(3, 3))
        self.assertBitwise(f(y2), double(double(data(2, 3, seed=1))))  # the latest output is fine

    def test_reading_an_overwritten_output_fails_loudly(self):
        f = self._graphed()
        w = data(2, 3, seed=4)
        y1 = f(data(2, 3))
        f(data(2, 3, seed=1)); overwrite_line = _line()  # noqa: E702
        # Paddle's own error would be "Tensor holds no memory": every kind of op raises the clear one instead.
        ops = {"operator": lambda: y1 + 1.0, "reflected operator": lambda: w * y1, "function": lambda: paddle.tanh(y1),
               "two tensors": lambda: paddle.matmul(y1, w.T), "a list of tensors": lambda: paddle.concat([w, y1]),
               "method": lambda: y1.sum(), "indexing": lambda: y1[0], "negation": lambda: -y1,
               "numpy": lambda: y1.numpy(), "item": lambda: y1[0, 0].item(), "print": lambda: print(y1),
               "f-string": lambda: f"{y1}"}
        for what, op in ops.items():
            with self.subTest(what), self.assertRaises(StaleOutputError) as ctx:
                op()
            self.assertIn("output 0 of double from run #1", str(ctx.exception))
            self.assertIn(f"called at {THIS_FILE}:{overwrite_line}, overwrote it", str(ctx.exception))
        self.assertBitwise(w * 1.0, data(2, 3, seed=4), "other tensors are untouched")

    def test_backward_through_an_overwritten_output_fails_instead_of_wrong_grads(self):
        f = self._graphed()
        w = data(2, 3, seed=4, grad=True)
        y1 = f(data(2, 3))
        loss = (y1 * w).sum()
        f(data(2, 3, seed=1))
        with self.assertRaisesRegex(StaleOutputError, r"'Tensor holds no memory'\) while 1 output\(s\) of graphed "
                                    r"calls that a later replay overwrote are alive.*output 0 of double from run #1"):
            loss.backward()

    def test_outputs_of_other_keys_and_current_outputs_stay_valid(self):
        f = self._graphed()
        xa = data(2, 3)
        ya = f(xa)
        for i in range(3):
            yb = f(data(4, 3, seed=i))
        self.assertBitwise([ya, yb], [double(xa), double(data(4, 3, seed=2))])
        self.assertBitwise(f(ya), double(double(xa)))

    def test_without_the_check_an_overwritten_output_silently_changes(self):
        f = self.graphed(double, warmup_steps=0, clone_outputs=False)
        y1 = f(data(2, 3))
        f(data(2, 3, seed=1))
        self.assertBitwise(y1, double(data(2, 3, seed=1)))


def _line():
    import sys

    return sys._getframe(1).f_lineno
