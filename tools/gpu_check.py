"""End-to-end check of autocudagraph's ``cuda`` backend on a real GPU, bitwise against eager.

On the GPU host (after ``bash .gpu/bin/setup.sh && source .gpu/bin/env.sh``)::

    python tools/gpu_check.py --out docs/gpu_check.md

CPU smoke test of the same script (simulated backend, models on the CPU)::

    python tools/gpu_check.py --backend simulate

Every case runs a graphed model and an eager twin with identical parameters and inputs and
compares outputs, input grads and parameter grads bit for bit; the wrapper's counters pin that
the graphs were really captured and replayed (a capture that fell back to eager would also
match eager). The models use only matmuls (no bias, no activation) and explicit loss grads
(``y.backward(dy)``), and parameter grads are cleared with ``clear_gradient(False)`` between
steps: Paddle 2.6.2 has no kernels for Hopper (sm_90) beyond cuBLAS and copies, so adds, fills
and random initialisers must stay out of the run (parameters are made on the CPU and moved).

Exit code: 0 when every case passes, 1 otherwise. Each case is caught separately.
"""

import argparse
import contextlib
import datetime
import gc
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import paddle  # noqa: E402

from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from paddlefleet.cudagraph.backends import cuda_available, pool_sharing_supported  # noqa: E402
from paddlefleet.cudagraph.options import ENV_BACKEND  # noqa: E402

BACKEND = "cuda"  # set by main()
DEVICE = "gpu"


# ----------------------------------------------------------------------------- helpers
def short(err, limit=300):
    """The informative line of a (long, multi-line) Paddle error."""
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    pick = next((l for l in lines if l.startswith("(") and ")" in l[:40]), None)
    pick = pick or next((l for l in lines if "rror" in l), None) or (lines[-1] if lines else "")
    return f"{type(err).__name__}: {pick}"[:limit]


@contextlib.contextmanager
def on_device(name):
    old = paddle.get_device()
    paddle.set_device(name)
    try:
        yield
    finally:
        paddle.set_device(old)


def T(a, sg=True):
    """A tensor on the current device from numpy (a host-to-device copy, no kernel)."""
    return paddle.to_tensor(np.ascontiguousarray(a, dtype="float32"), stop_gradient=sg)


def npy(t):
    return None if t is None else t.numpy()


class Rng:
    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)

    def __call__(self, *shape, scale=1.0):
        return (self._rng.standard_normal(shape) * scale).astype("float32")


class MatLayer(paddle.nn.Layer):
    """y = x @ w: one parameter, no bias, no activation."""

    def __init__(self, din, dout):
        super().__init__()
        self.w = self.create_parameter([din, dout], dtype="float32")

    def forward(self, x):
        return paddle.matmul(x, self.w)


class MLP(paddle.nn.Layer):
    """A chain of MatLayers (each tensor is used once, so backward needs no add kernel)."""

    def __init__(self, dims):
        super().__init__()
        self.layers = paddle.nn.LayerList([MatLayer(a, b) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(factory, seed):
    """A Layer from ``factory`` with numpy-random parameters, on DEVICE.

    Made on the CPU (Paddle's initialiser kernels do not run on sm_90 with Paddle 2.6), filled
    with set_value (a copy) and moved with Layer.to (copies)."""
    rng = Rng(seed)
    with on_device("cpu"):
        layer = factory()
        for p in layer.parameters():
            p.set_value(rng(*p.shape, scale=1.0 / np.sqrt(p.shape[0])))
    if DEVICE != "cpu":
        layer.to(device=DEVICE)
    return layer


def twins(factory, seed):
    return build(factory, seed), build(factory, seed)


def clear_grads(*layers):
    for layer in layers:
        for p in layer.parameters():
            p.clear_gradient(False)  # frees; set_to_zero=True would need a fill kernel


class Check:
    """Collects comparisons of one case; failures are recorded, not raised, until the end."""

    def __init__(self):
        self.compared = 0
        self.failures = []
        self.notes = []

    def fail(self, msg):
        self.failures.append(msg)

    def bitwise(self, what, actual, expected):
        self.compared += 1
        if expected is None or actual is None:
            if (expected is None) != (actual is None):
                self.fail(f"{what}: {'graphed' if actual is None else 'eager'} is None, the other is not")
            return
        a = actual.numpy() if isinstance(actual, paddle.Tensor) else np.asarray(actual)
        e = expected.numpy() if isinstance(expected, paddle.Tensor) else np.asarray(expected)
        if a.dtype != e.dtype or a.shape != e.shape:
            self.fail(f"{what}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}")
            return
        if a.tobytes() != e.tobytes():
            diff = np.abs(a.astype("float64") - e.astype("float64"))
            n = int(np.count_nonzero(a != e)) if a.size else 0
            self.fail(f"{what}: {n}/{a.size} elements differ, max |diff| {np.nanmax(diff) if diff.size else 0:.3g}")

    def close(self, what, actual, reference, rtol=2e-2):
        """Loose check against numpy float64 (Paddle may use TF32 for float32 matmuls)."""
        a = actual.numpy().astype("float64")
        ref = np.asarray(reference, dtype="float64")
        scale = max(float(np.abs(ref).max()), 1e-6)
        err = float(np.abs(a - ref).max()) if a.shape == ref.shape else float("inf")
        if not np.isfinite(err) or err > rtol * scale:
            self.fail(f"{what}: differs from numpy by {err:.3g} (scale {scale:.3g}); kernels broken?")
        return err / scale

    def expect(self, what, cond):
        if not cond:
            self.fail(what)

    def stats(self, wrapper, **expected):
        """Pins the wrapper's counters (captures, replays, fallbacks, graphs, keys)."""
        stats = wrapper.stats()
        got = {k: stats.get(k) for k in expected}
        if got != expected:
            self.fail(f"counters {got} != expected {expected}; explain(): {wrapper.explain()}")
        self.notes.append(
            "captures={} replays={} eager={} graphs={}".format(
                stats.get("captures"), stats.get("replays"), stats.get("fallbacks"), stats.get("graphs")
            )
        )
        return stats


# ----------------------------------------------------------------------------- cases
CASES = []


def case(title):
    def deco(fn):
        CASES.append((title, fn))
        return fn

    return deco


@case("sanity: eager matmul forward/backward vs numpy")
def case_sanity(chk):
    rng = Rng(1)
    xn, wn, dyn = rng(16, 64), rng(64, 32), rng(16, 32)
    x, w = T(xn, sg=False), T(wn, sg=False)
    y = paddle.matmul(x, w)
    y.backward(T(dyn))
    errs = [
        chk.close("y", y, xn.astype("float64") @ wn),
        chk.close("x.grad", x.grad, dyn.astype("float64") @ wn.T),
        chk.close("w.grad", w.grad, xn.T.astype("float64") @ dyn),
    ]
    y2 = paddle.matmul(x, w)
    chk.bitwise("matmul is deterministic", y2, y)
    c = y.clone()
    chk.bitwise("clone", c, y)
    chk.notes.append(f"max rel. error vs float64 {max(errs):.2g} ({'TF32-like' if max(errs) > 2e-5 else 'FP32-like'})")


@case("function with tensor args")
def case_function(chk):
    def f(x, w):
        return paddle.matmul(x, w)

    g = autocudagraph(f, backend=BACKEND)
    rng = Rng(2)
    held = []
    steps = 5
    for k in range(steps):
        xn, wn, dyn = rng(8, 32), rng(32, 16), rng(8, 16)
        xa, wa, xb, wb = T(xn, False), T(wn, False), T(xn, False), T(wn, False)
        ya = g(xa, wa)
        ya.backward(T(dyn))
        yb = f(xb, wb)
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        chk.bitwise(f"step {k} x.grad", xa.grad, xb.grad)
        chk.bitwise(f"step {k} w.grad", wa.grad, wb.grad)
        held.append((ya, yb.numpy()))
    for k, (ya, ref) in enumerate(held):  # clone_outputs=True: later replays leave them alone
        chk.bitwise(f"step {k} y read after later replays", ya, ref)
    chk.stats(g, captures=1, replays=steps - 2, fallbacks=0)


@case("Layer method (two instances, own graphs)")
def case_method(chk):
    class GNet(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w1 = self.create_parameter([16, 32], dtype="float32")
            self.w2 = self.create_parameter([32, 8], dtype="float32")

        @autocudagraph(backend=BACKEND)
        def step(self, x):
            return paddle.matmul(paddle.matmul(x, self.w1), self.w2)

    class ENet(GNet):
        def step(self, x):  # the same body, eager
            return paddle.matmul(paddle.matmul(x, self.w1), self.w2)

    pairs = [(build(GNet, 30 + i), build(ENet, 30 + i)) for i in range(2)]
    rng = Rng(3)
    steps = 4
    for k in range(steps):
        for i, (gnet, enet) in enumerate(pairs):
            xn, dyn = rng(4, 16), rng(4, 8)
            xa, xb = T(xn, False), T(xn, False)
            ya = gnet.step(xa)
            ya.backward(T(dyn))
            yb = enet.step(xb)
            yb.backward(T(dyn))
            chk.bitwise(f"step {k} net {i} y", ya, yb)
            chk.bitwise(f"step {k} net {i} x.grad", xa.grad, xb.grad)
            chk.bitwise(f"step {k} net {i} w1.grad", gnet.w1.grad, enet.w1.grad)
            chk.bitwise(f"step {k} net {i} w2.grad", gnet.w2.grad, enet.w2.grad)
            clear_grads(gnet, enet)
    chk.expect("each instance has its own wrapper", pairs[0][0].step is not pairs[1][0].step)
    for gnet, _ in pairs:
        chk.stats(gnet.step, captures=1, replays=steps - 2, fallbacks=0)


@case("Layer instance (4 matmul layers, param + input grads, 6 steps)")
def case_layer(chk):
    dims = [24, 48, 40, 32, 16]
    g, e = twins(lambda: MLP(dims), 40)
    autocudagraph(g, backend=BACKEND)
    rng = Rng(4)
    steps = 6
    for k in range(steps):
        xn, dyn = rng(8, dims[0]), rng(8, dims[-1])
        xa, xb = T(xn, False), T(xn, False)
        ya = g(xa)
        ya.backward(T(dyn))
        yb = e(xb)
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        chk.bitwise(f"step {k} x.grad", xa.grad, xb.grad)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"step {k} {name}.grad", pa.grad, pb.grad)
        if k == steps - 1:
            ref = xn.astype("float64")
            for p in e.parameters():
                ref = ref @ p.numpy().astype("float64")
            chk.close("eager y vs numpy", yb, ref)
        clear_grads(g, e)
    chk.stats(g.forward, captures=1, replays=steps - 2, fallbacks=0)


@case("several inputs, mixed stop_gradient (non-leaf / constant / leaf)")
def case_mixed(chk):
    def f(a, b, c):
        return paddle.matmul(paddle.matmul(a, b), c)

    g = autocudagraph(f, backend=BACKEND)
    rng = Rng(5)
    steps = 5
    for k in range(steps):
        a0n, mn, bn, cn, dyn = rng(6, 10), rng(10, 12), rng(12, 14), rng(14, 4), rng(6, 4)
        res = []
        for fn in (g, f):
            a0, m = T(a0n, False), T(mn, True)
            a = paddle.matmul(a0, m)  # non-leaf that needs grad
            b, c = T(bn, True), T(cn, False)
            y = fn(a, b, c)
            y.backward(T(dyn))
            res.append((y, a0.grad, b.grad, c.grad, m.grad))
        for name, ga, ea in zip(("y", "a0.grad (through the non-leaf a)", "b.grad", "c.grad", "m.grad"), *res):
            chk.bitwise(f"step {k} {name}", ga, ea)
        chk.expect(f"step {k}: b (stop_gradient) got a grad", res[0][2] is None)
    chk.stats(g, captures=1, replays=steps - 2, fallbacks=0)


@case("nested dict/list IO with a non-tensor leaf")
def case_nested(chk):
    def f(batch):
        w1, w2 = batch["ws"]
        return {
            "out": [paddle.matmul(batch["x"], w1), paddle.matmul(batch["z"], w2)],
            "tag": ("nested", batch["n"]),
        }

    g = autocudagraph(f, backend=BACKEND)
    rng = Rng(6)
    steps = 5
    for k in range(steps):
        xn, zn, w1n, w2n, d1, d2 = rng(4, 8), rng(5, 6), rng(8, 3), rng(6, 7), rng(4, 3), rng(5, 7)
        res = []
        for fn in (g, f):
            batch = {"x": T(xn, False), "z": T(zn, True), "ws": [T(w1n, False), T(w2n, False)], "n": 3}
            out = fn(batch)
            paddle.autograd.backward(out["out"], [T(d1), T(d2)])
            res.append((out, batch))
        (oa, ba), (ob, bb) = res
        chk.expect(f"step {k}: output structure {type(oa).__name__} {sorted(oa)} "
                   f"{type(oa['out']).__name__}", isinstance(oa, dict) and isinstance(oa["out"], list))
        chk.expect(f"step {k}: non-tensor output {oa.get('tag')!r} != {ob['tag']!r}", oa.get("tag") == ob["tag"])
        chk.bitwise(f"step {k} out[0]", oa["out"][0], ob["out"][0])
        chk.bitwise(f"step {k} out[1]", oa["out"][1], ob["out"][1])
        chk.bitwise(f"step {k} x.grad", ba["x"].grad, bb["x"].grad)
        chk.bitwise(f"step {k} z.grad", ba["z"].grad, bb["z"].grad)
        chk.bitwise(f"step {k} w1.grad", ba["ws"][0].grad, bb["ws"][0].grad)
        chk.bitwise(f"step {k} w2.grad", ba["ws"][1].grad, bb["ws"][1].grad)
    chk.stats(g, captures=1, replays=steps - 2, fallbacks=0)


@case("several keys (3 batch sizes) with max_graphs=2: third runs eagerly")
def case_keys(chk):
    dims = [16, 24, 8]
    g, e = twins(lambda: MLP(dims), 70)
    autocudagraph(g, backend=BACKEND, max_graphs=2)
    rng = Rng(7)
    rounds, batches = 4, (4, 8, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(rounds):
            for bs in batches:
                xn, dyn = rng(bs, dims[0]), rng(bs, dims[-1])
                ya = g(T(xn))
                ya.backward(T(dyn))
                yb = e(T(xn))
                yb.backward(T(dyn))
                chk.bitwise(f"round {k} batch {bs} y", ya, yb)
                for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
                    chk.bitwise(f"round {k} batch {bs} {name}.grad", pa.grad, pb.grad)
                clear_grads(g, e)
    stats = chk.stats(g.forward, captures=2, replays=2 * (rounds - 2), fallbacks=rounds, graphs=2)
    reasons = stats.get("eager_reasons", {})
    chk.expect(f"eager calls with reason 'max_graphs reached': {reasons.get('max_graphs reached')}, expected {rounds}",
               reasons.get("max_graphs reached") == rounds)
    chk.expect("no max_graphs warning", any("max_graphs" in str(w.message) for w in caught))


@case("no_grad calls (own key), then grad calls")
def case_no_grad(chk):
    dims = [12, 20, 6]
    g, e = twins(lambda: MLP(dims), 80)
    autocudagraph(g, backend=BACKEND)
    rng = Rng(8)
    n_nograd, n_grad = 4, 3
    for k in range(n_nograd):
        xn = rng(5, dims[0])
        with paddle.no_grad():
            ya = g(T(xn, False))
            yb = e(T(xn, False))
        chk.bitwise(f"no_grad call {k} y", ya, yb)
        chk.expect(f"no_grad call {k}: output needs grad", ya.stop_gradient)
    for k in range(n_grad):
        xn, dyn = rng(5, dims[0]), rng(5, dims[-1])
        xa, xb = T(xn, False), T(xn, False)
        ya = g(xa)
        ya.backward(T(dyn))
        yb = e(xb)
        yb.backward(T(dyn))
        chk.bitwise(f"grad call {k} y", ya, yb)
        chk.bitwise(f"grad call {k} x.grad", xa.grad, xb.grad)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"grad call {k} {name}.grad", pa.grad, pb.grad)
        clear_grads(g, e)
    chk.stats(g.forward, captures=2, replays=(n_nograd - 2) + (n_grad - 2), fallbacks=0, keys=2)


@case("Layer instance, clone_outputs=False + clone_param_grads=False, 6 steps")
def case_no_clone(chk):
    dims = [32, 32, 32, 32]
    g, e = twins(lambda: MLP(dims), 90)
    autocudagraph(g, backend=BACKEND, clone_outputs=False, clone_param_grads=False)
    rng = Rng(9)
    steps = 6
    for k in range(steps):
        xn, dyn = rng(8, dims[0]), rng(8, dims[-1])
        xa, xb = T(xn, False), T(xn, False)
        ya = g(xa)
        ya.backward(T(dyn))
        yb = e(xb)
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        chk.bitwise(f"step {k} x.grad", xa.grad, xb.grad)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"step {k} {name}.grad", pa.grad, pb.grad)
        clear_grads(g, e)
    chk.stats(g.forward, captures=1, replays=steps - 2, fallbacks=0)


@case("verify_replays=3: every verified call matches eager, nothing disabled")
def case_verify(chk):
    dims = [32, 32, 32]
    g, e = twins(lambda: MLP(dims), 95)
    autocudagraph(g, backend=BACKEND, verify_replays=3)
    rng = Rng(11)
    steps = 6
    for k in range(steps):
        xn, dyn = rng(8, dims[0]), rng(8, dims[-1])
        ya = g(T(xn))
        ya.backward(T(dyn))
        yb = e(T(xn))
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"step {k} {name}.grad", pa.grad, pb.grad)
        clear_grads(g, e)
    stats = chk.stats(g.forward, captures=1, replays=steps - 2, fallbacks=0)
    chk.expect(f"verified_replays {stats.get('verified_replays')} == 3, mismatches {stats.get('verify_mismatches')} == 0",
               stats.get("verified_replays") == 3 and stats.get("verify_mismatches") == 0)


class AttrOut(dict):
    """ModelOutput style: items readable as attributes (tools/ keeps to matmul-only models)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


Pair = __import__("collections").namedtuple("Pair", ["a", "b"])


@__import__("dataclasses").dataclass(frozen=True)
class Frozen:
    t: object
    n: int = 1


@case("call patterns: containers keep their type in and out (dict subclass, namedtuple, frozen dataclass)")
def case_containers(chk):
    def f(batch, pair):
        return AttrOut(h=paddle.matmul(batch.x, batch.w), z=Frozen(t=paddle.matmul(pair.a, pair.b))), Pair(a=3, b=None)

    g = autocudagraph(f, backend=BACKEND)
    rng = Rng(12)
    steps = 5
    for k in range(steps):
        xn, wn, an, bn, d1, d2 = rng(4, 8), rng(8, 3), rng(5, 6), rng(6, 2), rng(4, 3), rng(5, 2)
        res = []
        for fn in (g, f):
            batch, pair = AttrOut(x=T(xn, False), w=T(wn, False)), Pair(a=T(an, False), b=T(bn, True))
            out, tail = fn(batch, pair)
            paddle.autograd.backward([out.h, out.z.t], [T(d1), T(d2)])
            res.append((out, tail, batch, pair))
        (oa, ta, ba, pa), (ob, tb, bb, pb) = res
        chk.expect(f"step {k}: types {type(oa).__name__} {type(oa['z']).__name__} {type(ta).__name__}",
                   type(oa) is AttrOut and type(oa["z"]) is Frozen and type(ta) is Pair and ta == tb)
        chk.bitwise(f"step {k} out.h", oa.h, ob.h)
        chk.bitwise(f"step {k} out.z.t", oa.z.t, ob.z.t)
        chk.bitwise(f"step {k} batch.x.grad", ba.x.grad, bb.x.grad)
        chk.bitwise(f"step {k} batch.w.grad", ba.w.grad, bb.w.grad)
        chk.bitwise(f"step {k} pair.a.grad", pa.a.grad, pb.a.grad)
    chk.stats(g, captures=1, replays=steps - 2, fallbacks=0)


def _hierarchy(decorate):
    class Base(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w1 = self.create_parameter([16, 24], dtype="float32")

        @decorate
        def forward(self, x):
            return paddle.matmul(x, self.w1)

    class Sub(Base):
        def __init__(self):
            super().__init__()
            self.w2 = self.create_parameter([24, 8], dtype="float32")

        @decorate
        def forward(self, x):
            return paddle.matmul(super().forward(x), self.w2)

    return Sub


@case("call patterns: graphed Base.forward and Sub.forward, Sub calling super().forward()")
def case_hierarchy(chk):
    g = build(_hierarchy(lambda fn: autocudagraph(fn, backend=BACKEND)), 110)
    e = build(_hierarchy(lambda fn: fn), 110)
    rng = Rng(13)
    steps = 5
    for k in range(steps):
        xn, dyn = rng(4, 16), rng(4, 8)
        xa, xb = T(xn, False), T(xn, False)
        ya = g(xa)
        ya.backward(T(dyn))
        yb = e(xb)
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        chk.bitwise(f"step {k} x.grad", xa.grad, xb.grad)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"step {k} {name}.grad", pa.grad, pb.grad)
        clear_grads(g, e)
    chk.stats(g.forward, captures=1, replays=steps - 2, fallbacks=0)
    inner = super(type(g), g).forward.stats()
    chk.expect(f"inner wrapper: captures {inner['captures']}, eager reasons {inner['eager_reasons']}",
               inner["captures"] == 0 and "called inside another capture" in inner["eager_reasons"])


@case("call patterns: @staticmethod / @classmethod with @autocudagraph, both orders")
def case_static_methods(chk):
    class Ops:
        @staticmethod
        @autocudagraph(backend=BACKEND)
        def below(x, w):
            return paddle.matmul(x, w)

        @autocudagraph(backend=BACKEND)
        @classmethod
        def above(cls, x, w):
            return paddle.matmul(x, w)

    rng = Rng(14)
    steps = 5
    for name in ("below", "above"):
        for k in range(steps):
            xn, wn, dyn = rng(4, 8), rng(8, 6), rng(4, 6)
            xa, wa, xb, wb = T(xn, False), T(wn, False), T(xn, False), T(wn, False)
            ya = getattr(Ops if k % 2 else Ops(), name)(xa, wa)
            ya.backward(T(dyn))
            yb = paddle.matmul(xb, wb)
            yb.backward(T(dyn))
            chk.bitwise(f"{name} step {k} y", ya, yb)
            chk.bitwise(f"{name} step {k} x.grad", xa.grad, xb.grad)
            chk.bitwise(f"{name} step {k} w.grad", wa.grad, wb.grad)
        chk.stats(getattr(Ops, name), captures=1, replays=steps - 2, fallbacks=0)


class TwoArgs(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([12, 12], dtype="float32")

    def forward(self, x, m):
        return paddle.matmul(paddle.matmul(x, self.w), m)


class Recomputed(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = paddle.nn.LayerList([TwoArgs(), TwoArgs()])

    def forward(self, x, m1, m2):
        from paddle.distributed.fleet.utils import recompute

        return recompute(self.blocks[1], recompute(self.blocks[0], x, m1), m2)


@case("call patterns: reentrant recompute around graphed Layers with two tensor arguments")
def case_recompute_signature(chk):
    import inspect

    g, e = twins(Recomputed, 120)
    for block in g.blocks:
        autocudagraph(block, backend=BACKEND)
    chk.expect(f"signature {inspect.signature(g.blocks[0].forward)}",
               list(inspect.signature(g.blocks[0].forward).parameters) == ["x", "m"])
    rng = Rng(15)
    steps = 5
    for k in range(steps):
        xn, m1n, m2n, dyn = rng(4, 12), rng(12, 12), rng(12, 12), rng(4, 12)
        xa, xb = T(xn, False), T(xn, False)
        ya = g(xa, T(m1n), T(m2n))
        ya.backward(T(dyn))
        yb = e(xb, T(m1n), T(m2n))
        yb.backward(T(dyn))
        chk.bitwise(f"step {k} y", ya, yb)
        chk.bitwise(f"step {k} x.grad", xa.grad, xb.grad)
        for (name, pa), pb in zip(g.named_parameters(), e.parameters()):
            chk.bitwise(f"step {k} {name}.grad", pa.grad, pb.grad)
        clear_grads(g, e)
    for block in g.blocks:  # recompute's forward (no grad) and its re-run in backward: two keys
        chk.stats(block.forward, captures=2, replays=2 * (steps - 2), fallbacks=0, keys=2)


@case("call patterns: masked_select (output shape from values) fails the capture; the key runs eagerly")
def case_value_shapes(chk):
    def f(x, keep):
        return paddle.masked_select(x, keep)

    try:
        probe = f(T(np.ones((2, 2))), paddle.to_tensor(np.eye(2, dtype=bool)))
        ok = probe.shape == [2] or list(probe.shape) == [2]
    except Exception as err:  # noqa: BLE001
        ok, probe = False, err
    if not ok:
        chk.notes.append(f"not checked: eager masked_select does not run on this GPU ({short(probe) if isinstance(probe, Exception) else probe})")
        return
    g = autocudagraph(f, backend=BACKEND)
    rng = Rng(16)
    for k in range(4):
        xn = rng(4, 4)
        keep = paddle.to_tensor(xn > (k - 2) * 0.3)  # a host-to-device copy, no kernel
        chk.bitwise(f"call {k} y", g(T(xn), keep), f(T(xn), keep))
    stats = g.stats()
    chk.expect(f"captures {stats['captures']} (expected 0), eager reasons {stats['eager_reasons']}",
               stats["captures"] == 0 and stats["eager_reasons"].get("capture failed") == 1)
    chk.notes.append(f"reason: {g.report()[0]['fallback_reason'][:160]}")


# ----------------------------------------------------------------------------- runner
def run_case(title, fn):
    chk = Check()
    t0 = time.perf_counter()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle.seed(2024)  # host-side only (no kernel)
        try:
            fn(chk)
        except Exception as err:  # noqa: BLE001 - one case's failure must not hide the others
            error = err
            tb = traceback.format_exc()
    ms = (time.perf_counter() - t0) * 1e3
    # Free this case's tensors now: one of a graph's private pool freed later, while another
    # capture is open, aborts Paddle 2.6 (CUDA error 900 in CUDAGraphAllocator::FreeImpl).
    gc.collect()
    ours = [str(w.message) for w in caught if "autocudagraph" in str(w.message)]
    if error is not None:
        result = "ERROR"
        detail = short(error)
        long = tb
    elif chk.failures:
        result = "FAIL"
        detail = f"{len(chk.failures)} of {chk.compared} checks failed: " + "; ".join(chk.failures[:2])
        long = "\n".join(chk.failures)
    else:
        result = "PASS"
        detail = f"{chk.compared} values bitwise equal"
        long = ""
    if chk.notes:
        detail += "; " + "; ".join(dict.fromkeys(chk.notes))
    if ours:
        detail += "; warnings: " + " | ".join(dict.fromkeys(m[:200] for m in ours))
        long += ("\n" if long else "") + "\n".join(dict.fromkeys(ours))
    return {"case": title, "result": result, "detail": detail, "long": long, "ms": ms}


def git_head():
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "paddlefleet"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        head = out.stdout.strip()
        if out.returncode != 0 or not head:
            return "? (no git checkout here)"
        return head + (" (+ uncommitted changes in paddlefleet/)" if dirty else "")
    except Exception:  # noqa: BLE001
        return "?"


def header():
    lines = [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- backend: `{BACKEND}` (device `{DEVICE}`), paddlefleet at {git_head()}",
        f"- paddle: {paddle.__version__} (commit {getattr(paddle.version, 'commit', '?')[:12]}, "
        f"CUDA {paddle.version.cuda() if paddle.is_compiled_with_cuda() else 'none'}, "
        f"cuDNN {paddle.version.cudnn() if paddle.is_compiled_with_cuda() else 'none'}), "
        f"python {platform.python_version()}, numpy {np.__version__}",
    ]
    if DEVICE != "cpu":
        try:
            cap = paddle.device.cuda.get_device_capability()
            lines.append(f"- GPU: {paddle.device.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
        except Exception as err:  # noqa: BLE001
            lines.append(f"- GPU: ? ({short(err)})")
    try:
        from paddle.device.cuda import graphs

        core_graph = getattr(graphs, "CoreCUDAGraph", None)
        names = ("begin_capture", "begin_capture_with_pool_id", "gen_new_memory_pool_id")
        found = [n for n in names if core_graph is not None and hasattr(core_graph, n)]
        lines.append(
            f"- CUDA-graph API: cuda_available()={cuda_available()}, pool_sharing_supported()="
            f"{pool_sharing_supported()} ({'forward and backward share one pool' if pool_sharing_supported() else 'private pool per graph'}); "
            f"core.CUDAGraph has {found or 'nothing (CPU build)'}"
        )
    except Exception as err:  # noqa: BLE001
        lines.append(f"- CUDA-graph API: ? ({short(err)})")
    try:
        a, b = T([1.0]), T([1.0])
        lines.append(f"- Place: `a.place == b.place` for two tensors on one device is {a.place == b.place}, "
                     f"str equal {str(a.place) == str(b.place)}, hash equal {hash(a.place) == hash(b.place)} "
                     "(a key holding Place objects needs ==)")
    except Exception as err:  # noqa: BLE001
        lines.append(f"- Place: ? ({short(err)})")
    lines.append(f"- NVIDIA_TF32_OVERRIDE={os.environ.get('NVIDIA_TF32_OVERRIDE', 'unset')}")
    return lines


def md(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def run_isolated(index, backend, timeout):
    """Runs case ``index`` in a child process, so that an abort (e.g. CUDA error 900 after a
    failed capture) costs one row, not the report."""
    import json
    import tempfile

    title = CASES[index][0]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--child-case", str(index), "--child-json", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            tail = [l.strip() for l in (proc.stderr or "").splitlines() if l.strip()][-4:]
            return {"case": title, "result": "ERROR", "ms": 0.0,
                    "detail": f"process died (exit {proc.returncode}): " + " / ".join(tail)[-300:],
                    "long": (proc.stderr or "")[-4000:]}
    except subprocess.TimeoutExpired:
        return {"case": title, "result": "ERROR", "ms": timeout * 1e3, "detail": f"timed out after {timeout}s", "long": ""}
    finally:
        os.unlink(path)


def render(head, rows, total, done):
    out = list(head)
    out.append("| case | result | details |")
    out.append("|---|---|---|")
    for row in rows:
        out.append(f"| {md(row['case'])} | **{row['result']}** | {md(row['detail'])} |")
    out.append("")
    bad = [r for r in rows if r["result"] != "PASS"]
    if done:
        out.append(f"**{len(rows) - len(bad)} of {len(rows)} cases passed.**")
    else:
        out.append(f"**INCOMPLETE: {len(rows)} of {total} cases ran so far ({len(rows) - len(bad)} passed).**")
    if bad:
        out.append("")
        out.append("## Failures")
        for row in bad:
            out.append("")
            out.append(f"### {row['case']} ({row['result']})")
            out.append("")
            out.append("```")
            out.append(row["long"].rstrip())
            out.append("```")
    return out


def main():
    global BACKEND, DEVICE
    parser = argparse.ArgumentParser(description="autocudagraph end-to-end check, bitwise against eager")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda")
    parser.add_argument("--out", help="write the report as markdown here (e.g. docs/gpu_check.md); "
                        "rewritten after every case, so an aborted run leaves a partial report")
    parser.add_argument("--cases", help="comma-separated substrings: run only matching cases")
    parser.add_argument("--isolate", action="store_true", help="run every case in its own process")
    parser.add_argument("--timeout", type=int, default=180, help="per case, with --isolate")
    parser.add_argument("--child-case", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    BACKEND = args.backend
    DEVICE = "gpu" if BACKEND == "cuda" else "cpu"
    env_override = os.environ.pop(ENV_BACKEND, None)
    paddle.set_device(DEVICE)

    if args.child_case is not None:
        import json

        title, fn = CASES[args.child_case]
        row = run_case(title, fn)
        with open(args.child_json, "w") as fh:
            json.dump(row, fh)
        return 0

    head = [f"# autocudagraph end-to-end check ({BACKEND} backend)", ""]
    head += header()
    if env_override:
        head.append(f"- note: {ENV_BACKEND}={env_override} was set and is ignored by this check")
    if args.isolate:
        head.append("- every case ran in its own process (--isolate)")
    head.append("")
    print("\n".join(head), flush=True)
    indices = list(range(len(CASES)))
    if args.cases:
        wanted = [w.strip().lower() for w in args.cases.split(",") if w.strip()]
        indices = [i for i in indices if any(w in CASES[i][0].lower() for w in wanted)]
    rows = []
    for i in indices:
        title, fn = CASES[i]
        row = run_isolated(i, BACKEND, args.timeout) if args.isolate else run_case(title, fn)
        rows.append(row)
        print(f"  [{row['result']}] {title} ({row['ms']:.0f} ms)", file=sys.stderr, flush=True)
        if args.out:
            write(args.out, render(head, rows, len(indices), done=False))
    report = render(head, rows, len(indices), done=True)
    print("\n".join(report[len(head):]))
    if args.out:
        write(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if any(r["result"] != "PASS" for r in rows) else 0


def write(path, lines):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
