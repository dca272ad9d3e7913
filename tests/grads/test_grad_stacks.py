"""Same-shape parameter grads stacked for a one-call hand-out (NOTE [ Grad groups ] in grads/stacks.py), stacked
as the backward makes them where Paddle has node post hooks (NOTE [ Stacking grads as they arrive ]): the
storage a backward graph keeps counts each stacked grad once, and grads equal eager's bit for bit under every
hand-out policy, with hooks that keep grads, with grads accumulated over micro-batches (two grad buffer sets),
with a stacked parameter that gets no grad and with parameters whose grad comes from nodes not hooked."""

import unittest
from unittest import mock

import numpy as np
import paddle
import paddle.nn.functional as F
from parameterized import parameterized

from paddlefleet.cudagraph.backends import pool_memory, simulated
from paddlefleet.cudagraph.grads.stacks import stacks_as_grads_arrive
from testkit.common import RECORD, MatMLP, build, host_tensor, normal
from testkit.harness import MatmulOnlyCase, for_each_backend

B, W = 4, 8
ROW, PARAM = B * W * 4, W * W * 4


def steps(model, n, micro=1, seed=3, free=True, rows=B):
    """``n`` steps of ``micro`` micro-batches: outputs, input grads and parameter grads, as numpy."""
    draw, log = normal(seed), []
    for _ in range(n):
        for _ in range(micro):
            x = host_tensor(draw(rows, W), stop_gradient=False)
            y = model(x)
            y.backward(host_tensor(draw(rows, y.shape[-1])))
            log += [y.numpy(), x.grad.numpy()]
        log += [None if p.grad is None else p.grad.numpy() for p in model.parameters()]
        if free:
            for p in model.parameters():
                p.clear_gradient(False)
    return log


def backward_storage(wrapper):
    """Distinct bytes of what the simulated backward graphs of the wrapper's key keep: their static results."""
    graphs = wrapper.entry().graphs
    return [pool_memory.distinct_bytes(g._static, set()) for g, _ in graphs.current.backward.sets.sets]


class StorageCensusTest(unittest.TestCase):
    """Four same-shape matmuls: the backward graph keeps x's grad and four parameter grads, the latter once."""

    def test_each_stacked_grad_is_kept_once(self):
        graphed, eager = build(lambda: MatMLP([W] * 5), 0), build(lambda: MatMLP([W] * 5), 0)
        from paddlefleet.cudagraph import autocudagraph

        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True):
            autocudagraph(graphed, backend="simulate", warmup_steps=0)
            np.testing.assert_equal(steps(graphed, 3), steps(eager, 3))
        [kept] = backward_storage(graphed.forward)
        # Stacked as they arrive (Paddle 3), or not stacked (2.6: aliases, NOTE [ Stacks after paddle.grad only for
        # copied grads ]): each grad kept once either way.
        self.assertEqual(kept, ROW + 4 * PARAM)
        mem = graphed.forward.stats()["memory"]
        self.assertEqual(mem["pool"], mem["outputs"] + mem["grads"])

    def test_grads_stacked_after_paddle_grad_for_copies_are_kept_twice(self):
        """clone_param_grads=True with grads stacked after paddle.grad (Paddle 2.6; forced on Paddle 3): one copy of the
        stack per hand-out, at the price of each grad kept twice (as computed, and stacked)."""
        graphed, eager = build(lambda: MatMLP([W] * 5), 0), build(lambda: MatMLP([W] * 5), 0)
        from paddlefleet.cudagraph import autocudagraph

        with mock.patch.object(simulated.SimulatedBackend, "pool_model", True), \
                mock.patch("paddlefleet.cudagraph.grads.stacks.stacks_as_grads_arrive", lambda: False):
            autocudagraph(graphed, backend="simulate", warmup_steps=0, clone_param_grads=True)
            np.testing.assert_equal(steps(graphed, 3), steps(eager, 3))
        [kept] = backward_storage(graphed.forward)
        self.assertEqual(kept, ROW + 4 * PARAM + 4 * PARAM)
        [plan] = graphed.forward.entry().graphs.current.plans()
        self.assertEqual([idxs for _, idxs in plan.groups], [[0, 1, 2, 3]])


class HostPeakTest(unittest.TestCase):
    """What a GPU pool keeps is the peak of its capture: on the CPU, Paddle's host allocator counts the same peak."""

    def test_the_backward_capture_peaks_at_the_stack_and_about_one_grad(self):
        core = paddle.base.core
        if not hasattr(core, "host_memory_stat_reset_peak_value"):
            self.skipTest("this Paddle cannot reset its host memory peak")
        width, peaks = 256, []
        original = simulated._SimulatedGraph.capture

        def measured(graph, body, hooks=()):
            core.host_memory_stat_reset_peak_value("Allocated", 0)
            base = core.host_memory_stat_current_value("Allocated", 0)
            result = original(graph, body, hooks)
            peaks.append(core.host_memory_stat_peak_value("Allocated", 0) - base)
            return result

        graphed = build(lambda: MatMLP([width] * 5), 0)
        from paddlefleet.cudagraph import autocudagraph

        autocudagraph(graphed, backend="simulate", warmup_steps=0)
        draw = normal(2)
        with mock.patch.object(simulated._SimulatedGraph, "capture", measured):
            graphed(host_tensor(draw(B, width), stop_gradient=False)).backward(host_tensor(draw(B, width)))
        grads = peaks[1] / (width * width * 4)  # the backward graph's capture, in parameter grads
        if stacks_as_grads_arrive():
            self.assertLess(grads, 5.5, "the stack of four and about one grad as computed")
        else:
            self.assertGreater(grads, 7.9, "four grads as computed and their stack")


class FinishTest(unittest.TestCase):
    def test_grads_of_another_dtype_than_their_parameters_get_a_stack_of_their_own(self):
        from paddlefleet.cudagraph.grads.stacks import Stacking

        leaves = [paddle.zeros([2, 3], dtype="float32") for _ in range(3)]
        stacking = Stacking([[0, 1, 2]])
        stacks = stacking.begin([], leaves)
        stacking.end()
        grads = [paddle.full([2, 3], float(i), dtype="float64") for i in range(2)] + [None]  # master grads
        [stack] = stacking.finish(grads, stacks)
        self.assertEqual(stack.dtype, paddle.float64)
        np.testing.assert_array_equal(stack.numpy()[:2], np.stack([g.numpy() for g in grads[:2]]))


class Tied(paddle.nn.Layer):
    """Four same-shape matmuls, one weight used twice (two edges: not hooked)."""

    def __init__(self):
        super().__init__()
        self.ws = paddle.nn.ParameterList([self.create_parameter([W, W]) for _ in range(3)])

    def forward(self, x):
        return paddle.matmul(paddle.matmul(paddle.matmul(paddle.matmul(x, self.ws[0]), self.ws[1]), self.ws[0]),
                             self.ws[2])


class OneUnused(paddle.nn.Layer):
    """Three same-shape weights, the third never used: its grad stays None."""

    def __init__(self):
        super().__init__()
        self.ws = paddle.nn.ParameterList([self.create_parameter([W, W]) for _ in range(3)])

    def forward(self, x):
        return paddle.matmul(paddle.matmul(x, self.ws[0]), self.ws[1])


class WithEmbedding(paddle.nn.Layer):
    """An embedding table of the matmuls' shape: its node has an index slot without an edge."""

    def __init__(self):
        super().__init__()
        self.table = self.create_parameter([W, W])
        self.ws = paddle.nn.ParameterList([self.create_parameter([W, W]) for _ in range(2)])

    def forward(self, x):
        ids = paddle.to_tensor(np.arange(B) % W, dtype="int64", place=x.place)
        return paddle.matmul(paddle.matmul(x, self.ws[0]), self.ws[1]) + F.embedding(ids, self.table)


@for_each_backend
class StackedGradsBitwiseTest(MatmulOnlyCase):

    @parameterized.expand([("auto", "auto"), ("aliases", False), ("copies", True)])
    def test_grads_equal_eager_under_each_policy_with_accumulation(self, _, policy):
        graphed, eager = self.twins(lambda: MatMLP([W] * 5), 0)
        self.graphed(graphed, warmup_steps=0, clone_param_grads=policy)
        self.assertBitwise(steps(graphed, 3, micro=2), steps(eager, 3, micro=2), "accumulated over micro-batches")
        self.assertBitwise(steps(graphed, 2), steps(eager, 2), "freed every step")
        self.assertEqual(graphed.forward.stats()["eager_calls"], 0, graphed.forward.explain())

    def test_a_hook_that_keeps_its_grad_sees_eager_s_values(self):
        graphed, eager = self.twins(lambda: MatMLP([W] * 5), 0)
        kept = {id(m): [] for m in (graphed, eager)}
        for model in (graphed, eager):
            model.layers[1].w.register_hook(lambda g, k=kept[id(model)]: k.append(g))
        self.graphed(graphed, warmup_steps=0)
        # Grads kept, not freed: what the hook kept is compared while it lives (freeing p.grad frees it in eager).
        self.assertBitwise(steps(graphed, 2, micro=2, free=False), steps(eager, 2, micro=2, free=False))
        self.assertBitwise([g.numpy() for g in kept[id(graphed)]], [g.numpy() for g in kept[id(eager)]], "kept")

    def test_a_wide_stacked_backward_equals_eager_and_reports_its_pool(self):
        """Four 512 x 512 matmuls (1 MiB grads, one stack): values bitwise; the pools each graph of the
        key made the process reserve go to the report (None on the simulated backend, which measures none)."""
        width = 512
        graphed, eager = self.twins(lambda: MatMLP([width] * 5), 0)
        self.graphed(graphed, warmup_steps=1)
        draw = normal(11)
        for step in range(4):
            x, dy = self.tensor(draw(B, width)), self.tensor(draw(B, width))
            got, want = graphed(x), eager(x)
            got.backward(dy)
            want.backward(dy)
            self.assertBitwise([got] + [p.grad for p in graphed.parameters()],
                               [want] + [p.grad for p in eager.parameters()], f"step {step}")
            for p in list(graphed.parameters()) + list(eager.parameters()):
                p.clear_gradient(False)
        self.assertCounters(graphed.forward, captures=1, replays=2, eager=0)
        graphs = graphed.forward.entry().graphs.current
        pools = [graphs.fwd_graph.pool_bytes] + [g.pool_bytes for g, _ in graphs.backward.sets.sets]
        mib = [None if b is None else round(b / 2**20, 2) for b in pools]
        RECORD.notes.append(f"pool MiB forward {mib[0]}, backward {mib[1:]} (grads 4 x 1 MiB in one stack; "
                            f"stacked as they arrive: {stacks_as_grads_arrive()})")

    @parameterized.expand([("tied", Tied), ("one_unused", OneUnused)])
    def test_grads_of_unhooked_or_unused_stacked_parameters_equal_eager(self, _, factory):
        graphed, eager = self.twins(factory, 0)
        self.graphed(graphed, warmup_steps=0)
        self.assertBitwise(steps(graphed, 3, micro=2), steps(eager, 3, micro=2))
        self.assertIsNone(graphed.ws[2].grad if factory is OneUnused else None)


class StackAndSingle(paddle.nn.Layer):
    """Three same-shape weights (one stack of grads) and one of its own shape (a single grad)."""

    def __init__(self):
        super().__init__()
        self.ws = paddle.nn.ParameterList([self.create_parameter([W, W]) for _ in range(3)])
        self.out = self.create_parameter([W, 4])

    def forward(self, x):
        for w in self.ws:
            x = paddle.matmul(x, w)
        return paddle.matmul(x, self.out)


@for_each_backend
class ReusedViewsTest(MatmulOnlyCase):
    """NOTE [ Reused aliases ] in grads/hand_out_plan.py, with only matmuls, copies and cuBLAS adds: grads accumulated
    over backwards (the first backward's views become p.grad, the later ones' are added into it from the second
    buffer set), freed once midway (the views p.grad had adopted are emptied). Every backward's grads bitwise eager's;
    the views are made where a fresh one is needed and reused otherwise."""

    def test_views_reused_while_untouched_and_made_again_once_freed(self):
        graphed, eager = self.twins(StackAndSingle, 0)
        self.graphed(graphed, warmup_steps=0)
        draw = normal(5)
        for step in range(8):
            x, dy = self.tensor(draw(B, W)), self.tensor(draw(B, 4))
            for model in (graphed, eager):
                model(x).backward(dy)
                if step == 4:
                    for p in model.parameters():
                        p.clear_gradient(False)
            self.assertBitwise([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()],
                               f"step {step}")
        plans = graphed.forward.entry().graphs.current.plans()
        made, reused = sum(p.views_made for p in plans), sum(p.views_reused for p in plans)
        # Views kept per stack and for the single grads together (a stack where grads are stacked as they arrive,
        # Paddle 3; on 2.6 the four grads are singles), per backward: made by the first backward (adopted as p.grad),
        # by the second (the second set), and after the free by the backward p.grad adopts again; else reused.
        kept = 2 if stacks_as_grads_arrive() else 1
        self.assertEqual((made, reused), (3 * kept, 8 * kept - 3 * kept), plans)
        self.assertCounters(graphed.forward, captures=1, replays=7, eager=0)


@for_each_backend
class EmbeddingStackTest(MatmulOnlyCase):
    kernels = "all"  # the embedding's and the add's kernels

    def test_a_table_grad_whose_node_is_not_hooked_is_copied_into_its_stack(self):
        graphed, eager = self.twins(WithEmbedding, 0)
        self.graphed(graphed, warmup_steps=0)
        self.assertBitwise(steps(graphed, 3, micro=2), steps(eager, 3, micro=2))


if __name__ == "__main__":
    unittest.main()


def run_loop(case, release, arrive=False, **options):
    """Both twins through 8 steps of forward and backward, then ``release(k, p)`` on every parameter after step
    ``k``, the key captured at the third step and grads compared after every step (``arrive``: whether grads may be
    stacked as they arrive; ``options``: the wrapper's); the groups of the graphed key's buffer sets."""
    graphed, eager = case.twins(lambda: MatMLP([W] * 5), 0)
    case.graphed(graphed, warmup_steps=2, **options)
    draw = normal(5)
    with mock.patch("paddlefleet.cudagraph.grads.stacks.stacks_as_grads_arrive", lambda: arrive):
        for step in range(8):
            x, dy = case.tensor(draw(B, W)), case.tensor(draw(B, W))
            for model in (graphed, eager):
                model(x).backward(dy)
            case.assertBitwise([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()],
                               f"step {step}")
            for model in (graphed, eager):
                for p in model.parameters():
                    release(step, p)
    case.assertCounters(graphed.forward, captures=1, eager=0)
    return [[idxs for _, idxs in plan.groups] for plan in graphed.forward.entry().graphs.current.plans()]


@for_each_backend
class StacksAfterBackwardTest(MatmulOnlyCase):
    """NOTE [ Stacks after paddle.grad only for copied grads ] in grads/stacks.py: where grads are stacked after
    paddle.grad (Paddle 2.6; forced here on Paddle 3 too), grads handed out as aliases go one by one in a loop that
    frees its grads and in one that keeps them; grads handed out as copies are stacked in both. Grads bitwise
    eager's every step, also in loops that change how they release grads after the capture."""

    def groups(self, frees, arrive=False, **options):
        """The groups of the graphed key's buffer sets after run_loop(), grads freed after step ``k`` where
        ``frees(k)``, else accumulated."""
        return run_loop(self, lambda k, p: p.clear_gradient(False) if frees(k) else None, arrive, **options)

    def test_aliases_in_a_loop_that_frees_its_grads_go_one_by_one(self):
        self.assertEqual(self.groups(lambda k: True), [[]], "one buffer set, no stack")

    def test_aliases_in_a_loop_that_keeps_its_grads_go_one_by_one(self):
        # One buffer set: grads added into the p.grad kept from the warmup are never adopted.
        self.assertEqual(self.groups(lambda k: k == 0), [[]], "no stack")

    def test_a_loop_that_stops_freeing_its_grads_after_the_capture(self):
        # The first accumulating backward adopts the views of one buffer set: the next writes the second one.
        self.assertEqual(self.groups(lambda k: k < 4), [[], []])

    def test_copies_are_stacked_in_either_loop(self):
        for frees in (lambda k: True, lambda k: k == 0):
            self.assertEqual(self.groups(frees, clone_param_grads=True), [[[0, 1, 2, 3]]])

    def test_stacks_made_as_grads_arrive_take_aliases_too(self):
        if not stacks_as_grads_arrive():
            self.skipTest("this Paddle has no node post hooks: its grads are stacked after paddle.grad")
        self.assertEqual(self.groups(lambda k: True, arrive=True), [[[0, 1, 2, 3]]])


@for_each_backend
class StacksAfterBackwardZeroedTest(MatmulOnlyCase):
    """The same for a loop that zeroes its grads (``clear_grad()``'s default; Paddle's fill kernel)."""

    kernels = "all"

    def test_aliases_in_a_loop_that_zeroes_its_grads_go_one_by_one(self):
        # Two buffer sets: a zeroed p.grad adopts the views a backward hands out, so the next writes the other set.
        self.assertEqual(run_loop(self, lambda k, p: p.clear_gradient(True)), [[], []], "no stack in either set")


@for_each_backend
class FreedViewsRepointedTest(MatmulOnlyCase):
    """NOTE [ Freed aliases re-pointed ] in grads/hand_out_plan.py, with only matmuls and copies: a loop that frees its
    grads after every step gets the views of the hand-out before the last filled again instead of made; grads bitwise
    eager's every step, and ``p.grad`` None after every free as eagerly."""

    def test_a_freeing_loop_fills_the_freed_views_again(self):
        graphed, eager = self.twins(StackAndSingle, 0)
        self.graphed(graphed, warmup_steps=0)
        draw = normal(6)
        for step in range(8):
            x, dy = self.tensor(draw(B, W)), self.tensor(draw(B, 4))
            for model in (graphed, eager):
                model(x).backward(dy)
            self.assertBitwise([p.grad for p in graphed.parameters()], [p.grad for p in eager.parameters()],
                               f"step {step}")
            for model in (graphed, eager):
                for p in model.parameters():
                    p.clear_gradient(False)
                self.assertEqual([p.grad for p in model.parameters()], [None] * 4, f"step {step}")
        plans = graphed.forward.entry().graphs.current.plans()
        made, repointed = sum(p.views_made for p in plans), sum(p.views_repointed for p in plans)
        kept = 2 if stacks_as_grads_arrive() else 1  # views kept per stack and for the single grads together
        self.assertEqual((made, repointed), (2 * kept, 6 * kept), plans)


class _Bridge(paddle.autograd.PyLayer):
    """``y = x @ w`` whose backward hands out ``plan``'s grads (the bridge's, without graphs)."""

    @staticmethod
    def forward(ctx, plan, x, w):
        ctx.plan = plan
        return paddle.matmul(x, w)

    @staticmethod
    def backward(ctx, dy):
        return ctx.plan.hand_out()


class _FreedViewStillPGrad:
    """NOTE [ Freed aliases re-pointed ]: a freed view that is still the parameter's grad slot (no backward adopted
    another grad since: here the last hand-out went elsewhere and was then emptied)."""

    def run_plan(self):
        from paddlefleet.cudagraph.grads.hand_out_plan import GradPlan

        w = paddle.create_parameter([W, 4], "float32")
        w.set_value(normal(1)(W, 4))
        gx, gw = self.tensor(normal(2)(B, W)), self.tensor(normal(3)(W, 4))
        plan = GradPlan([gx, gw], [True], [w], False)
        x, dy = self.tensor(normal(4)(B, W), grad=True), self.tensor(normal(5)(B, 4))
        _Bridge.apply(plan, x, w).backward(dy)  # views made, adopted as w.grad
        w.clear_gradient(False)
        for v in plan.hand_out()[1:]:  # views made for a backward that gave them elsewhere: w.grad stays freed
            v._clear_data()  # ... and then freed too
        _Bridge.apply(plan, x, w).backward(dy)
        return plan, w, self.tensor(normal(3)(W, 4))  # the static grad's values (a grad added to itself writes there)


@for_each_backend
class FreedViewStillPGradTest(_FreedViewStillPGrad, MatmulOnlyCase):
    """Such a view is not filled again, which would turn ``p.grad`` back on and double the next grad: it is made
    anew instead (the same run without the ``p.grad`` check: FreedViewStillPGradControlTest)."""

    def test_a_freed_view_still_held_as_p_grad_is_made_anew(self):
        plan, w, gw = self.run_plan()
        self.assertEqual((plan.views_made, plan.views_repointed), (3, 0))
        self.assertBitwise(w.grad, gw)


@for_each_backend
class FreedViewStillPGradControlTest(_FreedViewStillPGrad, MatmulOnlyCase):
    """The negative control: without the ``p.grad`` check the view is filled again and the grad added to itself
    (Paddle's add kernel)."""

    kernels = "all"

    def test_without_the_p_grad_check_the_grad_doubles(self):
        with mock.patch.object(paddle.Tensor, "grad", property(lambda self: None)):
            try:
                plan, w, gw = self.run_plan()
            except Exception:  # noqa: BLE001 - a grad added to itself may also fail outright
                return
        self.assertEqual(plan.views_repointed, 1)
        with self.assertRaises(AssertionError):
            self.assertBitwise(w.grad, gw)
