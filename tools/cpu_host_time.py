"""CPU host time of a model graphed layer by layer, of a whole-step graph, and of the pieces of one
replayed block call, without a GPU.

    OMP_NUM_THREADS=1 python tools/cpu_host_time.py [--layers 32 --width 32 --batch 4]
                                                    [--block 16x512x16 | --block 0]

The block rows time one graphed Layer of ``--block`` LAYERSxWIDTHxBATCH matmul layers (default: the
16 x 512, batch 16 block of docs/reports/host_breakdown.md) replaying: the whole call forward and
backward, then each of its pieces alone (tools/host_breakdown.py's Internals: the same pieces as
that report's rows) and Paddle's own pieces at that size. ``--block 0`` leaves them out. The
pass-through rows time a Linear(4, 4) eagerly and wrapped with ``backend=None``, which a Paddle
without CUDA graphs passes through (NOTE [ Pass-through wrappers ] in core/lifecycle.py). The eager-call
rows (eager_call_rows(); ``--eager-calls`` prints only them) time the same Layer through wrappers on the
simulated backend whose key runs eagerly (its capture failed; eager_if_slower sent it eager while another
key stays graphed; every key slower; max_graphs=0; a key refused under max_graphs=1 while another replays
between its calls), interleaved with the Layer's own call,
forward alone and forward + backward. The
``layer_call_us`` tables are tools/host_breakdown.py's (one graphed Layer called alone, forward +
backward, every piece with its share) for the ``--block`` Layer and a 6 x 1024 one, on the stand-in
graph; perf_counter host time there, not thread CPU time.

NOTE [ Stand-in graph ]
To time only the host work of a graphed call on a machine without a GPU, the simulated backend is
changed in this process only: its capture records like a CUDA capture (``capture_executes=False``:
the capture call replays, RNG is guarded as on a GPU) and its replay does nothing (the static
buffers keep what the capture wrote). What is left per call is the wrapper's work and Paddle's:
key, checks, copies, the autograd bridge. Times are CPU time of the calling thread
(``time.thread_time``), so that other processes on a shared machine do not count; they are CPU
host times, not GPU timings (a GPU host adds the launch cost of each device copy and of the replay).

The whole-step rows are followed by the step's replayed call piece by piece (host_breakdown.StepInternals,
each piece run alone in a loop), once for a step without a Paddle optimizer (``optimizers=[]``, as
tools/host_breakdown.py and tools/bench.py time it) and once for a step function closing over the model
and ``paddle.optimizer.SGD`` on a learning-rate scheduler (the closure check, the learning-rate feed,
every parameter's address and a grad checked), then the replay preconditions of that SGD step with 32 and 256
parameters, their walks of the parameters compiled and in Python, side by side (step_check_rows()).
"""

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import paddle  # noqa: E402

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step  # noqa: E402
from paddlefleet.cudagraph.backends import simulated  # noqa: E402
from testkit.common import MatMLP, build, host_tensor, layer_stack, normal, through  # noqa: E402
from testkit.step_gpu import MatmulStep  # noqa: E402
from host_breakdown import StepInternals  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_breakdown import Internals, Passthrough, layer_call_lines, layer_call_us  # noqa: E402

clock = time.thread_time


class _StandInGraph(simulated._SimulatedGraph):
    def replay(self):  # NOTE [ Stand-in graph ]
        pass


def stand_in():
    simulated.SimulatedBackend.new_graph = lambda self, pool: _StandInGraph()
    simulated.SimulatedBackend.capture_executes = False


@contextlib.contextmanager
def standing_in():
    """stand_in() for the duration of the block only."""
    saved = simulated.SimulatedBackend.__dict__.get("new_graph"), simulated.SimulatedBackend.capture_executes
    stand_in()
    try:
        yield
    finally:
        simulated.SimulatedBackend.new_graph, simulated.SimulatedBackend.capture_executes = saved


def cpu_us(fn):
    start = clock()
    fn()
    return (clock() - start) * 1e6


def per_layer_step(args, x, dy, graph, zero=False):
    """A step of ``args.layers`` layers, each graphed on its own (``graph``) or eager; its grads freed after the
    backward, or zeroed (``zero``: ``clear_gradient(True)``, where a graphed layer reuses the views it handed out
    the backward before, NOTE [ Reused aliases ] in grads/hand_out_plan.py)."""
    # eager_if_slower=False: the graphed path is what is timed
    graphed = {"backend": "simulate", "eager_if_slower": False}
    layers = layer_stack(args.layers, [args.width] * 2, graphed if graph else None)
    params = layers.parameters()

    def step():
        through(layers, x, dy)
        for p in params:
            p.clear_gradient(zero)

    return step, layers


def sgd_step(model):
    """A step function as users write one (a closure over the model and its optimizer):
    ``paddle.optimizer.SGD`` on a scheduler, then grads cleared."""
    sgd = paddle.optimizer.SGD(paddle.optimizer.lr.StepDecay(1e-3, step_size=10 ** 9), parameters=model.parameters())

    def step(x, dy):
        y = model(x)
        y.backward(dy)
        sgd.step()
        sgd.clear_grad()
        return y

    return step, sgd


def whole_step(args, x, dy, with_sgd=False):
    """``graphed``: a whole-step graph replaying its key for ``graphed(x, dy)``."""
    model = build(lambda: MatMLP([args.width] * (args.layers + 1)), 0)
    train, sgd = sgd_step(model) if with_sgd else (MatmulStep(model), None)
    graphed = autocudagraph_step(train, optimizers=[sgd] if with_sgd else [], warmup_steps=2,
                                 backend="simulate")
    for _ in range(4 + 16):  # 2 warmup steps, capture, first replay; the replays timed by core/host_cost.py
        graphed(x, dy)
    return graphed


def step_check_rows(args, x, dy, counts=(32, 256), rounds=21):
    """``[(parameters, compiled us, Python us)]``: the replay preconditions (StepBody.blocker) of a replaying SGD step
    of ``counts`` layers, with the compiled walks of its parameters' data pointers and flags (NOTE [ Step replay
    checks ] in step/replay_checks.py) and with every read in Python (``native.disabled()``), in alternating rounds
    of 300 calls (medians, thread CPU time)."""
    from paddlefleet.cudagraph import native
    from paddlefleet.cudagraph.core.call import Call

    rows = []
    for n in counts:
        graphed = whole_step(argparse.Namespace(layers=n, width=args.width, batch=args.batch), x, dy, with_sgd=True)
        body, entry, call = graphed.body(), graphed.entry(), Call((x, dy), {})
        times = {"compiled": [], "python": []}
        for r in range(rounds):
            for way in (("compiled", "python") if r % 2 else ("python", "compiled")):
                with native.disabled() if way == "python" else contextlib.nullcontext():
                    times[way].append(loop_us(lambda: body.blocker(entry, call), n=300, rounds=1))
        rows.append((len(entry.graphs.checks._params), statistics.median(times["compiled"]),
                     statistics.median(times["python"])))
    return rows


def loop_us(fn, n=200, rounds=9):
    """Median over ``rounds`` of the thread CPU time of ``n`` calls of ``fn``, per call."""
    samples = []
    for _ in range(rounds):
        start = clock()
        for _ in range(n):
            fn()
        samples.append((clock() - start) / n * 1e6)
    return statistics.median(samples)


def step_pieces(graphed, x, dy):
    """``[(piece, us or "n/a (why)", part)]`` of one replayed call, then the call itself and the
    lifecycle's own bookkeeping (the call less its parts)."""
    rows, parts = [], 0.0
    for name, resolve, part in StepInternals(graphed, (x, dy)).pieces():
        try:
            us = loop_us(resolve())
        except Exception as err:  # noqa: BLE001 - a piece a refactor moved; the others still run
            rows.append((name, f"n/a ({type(err).__name__}: {err})"[:160], part))
            continue
        parts += us if part else 0.0
        rows.append((name, f"{us:.2f}", part))
    total = loop_us(lambda: graphed(x, dy))
    rows.append(("lifecycle bookkeeping (the call less the pieces above)", f"{total - parts:.2f}", True))
    rows.append(("one replayed call", f"{total:.2f}", False))
    return rows


def median_us(fn, reps):
    """Median thread CPU us of ``fn()``; ``fn.after()``, where ``fn`` has one, runs untimed after each call."""
    after = getattr(fn, "after", None)
    samples = []
    for _ in range(reps):
        samples.append(cpu_us(fn))
        if after is not None:
            after()
    return statistics.median(samples)


def block_rows(spec, reps):
    """``[(piece, us)]``: one replayed call of a graphed block of ``spec`` (LAYERSxWIDTHxBATCH),
    forward and backward, then its pieces alone; the same pieces as tools/host_breakdown.py's."""
    n, width, batch = (int(v) for v in spec.lower().split("x"))
    draw = normal(1)
    x, dy = host_tensor(draw(batch, width)), host_tensor(draw(batch, width))
    model = build(lambda: MatMLP([width] * (n + 1)), 0)
    autocudagraph(model, backend="simulate", warmup_steps=1, eager_if_slower=False)
    params = model.parameters()

    def step():
        model(x).backward(dy)
        for p in params:
            p.clear_gradient(False)

    for _ in range(3):  # warmup, capture, first replay
        step()
    rows = [("block call: forward + backward + release grads", median_us(step, reps)),
            (f"release {len(params)} grads (clear_gradient(False))",
             median_us(lambda: [p.clear_gradient(False) for p in params], reps)),
            ("forward call alone (then drop the output)", median_us(lambda: model(x), reps))]
    for name, _, resolve in Internals(model.forward, x).pieces():
        try:
            rows.append((name, median_us(resolve(), reps)))
        except Exception as err:  # noqa: BLE001 - a piece whose private name moved (NOTE in host_breakdown.py)
            rows.append((name, f"n/a ({type(err).__name__}: {err})"))
    stack = host_tensor(draw(n, width, width))
    Passthrough.grads = [host_tensor(draw(width, width)) for _ in params]

    def pylayer_step():
        Passthrough.apply(x, *params).backward(dy)
        for p in params:
            p.clear_gradient(False)

    rows += [(f"Paddle: unbind of a {n}-grad stack", median_us(lambda: paddle._C_ops.unbind(stack, 0), reps)),
             (f"Paddle: PyLayer.apply with {len(params) + 1} tensor inputs", median_us(lambda: Passthrough.apply(x, *params), reps)),
             (f"Paddle: PyLayer forward + backward handing {len(params)} grads + release", median_us(pylayer_step, reps))]
    return [(name, us if isinstance(us, str) else f"{us:.1f}") for name, us in rows]


def pass_through_rows(reps):
    """``[(row, us)]``: a Linear(4, 4) called eagerly, then the same Layer wrapped with backend=None
    (run before stand_in(): a Paddle without CUDA graphs passes such calls through, NOTE
    [ Pass-through wrappers ] in core/lifecycle.py), best of ``reps`` rounds of 200 calls each."""
    paddle.seed(0)
    own, wrapped = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
    wrapped.set_state_dict(own.state_dict())
    autocudagraph(wrapped)
    x = paddle.randn([2, 4])
    own_us, wrapped_us = [], []
    for _ in range(reps):  # interleaved
        own_us.append(cpu_us(lambda: [own(x) for _ in range(200)]) / 200)
        wrapped_us.append(cpu_us(lambda: [wrapped(x) for _ in range(200)]) / 200)
    o, w = min(own_us), min(wrapped_us)
    return [("Linear(4, 4) forward, eagerly", f"{o:.2f}"),
            (f"the same wrapped with backend=None ({wrapped.forward.stats()['eager_reasons']})", f"{w:.2f} ({w / o:.2f}x)")]


def _eager_keyed(case, x, other):
    """A Linear(4, 4) graphed on the simulated backend whose key for ``x`` runs eagerly as ``case`` says;
    ``other``: an input of another shape whose key is captured first and stays graphed."""
    import warnings

    from paddlefleet.cudagraph.core.host_cost import HostCost
    from paddlefleet.cudagraph.errors import CudaGraphError

    paddle.seed(0)
    layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1, eager_if_slower=True,
                          max_graphs=0 if case == "max_graphs" else 16)
    wrapper = layer.forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3 if other is not None and case != "max_graphs" else 0):
            layer(other)
        if case == "capture failed":
            capture = wrapper._body.capture
            wrapper._body.capture = lambda *a, **k: (_ for _ in ()).throw(CudaGraphError("refused here"))
        for _ in range(2):  # warmup, capture
            layer(x)
        if case == "capture failed":
            wrapper._body.capture = capture
        if case == "eager_if_slower":  # its graphed calls measured slower (as core/host_cost.py would)
            [entry] = [e for e in wrapper._entries.values() if e.key.arguments[1][0][0] == tuple(x.shape)]
            entry.host_cost = cost = HostCost(measure=True, judge=True)
            cost.eager_s, cost.replay_s, cost.verdict = [1e-5] * 8, [2e-5] * 9, "eager"
            wrapper._acted(entry)
    return layer


def eager_call_rows(reps):
    """``[(row, own us, wrapped us)]``: a Linear(4, 4) called directly and through wrappers whose key runs
    eagerly (_eager_keyed), interleaved, forward alone and forward + backward, median of ``reps`` rounds of
    200 calls each (thread CPU time)."""
    paddle.seed(0)
    own = paddle.nn.Linear(4, 4)
    x, other, dy = paddle.randn([2, 4]), paddle.randn([3, 4]), paddle.randn([2, 4])
    cases = [("its capture failed, another key graphed", "capture failed", other),
             ("eager_if_slower sent it eager, another key graphed", "eager_if_slower", other),
             ("eager_if_slower sent every key eager", "eager_if_slower", None),
             ("max_graphs=0 (no key may hold graphs)", "max_graphs", None)]
    layers = [own] + [_eager_keyed(case, x, o) for _, case, o in cases]
    params = [layer.parameters() for layer in layers]
    fwd = [[] for _ in layers]
    both = [[] for _ in layers]
    for _ in range(reps):  # interleaved
        for k, layer in enumerate(layers):
            fwd[k].append(cpu_us(lambda: [layer(x) for _ in range(200)]) / 200)

            def step(layer=layer, ps=params[k]):
                layer(x).backward(dy)
                for p in ps:
                    p.clear_gradient(False)

            both[k].append(cpu_us(lambda: [step() for _ in range(200)]) / 200)
    f = [statistics.median(v) for v in fwd]
    b = [statistics.median(v) for v in both]
    rows = [("Linear(4, 4), the Layer's own call", f[0], b[0])]
    for k, (name, _, _) in enumerate(cases, 1):
        reasons = layers[k].forward.stats()["eager_reasons"]
        rows.append((f"through autocudagraph, {name} ({max(reasons, key=reasons.get)[:48]}...)", f[k], b[k]))
    return rows


def refused_call_us(reps):
    """``(own us, refused us, reason)``: the forward of a Linear(4, 4) whose key is refused under max_graphs=1 while
    another key holds the place and replays between its calls (so the refused key never displaces it: NOTE [ Places
    under max_graphs ]), against the Layer's own call after the same replay; medians of ``reps`` rounds of 200 calls,
    thread CPU time of the timed call alone. The held key replays the stand-in graph (NOTE [ Stand-in graph ]), as a
    GPU replay runs none of its Python (the simulated backend's re-run of it between the timed calls leaves the caches
    cold: on this repository's CPU machine the wrapped call then paid about 7 us more, the Layer's own about 3)."""
    with standing_in():
        return _refused_call_us(reps)


def _refused_call_us(reps):
    import warnings

    paddle.seed(0)
    own = paddle.nn.Linear(4, 4)
    layer = autocudagraph(paddle.nn.Linear(4, 4), backend="simulate", warmup_steps=1, max_graphs=1,
                          eager_if_slower=False)
    held, x = paddle.randn([3, 4]), paddle.randn([2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the max_graphs warning
        for _ in range(3):  # warmup, capture, replay
            layer(held)
        layer(x)

    def timed(call):
        total = 0.0
        for _ in range(200):
            layer(held)
            start = clock()
            call(x)
            total += clock() - start
        return total / 200 * 1e6

    own_us, refused_us = [], []
    for _ in range(reps):  # interleaved
        own_us.append(timed(own))
        refused_us.append(timed(layer))
    reasons = layer.forward.stats()["eager_reasons"]
    return statistics.median(own_us), statistics.median(refused_us), max(reasons, key=reasons.get)


def eager_call_lines(reps):
    rows = eager_call_rows(reps)
    own_f, own_b = rows[0][1], rows[0][2]
    lines = [f"Eager calls through the wrapper (simulated backend), us per call, median of {reps} interleaved rounds "
             "of 200 calls, thread CPU time:", "| call | forward | over own | forward + backward | over own |",
             "|---|---|---|---|---|"]
    for name, f, b in rows:
        lines.append(f"| {name} | {f:.2f} | {f - own_f:+.2f} | {b:.2f} | {b - own_b:+.2f} |")
    own, refused, reason = refused_call_us(reps)
    lines.append(f"- a key refused under max_graphs=1 ({reason}), another key replaying between its calls: forward "
                 f"{refused:.2f} us against the Layer's own {own:.2f} after the same replay ({refused - own:+.2f})")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="graphed layers of the per-layer model (default 32)")
    parser.add_argument("--width", type=int, default=32, help="width of each layer's matmul (default 32)")
    parser.add_argument("--batch", type=int, default=4, help="rows of the input (default 4)")
    parser.add_argument("--steps", type=int, default=60,
                        help="timed steps per runner; the medians are taken over them (default 60)")
    parser.add_argument("--block", default="16x512x16", help="LAYERSxWIDTHxBATCH of the timed block, or 0 for none")
    parser.add_argument("--eager-calls", action="store_true", help="print only the eager-call rows")
    args = parser.parse_args()
    paddle.set_device("cpu")
    os.environ.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)  # the pass-through rows time backend=None itself
    passing = pass_through_rows(15)
    eager_calls = eager_call_lines(max(5, args.steps // 4))
    if args.eager_calls:
        print("\n".join(eager_calls))
        return 0
    stand_in()
    draw = normal(0)
    x, dy = host_tensor(draw(args.batch, args.width)), host_tensor(draw(args.batch, args.width))
    graphed, layers = per_layer_step(args, x, dy, graph=True)
    startup = sum(cpu_us(graphed) for _ in range(3)) / 1e3
    eager, _ = per_layer_step(args, x, dy, graph=False)
    zeroed = [per_layer_step(args, x, dy, graph=graph, zero=True)[0] for graph in (True, False)]
    for run in zeroed:
        run()
    g, e, gz, ez = [], [], [], []
    for _ in range(args.steps):  # interleaved
        g.append(cpu_us(graphed))
        e.append(cpu_us(eager))
        gz.append(cpu_us(zeroed[0]))
        ez.append(cpu_us(zeroed[1]))
    g, e, gz, ez = (statistics.median(v) for v in (g, e, gz, ez))
    collect = cpu_us(gc.collect) / 1e3
    step = whole_step(args, x, dy)
    w = statistics.median(cpu_us(lambda: step(x, dy)) for _ in range(5 * args.steps))
    pieces = [(label, step_pieces(whole_step(args, x, dy, with_sgd), x, dy))
              for label, with_sgd in (("optimizers=[]", False), ("paddle SGD + scheduler", True))]
    n = args.layers
    print(f"CPU host time (thread CPU time, stand-in graph; not a GPU timing), {n} layers x {args.width}, batch {args.batch}")
    print(f"- per-layer step, {n} graphed layers: {g:.0f} us ({g / n:.1f} us per layer call, forward + backward); "
          f"eager {e:.0f} us ({e / n:.1f} us per layer)")
    print(f"- the same with grads zeroed (clear_gradient(True)) instead of freed: graphed {gz:.0f} us ({gz / n:.1f} us "
          f"per layer call: the views of the backward before reused); eager {ez:.0f} us ({ez / n:.1f} us per layer)")
    print(f"- start-up of {n} graphed layers (first 3 steps): {startup:.0f} ms; one gc.collect() in this process: "
          f"{collect:.0f} ms")
    print(f"- whole-step graph (autocudagraph_step), one call: {w:.1f} us")
    print(f"- whole-step graph, one replayed call piece by piece (us; {n} layers, {n} parameters):")
    print("  | piece | " + " | ".join(label for label, _ in pieces) + " |")
    print("  |---|" + "---|" * len(pieces))
    for k, (name, _, _) in enumerate(pieces[0][1]):
        print(f"  | {name} | " + " | ".join(rows[k][1] for _, rows in pieces) + " |")
    checks = "; ".join(f"{n} parameters {fast:.1f} against {slow:.1f} us" for n, fast, slow in step_check_rows(args, x, dy))
    print(f"- replay preconditions of the SGD step (StepBody.blocker), its walks compiled against in Python: {checks}")
    said = [line.strip() for line in layers[0].forward.explain().splitlines()
            if line.strip().startswith(("key ", "host time:"))]
    print(f"- explain() of the first layer: {'; '.join(said)}")
    print("A wrapper that can only run eagerly (backend=None, no CUDA build), us per call, best of 15 rounds:")
    for name, us in passing:
        print(f"- {name}: {us} us")
    print("\n".join(eager_calls))
    if args.block != "0":
        n, width, batch = (int(v) for v in args.block.lower().split("x"))
        sized = argparse.Namespace(batch=batch, reps=5 * args.steps, backend="simulate", layers=n, width=width)
        calls = [layer_call_us(sized, lambda: None, n, width, f"{n} parameters ({n} matmuls x {width})"),
                 layer_call_us(sized, lambda: None, 6, 1024, "realistic: 6 matmuls x 1024")]
        print("\n".join(layer_call_lines(calls, sized.reps)).replace("## ", "- ") + "\n")
        print(f"One replayed call of a graphed block of {args.block} (LAYERSxWIDTHxBATCH), median of {5 * args.steps}:")
        for name, us in block_rows(args.block, 5 * args.steps):
            print(f"- {name}: {us} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
