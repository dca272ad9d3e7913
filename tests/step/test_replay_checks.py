"""The cheap per-call checks of a replayed step catch what the per-item walks caught.

NOTE [ Step replay checks ] (step/replay_checks.py) fixes at capture what a replay checks and walks
it at C level. Each test here changes one thing between two calls of a replaying step and asks both
the new check and the walk it replaced (kept below as the oracle, as the code was) for their
verdict: they must agree, change by change.
"""

import threading
import unittest

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step, native
from paddlefleet.cudagraph.core.body import Action
from paddlefleet.cudagraph.core.call import Call
from paddlefleet.cudagraph.step.grad_slots import CLOSED, grad_ptr
from paddlefleet.cudagraph.guards.host_reads import BindingWatch, OpTrace

SCALE = 1.0  # a global the step reads (rebound by the tests)


def _old_blocker(body, graphs, tensors):
    """StepBody.blocker as it was before ReplayChecks: the per-item walks, for (action, reason);
    with the adopted inputs asked StaticInputs.moved() (NOTE [ Adopted inputs of a step ])."""
    if graphs.grad_mode != body.slots.mode:
        return Action.RECAPTURE, "the step started leaving grads between calls (gradient accumulation)"
    changed = BindingWatch.changed(graphs.bindings, body._bindings.snapshot())
    if changed is not None:
        return Action.EAGER, f"binding '{changed[0]}' changed since capture"
    for p, ptr in graphs.params:
        if p.data_ptr() != ptr:
            return Action.RECAPTURE, f"parameter {p.name} was replaced or moved"
    name = graphs.static_inputs.moved(tensors)
    if name is not None:
        return Action.RECAPTURE, f"input '{name}' is another tensor than the one the graph reads in place"
    if graphs.grad_mode == CLOSED:
        for p, ptr in body._between:
            if grad_ptr(p) != ptr:
                return Action.EAGER, "grads changed between calls"
    else:
        for p, ptr in graphs.watched:
            if grad_ptr(p) != ptr:
                return Action.RECAPTURE_ONCE, f"the grad storage of {p.name} was released or replaced"
    return None


def _batches(n, seed=4):
    rs = np.random.RandomState(seed)
    return [paddle.to_tensor(rs.standard_normal((4, 6)).astype("float32")) for _ in range(n)]


class _Replaying:
    """A closure step (model, optimizer, a factor in a cell, SCALE as a global) replaying its key."""

    def __init__(self, accumulate=False):
        paddle.seed(2)
        self.model = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 2))
        self.opt = paddle.optimizer.SGD(0.1, parameters=self.model.parameters())
        model, opt, factor = self.model, self.opt, paddle.to_tensor(0.5)

        def train_step(x, apply=True):
            loss = model(x).square().mean() * factor * SCALE
            loss.backward()
            if apply:
                opt.step()
                opt.clear_grad()
            return loss

        self.fn = train_step
        self.step = autocudagraph_step(train_step, optimizers=[opt], warmup_steps=2, backend="simulate")
        self.x = _batches(1)[0]
        for i in range(4 if not accumulate else 8):
            self.step(self.x, not accumulate or i % 2 == 1)
        self.apply = True  # the key the verdicts are asked for
        assert self.step.stats()["replays"] >= 1, self.step.explain()

    def verdicts(self, x=None):
        """(new, old) verdicts for the next call (with ``x``, default the batch tensor of every call
        so far): (action, reason) or None each."""
        body = self.step.body()
        call = Call((self.x if x is None else x, self.apply), {})
        entry = self._entry(call)
        new = body.blocker(entry, call)
        return (None if new is None else (new.action, new.reason)), _old_blocker(body, entry.graphs, call.tensors)

    def _entry(self, call):
        key = self.step._keys.key(call.args, call.kwargs, call.tensors, call.spec)
        return self.step.entry(key)


class ReplayChecksAgreeWithTheWalksTest(unittest.TestCase):
    def setUp(self):
        global SCALE
        SCALE = 1.0
        self.run_ = _Replaying()

    def assertAgree(self, expect_blocked):
        new, old = self.run_.verdicts()
        self.assertEqual(new, old)
        self.assertEqual(new is not None, expect_blocked, new)
        return new

    def test_nothing_changed(self):
        self.assertAgree(False)

    def test_a_global_rebound_to_an_equal_new_object(self):
        global SCALE
        SCALE = float("1.0")  # equal, not the same object: identity is what both compare
        self.assertEqual(self.assertAgree(True), (Action.EAGER, "binding 'SCALE' changed since capture"))

    def test_a_global_rebound(self):
        global SCALE
        SCALE = 2.0
        self.assertEqual(self.assertAgree(True), (Action.EAGER, "binding 'SCALE' changed since capture"))

    def test_a_global_deleted_and_an_unbound_one_bound(self):
        global SCALE
        del SCALE
        try:
            self.assertAgree(False)  # unbound now: changed() skips it, so does the check
        finally:
            SCALE = 1.0
        globals()["train_step"] = object()  # a name of the module, not read by the step
        try:
            self.assertAgree(False)
        finally:
            del globals()["train_step"]

    def test_a_closure_variable_rebound(self):
        cell = dict(zip(self.run_.fn.__code__.co_freevars, self.run_.fn.__closure__))["factor"]
        before = cell.cell_contents
        cell.cell_contents = paddle.to_tensor(0.5)
        try:
            self.assertEqual(self.assertAgree(True), (Action.EAGER, "binding 'factor' changed since capture"))
        finally:
            cell.cell_contents = before
        self.assertAgree(False)

    def test_a_closure_variable_emptied(self):
        cell = dict(zip(self.run_.fn.__code__.co_freevars, self.run_.fn.__closure__))["factor"]
        before = cell.cell_contents
        del cell.cell_contents
        try:
            self.assertAgree(False)  # gone from the snapshot: not a rebinding for either
        finally:
            cell.cell_contents = before

    def test_a_parameter_moved(self):
        p = self.run_.model.parameters()[0]
        moved = p.clone()
        moved._share_buffer_to(p)  # same values, other storage
        verdict = self.assertAgree(True)
        self.assertEqual(verdict[0], Action.RECAPTURE)
        self.assertIn(p.name, verdict[1])

    def test_another_tensor_where_the_graph_reads_an_adopted_one(self):
        self.assertTrue(self.run_.step.entry().graphs.static_inputs.adopted)
        other = self.run_.x.clone()  # same values and metadata, other storage
        new, old = self.run_.verdicts(other)
        self.assertEqual(new, old)
        self.assertEqual(new, (Action.RECAPTURE, "input 'x' is another tensor than the one the graph reads in place"))

    def test_a_non_contiguous_view_at_the_adopted_address(self):
        x = self.run_.x
        view = x.reshape([6, 4]).transpose([1, 0])  # shape [4, 6] again, strided where Paddle has views
        new, old = self.run_.verdicts(view)
        self.assertEqual(new, old)
        self.assertIsNotNone(new)

    def test_a_backward_between_calls(self):
        self.run_.model(self.run_.x).mean().backward()
        self.assertEqual(self.assertAgree(True), (Action.EAGER, "grads changed between calls"))

    def test_grads_released_under_persistent_slots_and_the_mode_change(self):
        acc = _Replaying(accumulate=True)
        self.run_ = acc
        self.assertAgree(False)
        acc.opt.clear_grad(set_to_zero=False)
        self.assertEqual(self.assertAgree(True)[0], Action.RECAPTURE_ONCE)

    def test_the_grad_slot_mode_changed(self):
        self.run_.step.body().slots.mode = "persistent"
        self.assertEqual(self.assertAgree(True)[0], Action.RECAPTURE)

    def test_a_parameter_frozen_and_unfrozen(self):
        p = self.run_.model.parameters()[1]
        p.stop_gradient = True
        frozen, _ = self.run_.verdicts()
        self.assertEqual(frozen[0], Action.REWARM)
        self.assertIn(f"parameter {p.name} was frozen", frozen[1])
        p.stop_gradient = False
        self.assertAgree(False)


class ReplayChecksInPythonAgreeTest(ReplayChecksAgreeWithTheWalksTest):
    """The same changes with every tensor read in Python (NOTE [ Compiled tensor reads ] in native/__init__.py: the
    walks of addresses and flags are compiled calls where the module is in use)."""

    def setUp(self):
        super().setUp()
        python_reads = native.disabled()
        python_reads.__enter__()
        self.addCleanup(python_reads.__exit__, None, None, None)


class BindingWatchFastCheckTest(unittest.TestCase):
    """unchanged_since() is True only where changed(snapshot, snapshot()) is None."""

    def test_every_binding_change_of_a_function_with_globals_and_cells(self):
        ns = {"a": [1], "b": object()}
        exec("def outer():\n    c = [2]\n    def f():\n        return a, b, c, d\n    return f\n", ns)
        f = ns["outer"]()
        watch = BindingWatch(f)
        snap = watch.snapshot()
        unchanged = watch.unchanged_since(snap)
        cell = f.__closure__[0]

        def agree():
            fast, slow = unchanged(), BindingWatch.changed(snap, watch.snapshot()) is None
            self.assertTrue(slow or not fast, "the fast check missed a change")
            return fast, slow

        self.assertEqual(agree(), (True, True))
        for change, undo in (
                (lambda: ns.__setitem__("a", [1]), lambda: ns.__setitem__("a", snap["a"])),
                (lambda: ns.__setitem__("d", 1), lambda: ns.pop("d")),
                (lambda: ns.pop("b"), lambda: ns.__setitem__("b", snap["b"])),
                (lambda: setattr(cell, "cell_contents", [2]), lambda: setattr(cell, "cell_contents", snap["c"]))):
            change()
            agree()
            undo()
            self.assertEqual(agree(), (True, True))

    def test_nothing_bound_needs_no_check(self):
        self.assertIsNone(BindingWatch(lambda x: x).unchanged_since({}))


class OpTraceThreadTest(unittest.TestCase):
    """Only the step's thread is traced: a DataLoader's prefetch thread collating the next batch
    (paddle.to_tensor of a list) while the step runs made a replay's trace differ from the capture's."""

    def test_ops_of_another_thread_are_not_recorded(self):
        with OpTrace() as trace:
            worker = threading.Thread(target=lambda: (paddle.to_tensor([1, 2]), paddle.ones([2]) + 1))
            worker.start()
            worker.join()
            paddle.to_tensor(2.0)
        self.assertEqual([op[0] for op in trace.ops], ["paddle.to_tensor"])
