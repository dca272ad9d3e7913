"""Pipeline parallel in one process: several forwards of one key in flight (NOTE [ Slots ] in
block/slots.py).

Two stages run four micro-batches per step under GPipe, 1F1B and interleaved 1F1B (two model
chunks per stage). Each chunk is a graphed Layer; a stage passes a detached copy of its output
to the next (as a pipeline's p2p receive makes a new leaf), and a backward runs the chunk's
output backward with the grad of the next chunk's input. A graphed twin and an eager twin run the
same schedule; testkit.differential compares losses, grads and every parameter and optimizer
state after every step bit for bit, and the chunks' stats() show replays once warm. Fleet's
PipelineLayer / PipelineParallel runs on two gloo ranks (tests/dist_scripts/pipeline_worker.py).
"""

import inspect
import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.options import GraphOptions
from testkit.differential import Trainee, differential_run
from tests.integration import test_distributed  # the module, not its classes: pytest would collect them here too

STAGES, MICRO, WIDTH = 2, 4, 8
STEPS = 4


class Chunk(paddle.nn.Layer):
    """One model chunk: Linear, GELU, dropout, Linear (dropout: its masks must equal eager's)."""

    def __init__(self, dropout=0.25):
        super().__init__()
        self.fc1 = paddle.nn.Linear(WIDTH, 2 * WIDTH)
        self.drop = paddle.nn.Dropout(dropout)
        self.fc2 = paddle.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(self.drop(paddle.nn.functional.gelu(self.fc1(x))))


# ----------------------------------------------------------------------------- schedules
def gpipe():
    """Per stage, its ops in order: every forward, then every backward."""
    return [[("F", 0, m) for m in range(MICRO)] + [("B", 0, m) for m in range(MICRO)] for _ in range(STAGES)]


def one_f_one_b(rank):
    """Per stage (rank): warmup forwards, then one forward one backward, then the backwards left."""
    warm = min(STAGES - rank - 1, MICRO)
    ops = [("F", 0, m) for m in range(warm)]
    f, b = warm, 0
    while f < MICRO:
        ops += [("F", 0, f), ("B", 0, b)]
        f, b = f + 1, b + 1
    return ops + [("B", 0, m) for m in range(b, MICRO)]


def interleaved(rank, chunks=2):
    """Interleaved 1F1B (Megatron's order): per stage, forwards of (local chunk, micro-batch) in
    groups of STAGES micro-batches per chunk, backwards the same with the chunks reversed."""
    order = [(c, m) for g in range(0, MICRO, STAGES) for c in range(chunks) for m in range(g, g + STAGES)]
    fwd = order
    bwd = [(chunks - 1 - c, m) for c, m in order]
    total = chunks * MICRO
    warm = min((STAGES - rank - 1) * 2 + (chunks - 1) * STAGES, total)
    ops = [("F",) + fwd[i] for i in range(warm)]
    f, b = warm, 0
    while f < total:
        ops += [("F",) + fwd[f], ("B",) + bwd[b]]
        f, b = f + 1, b + 1
    return ops + [("B",) + bwd[i] for i in range(b, total)]


SCHEDULES = {
    "gpipe": (lambda: gpipe(), 1),
    "1f1b": (lambda: [one_f_one_b(r) for r in range(STAGES)], 1),
    "interleaved": (lambda: [interleaved(r) for r in range(STAGES)], 2),
}


def run_schedule(per_stage, chunks, xs, ys):
    """Runs the stages' op lists, one op of one stage at a time, each as soon as what it needs
    has run (a forward: the previous chunk's forward of that micro-batch; a backward: the next
    chunk's backward). ``chunks[k]`` is model chunk k; stage s holds chunks s, s + STAGES, ...
    Returns the losses per micro-batch."""
    last = len(chunks) - 1
    outs, recvs, losses, done = {}, {}, {}, set()
    pos = [0] * len(per_stage)
    while any(p < len(ops) for p, ops in zip(pos, per_stage)):
        progressed = False
        for s, ops in enumerate(per_stage):
            if pos[s] == len(ops):
                continue
            kind, local, m = ops[pos[s]]
            k = s + local * STAGES
            if kind == "F":
                if k > 0 and ("F", k - 1, m) not in done:
                    continue
                x = xs[m] if k == 0 else recvs[(k, m)]
                outs[(k, m)] = chunks[k](x)
                if k < last:
                    recv = outs[(k, m)].detach()
                    recv.stop_gradient = False
                    recvs[(k + 1, m)] = recv
                else:
                    losses[m] = (outs[(k, m)] - ys[m]).square().mean() / MICRO
            else:
                if k < last and ("B", k + 1, m) not in done:
                    continue
                if k == last:
                    losses[m].backward()
                else:
                    paddle.autograd.backward([outs[(k, m)]], [recvs[(k + 1, m)].grad])
                outs.pop((k, m))
            done.add((kind, k, m))
            pos[s] += 1
            progressed = True
        assert progressed, "schedule deadlocked"
    return [losses[m] for m in range(MICRO)]


def batches(steps=STEPS):
    out = []
    for i in range(steps):
        rs = np.random.RandomState(100 + i)
        xs = [paddle.to_tensor(rs.randn(3, WIDTH).astype("float32")) for _ in range(MICRO)]
        ys = [paddle.to_tensor(rs.randn(3, WIDTH).astype("float32")) for _ in range(MICRO)]
        out.append((xs, ys, 1000 + i))
    return out


def builder(schedule, n_chunks):
    def build():
        paddle.seed(3)
        chunks = paddle.nn.LayerList([Chunk() for _ in range(n_chunks)])
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=chunks.parameters())

        def step(xs, ys, seed):
            paddle.seed(seed)  # both twins draw the same dropout masks
            losses = run_schedule(schedule(), chunks, xs, ys)
            grads = [p.grad.clone() for p in chunks.parameters()]
            opt.step()
            opt.clear_grad()
            return losses + grads
        return Trainee(step, {"chunks": chunks, "opt": opt})
    return build


class PipelineSchedulesTest(unittest.TestCase):
    """Graphed chunks match an eager run of the same schedule bit for bit; replays once warm."""

    def run_case(self, name, **options):
        schedule, per_stage = SCHEDULES[name]
        n_chunks = STAGES * per_stage
        options.setdefault("backend", "simulate")
        per_step = []

        def graph(trainee):
            for chunk in trainee.objects["chunks"]:
                autocudagraph(chunk, **options)
            return trainee.step

        def after_step(i, eager, graphed):
            per_step.append([dict(c.forward.stats()) for c in graphed.objects["chunks"]])

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the past-the-cap warning, where a case wants it
            differential_run(builder(schedule, n_chunks), batches(), graph, after_step=after_step)
        return per_step

    def assert_replays_once_warm(self, per_step, slots, accumulate=False):
        """The last step: every call of every chunk replays; ``slots``: slots per chunk. With
        ``accumulate`` (accumulate_in_graph) a key may be captured again once: forwards of one key
        in flight together count as sharing its parameters (NOTE [ Shared parameters leave the
        graph ] in grads/accumulate.py), whose grads then go through autograd."""
        last, before = per_step[-1], per_step[-2]
        for k, (a, b) in enumerate(zip(last, before)):
            self.assertEqual(a["replays"] - b["replays"], MICRO, (k, a))
            self.assertEqual(a["eager_calls"], 0, (k, a["eager_reasons"]))
            self.assertEqual(a["captures"] - b["captures"], 0, k)
            self.assertEqual(a["slots"], slots[k], (k, a["slot_bytes"]))
            if accumulate:
                self.assertLessEqual(a["recaptures"], 1, k)
            else:
                self.assertEqual(a["slot_captures"], slots[k] - 1, k)

    def test_gpipe(self):
        self.assertEqual(inspect.signature(GraphOptions).parameters["clone_param_grads"].default, "auto")
        self.assert_replays_once_warm(self.run_case("gpipe"), [MICRO] * STAGES)

    def test_1f1b(self):
        # Stage 0 has STAGES micro-batches in flight, the last stage one.
        self.assert_replays_once_warm(self.run_case("1f1b"), [STAGES, 1])

    def test_interleaved_two_chunks_per_stage(self):
        for options in ({}, {"clone_param_grads": False}, {"accumulate_in_graph": True}):
            with self.subTest(**options):
                per_step = self.run_case("interleaved", **options)
                last = per_step[-1]
                self.assertEqual(len(last), 2 * STAGES)
                # In this order model chunk k has at most 2 * STAGES - k forwards in flight.
                self.assert_replays_once_warm(per_step, [4, 3, 2, 1], "accumulate_in_graph" in options)

    def test_gpipe_every_grad_policy(self):
        # clone_param_grads="auto", the default, is test_gpipe (which checks it is the default).
        for options in ({"clone_param_grads": True}, {"clone_param_grads": False}, {"accumulate_in_graph": True}):
            with self.subTest(**options):
                self.assert_replays_once_warm(self.run_case("gpipe", **options), [MICRO] * STAGES,
                                              "accumulate_in_graph" in options)

    def test_gpipe_static_outputs_and_verified_replays(self):
        for options in ({"clone_outputs": False, "check_stale_outputs": True}, {"verify_replays": 6}):
            with self.subTest(**options):
                per_step = self.run_case("gpipe", **options)
                self.assert_replays_once_warm(per_step, [MICRO] * STAGES)
                if "verify_replays" in options:
                    self.assertEqual([s["verify_mismatches"] for s in per_step[-1]], [0] * STAGES)
                    self.assertEqual([s["verified_replays"] for s in per_step[-1]], [6] * STAGES)

    def test_1f1b_without_grad_copies(self):
        for options in ({"clone_param_grads": False}, {"accumulate_in_graph": True}):
            with self.subTest(**options):
                self.assert_replays_once_warm(self.run_case("1f1b", **options), [STAGES, 1],
                                              "accumulate_in_graph" in options)

    def test_past_max_inflight_runs_eagerly_with_the_reason(self):
        per_step = self.run_case("gpipe", max_inflight=2)
        last, before = per_step[-1], per_step[-2]
        for a, b in zip(last, before):
            self.assertEqual(a["slots"], 2)
            self.assertEqual(a["replays"] - b["replays"], 2)
            self.assertEqual(a["eager_calls"] - b["eager_calls"], MICRO - 2)
            self.assertEqual(set(a["eager_reasons"]), {"all 2 slots have a pending backward (max_inflight=2)"})

    def test_max_inflight_one_is_one_forward_in_flight(self):
        per_step = self.run_case("1f1b", max_inflight=1)
        self.assertEqual(per_step[-1][0]["slots"], 1)
        self.assertEqual(per_step[-1][1]["eager_calls"], 0)  # the last stage never has two in flight


class SlotsApiTest(unittest.TestCase):
    def setUp(self):
        paddle.seed(0)
        self.layer = paddle.nn.Linear(4, 4)

    def test_max_inflight_is_checked_at_decoration(self):
        with self.assertRaisesRegex(ValueError, r"max_inflight must be >= 1, got 0.*max_inflight=4"):
            autocudagraph(paddle.nn.Linear(2, 2), max_inflight=0)
        with self.assertRaisesRegex(TypeError, r"max_inflight must be an int, got '2'"):
            autocudagraph(max_inflight="2")

    def test_slot_bytes_in_stats_and_explain(self):
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        xs = [paddle.randn([2, 4]) for _ in range(3)]
        ys = [layer(x) for x in xs]  # three forwards in flight: three slots
        stats = layer.forward.stats()
        self.assertEqual(stats["slots"], 3)
        (sizes,) = stats["slot_bytes"].values()
        self.assertEqual(len(sizes), 3)
        self.assertEqual(sum(sizes), stats["static_bytes"])
        self.assertGreater(min(sizes), 0)
        self.assertIn(f"{stats['static_bytes']} static bytes in 3 slots of {sizes[0]} static bytes each",
                      layer.forward.explain())
        for y in reversed(ys):
            y.sum().backward()
        self.assertEqual(layer.forward.stats()["slots"], 3)

    def test_a_slots_record_is_read_through_the_slot(self):
        """The key's Slots answer for all slots together; a slot's own record (static inputs, graphs)
        is read through ``graphs.current`` or ``graphs.all``, never answered for the latest slot."""
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        ys = [layer(paddle.randn([2, 4])) for _ in range(2)]  # two forwards in flight: two slots
        slots = layer.forward.entry().graphs
        self.assertIs(slots.current, slots.all[1])
        self.assertIsNotNone(slots.current.static_inputs)
        with self.assertRaisesRegex(AttributeError, r"no attribute 'static_inputs'.*graphs\.current\.static_inputs"):
            slots.static_inputs
        for y in ys:
            y.sum().backward()

    def test_backwards_in_any_order_get_their_own_forward(self):
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        xs = [paddle.randn([2, 4]) for _ in range(4)]
        for x in xs:
            x.stop_gradient = False
        order = [2, 0, 3, 1]
        got, want = [layer(x) for x in xs], [eager(x) for x in xs]
        for i in order:
            (got[i] * (i + 1)).sum().backward()
            (want[i] * (i + 1)).sum().backward()
        for a, b in [(self.layer.weight.grad, eager.weight.grad), (self.layer.bias.grad, eager.bias.grad)]:
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        self.assertEqual(layer.forward.stats()["slots"], 4)

    def three_in_flight(self, **options):
        """Three forwards of one key, then their backwards; checks outputs and grads against eager
        and returns the wrapper's stats."""
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0, **options)
        xs = [paddle.randn([2, 4]) for _ in range(3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [layer(x) for x in xs]
        want = [eager(x) for x in xs]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        for y in got + want:
            y.sum().backward()
        np.testing.assert_array_equal(self.layer.weight.grad.numpy(), eager.weight.grad.numpy())
        self.caught = [str(w.message) for w in caught]
        return layer.forward.stats()

    def test_a_slot_beyond_max_bytes_is_not_made(self):
        one = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=0)
        one(paddle.randn([2, 4])).sum().backward()
        budget = one.forward.stats()["static_bytes"] + 8
        stats = self.three_in_flight(max_bytes=budget)
        self.assertEqual((stats["slots"], stats["eager_calls"]), (1, 2))
        self.assertEqual(stats["eager_reasons"], {
            "a new slot would exceed max_bytes": 1,
            f"every slot has a pending backward and no further slot is made: another slot needs "
            f"{budget - 8} bytes, and the key's slots would exceed max_bytes={budget}": 1})
        self.assertTrue(any("Raise max_bytes, or lower max_inflight" in m for m in self.caught), self.caught)

    def test_a_failed_slot_capture_leaves_the_key_its_slots(self):
        from paddlefleet.cudagraph.block import graphed

        real, calls = graphed.capture_block, []

        def failing_second(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("no memory for another pool")
            return real(*args, **kwargs)

        graphed.capture_block = failing_second
        try:
            stats = self.three_in_flight()
        finally:
            graphed.capture_block = real
        self.assertEqual((stats["slots"], stats["captures"], stats["eager_calls"]), (1, 1, 2))
        self.assertIn("capture of a new slot failed", stats["eager_reasons"])
        self.assertTrue(any("no memory for another pool" in m for m in self.caught), self.caught)

    def evaluate(self, layer, eager, kept, n=6):
        """``n`` calls of ``layer`` in grad mode whose outputs get no backward (evaluation without
        paddle.no_grad()): each output freed before the next call but one, or all ``kept`` (a loss summed
        over the evaluation); checks each against ``eager``; returns the warnings."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            total = []
            for _ in range(n):
                x = paddle.randn([2, 4])
                out = layer(x)
                np.testing.assert_array_equal(out.numpy(), eager(x).numpy())
                if kept:
                    total.append(out)
        return [str(w.message) for w in caught]

    def test_evaluation_without_no_grad_captures_no_slot_for_outputs_never_backwarded(self):
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        self.assertEqual(self.evaluate(layer, eager, kept=False), [])
        self.assertEqual(layer.forward.stats()["slots"], 2)  # a call while the previous output lived
        messages = self.evaluate(layer, eager, kept=True)
        stats = layer.forward.stats()
        self.assertEqual((stats["slots"], stats["eager_calls"]), (2, 4))
        self.assertEqual(stats["eager_reasons"], {
            "outputs needed grad but no backward came for earlier calls, and every slot waits for one": 4})
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("earlier call(s) returned outputs that needed grad, but no backward came for them", messages[0])
        self.assertIn("run them under paddle.no_grad() (after model.eval())", messages[0])
        self.assertNotIn("max_inflight", messages[0])
        self.assertIn("no backward", layer.forward.explain())

    def test_past_max_inflight_without_any_backward_suggests_no_grad(self):
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0, max_inflight=2)
        messages = self.evaluate(layer, eager, kept=True, n=4)
        self.assertEqual(layer.forward.stats()["slots"], 2)
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("No backward has come for any call of this key yet: if these calls are evaluation or "
                      "inference, run them under paddle.no_grad()", messages[0])

    def test_pipeline_after_evaluation_without_no_grad_gets_its_slots(self):
        # Outputs freed without backward, then three micro-batches in flight per step: the first step runs
        # the third eagerly (no backward has come since), the next captures its slot, the last replays all.
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        self.evaluate(layer, eager, kept=False)
        for step in range(3):
            xs = [paddle.randn([2, 4]) for _ in range(3)]
            before = layer.forward.stats()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                got = [layer(x) for x in xs]
            want = [eager(x) for x in xs]
            for g, w in zip(got + want, want + want):
                np.testing.assert_array_equal(g.numpy(), w.numpy())
                g.sum().backward()
            np.testing.assert_array_equal(self.layer.weight.grad.numpy(), eager.weight.grad.numpy())
            after = layer.forward.stats()
            delta = [after[k] - before[k] for k in ("replays", "slot_captures", "eager_calls")]
            self.assertEqual(delta, [[2, 0, 1], [2, 1, 0], [3, 0, 0]][step], step)

    def test_release_keeps_a_pending_slot_for_its_backward(self):
        eager = paddle.nn.Linear(4, 4)
        eager.set_state_dict(self.layer.state_dict())
        layer = autocudagraph(self.layer, backend="simulate", warmup_steps=0)
        x = paddle.randn([2, 4])
        y1, y2 = layer(x), layer(x * 2)
        layer.forward.reset()  # drops the key; both slots' backwards are pending
        y2.sum().backward()
        y1.sum().backward()
        eager(x).sum().backward()
        eager(x * 2).sum().backward()
        np.testing.assert_array_equal(self.layer.weight.grad.numpy(), eager.weight.grad.numpy())


@unittest.skipIf(paddle.is_compiled_with_cuda(), "CPU/gloo test; on GPUs run tools/gpu_check.py")
class TestFleetPipelineTwoRanks(test_distributed.TwoRankJob):
    """Fleet's PipelineLayer / PipelineParallel (1F1B) on two gloo ranks, blocks graphed
    (tests/dist_scripts/pipeline_worker.py; NOTE [ Fleet pipeline parallel on the CPU ] there)."""

    WORKER = test_distributed.ROOT / "tests" / "dist_scripts" / "pipeline_worker.py"

    def test_job_exited_cleanly(self):
        self.assertEqual(self.rc, 0, self.logs_text())

    def check(self, name, slots):
        """Bitwise against eager (the worker checks); the last step replays every micro-batch;
        ``slots``: per rank, the slots of each block (stage 0 has two micro-batches in flight)."""
        results = self.case(name)
        for rank, r in enumerate(results):
            for block in r["blocks"]:
                self.assertEqual((block["replays"], block["eager_calls"], block["slots"]), (4, 0, slots[rank]),
                                 (rank, r["blocks"]))

    def test_one_f_one_b(self):
        self.check("one_f_one_b", slots=[2, 1])

    def test_one_f_one_b_accumulate_in_graph(self):
        self.check("one_f_one_b_accumulate_in_graph", slots=[2, 1])

    def test_max_inflight_one_runs_stage_zero_half_eagerly(self):
        r0, r1 = self.case("one_f_one_b_max_inflight_one")
        for block in r0["blocks"]:
            self.assertEqual((block["replays"], block["eager_calls"], block["slots"]), (2, 2, 1), r0)
            self.assertEqual(set(block["reasons"]), {"all 1 slots have a pending backward (max_inflight=1)"})
        for block in r1["blocks"]:
            self.assertEqual((block["replays"], block["eager_calls"]), (4, 0), r1)


if __name__ == "__main__":
    unittest.main()
