"""Shared test machinery: the backends to run on, device placement, bitwise comparison.

Every test class that mixes in BackendCase runs once per backend in BACKENDS (simulate always;
cuda where Paddle has CUDA graphs and kernels for the GPU, else skipped with the reason). Classes
of MatmulOnlyCase need only matmuls and copies, so their cuda variants also run on a GPU whose
Paddle lacks its other kernels (tools/gpu_check.py runs them there). The comparison, device and
model helpers live in testkit/common.py, which the tools share.
"""

import contextlib
import functools
import os
import subprocess
import sys
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.options import ENV_BACKEND
from testkit.common import (
    RECORD,
    assert_bitwise,
    build,
    cuda_skip_reason,
    eager_calls,
    host_tensor,
    normal,
    release_grads,
)
from testkit.common import device as paddle_device

BACKENDS = ("simulate", "cuda")



@functools.lru_cache(maxsize=None)
def numpy_random_after_paddle_kills_the_process():
    """None, or why a fresh process that imports paddle and then numpy.random dies here.

    Paddle 2.6.2 is built for numpy 1.x; with numpy 2.x, loading numpy.random's extension
    modules after paddle segfaults (measured: numpy 2.4.6, also ``import paddle;
    numpy.random.rand(1)``). Importing numpy.random first, or numpy<2, avoids it.
    """
    probe = subprocess.run([sys.executable, "-c", "import paddle; import numpy.random"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        return None
    return (f"this Paddle ({paddle.__version__}) kills a process that imports numpy.random after paddle "
            f"(exit {probe.returncode}) with numpy {np.__version__}: it does not support numpy 2; install "
            "numpy<2 next to it (docs/guides/compat.md)")


def storageless_numpy_is_empty():
    """Whether ``numpy()`` of a tensor whose storage was released returns an empty array
    (Paddle 3.x) rather than an uninitialised array of the tensor's shape (Paddle 2.6)."""
    t = paddle.ones([2])
    t._clear_data()
    return t.numpy().size == 0


def on_device(test, name):
    """Sets Paddle's current device to ``name`` for the rest of ``test`` (a TestCase), put back at its cleanup."""
    device = paddle_device(name)
    device.__enter__()
    test.addCleanup(device.__exit__, None, None, None)


class BackendCase(unittest.TestCase):
    """Base for tests that run on every backend: sets the device and offers helpers."""

    backend = None  # set on each variant by for_each_backend / backend_variants
    kernels = "all"  # Paddle kernels the cuda variant needs: "all", or "matmul" (MatmulOnlyCase)

    def setUp(self):
        super().setUp()
        if self.backend is None:
            self.skipTest("abstract base")
        if self.backend == "cuda":
            reason = cuda_skip_reason(self.kernels)
            if reason:
                self.skipTest(reason)
        env = os.environ.get(ENV_BACKEND)
        if env and env != self.backend:
            self.skipTest(f"{ENV_BACKEND}={env} runs every wrapper on {env}")
        self._device = paddle_device("gpu" if self.backend == "cuda" else "cpu")
        self._device.__enter__()
        self.addCleanup(self._device.__exit__, None, None, None)
        paddle.seed(2024)

    def graphed(self, target=None, **options):
        """autocudagraph on this test's backend."""
        options.setdefault("backend", self.backend)
        if target is None:
            return autocudagraph(**options)
        return autocudagraph(target, **options)

    def assertBitwise(self, actual, expected, what="value"):
        """Nests of tensors/arrays/scalars equal bit for bit, None matching None."""
        RECORD.compared += assert_bitwise(actual, expected, what)

    def assertCounters(self, wrapper, **expected):
        """Pins a wrapper's stats(): ``eager=`` counts eager calls after warmup, the rest by name."""
        stats = wrapper.stats()
        got = {k: (eager_calls(stats) if k == "eager" else stats.get(k)) for k in expected}
        RECORD.notes.append(" ".join(f"{k}={v}" for k, v in got.items()))
        if got != expected:
            self.fail(f"counters {got} != expected {expected}; explain(): {wrapper.explain()}")
        return stats


class MatmulOnlyCase(BackendCase):
    """Base for cases a GPU without Paddle's arithmetic kernels can run (NOTE [ Kernel-less GPUs ]
    in testkit/common.py): marked ``gpu_safe`` by conftest, run by tools/gpu_check.py."""

    kernels = "matmul"

    def tensor(self, array, grad=False):
        """A float32 tensor from numpy on this test's device (a copy, no kernel)."""
        return host_tensor(array, stop_gradient=not grad)

    def twins(self, factory, seed):
        """Two Layers with the same numpy-random parameters, on this test's device."""
        return build(factory, seed), build(factory, seed)


def for_each_backend(base):
    """Class decorator, the suite's one backend fixture: adds one subclass of ``base`` per backend
    (``Base_simulate``, ``Base_cuda``) to ``base``'s module, where the test runner collects them;
    ``base`` itself is not collected (``__test__ = False``; without a backend it would skip)."""
    module = sys.modules[base.__module__]
    for name, cls in backend_variants(base).items():
        setattr(module, name, cls)
    base.__test__ = False
    return base


def backend_variants(base):
    """``{name: subclass}``, one subclass of ``base`` per backend, without the parameterized package."""
    return {f"{base.__name__}_{b}": type(f"{base.__name__}_{b}", (base,),
                                         {"backend": b, "__module__": base.__module__, "__test__": True})
            for b in BACKENDS}


def clone_leaf(t, stop_gradient=None):
    """A fresh leaf copy of ``t`` (same values), optionally with another stop_gradient."""
    c = t.detach().clone()
    c.stop_gradient = t.stop_gradient if stop_gradient is None else stop_gradient
    return c


def twin_layers(factory):
    """Two Layers from ``factory`` with identical parameters and buffers."""
    a = factory()
    b = factory()
    b.set_state_dict(a.state_dict())
    return a, b


def grads_of(layer):
    """``{name: grad numpy or None}`` of a Layer's parameters."""
    return {n: (None if p.grad is None else p.grad.numpy()) for n, p in layer.named_parameters()}


def add_tracker_state(test, name, seed):
    """Adds ``name`` to Fleet's RNG tracker for ``test`` (removed again at its clean-up) and returns
    the tracker's states right after, to reseed from (hand ``dict(start)`` to set_states_tracker:
    Paddle 2.6 adopts the dict it is given, NOTE [ Restoring the tracker ] in core/state.py)."""
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    tracker = get_rng_state_tracker()
    saved = (dict(tracker.states_), set(tracker.seeds_))

    def restore():
        tracker.states_, tracker.seeds_ = saved

    test.addCleanup(restore)
    tracker.add(name, seed)
    return tracker.get_states_tracker()


def clear_grads(layer, set_to_zero=True):
    """``layer.clear_gradients(set_to_zero)`` in a spelling every Paddle has: Paddle 2.6's
    Layer.clear_gradients() takes no argument (it always zeroes), Tensor.clear_gradient(flag)
    exists on 2.6 and 3.x alike."""
    for p in layer.parameters():
        if p.trainable:
            p.clear_gradient(set_to_zero)


def params_of(layer):
    return {n: p.numpy() for n, p in layer.named_parameters()}


def hooked_params(params):
    """The names of ``params`` that still have a gradient hook registered since the first wrapper (the
    registry sees every one: NOTE [ Grad consumers ] in grads/hook_registry.py), with their hook ids."""
    from paddlefleet.cudagraph.grads import hook_registry

    records = ((p.name, hook_registry._tensors.get(id(p))) for p in params)
    return {name: sorted(record.hooks) for name, record in records if record is not None and record.hooks}


def refusal_sequence(a, b, c):
    """Calls of three keys under max_graphs=1: b refused while a replays between its calls, c refused too, then b
    called twice in a row takes a's place (NOTE [ Places under max_graphs ] in core/budgets.py)."""
    return [a, a, b] + [a, b] * 4 + [c, b, a, b, b, b, a, c, a]


def wrapper_books(wrapper):
    """What dispatch() keeps of a wrapper's calls: its counts, the refused keys' remembered calls, its tick, its
    latest refusal and its entries' labels in their order."""
    stats = wrapper.stats()
    return ([stats[k] for k in ("eager_calls", "eager_reasons", "replays", "captures", "warmup_calls", "evictions")],
            list(wrapper._places.waiting().items()), wrapper._tick, wrapper._last_refusal,
            [e.label for e in wrapper._entries.values()])


def refusal_books(wrapper, call, a, b, c, patches=()):
    """``call(t)`` for each call of refusal_sequence(a, b, c) (``call`` checks its result), with dispatch() spied and
    ``patches`` (context managers) entered; returns (wrapper_books of ``wrapper`` after every call, the shape of the
    first argument of every call dispatch() saw)."""
    from paddlefleet.cudagraph.core import lifecycle

    dispatched, books = [], []
    real = lifecycle.dispatch
    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack.enter_context(mock.patch.object(
            lifecycle, "dispatch", lambda *args: dispatched.append(args[1][0].shape) or real(*args)))
        for patch in patches:
            stack.enter_context(patch)
        for t in refusal_sequence(a, b, c):
            call(t)
            books.append(wrapper_books(wrapper))
    return books, dispatched


def assert_refused_from_front(case, front, full, every, dispatched):
    """What a refusal_sequence run checked by its front path and the same run through dispatch() alone must show:
    the same books after every call (``front``, ``full``: wrapper_books lists), all 20 calls dispatched by the full
    path (``every``), six calls of b refused without dispatch() by the front path (``dispatched``), and 11 calls
    refused under max_graphs in all."""
    case.assertEqual(front, full)
    case.assertEqual(len(every), 20)
    case.assertEqual(len(dispatched), 20 - 6, "six calls of b refused from the front")
    case.assertEqual(front[-1][0][1], {"max_graphs reached": 11})


__all__ = [
    "BACKENDS",
    "add_tracker_state",
    "assert_refused_from_front",
    "refusal_books",
    "hooked_params",
    "RECORD",
    "BackendCase",
    "MatmulOnlyCase",
    "assert_bitwise",
    "backend_variants",
    "clear_grads",
    "clone_leaf",
    "for_each_backend",
    "cuda_skip_reason",
    "grads_of",
    "normal",
    "numpy_random_after_paddle_kills_the_process",
    "params_of",
    "refusal_sequence",
    "storageless_numpy_is_empty",
    "on_device",
    "paddle_device",
    "release_grads",
    "twin_layers",
    "wrapper_books",
]
