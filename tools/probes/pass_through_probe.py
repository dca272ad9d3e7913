"""What a wrapper whose calls run eagerly costs on a GPU host, against the Layers' own calls (a probe).

    python tools/probes/pass_through_probe.py [--width 1024] [--layers 32] [--batch 32]

The benchmark's one-matmul per-layer model (``--layers`` square matmuls of ``--width``, one graphed Layer per
layer) built four times with the same parameters: eager; every layer wrapped with the default options, which judge
every key slower here and then pass calls through (``eager_if_slower``); every layer wrapped with ``max_graphs=0``
(passed through from the first call, never captured); every layer graphed (``eager_if_slower=False``); every
layer's key of the timed batch fallen back (a stand-in refuses its capture) after a key of half the batch was
captured (``fall_back_beside``: the front path of a key that runs eagerly beside a graphed one). Each is
compared bit for bit with eager. Then, side by side, runners interleaved, best of 3 rounds:

* us per step in throughput (one sync at the end) and latency (a sync per step), with the forward call's host time;
* the device time of a step: the steps are queued behind a long blocker kernel, so the span between two events
  around them is the GPU's own time, not the host's; the host time of those queued steps says whether any of them
  waited for the GPU (a host that waited pays the blocker);
* the forward of every Layer called through ``type(layer).forward`` (neither Paddle's ``Layer.__call__`` nor the
  wrapper): whether the tensors or the wrapper cost the time;
* a bare ``paddle.matmul`` of the same shape, before the wrapped models are built and at the end;
* one matmul Layer's call under no_grad against an unwrapped twin's, timed in alternating pairs, for each way a
  wrapper runs a call eagerly (passed through, max_graphs=0, a key that fell back beside a graphed key, a key refused
  under max_graphs=1 beside a graphed key) and for a graphed replay (``per_call_costs``).

Report: docs/reports/pass_through_probe.md.
"""

import argparse
import ctypes
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools"), os.path.dirname(os.path.abspath(__file__))]

import numpy  # noqa: E402
import paddle  # noqa: E402

from gpu_bound_probe import make, snapshot, step_fn, sync, timed  # noqa: E402
from testkit.common import device, host_tensor, normal  # noqa: E402

RUNNERS = {"eager": None, "judged (default options)": {"eager_if_slower": True},
           "max_graphs=0": {"max_graphs": 0}, "graphed (eager_if_slower=False)": {},
           "fell back, another key graphed": {"fell_back": True}}


def fall_back_beside(model, args, draw, x, dy):
    """Every block's key of ``x`` falls back (its capture refused by a stand-in that raises, as a failed capture's
    key does) after a key of another batch size was captured and replayed: the timed calls are then calls of a key
    that runs eagerly beside a graphed key (NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py)."""
    from paddlefleet.cudagraph.errors import CudaGraphError

    other = max(args.batch // 2, 1)
    xo, dyo = host_tensor(draw(other, args.width)), host_tensor(draw(other, args.width))
    for _ in range(4):  # warmup, capture, replays of the other key
        y = model(xo)
        y.backward(dyo)
    bodies = [b.forward._body for b in model.blocks]

    def refuse(*a, **k):
        raise CudaGraphError("refused by the probe (a failed capture's stand-in)")

    for body in bodies:
        body.capture = refuse
    try:
        for _ in range(4):  # warmup, the refused capture, eager calls of the key that fell back
            y = model(x)
            y.backward(dy)
    finally:
        for body in bodies:
            del body.capture  # the class's own again
    for p in model.parameters():
        p.clear_gradient(False)
    entries = [e for b in model.blocks for e in b.forward._entries.values()]
    phases = sorted({e.phase.name for e in entries})
    if len(entries) != 2 * len(bodies) or phases != ["FALLBACK", "REPLAY"]:
        raise SystemExit(f"fall_back_beside: expected one graphed and one fallen key per block, got {phases}")


class Events:
    """Two CUDA events on the current stream, through the driver (Paddle 2.6's Event has no elapsed time)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.start, self.end = ctypes.c_void_p(), ctypes.c_void_p()
        for ev in (self.start, self.end):
            assert self.lib.cuEventCreate(ctypes.byref(ev), 0) == 0

    def stream(self):
        return ctypes.c_void_p(paddle.device.cuda.current_stream().cuda_stream)

    def record(self, ev):
        assert self.lib.cuEventRecord(ev, self.stream()) == 0

    def elapsed_ms(self):
        assert self.lib.cuEventSynchronize(self.end) == 0
        ms = ctypes.c_float()
        assert self.lib.cuEventElapsedTime(ctypes.byref(ms), self.start, self.end) == 0
        return ms.value


def blocker(size):
    """A function queueing about as much GPU work as ``size`` square fp32 matmuls take (several ms)."""
    draw = normal(7)
    a = host_tensor(draw(size, size) / size ** 0.5)

    def block():
        b = a
        for _ in range(4):
            b = paddle.matmul(b, a)
        return b
    return block


def queued(step, steps, events, block):
    """(device us per step, host us per step) of ``steps`` steps queued behind ``block()``'s kernels."""
    sync()
    kept = block()
    events.record(events.start)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host = time.perf_counter() - start
    events.record(events.end)
    device_ms = events.elapsed_ms()
    del kept
    return device_ms * 1e3 / steps, host * 1e6 / steps


def blocker_us(events, block):
    sync()
    events.record(events.start)
    kept = block()
    events.record(events.end)
    ms = events.elapsed_ms()
    del kept
    return ms * 1e3


def direct_forward(model, x):
    """The model's forward with every block's own forward called directly (neither Layer.__call__ nor a wrapper
    around the block; the matmul Layers inside are called as usual)."""
    blocks = [(type(b).forward, b) for b in model.blocks]

    def run():
        y = x
        for forward, block in blocks:
            y = forward(block, y)
        return y
    return run


def timed_calls(fn, calls):
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    sync()
    return host * 1e6 / calls


def per_call_costs(args, draw, calls, backend="cuda"):
    """``{way: (median us over the Layer's own call, median us of the own call)}``: one matmul Layer (``--width``)
    called under no_grad, each call timed against a call of an unwrapped twin right before or after it (the order
    alternating), for every way a wrapper runs a call eagerly and for a graphed replay. Each iteration first calls
    the wrapper with another batch (a second key: graphed where the way graphs one), as a key refused under max_graphs
    needs to stay refused; every output is compared bit for bit with the twin's. ``backend``: the wrappers' (a CPU
    dry run gives "simulate")."""
    from paddlefleet.cudagraph import autocudagraph
    from paddlefleet.cudagraph.core.front import behind
    from paddlefleet.cudagraph.core.host_cost import HostCost
    from paddlefleet.cudagraph.errors import CudaGraphError
    from testkit.common import MatLayer, build

    x = host_tensor(draw(args.batch, args.width))
    xo = host_tensor(draw(max(args.batch // 2, 1), args.width))
    own = build(lambda: MatLayer(args.width, args.width), 11)

    def wrapped(**options):
        options.setdefault("eager_if_slower", False)
        layer = autocudagraph(build(lambda: MatLayer(args.width, args.width), 11), backend=backend, **options)
        return layer, behind(layer.forward)

    def refuse(*a, **k):
        raise CudaGraphError("refused by the probe (a failed capture's stand-in)")

    ways = {}
    layer, wrapper = wrapped(warmup_steps=1)
    for _ in range(3):
        layer(x)
    [entry] = wrapper._entries.values()
    entry.host_cost = cost = HostCost(measure=True, judge=True)  # judged slower: core/host_cost.py
    cost.eager_s, cost.replay_s, cost.verdict = [1e-5] * 8, [2e-5] * 9, "eager"
    wrapper._acted(entry)
    ways["passed through (every key slower)"] = layer
    ways["max_graphs=0"] = wrapped(max_graphs=0)[0]
    layer, wrapper = wrapped(warmup_steps=1)
    for _ in range(3):
        layer(xo)
    wrapper._body.capture = refuse
    for _ in range(3):
        layer(x)
    del wrapper._body.capture
    ways["fell back, another key graphed"] = layer
    layer, wrapper = wrapped(warmup_steps=1, max_graphs=1)
    for _ in range(3):
        layer(xo)
    for _ in range(3):
        layer(x), layer(xo)
    ways["refused under max_graphs=1, another key graphed"] = layer
    layer, wrapper = wrapped(warmup_steps=1)
    for _ in range(3):
        layer(x), layer(xo)
    ways["graphed (a replay)"] = layer
    pc = time.perf_counter
    out = {}
    for name, layer in ways.items():
        over, alone = [], []
        for i in range(calls):
            layer(xo)
            first, second = (layer, own) if i % 2 == 0 else (own, layer)
            t0 = pc()
            a = first(x)
            t1 = pc()
            b = second(x)
            t2 = pc()
            if first is layer:
                got, want, wrapped_s, own_s = a, b, t1 - t0, t2 - t1
            else:
                got, want, wrapped_s, own_s = b, a, t2 - t1, t1 - t0
            over.append(wrapped_s - own_s)
            alone.append(own_s)
        if not numpy.array_equal(got.numpy(), want.numpy()):
            raise SystemExit(f"{name}: differs from the Layer's own call")
        stats = behind(layer.forward).stats()
        out[name] = (numpy.median(over) * 1e6, numpy.median(alone) * 1e6,
                     {k: stats[k] for k in ("replays", "eager_calls")})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="width of every square matmul (default 1024)")
    parser.add_argument("--layers", type=int, default=32, help="one-matmul Layers, each wrapped (default 32)")
    parser.add_argument("--batch", type=int, default=32, help="rows of the input (default 32)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per runner, mode and round (default 50)")
    parser.add_argument("--warmup", type=int, default=60, help="steps before timing (default 60)")
    parser.add_argument("--calls", type=int, default=3000,
                        help="timed pairs per way of the one-Layer calls (default 3000)")
    args = parser.parse_args()
    args.blocks = args.layers
    with device("gpu"):
        draw = normal(1234)
        x, dy = host_tensor(draw(args.batch, args.width)), host_tensor(draw(args.batch, args.width))
        w = host_tensor(draw(args.width, args.width))
        matmul = lambda: paddle.matmul(x, w)  # noqa: E731
        events, block = Events(), blocker(8192)
        print(f"blocker: {blocker_us(events, block):.0f} us of GPU time; a bare matmul [{args.batch}, {args.width}] "
              f"x [{args.width}, {args.width}] before the wrappers: {timed_calls(matmul, 2000):.2f} us of host time")
        reference = snapshot(make(args, None)[0], x, dy)
        built = {}
        for name, options in RUNNERS.items():
            fell_back = options is not None and options.get("fell_back", False)
            model, params = make(args, None if options is None else {k: v for k, v in options.items()
                                                                      if k != "fell_back"})
            if fell_back:
                fall_back_beside(model, args, draw, x, dy)
            host = []
            step = step_fn(model, params, x, dy, host)
            for _ in range(args.warmup):
                step()
            got = snapshot(model, x, dy)
            same = all(numpy.array_equal(a, b) for a, b in zip(got, reference))
            stats = [b.forward.stats() for b in model.blocks if hasattr(b.forward, "stats")]
            counts = {k: sum(s[k] for s in stats) for k in ("captures", "replays", "eager_calls")} if stats else {}
            reasons = sorted({r for s in stats for r in s["eager_reasons"]}) if stats else []
            print(f"{name}: bitwise equal to eager: {same}; {counts}; eager reasons: {reasons}", flush=True)
            if not same:
                raise SystemExit(f"{name} differs from eager")
            built[name] = (model, step, host)
        results = {(n, m): [] for n in RUNNERS for m in ("throughput", "latency", "device", "queued host", "direct")}
        hosts = {n: [] for n in RUNNERS}
        for r in range(3):
            order = list(RUNNERS) if r % 2 == 0 else list(RUNNERS)[::-1]
            for mode in ("throughput", "latency"):
                for name in order:
                    model, step, host = built[name]
                    host.clear()
                    results[(name, mode)].append(timed(step, args.steps, mode))
                    if mode == "throughput":
                        hosts[name].extend(host)
            for name in order:
                model, step, host = built[name]
                device_us, host_us = queued(step, 2, events, block)
                results[(name, "device")].append(device_us)
                results[(name, "queued host")].append(host_us)
                with paddle.no_grad():
                    results[(name, "direct")].append(timed_calls(direct_forward(model, x), args.steps))
        print(f"\n{args.layers} x {args.width}, batch {args.batch}, one wrapper per layer; us per step, best of 3 "
              "rounds: throughput / latency, forward call host (median of throughput steps), device time of a step "
              "(queued behind the blocker) and the host time of those queued steps, the Layers' own forwards "
              "called directly (no_grad)")
        for name in RUNNERS:
            best = {m: min(results[(name, m)]) for m in ("throughput", "latency", "device", "queued host", "direct")}
            print(f"  {name:32s} {best['throughput']:8.1f} / {best['latency']:8.1f}   forward host "
                  f"{numpy.median(hosts[name]) * 1e6:8.1f}   device {best['device']:8.1f}   queued host "
                  f"{best['queued host']:8.1f} (worst {max(results[(name, 'queued host')]):8.1f})   direct "
                  f"{best['direct']:7.1f}", flush=True)
        print(f"\none Layer's call (one matmul, [{args.batch}, {args.width}], no_grad) against its twin's own call, "
              f"median of {args.calls} alternating pairs: host us over the own call (the own call's us)")
        with paddle.no_grad():
            for name, (over, alone, counts) in per_call_costs(args, draw, args.calls).items():
                print(f"  {name:48s} {over:+7.2f}   ({alone:6.2f})   {counts}", flush=True)
        print(f"\nbare matmul after: {timed_calls(matmul, 2000):.2f} us of host time")


if __name__ == "__main__":
    main()
