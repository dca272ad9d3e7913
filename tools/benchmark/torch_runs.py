"""The torch side of tools/bench.py, run in a child process that never loads Paddle.

The same step as the Paddle side (matmul-only MLP, forward + backward with an explicit dy, grads
released) as torch eager, ``torch.cuda.make_graphed_callables`` (one graphed callable per block,
as the Paddle side decorates one block at a time) and raw ``torch.cuda.CUDAGraph`` replay of the
whole step. Each graphed result is compared bit for bit with torch eager. TF32 for float32
matmuls is set to what Paddle does (measured on the Paddle side), so compare ratios, not
absolute times, across the two libraries. Without CUDA (a smoke run) only eager runs; the
graphed runners are recorded as unavailable with the reason.
"""

import json
import sys
import time

from .timing import MODES, STARTUP_STEPS, Runner, forward_timed, pick_configs, run_rounds, timed_call



def describe(err):
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


class TorchSetup:
    """One config's models (the same weights), data and eager reference."""

    def __init__(self, torch, cfg, dev, sync):
        self.torch, self.cfg, self.dev, self.sync = torch, cfg, dev, sync
        nn = torch.nn
        gen = torch.Generator().manual_seed(1234)
        dims = cfg.block_dims()
        self.weights = [[torch.randn(a, b, generator=gen) / a ** 0.5 for a, b in zip(dims[:-1], dims[1:])]
                        for _ in range(cfg.blocks)]
        self.x = torch.randn(cfg.batch, cfg.width, generator=gen).to(dev)
        self.dy = torch.randn(cfg.batch, cfg.width, generator=gen).to(dev)

        class Block(nn.Module):
            def __init__(self, ws):
                super().__init__()
                self.ws = nn.ParameterList([nn.Parameter(w.clone()) for w in ws])

            def forward(self, h):
                for w in self.ws:
                    h = torch.matmul(h, w)
                return h

        self.block = Block
        self.eager = self.model()
        self.reference = self.snapshot(self.eager, list(self.eager.parameters()))

    def model(self):
        blocks = [self.block(ws) for ws in self.weights]
        return self.torch.nn.Sequential(*blocks).to(self.dev)

    def snapshot(self, call, params):
        """[y, every parameter's grad] of one step; grads released."""
        y = call(self.x)
        y.backward(self.dy)
        got = [y.detach().clone()] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return got

    def same(self, got):
        equal = all(self.torch.equal(a, b) for a, b in zip(got, self.reference))
        return [] if equal else ["results differ from torch eager"]

    def step_of(self, call, params):
        """The timed step: returns the host seconds of the forward call."""
        def finish(y):
            y.backward(self.dy)
            for p in params:
                p.grad = None

        return forward_timed(call, self.x, finish)


def eager_pair(t):
    m = t.model()  # a model of its own, so that its peak memory counts its parameters as the others' do
    params = list(m.parameters())
    return t.step_of(m, params), lambda: t.same(t.snapshot(m, params))


def graphed_pair(t):
    """torch.cuda.make_graphed_callables, one graphed callable per block."""
    torch, m = t.torch, t.model()
    params = list(m.parameters())
    samples = [(t.x.clone(),)] + [(torch.randn_like(t.x).requires_grad_(),) for _ in range(t.cfg.blocks - 1)]
    blocks = torch.cuda.make_graphed_callables(tuple(m), tuple(samples))
    call = torch.nn.Sequential(*blocks) if t.cfg.blocks > 1 else blocks[0]
    return t.step_of(call, params), lambda: t.same(t.snapshot(call, params))


def raw_pair(t):
    """Raw torch.cuda.CUDAGraph replay of the whole step (the floor)."""
    torch, m = t.torch, t.model()
    params = list(m.parameters())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            t.snapshot(m, params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = [m(t.x)]
        static += list(torch.autograd.grad(static[0], params, t.dy))

    def check():
        graph.replay()
        t.sync()
        return t.same(static)

    return timed_call(graph.replay), check


class _Memory:
    """Reserved device bytes a runner adds at its peak (NOTE [ Peak memory and start-up per
    runner ] in paddle_runs.py); None without CUDA."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda, self.base = torch, cuda, None

    def start(self):
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_reserved()
            self.base_allocated = self.torch.cuda.memory_allocated()

    def peak(self):
        return int(self.torch.cuda.max_memory_reserved() - self.base) if self.cuda else None

    def allocated(self):
        return int(self.torch.cuda.max_memory_allocated() - self.base_allocated) if self.cuda else None




def _runners(torch, cfg, dev, sync, out, warmup):
    """(runner, check) pairs of one config, each built, warmed up and checked in turn with its
    start-up and peak memory in ``out``; failures go to ``out['why_null']``."""
    t = TorchSetup(torch, cfg, dev, sync)
    memory = _Memory(torch, dev.type == "cuda")
    pairs = []
    for name, make in (("torch_eager", eager_pair), ("torch_graphed", graphed_pair), ("torch_raw_replay", raw_pair)):
        if name != "torch_eager" and dev.type != "cuda":
            out["why_null"][name] = "torch has no CUDA here (smoke run): CUDA graphs need a GPU"
            continue
        memory.start()
        start = time.perf_counter()
        try:
            step, check = make(t)
        except Exception as err:  # noqa: BLE001 - keep the other runners
            out["why_null"][name] = f"could not be set up: {describe(err)}"
            continue
        run = Runner(name, step, sync, describe)
        run.warm(STARTUP_STEPS)
        sync()
        out["startup_ms"][name] = (time.perf_counter() - start) * 1e3
        run.warm(max(warmup - STARTUP_STEPS, 0))
        if run.error:
            out["why_null"][run.name] = f"failed in warmup: {run.error}"
            continue
        out["checks"][run.name] = check()
        sync()
        out["peak_bytes"][name] = memory.peak()
        out["allocated_bytes"][name] = memory.allocated()
        pairs.append((run, check))
    return pairs


def bench_config(torch, cfg, args, dev, sync):
    print(f"[torch] {cfg.name}", file=sys.stderr, flush=True)
    out = {"times": {}, "checks": {}, "why_null": {}, "peak_bytes": {}, "allocated_bytes": {}, "startup_ms": {}}
    pairs = _runners(torch, cfg, dev, sync, out, args.warmup)
    sync()
    run_rounds([run for run, _ in pairs], args.rounds, args.steps)
    for run, check in pairs:
        if run.error:
            out["why_null"][run.name] = f"failed while timed: {run.error}"
            continue
        out["times"][run.name] = {mode: run.summary(mode) for mode in MODES}
        out["checks"][run.name] += check()
    return out


def worker(args):
    """Entry point of the torch child: times every config, writes JSON to ``args.json_out``."""
    import torch

    cuda = args.backend == "cuda" and torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tf32 = bool(int(args.tf32))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_tf32": tf32,
              "torch_gpu": torch.cuda.get_device_name(0) if cuda else None, "configs": {}}
    for cfg in pick_configs(args.configs, smoke=args.backend != "cuda"):
        result["configs"][cfg.name] = bench_config(torch, cfg, args, dev, sync)
        if cuda:
            torch.cuda.empty_cache()
    with open(args.json_out, "w") as fh:
        json.dump(result, fh)
    return 0
