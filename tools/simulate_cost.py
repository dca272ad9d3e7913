"""CPU time of one call of a tiny Layer on the simulated backend against its own eager call.

    OMP_NUM_THREADS=1 python tools/simulate_cost.py [--calls 300] [--width 8] [--repo PATH]

Times forward and backward of ``Linear(width, width) -> relu -> Linear`` three ways, each call's
CPU time of the calling thread (``time.thread_time``, so other processes on a shared machine do not
count): eager, ``autocudagraph(backend="simulate")`` (every call a replay that re-runs the Python
under the op trace and compares its dataflow with the capture's) and the same in ``no_grad``
(forward only). Prints microseconds per call (median of 5 rounds) and the ratio to eager; the
simulated backend's budget is 20x eager per call. ``--repo`` imports the package from another
checkout (to compare two commits in one run).
"""

import argparse
import os
import statistics
import sys
import time


def _rounds(fn, calls, rounds=5):
    for _ in range(20):
        fn()
    per = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        per.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(per)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed round (5 rounds; default 300)")
    parser.add_argument("--width", type=int, default=8, help="the Linear layers' width (default 8)")
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout to import the package from (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    import paddle
    from paddlefleet.cudagraph import autocudagraph

    paddle.seed(0)
    w = args.width
    model = paddle.nn.Sequential(paddle.nn.Linear(w, w), paddle.nn.ReLU(), paddle.nn.Linear(w, w))
    twin = paddle.nn.Sequential(paddle.nn.Linear(w, w), paddle.nn.ReLU(), paddle.nn.Linear(w, w))
    twin.set_state_dict(model.state_dict())
    graphed = autocudagraph(twin, backend="simulate", warmup_steps=1, eager_if_slower=False)
    x = paddle.randn([4, w])
    x.stop_gradient = False

    def train(layer):
        def call():
            layer(x).sum().backward()
        return call

    def infer(layer):
        def call():
            with paddle.no_grad():
                layer(x)
        return call

    rows = []
    for name, fn_eager, fn_sim in (("forward+backward", train(model), train(graphed)),
                                   ("forward (no_grad)", infer(model), infer(graphed))):
        eager = _rounds(fn_eager, args.calls)
        sim = _rounds(fn_sim, args.calls)
        rows.append((name, eager, sim))
    stats = graphed.forward.stats() if hasattr(graphed, "forward") else graphed.stats()
    print(f"package: {os.path.abspath(args.repo)}; replays {stats['replays']}, eager calls {stats['eager_calls']}")
    for name, eager, sim in rows:
        print(f"{name:18s} eager {eager:8.1f} us  simulate {sim:8.1f} us  ratio {sim / eager:6.1f}x")


if __name__ == "__main__":
    main()
