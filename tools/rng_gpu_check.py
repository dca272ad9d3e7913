"""Random numbers under the cuda backend on a real GPU, bitwise against eager.

Needs a GPU on which the installed Paddle's dropout and uniform kernels run (Paddle 2.6.2 ships
kernels for sm_61-sm_86 only, so on a Hopper GPU use a Paddle 3.x GPU build; the check says so
and exits 2 when the kernels do not run)::

    python tools/rng_gpu_check.py                 # cuda backend on the GPU
    python tools/rng_gpu_check.py --backend simulate   # CPU smoke test of the script

Cases (NOTE [ Random draws seen from generator state ] in guards/rng.py, NOTE [ Generator state
index after replay ] in backends/cuda.py):

1. dropout on the default generator: masks equal eager call by call and differ per replay;
   the generator is where eager leaves it;
2. dropout under a Fleet tracker ``rng_state`` block inside the function: captured where the
   generators keep states by index (3.x) and then bitwise with both streams' next draws equal
   and the caller's state index unchanged; refused (eager, still bitwise) without (2.6);
3. the graphed call made inside a tracker block: captured on every Paddle, bitwise;
4. ``paddle.rand`` inside the function: refused on cuda (Paddle does not re-seed it), bitwise;
5. dropout with four forwards in flight before their backwards (pipeline slots, NOTE [ Slots ] in
   block/slots.py): each forward's mask and grads equal eager's.

Exit code: 0 when every case passes, 1 when one fails, 2 when the GPU cannot run the kernels or
there is no GPU (use --backend simulate on a CPU).
"""

import argparse
import os
import sys
import traceback

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker  # noqa: E402

from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from paddlefleet.cudagraph.guards import rng  # noqa: E402
from paddlefleet.cudagraph.options import ENV_BACKEND  # noqa: E402
from testkit.cli import BACKEND_HELP, expected_refusals, refusal_lines, require_gpu  # noqa: E402

STATE = "rng_gpu_check"
BACKEND = "cuda"


def same(a, b):
    a = a.numpy() if isinstance(a, paddle.Tensor) else np.asarray(a)
    b = b.numpy() if isinstance(b, paddle.Tensor) else np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def draws():
    """The next numbers of the default generator and of the tracker state (consumed)."""
    out = [paddle.rand([4])]
    with get_rng_state_tracker().rng_state(STATE):
        out.append(paddle.rand([4]))
    return out


def state_index():
    incubate = getattr(paddle, "incubate", None)
    if rng.generator_state_indices() and hasattr(incubate, "get_rng_state"):
        return incubate.get_rng_state(use_index=True)
    return None


def run_twice(fn, graphed, start, calls=6, inside_block=False):
    """Calls ``fn`` eagerly and ``graphed`` from the same RNG state; returns both logs."""
    logs = []
    for f in (fn, graphed):
        paddle.seed(11)
        get_rng_state_tracker().set_states_tracker(dict(start))
        outs = []
        for i in range(calls):
            x = paddle.to_tensor(np.full([4096], 1.0 + i, dtype="float32"))
            if inside_block:
                with get_rng_state_tracker().rng_state(STATE):
                    outs.append(f(x))
            else:
                outs.append(f(x))
        logs.append(outs + draws())
    return logs


def compare(name, got, want, stats, expected, extra=()):
    problems = [f"item {i} differs from eager" for i, (g, w) in enumerate(zip(got, want)) if not same(g, w)]
    seen = {k: stats.get(k) for k in expected}
    if seen != expected:
        problems.append(f"counters {seen} != {expected}")
    problems += [p for p in extra if p]
    return name, problems, f"{len(got)} values; counters {seen}"


def case_default_dropout(start):
    fn = lambda x: F.dropout(x, 0.5)  # noqa: E731
    graphed = autocudagraph(fn, backend=BACKEND, warmup_steps=1)
    want, got = run_twice(fn, graphed, start)
    masks = [(m.numpy() != 0).tobytes() for m in got[:6]]
    distinct = None if len(set(masks)) == 6 else "two calls share a mask"
    return compare("default-generator dropout", got, want, graphed.stats(),
                   {"captures": 1, "replays": 4, "warmup_calls": 1}, [distinct])


def case_tracker_inside(start):
    def fn(x):
        y = F.dropout(x, 0.25)
        with get_rng_state_tracker().rng_state(STATE):
            return F.dropout(y, 0.5)

    graphed = autocudagraph(fn, backend=BACKEND, warmup_steps=1)
    before = state_index()
    want, got = run_twice(fn, graphed, start)
    after = state_index()
    index_moved = None if before == after else f"state index {before} -> {after} after replays"
    captured = rng.generator_state_indices()  # refused on every backend without state indices (2.6)
    expected = {"captures": 1, "replays": 4} if captured else {"captures": 0, "replays": 0}
    return compare(f"tracker block inside the function ({'captured' if captured else 'refused'})", got, want,
                   graphed.stats(), expected, [index_moved])


def case_call_inside_block(start):
    fn = lambda x: F.dropout(x, 0.5)  # noqa: E731
    graphed = autocudagraph(fn, backend=BACKEND, warmup_steps=1)
    want, got = run_twice(fn, graphed, start, inside_block=True)
    return compare("graphed call inside a tracker block", got, want, graphed.stats(), {"captures": 1, "replays": 4})


def case_uniform(start):
    fn = lambda x: x + paddle.rand(x.shape)  # noqa: E731
    graphed = autocudagraph(fn, backend=BACKEND, warmup_steps=1)
    want, got = run_twice(fn, graphed, start)
    # A kernel Paddle does not re-seed on replay is refused on every backend (NOTE [ Random draws
    # seen from generator state ] in guards/rng.py): the key runs eagerly, drawing eager's numbers.
    return compare("paddle.rand inside the function (refused)", got, want, graphed.stats(),
                   {"captures": 0, "replays": 0})


def case_slots_dropout(start):
    """Four forwards in flight before their backwards (a pipeline stage under GPipe), three steps:
    each in its own slot (NOTE [ Slots ] in block/slots.py), masks and grads equal eager's."""
    fn = lambda x: F.dropout(x, 0.5)  # noqa: E731
    graphed = autocudagraph(fn, backend=BACKEND, warmup_steps=1)
    logs = []
    for f in (fn, graphed):
        paddle.seed(11)
        get_rng_state_tracker().set_states_tracker(dict(start))
        outs = []
        for step in range(3):
            xs = [paddle.to_tensor(np.full([4096], 1.0 + step + i / 8, dtype="float32"), stop_gradient=False)
                  for i in range(4)]
            ys = [f(x) for x in xs]
            for y in reversed(ys):
                (y * y).sum().backward()
            outs += ys + [x.grad for x in xs]
        logs.append(outs + draws())
    want, got = logs
    return compare("dropout, four forwards in flight (slots)", got, want, graphed.stats(),
                   {"captures": 4, "replays": 7, "slots": 4, "eager_calls": 0})


def kernels_run():
    """None when dropout and uniform run correctly here, else why not."""
    try:
        y = F.dropout(paddle.ones([4096]), 0.5).numpy()
        r = paddle.rand([4096]).numpy()
    except Exception as err:  # e.g. CUDA error 209: no kernel image for this GPU
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:160]}"
    if not (set(np.unique(y)) <= {0.0, 2.0} and 0.4 < (y != 0).mean() < 0.6 and 0.4 < r.mean() < 0.6):
        return "dropout or uniform returns wrong values on this GPU (no kernels for its architecture)"
    return None


def main():
    global BACKEND
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    BACKEND = parser.parse_args().backend
    require_gpu("tools/rng_gpu_check.py", BACKEND)
    os.environ.pop(ENV_BACKEND, None)
    paddle.set_device("gpu" if BACKEND == "cuda" else "cpu")
    print(f"paddle {paddle.__version__}, backend {BACKEND}, device {paddle.get_device()}, "
          f"generator state indices: {rng.generator_state_indices()}")
    reason = kernels_run()
    if reason:
        print(f"CANNOT RUN: {reason}")
        return 2
    tracker = get_rng_state_tracker()
    if STATE not in tracker.states_:
        tracker.add(STATE, 4242)
    start = tracker.get_states_tracker()
    failed = 0
    for case in (case_default_dropout, case_tracker_inside, case_call_inside_block, case_uniform, case_slots_dropout):
        with expected_refusals() as refusals:
            try:
                name, problems, detail = case(start)
            except Exception:  # noqa: BLE001 - report and go on
                name, problems, detail = case.__name__, [traceback.format_exc()], ""
        failed += bool(problems)
        print(f"[{'FAIL' if problems else 'PASS'}] {name}: {detail}" + "".join(f"\n    {p}" for p in problems))
        if "(refused)" in name:  # the case refuses its capture on purpose
            print("\n".join(refusal_lines(refusals)))
        else:
            print("".join(f"    warning: {m}\n" for m in refusals), end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
