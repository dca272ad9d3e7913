"""The Paddle side of tools/bench.py: one runner per way of running the same training step.

A step is forward + backward with an explicit ``dy`` on a matmul-only MLP, then parameter grads
released with ``clear_gradient(False)`` (NOTE [ Kernel-less GPUs ] in testkit/common.py).
Runners: Paddle eager; autocudagraph with default options and with each speed option
(SPEED_OPTIONS, feature-detected); the whole-step graph ``autocudagraph_step`` where the package
has it; raw replay of one graph of the whole step (the floor).

NOTE [ Peak memory and start-up per runner ]
Runners of a config live side by side (they are timed interleaved), so a process-wide peak would
mix them. Before each runner is built, unused cached device memory is released (empty_cache) and
the reserved bytes noted; after its warmup, before its first check (an eager twin a check builds is
not the runner's memory), ``peak_bytes`` is what it added to the reserved memory at its peak: Paddle
>= 3 resets the peak counter; on 2.6 the reserved memory only grows between two releases, so the
peak is the larger of what is reserved then and what was reserved right before each release the
package made before a capture (NOTE [ Allocator cache before a capture ] in
backends/pool_memory.py: a per-layer runner's eager warmup may peak before its graphs are
captured). It holds the runner's model, grads, activations, static buffers and graph pools.
``allocated_bytes`` is the allocated (not only reserved) memory it added: at its peak where Paddle
can reset the peak counter (>= 3), else what it holds after its warmup (2.6). ``pool_bytes`` is
what its graphs' captures reserved, from the wrappers' stats() (NOTE [ Graph pool bytes ] in
core/entry.py; 0 for eager, and for raw replay the reserved growth across its one capture), and
``held_bytes`` all a wrapper's graphs hold by the package's own accounting (NOTE [ What a key
holds ] in core/memory.py: static buffers outside the pools and the pools). Raw replay releases
the allocator's cache before its capture, as the package does, so that its row is the floor of
memory too. ``startup_ms`` is the wall
NOTE [ Bench checks ]
Every runner's results are compared bit for bit with an eager reference of the same step after
its warmup and again after it was timed, and every graphed runner's counters must show a capture
and no eager call: a runner that fell back to eager would otherwise be timed as "graphed". A failed
check is recorded in the row next to the time, never dropped. A runner that cannot run here (an
option this version lacks, a kernel this GPU lacks, an error) gets a null time and the reason.
"""

import contextlib
import gc
import sys
import time

import numpy as np
import paddle

import paddlefleet.cudagraph as package
from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.core import host_cost
from testkit.common import (
    SPEED_OPTIONS,
    MatMLP,
    bitwise_failures,
    build,
    cuda_skip_reason,
    eager_calls,
    host_tensor,
    normal,
    option_unsupported,
    release_grads,
    short,
)

from .timing import MODES, STARTUP_STEPS, Runner, forward_timed, run_rounds, timed_call



class Blocks(paddle.nn.Layer):
    """Equal MatMLP blocks called in turn; each is graphed on its own (its own PyLayer)."""

    def __init__(self, cfg):
        super().__init__()
        self.blocks = paddle.nn.LayerList([MatMLP(cfg.block_dims()) for _ in range(cfg.blocks)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Setup:
    """One config's models (all with the same parameters), data, eager reference and sync."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend, self.cuda = cfg, backend, backend == "cuda"
        draw = normal(1234)
        self.x, self.dy = host_tensor(draw(cfg.batch, cfg.width)), host_tensor(draw(cfg.batch, cfg.width))
        self.reference = self.snapshot(self.model())

    def model(self):
        cfg = self.cfg
        return build((lambda: MatMLP(cfg.block_dims())) if cfg.blocks == 1 else (lambda: Blocks(cfg)), 1)

    @staticmethod
    def targets(model):
        """What gets decorated: the MLP itself, or each block."""
        return list(model.blocks) if isinstance(model, Blocks) else [model]

    def sync(self):
        if self.cuda:
            paddle.device.cuda.synchronize()

    def snapshot(self, model, release=True):
        """[y, grad of every parameter] of one step, as numpy."""
        y = model(self.x)
        y.backward(self.dy)
        out = [y.numpy()] + [p.grad.numpy() for p in model.parameters()]
        if release:
            release_grads(model)
        return out

    def step(self, model, release=True):
        """The timed step: returns the host seconds of the forward call. Grads are released
        through a parameter list made once (Layer.parameters() walks the sublayers: ~20 us a
        step on an H100 host, which would be charged to every Paddle runner)."""
        params = model.parameters()

        def finish(y):
            y.backward(self.dy)
            if release:
                for p in params:
                    p.clear_gradient(False)

        return forward_timed(model, self.x, finish)


class Unavailable(Exception):
    """A runner that cannot run in this version or on this GPU; the message says why."""


class Entry:
    """A runner with its check (returns failure messages; None for an eager baseline with nothing to
    compare against), its counters and its clean-up."""

    def __init__(self, runner, check, counters=None, cleanup=None, capture_ms=None, pool_bytes=None, held_bytes=None):
        self.runner, self.check = runner, check
        self.pool_bytes = pool_bytes or (lambda: 0)
        self.held_bytes = held_bytes or (lambda: None)  # NOTE [ What a key holds ] in core/memory.py
        self.counters = counters or (lambda: None)
        self.cleanup = cleanup or (lambda: None)
        self.capture_ms = capture_ms or (lambda: [])  # host ms of each key's capture


class DeviceMemory:
    """Reserved device bytes a runner adds at its peak (NOTE [ Peak memory and start-up per
    runner ]); None without CUDA (a smoke run)."""

    def __init__(self, cuda):
        self.cuda, self.base, self.high = cuda, None, 0

    @contextlib.contextmanager
    def watching(self):
        """Notes what is reserved right before every release the package makes (Paddle 2.6 has no
        peak counter to reset: NOTE [ Peak memory and start-up per runner ])."""
        mod = paddle.device.cuda if self.cuda else None
        release = getattr(mod, "empty_cache", None)
        if release is None:
            yield
            return

        def noted():
            self.high = max(self.high, mod.memory_reserved())
            release()

        mod.empty_cache = noted
        try:
            yield
        finally:
            mod.empty_cache = release

    def start(self):
        if not self.cuda:
            return
        gc.collect()
        mod = paddle.device.cuda
        mod.empty_cache()
        reset = getattr(mod, "reset_max_memory_reserved", None)
        if reset is not None:
            reset()
        self.base = self.high = mod.memory_reserved()
        reset = getattr(mod, "reset_max_memory_allocated", None)
        if reset is not None:
            reset()
        self.base_allocated = mod.memory_allocated()

    def allocated(self):
        if not self.cuda:
            return None
        mod = paddle.device.cuda
        top = mod.max_memory_allocated() if hasattr(mod, "reset_max_memory_allocated") else mod.memory_allocated()
        return int(top - self.base_allocated)

    def peak(self):
        if not self.cuda:
            return None
        mod = paddle.device.cuda
        top = mod.max_memory_reserved() if hasattr(mod, "reset_max_memory_reserved") else max(
            mod.memory_reserved(), self.high)
        return int(top - self.base)


def judged_eager(stats):
    """Eager calls the wrapper chose (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py:
    calls timed against the graph, and calls of keys whose graphed calls were slower)."""
    return sum(n for reason, n in stats["eager_reasons"].items()
               if reason == host_cost.TIMED or "eager_if_slower=False keeps it graphed" in reason)


def slower_keys(wrappers):
    """Keys that run eagerly because their graphed calls were slower than eager."""
    return sum(1 for w in wrappers for row in w.report()
               if row["phase"] == "fallback" and "eager_if_slower=False keeps it graphed" in (row["fallback_reason"] or ""))


def _key_ms(stats):
    return list((stats.get("capture_ms") or {}).values())


def compare(got, want, what):
    """Bitwise failures of ``got`` against ``want`` (lists of numpy arrays); values that are not
    finite fail too, since NaN equal to NaN would prove nothing."""
    bad = [i for i, a in enumerate(want) if not np.isfinite(a).all()]
    finite = [f"{what}[{i}] of the eager reference is not finite" for i in bad]
    return finite + bitwise_failures(got, want, what)[1]


# ----------------------------------------------------------------------------- runners
def eager_entry(s):
    model = s.model()
    return Entry(Runner("paddle_eager", s.step(model), s.sync, short),
                 lambda: compare(s.snapshot(model), s.reference, "eager again"))


def graphed_entry(s, name, options, keeps_grads=False):
    """autocudagraph on every block of a fresh model with ``options``."""
    reason = option_unsupported(options)
    if reason:
        raise Unavailable(reason)
    if keeps_grads and s.cuda and cuda_skip_reason("all"):
        raise Unavailable(f"accumulating grads needs Paddle's add kernel: {cuda_skip_reason('all')}")
    model = s.model()
    targets = s.targets(model)
    for target in targets:
        autocudagraph(target, backend=s.backend, **options)
    step, counted = s.step(model, release=not keeps_grads), [0]

    def counting_step():
        counted[0] += 1
        return step()

    def check():
        failures = []
        for i, target in enumerate(targets):
            stats = target.forward.stats()
            if stats["captures"] < 1 or eager_calls(stats) - judged_eager(stats):
                failures.append(f"block {i} is not replaying: {target.forward.explain()}")
        if not keeps_grads:
            return failures + compare(s.snapshot(model), s.reference, "y and grads")
        got = s.snapshot(model, release=False)
        counted[0] += 1
        twin = s.model()  # the same number of accumulated steps, eagerly
        for _ in range(counted[0] - 1):
            s.step(twin, release=False)()
        return failures + compare(got, s.snapshot(twin, release=False), "y and accumulated grads")

    def counters():
        stats = [t.forward.stats() for t in targets]
        return {k: sum(st[k] for st in stats) for k in ("captures", "replays")} | \
            {"eager": sum(eager_calls(st) for st in stats), "eager_chosen": sum(judged_eager(st) for st in stats),
             "keys_eager_as_slower": slower_keys([t.forward for t in targets]), "keys": len(targets)}

    return Entry(Runner(name, counting_step, s.sync, short), check, counters,
                 lambda: [t.forward.reset() for t in targets],
                 lambda: [ms for t in targets for ms in _key_ms(t.forward.stats())],
                 lambda: sum(t.forward.stats()["pool_bytes"] for t in targets),
                 lambda: sum(t.forward.stats()["held_bytes"] for t in targets))


def capture_raw(s, body):
    """(graph, static results) of one graph of ``body``: Paddle's own CUDAGraph on cuda; on the
    simulated backend (smoke runs) its CPU stand-in, so the rest of the runner is exercised."""
    if not s.cuda:
        from paddlefleet.cudagraph.backends.simulated import SimulatedBackend

        graph = SimulatedBackend().new_graph(None)
        return graph, graph.capture(body)
    from paddle.device.cuda import graphs

    gc.collect()  # nothing of a graph's pool may be freed while a capture is open (Paddle 2.6)
    graph = graphs.CUDAGraph()
    graph.capture_begin()
    try:
        static = body()
    finally:
        graph.capture_end()
    return graph, static


def raw_entry(s):
    """Raw replay (the floor): replay() of one graph holding the step's forward and backward."""
    model = s.model()
    params = model.parameters()

    def body():
        y = model(s.x)
        return [y] + list(paddle.grad([y], params, [s.dy]))

    for _ in range(2):
        body()
    if s.cuda:  # as the package does before a capture (NOTE [ Peak memory and start-up per runner ])
        paddle.device.cuda.empty_cache()
    start = time.perf_counter()
    before = paddle.device.cuda.memory_reserved() if s.cuda else 0
    graph, static = capture_raw(s, body)
    took = (time.perf_counter() - start) * 1e3
    pool = (paddle.device.cuda.memory_reserved() - before) if s.cuda else 0

    def check():
        graph.replay()
        s.sync()
        return compare([t.numpy() for t in static], s.reference, "replayed y and grads")

    return Entry(Runner("raw_replay", timed_call(graph.replay), s.sync, short), check, cleanup=graph.reset,
                 capture_ms=lambda: [took], pool_bytes=lambda: pool)


class TrainStep:
    """The step function a whole-step graph captures (and its eager twin runs): forward, backward,
    then an SGD update or the grads released. ``calls`` counts the calls that ran its Python."""

    def __init__(self, model, with_sgd):
        self.model, self.calls = model, 0
        self.opt = paddle.optimizer.SGD(learning_rate=1e-7, parameters=model.parameters()) if with_sgd else None
        self.optimizers = [self.opt] if self.opt is not None else []

    def __call__(self, x, dy):
        self.calls += 1
        y = self.model(x)
        y.backward(dy)
        if self.opt is not None:
            self.opt.step()
            self.opt.clear_grad(set_to_zero=False)
        else:
            release_grads(self.model)
        return y


def whole_step_entry(s, name, with_sgd):
    """The package's whole-step graph, feature-detected: forward + backward + release (matmul-only),
    or with an SGD update (needs Paddle's arithmetic kernels)."""
    make = getattr(package, "autocudagraph_step", None)
    if make is None:
        raise Unavailable(NO_STEP)
    if with_sgd and s.cuda and cuda_skip_reason("all"):
        raise Unavailable(f"an SGD update needs Paddle's arithmetic kernels: {cuda_skip_reason('all')}")
    body, twins = TrainStep(s.model(), with_sgd), []  # the eager twin is made by the first check (not this runner's memory)
    graphed = make(body, optimizers=body.optimizers, warmup_steps=2, backend=s.backend)
    counted, timed = [0], timed_call(graphed, s.x, s.dy)

    def step():
        counted[0] += 1
        return timed()

    def check():  # with an update the twin catches up; then both take one more step
        twin = twins[0] if twins else twins.append(TrainStep(s.model(), with_sgd)) or twins[0]
        while with_sgd and twin.calls < counted[0]:
            twin(s.x, s.dy)
        counted[0] += 1
        got = [graphed(s.x, s.dy).numpy()] + [p.numpy() for p in body.model.parameters()]
        want = [twin(s.x, s.dy).numpy()] + [p.numpy() for p in twin.model.parameters()]
        failures = compare(got, want, "returned y and parameters (grads are released inside the step)")
        counts = stats() if stats else None
        if counts is not None and (counts["captures"] < 1 or eager_calls(counts)):
            failures.append(f"the step is not replaying: {graphed.explain()}")
        return failures

    stats = getattr(graphed, "stats", None)
    return Entry(Runner(name, step, s.sync, short), check, (lambda: dict(stats())) if stats else None,
                 getattr(graphed, "reset", None), (lambda: _key_ms(stats())) if stats else None,
                 (lambda: stats().get("pool_bytes", 0)) if stats else None,
                 (lambda: stats().get("held_bytes")) if stats else None)


def eager_sgd_entry(s):
    """Eager forward + backward + SGD update: what the whole-step graph with an update replaces."""
    if s.cuda and cuda_skip_reason("all"):
        raise Unavailable(f"an SGD update needs Paddle's arithmetic kernels: {cuda_skip_reason('all')}")
    step = timed_call(TrainStep(s.model(), with_sgd=True), s.x, s.dy)
    return Entry(Runner("paddle_eager_sgd", step, s.sync, short), check=None)


RESULT_KEYS = ("times", "checks", "why_null", "counters", "peak_bytes", "allocated_bytes", "pool_bytes", "held_bytes",
               "startup_ms",
               "capture_ms")
OPTION_NAMES = [f"autocudagraph_{opt.name}" for opt in SPEED_OPTIONS]
PER_LAYER_OPTIONS = [f"autocudagraph_{opt.name}" for opt in SPEED_OPTIONS if opt.per_layer]
NO_OPTIONS = ("options other than chain_calls are timed on the configs of 1 and 4 blocks (each would capture "
              "every layer again)")

#: Runner groups, each timed in its own child process: the whole-step graph is new, and a CUDA
#: error that aborts its capture must not cost the config's other rows.
GROUPS = ("wrappers", "step")
NO_STEP = "paddlefleet.cudagraph has no autocudagraph_step in this version"


def has_whole_step():
    return hasattr(package, "autocudagraph_step")


def runner_names(group):
    return [name for name, _ in entries(None, group)]


def entries(s, group):
    """(name, factory) of every runner of a config's ``group``, in timing order."""
    if group == "step":
        return [("autocudagraph_step", lambda: whole_step_entry(s, "autocudagraph_step", with_sgd=False)),
                ("paddle_eager_sgd", lambda: eager_sgd_entry(s)),
                ("autocudagraph_step_sgd", lambda: whole_step_entry(s, "autocudagraph_step_sgd", with_sgd=True))]
    out = [("paddle_eager", lambda: eager_entry(s)), ("autocudagraph", lambda: graphed_entry(s, "autocudagraph", {}))]
    for opt in SPEED_OPTIONS:
        name = f"autocudagraph_{opt.name}"
        out.append((name, lambda name=name, opt=opt: graphed_entry(s, name, opt.options, opt.keeps_grads)))
    return out + [("raw_replay", lambda: raw_entry(s))]


# ----------------------------------------------------------------------------- one config
def _checked(entry):
    if entry.check is None:  # an eager baseline with nothing to compare against
        return None
    try:
        return entry.check()
    except Exception as err:  # noqa: BLE001 - a check that cannot run is a failed check
        return [f"the check raised {short(err)}"]


def _build(name, factory, warmup, out, memory, sync):
    """The runner's Entry, warmed up and checked, or None with the reason in ``out``; its peak
    memory (before the check: NOTE [ Peak memory and start-up per runner ]), start-up and capture
    times go to ``out`` too."""
    memory.start()
    start = time.perf_counter()
    with memory.watching():
        try:
            entry = factory()
        except Unavailable as why:
            out["why_null"][name] = str(why)
            return None
        except Exception as err:  # noqa: BLE001 - this runner's failure must not stop the others
            out["why_null"][name] = f"could not be set up: {short(err)}"
            return None
        entry.runner.warm(STARTUP_STEPS)
        sync()
        out["startup_ms"][name] = (time.perf_counter() - start) * 1e3
        entry.runner.warm(max(warmup - STARTUP_STEPS, 0))
        sync()
    if entry.runner.error:
        out["why_null"][name] = f"failed in warmup: {entry.runner.error}"
        entry.cleanup()
        return None
    out["peak_bytes"][name] = memory.peak()
    out["allocated_bytes"][name] = memory.allocated()
    out["pool_bytes"][name] = entry.pool_bytes()
    out["held_bytes"][name] = entry.held_bytes()
    out["checks"][name] = _checked(entry)
    sync()
    keys = entry.capture_ms()
    if keys:
        out["capture_ms"][name] = {"keys": len(keys), "total_ms": sum(keys), "max_ms": max(keys)}
    return entry


def bench_config(cfg, backend, group, warmup, rounds, steps):
    """Builds, checks and times every runner of one config's ``group`` (NOTE [ Bench checks ]).

    Returns ``{"times": {runner: {mode: summary}}, "checks": {runner: [failures]}, "why_null":
    {runner: reason}, "counters": {runner: {...}}, "peak_bytes": {runner: bytes}, "startup_ms":
    {runner: ms}, "capture_ms": {runner: {keys, total_ms, max_ms}}}``."""
    print(f"[paddle] {cfg.name} ({group}): {cfg.describe()}", file=sys.stderr, flush=True)
    s = Setup(cfg, backend)
    out = {key: {} for key in RESULT_KEYS}
    memory = DeviceMemory(s.cuda)
    todo = []
    for name, factory in entries(s, group):
        if not cfg.options and name in OPTION_NAMES and name not in PER_LAYER_OPTIONS:
            out["why_null"][name] = NO_OPTIONS
        else:
            todo.append((name, factory))
    built = [(name, e) for name, e in ((n, _build(n, f, max(warmup, 3), out, memory, s.sync)) for n, f in todo) if e]
    s.sync()
    run_rounds([e.runner for _, e in built], rounds, steps)
    for name, entry in built:
        if entry.runner.error:
            out["why_null"][name] = f"failed while timed: {entry.runner.error}"
        else:
            out["times"][name] = {mode: entry.runner.summary(mode) for mode in MODES}
            after = _checked(entry)
            if after is not None:
                out["checks"][name] += after
        out["counters"][name] = entry.counters()
        entry.cleanup()
    return out


def tf32_probe():
    """Max relative error of a float32 matmul against float64 on the GPU: ~3e-4 with TF32, ~1e-6 without."""
    draw = normal(0)
    a, b = draw(256, 256), draw(256, 256)
    got = paddle.matmul(host_tensor(a), host_tensor(b)).numpy().astype("float64")
    ref = a.astype("float64") @ b.astype("float64")
    return float(abs(got - ref).max() / abs(ref).max())
