"""The pipeline row of tools/bench.py (``--pipeline``): one pipeline stage pair under GPipe.

Two stages of matmul-only MLPs run four micro-batches per step: every forward (stage 0, then
stage 1 on a detached copy of stage 0's output, as a pipeline's p2p receive makes), then every
backward (``y.backward(dy)``, then stage 0's output backward with that copy's grad), grads
released after each backward (``clear_gradient(False)``: no accumulation add, NOTE [ Kernel-less
GPUs ] in testkit/common.py). Runners: eager; graphed with slots (default max_inflight: four
forwards of each stage in flight, all replayed); graphed with max_inflight=1 (one forward in flight:
three micro-batches in four run eagerly). Each graphed runner's outputs and grads are checked bit
for bit against eager before and after timing.
"""

import sys

import paddle

from paddlefleet.cudagraph import autocudagraph
from testkit.common import MatMLP, bitwise_failures, build, host_tensor, normal, release_grads

from .timing import MODES, Runner, run_rounds, timed_call

MICRO = 4
RUNNERS = {"eager": None, "graphed_slots": {}, "graphed_max_inflight_1": {"max_inflight": 1}}


def _stages(width, layers, seed, options, backend):
    stages = [build(lambda: MatMLP([width] * (layers + 1)), seed + s) for s in range(2)]
    if options is not None:
        for stage in stages:
            autocudagraph(stage, backend=backend, warmup_steps=1, **options)
    return stages


def _gpipe_step(stages, xs, dys, record=None):
    """One step; ``record`` (a list) gets each micro-batch's output and grads when given."""
    s0, s1 = stages
    live = []
    for x in xs:
        h = s0(x)
        recv = h.detach()
        recv.stop_gradient = False
        live.append((h, recv, s1(recv)))
    for (h, recv, y), dy in zip(live, dys):
        y.backward(dy)
        h.backward(recv.grad)
        if record is not None:
            record.append([y.numpy(), recv.grad.numpy()] + [p.grad.numpy() for s in stages for p in s.parameters()])
        release_grads(s0, s1)


def bench_pipeline(backend, width, layers, batch, warmup, rounds, steps):
    """``{"times": {runner: {mode: summary}}, "checks": {runner: [failures]}, "counters": {runner:
    stats of each stage}, "device_bytes_after_warmup": {runner: bytes or None}}`` for one stage pair
    (times per step of MICRO micro-batches; device bytes: ``memory_allocated`` growth over the
    runner's warmup on cuda, where the slots and their pools are made)."""
    print(f"[paddle] pipeline: 2 stages x {layers} x {width}, batch {batch}, {MICRO} micro-batches (GPipe)",
          file=sys.stderr, flush=True)
    draw = normal(5)
    xs = [host_tensor(draw(batch, width)) for _ in range(MICRO)]
    dys = [host_tensor(draw(batch, width)) for _ in range(MICRO)]
    sync = paddle.device.cuda.synchronize if backend == "cuda" else (lambda: None)
    made = {name: _stages(width, layers, 40, options, backend) for name, options in RUNNERS.items()}
    reference = []
    _gpipe_step(made["eager"], xs, dys, reference)
    out = {"times": {}, "checks": {}, "counters": {}, "device_bytes_after_warmup": {}}
    allocated = paddle.device.cuda.memory_allocated if backend == "cuda" else None
    runners = []
    for name, stages in made.items():
        runner = Runner(name, timed_call(_gpipe_step, stages, xs, dys), sync)
        before = allocated() if allocated else None
        runner.warm(max(warmup, 3))
        sync()
        # What the runner keeps allocated once warm (its slots: static buffers and graph pools).
        out["device_bytes_after_warmup"][name] = allocated() - before if allocated else None
        runners.append(runner)
    checks = {name: _check(stages, xs, dys, reference) for name, stages in made.items() if name != "eager"}
    sync()
    run_rounds(runners, rounds, steps)
    for runner in runners:
        out["times"][runner.name] = {mode: runner.summary(mode) for mode in MODES}
        if runner.error:
            out["times"][runner.name]["error"] = runner.error
    for name, stages in made.items():
        if name == "eager":
            continue
        out["checks"][name] = checks[name] + _check(stages, xs, dys, reference)
        out["counters"][name] = [{k: v for k, v in s.forward.stats().items() if k != "eager_reasons"}
                                 for s in stages]
    return out


def _check(stages, xs, dys, reference):
    got = []
    _gpipe_step(stages, xs, dys, got)
    _, failures = bitwise_failures(got, reference, "pipeline step")
    return failures
