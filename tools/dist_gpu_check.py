"""Two-GPU data-parallel check of autocudagraph with NCCL, bitwise against eager.

On a host with two GPUs and a GPU build of Paddle (README.md, "Install on a GPU")::

    python tools/dist_gpu_check.py --out docs/reports/dist_gpu_check.md

launches every case as its own two-rank job (``python -m paddle.distributed.launch --gpus
0,1``, so a rank that aborts cannot take the other cases with it), reads the ``RESULT`` lines
of both ranks' logs and prints a report. A single job can also be launched by hand::

    python -m paddle.distributed.launch --gpus 0,1 tools/dist_gpu_check.py --rank-cases all

CPU smoke test of the same script (two CPU ranks, gloo, simulated backend)::

    python tools/dist_gpu_check.py --backend simulate

What runs on the GPU is limited to what Paddle 2.6.2 can do on Hopper (sm_90): cuBLAS matmuls
and copies, plus NCCL, whose kernels come with NCCL itself (untested on that GPU until this
runs). So the models are chains of matmuls (no bias, no activation, each tensor used once so
backward adds nothing), data and parameters are made with numpy and copied in, loss grads are
passed explicitly (``y.backward(dy)``), grads are released with ``clear_gradient(False)``
(zeroing would need a fill kernel), and the data-parallel all-reduce is a SUM over the grads
done by hand: ``paddle.DataParallel``'s reducer concatenates and scales grads with Paddle's own
kernels, which 2.6.2 lacks for sm_90.

Exit code: 0 when every case that ran passed on both ranks (a case this backend cannot run is
reported as SKIP, not as a pass), 1 otherwise, 2 when asked for the cuda backend on a host with
fewer than two GPUs.
"""

import argparse
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.autograd import PyLayer  # noqa: E402

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step  # noqa: E402
from paddlefleet.cudagraph.core import host_cost  # noqa: E402
from paddlefleet.cudagraph.options import ENV_BACKEND  # noqa: E402
from testkit.cli import BACKEND_HELP, require_gpu  # noqa: E402
from testkit.common import (  # noqa: E402
    MatMLP,
    bitwise_failures,
    build,
    check_smoke_path,
    close_error,
    eager_calls,
    host_tensor,
    info_lines,
    normal,
    run_info,
    write_generated,
)

BACKEND = "cuda"
#: Steps of a case: a key judged by eager_if_slower takes its SAMPLES eager calls (warmup included)
#: before its capture (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py), then replays.
STEPS = host_cost.SAMPLES + 4
CASES = {}


def case(name):
    def deco(fn):
        CASES[name] = fn
        return fn

    return deco


# ----------------------------------------------------------------------------- helpers
T = host_tensor  # a tensor on this rank's device from numpy: a host-to-device copy, no kernel
rng = normal


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


class Check:
    """Bitwise comparisons of one case; failures are collected, not raised."""

    def __init__(self):
        self.failures, self.notes, self.compared = [], [], 0
        self.skipped = None  # why the case did not run here, when it did not

    def skip(self, reason):
        self.skipped = reason

    def bitwise(self, what, actual, expected):
        compared, failures = bitwise_failures(actual, expected, what)
        self.compared += compared
        self.failures += failures

    def close(self, what, actual, reference, rtol=2e-2):
        """Loose check against numpy float64: kernels that silently compute garbage fail it."""
        err = close_error(actual, reference)
        if not err <= rtol:
            self.failures.append(f"{what}: differs from numpy by {err:.3g} (relative)")

    def phases(self, wrapper, captures, replays):
        """That the graphs engaged; the counters pinned only where ``eager_if_slower`` is off (its timed
        eager calls, and its verdict, depend on this host's timing: NOTE [ Graphed calls that cannot pay ]
        in paddlefleet/cudagraph/core/host_cost.py)."""
        s = wrapper.stats()
        got = (s["captures"], s["replays"], eager_calls(s))
        if not wrapper.options.eager_if_slower:
            if got != (captures, replays, 0):
                self.failures.append(f"(captures, replays, eager calls) {got} != {(captures, replays, 0)}: "
                                     f"{wrapper.explain()}")
        else:
            self.engaged(wrapper)
        self.notes.append(f"captures={s['captures']} replays={s['replays']} eager={eager_calls(s)}")

    def engaged(self, wrapper):
        """A capture and a replay were made, and every eager call after warmup is one eager_if_slower made."""
        s = wrapper.stats()
        if s["captures"] < 1 or s["replays"] < 1:
            self.failures.append(f"graphs never engaged (captures={s['captures']}, replays={s['replays']}): "
                                 f"{wrapper.explain()}")
        other = [r for r in s["eager_reasons"] if not timing_reason(r)]
        if other:
            self.failures.append(f"eager calls for other reasons than eager_if_slower: {other}: {wrapper.explain()}")


def timing_reason(reason):
    """Whether an eager call's reason is eager_if_slower's (a timed eager call, or a key found slower)."""
    return reason in (host_cost.TIMED, host_cost.ALL_SLOWER) or "cost more host time than its eager calls" in reason


def all_reduce_sum(t, calc_stream):
    """SUM all-reduce in place. ``calc_stream``: NCCL on the compute stream (the capture-friendly
    form); otherwise Paddle's default, NCCL on its communication stream joined by events."""
    if calc_stream:
        dist.stream.all_reduce(t, op=dist.ReduceOp.SUM, sync_op=True, use_calc_stream=True)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def MatChain(dims, seed):
    """x @ w0 @ w1 @ ...: parameters made on the CPU from numpy, then copied to the device."""
    return build(lambda: MatMLP(dims), seed)


# ----------------------------------------------------------------------------- cases
@case("sanity")
def case_sanity(chk, rank, world):
    """Eager matmul and NCCL all-reduce against numpy: do the kernels this check needs run?"""
    draw = rng(10 + rank)
    xn, wn = draw(16, 64), draw(64, 32)
    y = paddle.matmul(T(xn), T(wn))
    chk.close("matmul", y.numpy(), xn.astype("float64") @ wn)
    parts = [rng(10 + r)(8, 8) for r in range(world)]
    t = T(parts[rank])
    all_reduce_sum(t, calc_stream=False)
    chk.close("all_reduce (communication stream)", t.numpy(), np.sum(parts, axis=0, dtype="float64"), 1e-5)
    if BACKEND == "cuda":
        t = T(parts[rank])
        all_reduce_sum(t, calc_stream=True)
        chk.close("all_reduce (compute stream)", t.numpy(), np.sum(parts, axis=0, dtype="float64"), 1e-5)
    return {"replicated": digest([t.numpy()])}


@case("data_parallel_by_hand")
def case_data_parallel(chk, rank, world):
    """A graphed matmul chain per rank; grads summed over ranks by NCCL outside the graph."""
    dims = [32, 64, 48, 16]
    graphed, eager = MatChain(dims, seed=1), MatChain(dims, seed=1)  # same init on both ranks
    autocudagraph(graphed, backend=BACKEND, warmup_steps=1)
    draw = rng(100 + rank)  # each rank its own batch
    summed = []
    for step in range(STEPS):
        xn, dyn = draw(8, dims[0]), draw(8, dims[-1])
        ys = []
        for model in (graphed, eager):
            [p.clear_gradient(False) for p in model.parameters()]
            y = model(T(xn))
            y.backward(T(dyn))
            for w in model.parameters():
                all_reduce_sum(w.grad, calc_stream=False)
            ys.append(y)
        chk.bitwise(f"step {step} y", *ys)
        for i, (a, e) in enumerate(zip(graphed.parameters(), eager.parameters())):
            chk.bitwise(f"step {step} summed w{i}.grad", a.grad, e.grad)
        summed += [w.grad.numpy() for w in graphed.parameters()]
    chk.phases(graphed.forward, captures=1, replays=STEPS - 2)
    return {"replicated": digest(summed)}


class ReduceFromParallel(PyLayer):
    """Row-parallel output: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, calc_stream):
        return all_reduce_sum(x.clone(), calc_stream)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _all_reduce_in_graph(chk, rank, calc_stream):
    def row_parallel(x, w1, w2_shard):
        return ReduceFromParallel.apply(paddle.matmul(paddle.matmul(x, w1), w2_shard), calc_stream)

    graphed = autocudagraph(row_parallel, backend=BACKEND, warmup_steps=1)
    draw = rng(200 + rank)  # each rank its own shards
    shards = [draw(16, 32, scale=0.2), draw(32, 8, scale=0.2)]
    wa = [T(s, stop_gradient=False) for s in shards]
    we = [T(s, stop_gradient=False) for s in shards]
    common = rng(300)  # the same input and output grad on every rank
    outs = []
    for step in range(STEPS):
        xn, dyn = common(4, 16), common(4, 8)
        for w in wa + we:
            w.clear_gradient(False)
        xa, xe = T(xn, False), T(xn, False)
        ya, ye = graphed(xa, *wa), row_parallel(xe, *we)
        ya.backward(T(dyn))
        ye.backward(T(dyn))
        chk.bitwise(f"step {step} y (all-reduced in the graph)", ya, ye)
        chk.bitwise(f"step {step} x.grad", xa.grad, xe.grad)
        for i, (a, e) in enumerate(zip(wa, we)):
            chk.bitwise(f"step {step} w{i}.grad", a.grad, e.grad)
        outs.append(ya.numpy())
    chk.phases(graphed, captures=1, replays=STEPS - 2)
    return {"replicated": digest(outs)}


@case("all_reduce_in_graph_compute_stream")
def case_in_graph_calc(chk, rank, world):
    if BACKEND != "cuda":
        chk.skip("gloo has no compute-stream all_reduce")
        return {}
    return _all_reduce_in_graph(chk, rank, calc_stream=True)


@case("all_reduce_in_graph_comm_stream")
def case_in_graph_comm(chk, rank, world):
    return _all_reduce_in_graph(chk, rank, calc_stream=False)


@case("forward_only_in_place_all_reduce")
def case_forward_only(chk, rank, world):
    def reduce_matmul(x, w):
        y = paddle.matmul(x, w)
        return all_reduce_sum(y, calc_stream=BACKEND == "cuda")

    graphed = autocudagraph(reduce_matmul, backend=BACKEND, warmup_steps=1)
    draw = rng(400 + rank)
    outs = []
    with paddle.no_grad():
        for step in range(STEPS):
            x, w = T(draw(8, 16)), T(draw(16, 8))
            ya, ye = graphed(x, w), reduce_matmul(x, w)
            chk.bitwise(f"step {step} y", ya, ye)
            outs.append(ya.numpy())
    chk.phases(graphed, captures=1, replays=STEPS - 2)
    return {"replicated": digest(outs)}


# ----------------------------------------------------------------------------- the whole step
class DataParallelStep:
    """A whole training step of a matmul chain with the data-parallel all-reduce inside it: the
    grads of ``micro`` micro-batches stacked and summed by a matmul (NOTE [ SGD from matmuls ] in
    testkit/step_gpu.py: an elementwise add has no kernel on Hopper with Paddle 2.6.2) with no
    all-reduce in between (what ``no_sync`` does), then one SUM all-reduce per grad (NCCL on the
    compute stream on cuda: inside the graph), then ``W - lr * G`` as one matmul; grads released.
    Only ``backward()``, copies, matmuls and the all-reduce: what step_gpu_check proves capturable
    (``paddle.grad`` and assigning ``p.grad`` are not used)."""

    def __init__(self, model, micro, lr=1e-2, via=None):
        self.model, self.micro, self.lr, self.via = model, micro, lr, via
        self.params = list(model.parameters())
        self._stack = [T(np.zeros((micro * p.shape[0], p.shape[1]), "float32")) for p in self.params]
        self._sum = [T(np.hstack([np.eye(p.shape[0])] * micro).astype("float32")) for p in self.params]
        self._wg = [T(np.zeros((2 * p.shape[0], p.shape[1]), "float32")) for p in self.params]
        self._update = [T(np.hstack([np.eye(p.shape[0]), -lr * np.eye(p.shape[0])]).astype("float32"))
                        for p in self.params]

    def __call__(self, *batches):
        for k in range(self.micro):
            if self.via == "paddle.grad":  # the probe below: grads returned instead of accumulated
                grads = paddle.grad([self.model(batches[2 * k])], self.params, [batches[2 * k + 1]])
            else:
                self.model(batches[2 * k]).backward(batches[2 * k + 1])
                grads = [p.grad for p in self.params]
            for p, g, stack in zip(self.params, grads, self._stack):
                n = p.shape[0]
                stack._slice(k * n, (k + 1) * n).copy_(g, False)
                p.clear_gradient(False)  # released: the next micro-batch's grad is assigned, not added
        for p, stack, total, wg, update in zip(self.params, self._stack, self._sum, self._wg, self._update):
            n = p.shape[0]
            g = all_reduce_sum(paddle.matmul(total, stack), calc_stream=BACKEND == "cuda")
            if self.via == "grad assignment":  # the probe below: the summed grad handed to p.grad
                p.grad = g
                g = p.grad
            wg._slice(0, n).copy_(p, False)
            wg._slice(n, 2 * n).copy_(g, False)
            p.copy_(paddle.matmul(update, wg), False)
            if self.via == "grad assignment":
                p.clear_gradient(False)
        return self.params[0]


def _batches(rank, dims, micro):
    draw = rng(600 + rank)  # each rank its own batches
    return [[draw(8, dims[0]) if i % 2 == 0 else draw(8, dims[-1], scale=0.1) for i in range(2 * micro)]
            for _ in range(3)]


def _numpy_training(dims, micro, steps, world, lr):
    """The same training in float64 numpy, every rank's batches summed: catches kernels that
    return garbage on both sides of a bitwise comparison."""
    ws = [w.numpy().astype("float64") for w in MatChain(dims, seed=3).parameters()]
    data = [_batches(r, dims, micro) for r in range(world)]
    for step in range(steps):
        total = [np.zeros_like(w) for w in ws]
        for r in range(world):
            batch = data[r][step % 3]
            for k in range(micro):
                acts = [batch[2 * k].astype("float64")]
                for w in ws:
                    acts.append(acts[-1] @ w)
                g = batch[2 * k + 1].astype("float64")
                for i in reversed(range(len(ws))):
                    total[i] += acts[i].T @ g
                    g = g @ ws[i].T
        ws = [w - lr * t for w, t in zip(ws, total)]
    return ws


def _whole_step(chk, rank, micro, steps=20, via=None):
    dims = [32, 64, 48, 16]
    eager = DataParallelStep(MatChain(dims, seed=3), micro, via=via)  # the same init on both ranks
    body = DataParallelStep(MatChain(dims, seed=3), micro, via=via)
    graphed = autocudagraph_step(body, optimizers=[], warmup_steps=2, backend=BACKEND)
    data = [[T(a) for a in batch] for batch in _batches(rank, dims, micro)]
    params = []
    for step in range(steps):
        batch = data[step % 3]
        eager(*batch)
        graphed(*batch)
        for i, (a, e) in enumerate(zip(body.params, eager.params)):
            chk.bitwise(f"step {step} w{i} after the update", a, e)
        params.append(np.concatenate([p.numpy().ravel() for p in body.params]))
    reference = _numpy_training(dims, micro, steps, world=2, lr=body.lr)
    chk.close("parameters after training vs numpy float64", params[-1], np.concatenate([w.ravel() for w in reference]))
    s = graphed.stats()
    if via is None and (s["captures"], s["replays"]) != (1, steps - 3):
        chk.failures.append(f"(captures, replays) {(s['captures'], s['replays'])} != {(1, steps - 3)}: {graphed.explain()}")
    chk.notes.append(f"captures={s['captures']} replays={s['replays']} eager={eager_calls(s)}")
    if via is not None:  # a probe: contained (bitwise, above) whether or not it graphs; say which
        reasons = [r for r in s["eager_reasons"] if r.startswith("key fell back")]
        chk.notes.append(f"graphed: {'no, ' + reasons[0][:160] if reasons else 'yes'}")
    return {"replicated": digest(params)}


@case("whole_step_all_reduce_in_graph")
def case_whole_step(chk, rank, world):
    """The whole step (forward, backward, all-reduce, SGD) as one graph per rank, 20 steps."""
    return _whole_step(chk, rank, micro=1)


@case("whole_step_probe_paddle_grad")
def case_whole_step_paddle_grad(chk, rank, world):
    """Probe: the same step with paddle.grad instead of backward(); bitwise either way (a capture the
    device refuses falls back), the note says whether it graphed."""
    return _whole_step(chk, rank, micro=1, via="paddle.grad")


@case("whole_step_probe_grad_assignment")
def case_whole_step_grad_assignment(chk, rank, world):
    """Probe: the same step assigning the all-reduced grad to p.grad; the note says whether it graphed."""
    return _whole_step(chk, rank, micro=1, via="grad assignment")


@case("whole_step_no_sync_accumulation")
def case_whole_step_accumulation(chk, rank, world):
    """Two micro-batches accumulated without an all-reduce between them, then one all-reduce."""
    return _whole_step(chk, rank, micro=2)


# ----------------------------------------------------------------------------- pipeline stages
def _p2p(t, peer, send):
    """Blocking point-to-point transfer of ``t`` (NCCL on GPUs, gloo on the CPU)."""
    if send:
        dist.send(t, dst=peer)
    else:
        dist.recv(t, src=peer)
    return t


def _stage_schedule(model, rank, order, inputs, dys, width_in, width_out):
    """Runs this rank's stage of a two-stage pipeline in ``order`` ([("F", i) | ("B", i)]):
    stage 0 sends each forward's output to stage 1 and receives the grad of it back; stage 1
    receives its input, runs the loss grad ``dys[i]`` backward and sends its input's grad back.
    Returns ``(outputs, param_grads)`` per micro-batch (grads read and released after each
    backward: accumulating them would need an add kernel)."""
    held, outs, grads = {}, {}, {}
    params = list(model.parameters())
    for kind, i in order:
        if kind == "F":
            if rank == 0:
                x = T(inputs[i])
            else:
                x = _p2p(T(np.zeros((inputs[i].shape[0], width_in), "float32")), 0, send=False)
                x.stop_gradient = False
            y = model(x)
            if rank == 0:
                _p2p(y, 1, send=True)
            held[i] = (x, y)
            outs[i] = y.numpy()
        else:
            x, y = held.pop(i)
            dy = T(dys[i]) if rank == 1 else _p2p(T(np.zeros((y.shape[0], width_out), "float32")), 1, send=False)
            y.backward(dy)
            if rank == 1:
                _p2p(x.grad, 0, send=True)
            grads[i] = [p.grad.numpy() for p in params]
            for p in params:
                p.clear_gradient(False)
    return outs, grads


@case("pipeline_two_stages")
def case_pipeline(chk, rank, world):
    """A two-stage pipeline, one stage per rank, activations and grads sent between the ranks;
    each stage a graphed matmul chain with slots (max_inflight=4): GPipe (all forwards, then all
    backwards) and the backwards in reverse order, 3 rounds of 4 micro-batches, bitwise against
    the same schedule eagerly."""
    dims = [[32, 64, 48], [48, 40, 16]][rank]
    graphed, eager = MatChain(dims, seed=20 + rank), MatChain(dims, seed=20 + rank)
    # eager_if_slower off: the last round pins that every micro-batch replays (its slots are the point here).
    autocudagraph(graphed, backend=BACKEND, warmup_steps=1, max_inflight=4, eager_if_slower=False)
    common = rng(900)  # the same micro-batches on both ranks (stage 0 reads the inputs, stage 1 the grads)
    micro = 4
    rounds = [([common(8, 32) for _ in range(micro)], [common(8, 16, scale=0.1) for _ in range(micro)])
              for _ in range(3)]
    gpipe = [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    reverse = [("F", i) for i in range(micro)] + [("B", i) for i in reversed(range(micro))]
    for r, (inputs, dys) in enumerate(rounds):
        order = gpipe if r % 2 == 0 else reverse
        before = graphed.forward.stats()
        got = _stage_schedule(graphed, rank, order, inputs, dys, dims[0], dims[-1])
        want = _stage_schedule(eager, rank, order, inputs, dys, dims[0], dims[-1])
        after = graphed.forward.stats()
        for i in range(micro):
            chk.bitwise(f"round {r} micro-batch {i} stage {rank} output", got[0][i], want[0][i])
            chk.bitwise(f"round {r} micro-batch {i} stage {rank} parameter grads", got[1][i], want[1][i])
        if r == len(rounds) - 1 and (after["replays"] - before["replays"], after["eager_calls"] - before["eager_calls"]) != (micro, 0):
            chk.failures.append(f"round {r}: not every micro-batch replayed: {graphed.forward.explain()}")
    s = graphed.forward.stats()
    chk.notes.append(f"slots={s['slots']} captures={s['captures']} replays={s['replays']} eager={eager_calls(s)}")
    return {}


@case("timing")
def case_timing(chk, rank, world):
    """Per-step time of the data-parallel step, eager vs graphed (not a pass/fail check)."""
    dims = [512] * 17  # 16 matmul layers, 512 wide, batch 16
    graphed, eager = MatChain(dims, seed=2), MatChain(dims, seed=2)
    autocudagraph(graphed, backend=BACKEND, warmup_steps=1)
    draw = rng(500 + rank)
    x, dy = T(draw(16, 512)), T(draw(16, 512))
    sync = paddle.device.cuda.synchronize if BACKEND == "cuda" else (lambda: None)
    result, steps = {}, 50 if BACKEND == "cuda" else 3
    for name, model in (("eager", eager), ("graphed", graphed)):
        def step():
            [p.clear_gradient(False) for p in model.parameters()]
            model(x).backward(dy)
            for w in model.parameters():
                all_reduce_sum(w.grad, calc_stream=False)

        for _ in range(host_cost.SAMPLES + 12):  # eager samples, warmup, capture, the timed replays
            step()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        result[name] = (time.perf_counter() - start) / steps * 1e3
    for a, e in zip(graphed.parameters(), eager.parameters()):
        chk.bitwise("last step's summed grads", a.grad, e.grad)
    chk.notes.append(f"ms/step eager {result['eager']:.3f}, graphed {result['graphed']:.3f} "
                     f"(16 x 512x512 matmuls fwd+bwd, 16 grad all-reduces outside the graph)")
    return {}


# ----------------------------------------------------------------------------- rank side
def run_rank(names):
    global BACKEND
    BACKEND = os.environ.get("DIST_GPU_CHECK_BACKEND", "cuda")
    os.environ.pop(ENV_BACKEND, None)
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    for name in names:
        chk = Check()
        start = time.perf_counter()
        row = {"case": name, "rank": rank, "device": paddle.get_device()}
        try:
            row["detail"] = CASES[name](chk, rank, world) or {}
            row["ok"] = not chk.failures
        except Exception as err:  # the next case still runs
            row.update(ok=False, detail={}, error=f"{type(err).__name__}: {str(err).strip()[:800]}",
                       traceback=traceback.format_exc()[-3000:])
        row.update(failures=chk.failures[:20], notes=chk.notes, compared=chk.compared, skipped=chk.skipped,
                   ms=round((time.perf_counter() - start) * 1e3))
        failed += not row["ok"]
        print("RESULT " + json.dumps(row), flush=True)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- launcher side
def launch(names, backend, log_dir, timeout):
    env = dict(os.environ, PYTHONUNBUFFERED="1", DIST_GPU_CHECK_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(log_dir)]
    if backend == "cuda":
        cmd += ["--gpus", "0,1"]
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)  # set at all, even empty, it breaks the CPU launch
        cmd += ["--nproc_per_node", "2"]
    cmd += [__file__, "--rank-cases", ",".join(names)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the launcher stops its workers
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        out += f"\n[killed after {timeout} s]"
    logs = {f.name: f.read_text(errors="replace") for f in sorted(pathlib.Path(log_dir).glob("workerlog.*"))}
    return proc.returncode, out, logs


def summarize(name, rc, out, logs):
    rows = {}
    for text in logs.values():
        for line in text.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                rows[r["rank"]] = r
    lines, ok = [], len(rows) == 2 and all(r["ok"] for r in rows.values())
    skipped = {r.get("skipped") for r in rows.values()} - {None}
    if ok and skipped:  # a case that did not run is neither a pass nor a failure
        return None, [f"- **SKIP** `{name}`: {'; '.join(sorted(skipped))}"]
    replicated = {r["detail"].get("replicated") for r in rows.values()}
    if ok and len(replicated) != 1:
        ok = False
        lines.append("  - ranks disagree on values that must be replicated (all-reduced)")
    for rank in sorted(rows):
        r = rows[rank]
        lines.append(f"  - rank {rank} on {r['device']}: {'ok' if r['ok'] else 'FAILED'}, "
                     f"{r['compared']} bitwise comparisons, {r['ms']} ms" + "".join(f"; {n}" for n in r["notes"]))
        lines += [f"    - {f}" for f in r["failures"]]
        if r.get("error"):
            lines.append(f"    - error: {r['error']}")
    if len(rows) < 2:
        tail = "\n".join((out or "").splitlines()[-15:])
        logs_tail = {k: "\n".join(v.splitlines()[-25:]) for k, v in logs.items()}
        lines.append(f"  - {2 - len(rows)} rank(s) reported nothing (launcher exit {rc}); launcher tail:\n```\n{tail}\n```")
        for k, v in logs_tail.items():
            lines.append(f"  - {k} tail:\n```\n{v}\n```")
    return ok, [f"- **{'PASS' if ok else 'FAIL'}** `{name}`"] + lines


def header(backend):
    lines = [f"# autocudagraph two-rank data-parallel check ({backend} backend)", ""]
    lines += info_lines(run_info(backend == "cuda" and paddle.is_compiled_with_cuda(), str(REPO)))
    nccl = getattr(paddle.version, "nccl", None)
    if callable(nccl):
        lines.append(f"- NCCL (as built) {nccl()}")
    if backend == "cuda" and paddle.is_compiled_with_cuda():
        try:
            n = paddle.device.cuda.device_count()
            names = [paddle.device.cuda.get_device_name(i) for i in range(n)]
            caps = [paddle.device.cuda.get_device_capability(i) for i in range(n)]
            lines.append(f"- GPUs: {', '.join(f'{a} (sm_{b[0]}{b[1]})' for a, b in zip(names, caps))}")
        except Exception as err:  # the report still says what it could
            lines.append(f"- GPUs: unknown ({type(err).__name__}: {err})")
    return lines + [""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    parser.add_argument("--cases", default="all", help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--one-job", action="store_true", help="all cases in one launch (faster, less isolated; "
                        "always so with --backend simulate, the smoke run)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--rank-cases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_cases is not None or "PADDLE_TRAINER_ID" in os.environ:  # a rank of a launched job
        wanted = args.rank_cases or args.cases
        return run_rank(list(CASES) if wanted == "all" else wanted.split(","))
    if args.out and args.backend != "cuda":
        try:
            check_smoke_path(args.out, "tools/dist_gpu_check.py")
        except ValueError as err:
            raise SystemExit(str(err)) from None
    require_gpu("tools/dist_gpu_check.py", args.backend, gpus=2)
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    report, all_ok = header(args.backend), True
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    print("\n".join(report), flush=True)
    jobs = [names] if args.one_job or args.backend != "cuda" else [[n] for n in names]
    with tempfile.TemporaryDirectory(prefix="dist_gpu_check_") as tmp:
        for i, job in enumerate(jobs):
            rc, out, logs = launch(job, args.backend, pathlib.Path(tmp) / f"job{i}", args.timeout)
            for name in job:
                sub = {k: "\n".join(l for l in v.splitlines() if not l.startswith("RESULT ") or f'"case": "{name}"' in l)
                       for k, v in logs.items()}
                ok, lines = summarize(name, rc, out, sub)
                counts["skipped" if ok is None else "passed" if ok else "failed"] += 1
                all_ok &= ok is not False
                report += lines
                print("\n".join(lines), flush=True)
    all_ok &= counts["passed"] > 0
    report += ["", f"Overall: {'PASS' if all_ok else 'FAIL'} ({counts['passed']} passed, {counts['failed']} failed, "
                   f"{counts['skipped']} skipped)"]
    print(report[-1])
    if args.out:
        write_generated(args.out, report, "tools/dist_gpu_check.py", smoke=args.backend != "cuda")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
