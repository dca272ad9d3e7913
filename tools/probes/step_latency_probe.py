"""Where a whole-step graph's call spends host time after a device sync (latency) against back to back (a probe).

    python tools/probes/step_latency_probe.py [--cpu]

The benchmark's 16 x 512, batch 16 model as one block and as four, its training step graphed whole
(``autocudagraph_step``) next to the raw ``replay()`` of one graph of the same step. For each: the host time of a
call back to back (no sync between calls) and right after a device sync, median of 200; then every piece of a
replayed call (tools/host_breakdown.py's StepInternals) timed the same two ways; then a cProfile of calls made
after a sync. Last, side by side in alternating rounds: the whole step's call, an eager step of the same model and
one bare matmul, with the op trace's wrappers in place (``traced_ops.held()``: every Paddle op of the process wrapped,
as a whole step left them before they were taken back after its capture) and without. ``--cpu`` times only that
comparison, for single Paddle calls on the CPU.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import paddle  # noqa: E402

from benchmark.paddle_runs import Blocks, TrainStep, capture_raw  # noqa: E402
from benchmark.timing import Config  # noqa: E402
from host_breakdown import StepInternals  # noqa: E402
from paddlefleet.cudagraph.guards import traced_ops  # noqa: E402
from paddlefleet.cudagraph import autocudagraph_step  # noqa: E402
from testkit.common import MatMLP, build, device, host_tensor, normal  # noqa: E402


def sync():
    paddle.device.cuda.synchronize()


def host_us(fn, synced, n=200):
    times = []
    pc = time.perf_counter
    for _ in range(n):
        if synced:
            sync()
        start = pc()
        fn()
        times.append(pc() - start)
    sync()
    return statistics.median(times) * 1e6


def op_rows(rounds=6, calls=20000):
    """Single Paddle calls on the CPU, with the op trace's wrappers in place and without, alternating rounds:
    ``[(name, best without, best with)]`` in us per call."""
    x, w = paddle.ones([4, 4]), paddle.ones([4, 4])
    ops = {"paddle.matmul(x, w)": lambda: paddle.matmul(x, w), "x + w": lambda: x + w,
           "paddle._C_ops.assign(x)": lambda: paddle._C_ops.assign(x), "x[0]": lambda: x[0],
           "x.detach()": lambda: x.detach()}
    got = {(name, held): [] for name in ops for held in (False, True)}
    pc = time.perf_counter
    for r in range(2 * rounds):
        held = r % 2 == 1
        if held:
            traced_ops.hold()
        try:
            for name, fn in ops.items():
                start = pc()
                for _ in range(calls):
                    fn()
                got[(name, held)].append((pc() - start) / calls * 1e6)
        finally:
            if held:
                traced_ops.release()
    return [(name, min(got[(name, False)]), min(got[(name, True)])) for name in ops]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="only time single Paddle calls on the CPU with the op trace's wrappers and without")
    if parser.parse_args().cpu:
        print(f"paddle {paddle.__version__}, CPU; us per call, best of 6 alternating rounds of 20,000")
        for name, without, with_ in op_rows():
            print(f"  {name:28s} without {without:6.2f}   with {with_:6.2f}   ({with_ - without:+.2f})")
        return
    with device("gpu"):
        draw = normal(1)
        x, dy = host_tensor(draw(16, 512)), host_tensor(draw(16, 512))
        for blocks in (1, 4):
            cfg = Config("probe", 16, 512, 16, blocks=blocks)
            model = build((lambda: MatMLP(cfg.block_dims())) if blocks == 1 else (lambda: Blocks(cfg)), 1)
            graphed = autocudagraph_step(TrainStep(model, False), optimizers=[], warmup_steps=2, backend="cuda")
            for _ in range(30):
                graphed(x, dy)
            raw_model = build((lambda: MatMLP(cfg.block_dims())) if blocks == 1 else (lambda: Blocks(cfg)), 1)
            params = raw_model.parameters()

            def body():
                y = raw_model(x)
                return [y] + list(paddle.grad([y], params, [dy]))
            body()
            raw, _ = capture_raw(type("S", (), {"cuda": True})(), body)
            print(f"\n## 16 x 512, {blocks} block(s): {graphed.stats()['replays']} replays")
            for name, fn in (("whole step call", lambda: graphed(x, dy)), ("raw replay()", raw.replay)):
                print(f"  {name:60s} back to back {host_us(fn, False):7.1f}   after a sync {host_us(fn, True):7.1f}")
            for name, resolve, _part in StepInternals(graphed, (x, dy)).pieces():
                try:
                    fn = resolve()
                    print(f"  {name[:60]:60s} back to back {host_us(fn, False):7.1f}   after a sync "
                          f"{host_us(fn, True):7.1f}", flush=True)
                except Exception as err:  # noqa: BLE001
                    print(f"  {name[:60]:60s} n/a ({type(err).__name__}: {err})"[:200])
            profile = cProfile.Profile()
            for _ in range(300):
                sync()
                profile.enable()
                graphed(x, dy)
                profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
            print("\n".join(text.getvalue().splitlines()[:40]))
            raw.reset()
            eager_model = build((lambda: MatMLP(cfg.block_dims())) if blocks == 1 else (lambda: Blocks(cfg)), 1)
            eager_step = TrainStep(eager_model, False)
            w = host_tensor(draw(512, 512))
            rows = {"whole step call": lambda: graphed(x, dy), "eager step (forward, backward, release)":
                    lambda: eager_step(x, dy), "one bare paddle.matmul": lambda: paddle.matmul(x, w)}
            got = {(name, held): [] for name in rows for held in (False, True)}
            wrapped = set()
            for r in range(12):
                held = r % 2 == 1
                if held:
                    traced_ops.hold()
                try:
                    wrapped.add((held, hasattr(paddle._C_ops.matmul, "__native__")))
                    for name, fn in rows.items():
                        got[(name, held)].append(host_us(fn, False))
                finally:
                    if held:
                        traced_ops.release()
            print(f"  op trace wrappers in place (as a whole step left them) against taken back; host us, best and "
                  f"median of 6 alternating rounds of 200 (back to back); matmul wrapped when held, when not: "
                  f"{sorted(wrapped)}; wrappers in place now: {traced_ops.installed()}")
            for name in rows:
                a, b = got[(name, False)], got[(name, True)]
                print(f"    {name:52s} without {min(a):8.1f} ({statistics.median(a):8.1f})   with {min(b):8.1f} "
                      f"({statistics.median(b):8.1f})")


if __name__ == "__main__":
    main()
