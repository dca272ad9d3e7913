"""Configs and the two timing modes, shared by the Paddle runs and the torch child (no imports of either).

NOTE [ Two timing modes ]
*throughput*: N steps back to back, one device sync at the end, divided by N - what a training
loop that never waits for the device sees; the host may run ahead and hide its launch work
behind earlier steps' GPU work. *latency*: a device sync after every step, each step timed on the
host - what a loop that reads ``loss.item()`` every step sees; host work is fully exposed. Every
runner is measured in both modes in every round, the runners in alternating order (ABC, CBA, ...)
and the modes too, so that neither a slow phase of the machine nor the order favours one.
Throughput is the median over rounds of each round's mean; latency the median of all steps.
"""

import dataclasses
import statistics
import time

MODES = ("throughput", "latency")


@dataclasses.dataclass(frozen=True)
class Config:
    """A chain of ``layers`` square matmuls of ``width`` at ``batch`` rows, split into ``blocks``
    equal blocks that are graphed one by one (each its own PyLayer), as a model of several
    decorated blocks would be. With ``shape`` (widths of one layer's activations, in units of
    ``width``), each of the ``layers`` layers is a chain of ``len(shape) - 1`` matmuls of those
    widths: (1, 1, 1, 1, 1, 4, 1) is a transformer layer's q, k, v, o, up and down projections,
    one after another (Hopper with Paddle 2.6.2 runs only matmuls and copies: no attention
    arithmetic, no residual adds, and each tensor used once so that backward adds nothing)."""

    name: str
    layers: int
    width: int
    batch: int
    blocks: int = 1
    launch_bound: bool = True
    options: bool = True  # also time autocudagraph with each speed option (SPEED_OPTIONS)
    shape: tuple = ()

    def block_dims(self):
        """The activation widths along one graphed block: its matmuls are consecutive pairs."""
        if self.shape:
            per = self.layers // self.blocks
            return [self.width] + [self.width * m for _ in range(per) for m in self.shape[1:]]
        return [self.width] * (self.layers // self.blocks + 1)

    def matmuls(self):
        return (len(self.block_dims()) - 1) * self.blocks

    @property
    def per_layer(self):
        """One graphed Layer per layer, as users graph each decoder layer."""
        return self.blocks == self.layers and self.blocks > 1

    def smoke(self):
        """The same shape of config, small enough for the CPU in seconds."""
        layers = min(self.layers, 8)
        blocks = layers if self.per_layer else min(self.blocks, layers)
        return dataclasses.replace(self, layers=layers, width=min(self.width, 32), batch=min(self.batch, 8),
                                   blocks=blocks)

    def describe(self):
        if self.shape:
            kinds = "q, k, v, o, up, down" if tuple(self.shape) == TRANSFORMER else f"{len(self.shape) - 1} matmuls"
            layer = f"{self.layers} layers of {len(self.shape) - 1} matmuls ({kinds}) x {self.width}, batch {self.batch}"
            return layer + (", one graphed Layer per layer" if self.per_layer else f", {self.blocks} graphed blocks")
        if self.per_layer:
            split = ", one graphed Layer per layer"
        else:
            split = f", {self.blocks} graphed blocks of {self.layers // self.blocks}" if self.blocks > 1 else ""
        return f"{self.layers} x {self.width}, batch {self.batch}{split}"


#: Steps whose wall time is a runner's start-up: a graphed key's timed eager calls and warmup (8 eager
#: calls where eager_if_slower measures them: SAMPLES in paddlefleet/cudagraph/core/host_cost.py), its
#: capture and its first replay. Every runner, Paddle's and torch's, is timed over as many steps.
STARTUP_STEPS = 10

#: One transformer layer's projections: q, k, v, o (width), up (4x width), down.
TRANSFORMER = (1, 1, 1, 1, 1, 4, 1)

_BASE = [
    Config("mlp16x512_b16", 16, 512, 16),
    Config("mlp32x256_b8", 32, 256, 8),
    Config("mlp8x4096_b64", 8, 4096, 64, launch_bound=False),
]
#: Each decoder layer graphed on its own, the way users start: the options are timed on the
#: other configs only (each option would capture every layer once more: minutes of a GPU run).
PER_LAYER = [
    Config("xformer24x1024_b32_perlayer", 24, 1024, 32, blocks=24, options=False, shape=TRANSFORMER),
    Config("xformer32x512_b16_perlayer", 32, 512, 16, blocks=32, options=False, shape=TRANSFORMER),
    Config("mlp32x1024_b32_perlayer", 32, 1024, 32, blocks=32, options=False),
    Config("mlp24x2048_b8_perlayer", 24, 2048, 8, blocks=24, options=False),
]
CONFIGS = _BASE + [dataclasses.replace(c, name=f"{c.name}_4blocks", blocks=4) for c in _BASE] + PER_LAYER


def pick_configs(names, smoke):
    """CONFIGS named in ``names`` (comma-separated; all when empty), shrunk in a smoke run."""
    wanted = [n for n in (names or "").split(",") if n]
    unknown = sorted(set(wanted) - {c.name for c in CONFIGS})
    if unknown:
        raise SystemExit(f"bench: unknown config(s) {unknown}; known: {[c.name for c in CONFIGS]}")
    chosen = [c for c in CONFIGS if not wanted or c.name in wanted]
    return [c.smoke() for c in chosen] if smoke else chosen


class Runner:
    """One way of running a training step, timed in both modes (NOTE [ Two timing modes ]).

    ``step()`` runs one step and returns the host seconds of its forward call (the wrapper's
    host time where it is graphed); ``sync()`` waits for the device. The first error stops the
    runner and is kept as ``error`` (``describe(err)``), so the other runners go on.
    """

    def __init__(self, name, step, sync, describe=repr):
        self.name, self.step, self.sync, self.describe = name, step, sync, describe
        self.times = {m: [] for m in MODES}
        self.host = {m: [] for m in MODES}
        self.error = None

    def warm(self, steps):
        self._guard(lambda: [self.step() for _ in range(steps)])

    def measure(self, mode, steps):
        if self.error is None:
            self._guard(lambda: (self._throughput if mode == "throughput" else self._latency)(steps))

    def _guard(self, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one runner's failure must not stop the others
            self.error = self.describe(err)

    def _latency(self, steps):
        pc = time.perf_counter
        for _ in range(steps):
            start = pc()
            self.host["latency"].append(self.step())
            self.sync()
            self.times["latency"].append(pc() - start)

    def _throughput(self, steps):
        self.sync()
        start = time.perf_counter()
        host = [self.step() for _ in range(steps)]
        self.sync()
        self.times["throughput"].append((time.perf_counter() - start) / steps)
        self.host["throughput"] += host

    def summary(self, mode):
        """``{us, p10_us, p90_us, host_us, samples}`` for ``mode``; us is None without samples."""
        times = sorted(self.times[mode])
        if not times:
            return {"us": None}
        host = [h for h in self.host[mode] if h is not None]
        return {"us": statistics.median(times) * 1e6, "p10_us": times[len(times) // 10] * 1e6,
                "p90_us": times[(9 * len(times)) // 10] * 1e6,
                "host_us": statistics.median(host) * 1e6 if host else None, "samples": len(times)}


def timed_call(fn, *args):
    """A runner step that calls ``fn(*args)`` and returns its host seconds."""
    pc = time.perf_counter

    def step():
        start = pc()
        fn(*args)
        return pc() - start

    return step


def forward_timed(call, x, finish):
    """A runner step: ``y = call(x)``, timed on the host (the forward call: a graphed wrapper's host
    time), then ``finish(y)`` (backward, release grads)."""
    pc = time.perf_counter

    def step():
        start = pc()
        y = call(x)
        host = pc() - start
        finish(y)
        return host

    return step


def run_rounds(runners, rounds, steps):
    """Times every runner in both modes, ``rounds`` times, order and modes alternating."""
    for r in range(rounds):
        order = runners if r % 2 == 0 else runners[::-1]
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            for run in order:
                run.measure(mode, steps)
