"""Shared test machinery: the backends to run on, device placement, bitwise comparison.

Every test class that mixes in BackendCase runs once per backend in BACKENDS (simulate always;
cuda where Paddle has CUDA graphs and kernels for the GPU, else skipped with the reason).
"""

import contextlib
import functools
import os
import subprocess
import sys
import unittest

import numpy as np
import paddle
from parameterized import parameterized_class

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.backends import cuda_available
from paddlefleet.cudagraph.options import ENV_BACKEND

BACKENDS = ("simulate", "cuda")


@functools.lru_cache(maxsize=None)
def cuda_skip_reason():
    """None when the cuda backend can run the suite here, else why not."""
    if not cuda_available():
        return f"paddle {paddle.__version__} has no CUDA graphs (CPU build or no GPU)"
    try:
        with paddle_device("gpu"):
            a = paddle.to_tensor([1.0, 2.0])
            b = (a + a).numpy()
    except Exception as err:  # e.g. CUDA error 209: no kernel image for this GPU
        return f"Paddle's kernels do not run on this GPU: {str(err).splitlines()[0][:120]}"
    if not np.array_equal(b, [2.0, 4.0]):
        return "Paddle's add kernel returns wrong values on this GPU (no kernels for its architecture)"
    return None


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
            "numpy<2 next to it (docs/compat.md)")


def storageless_numpy_is_empty():
    """Whether ``numpy()`` of a tensor whose storage was released returns an empty array
    (Paddle 3.x) rather than an uninitialised array of the tensor's shape (Paddle 2.6)."""
    t = paddle.ones([2])
    t._clear_data()
    return t.numpy().size == 0


@contextlib.contextmanager
def paddle_device(name):
    old = paddle.get_device()
    paddle.set_device(name)
    try:
        yield
    finally:
        paddle.set_device(old)


def backend_classes():
    """parameterized_class arguments: one class per backend."""
    return [{"backend": b} for b in BACKENDS]


class BackendCase(unittest.TestCase):
    """Base for tests that run on every backend: sets the device and offers helpers."""

    backend = None  # set by parameterized_class

    def setUp(self):
        super().setUp()
        if self.backend is None:
            self.skipTest("abstract base")
        if self.backend == "cuda":
            reason = cuda_skip_reason()
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
        """Nests of tensors/arrays/scalars equal bit for bit (rtol=0, atol=0), None matching None."""
        assert_bitwise(actual, expected, what)


def to_numpy(value):
    if isinstance(value, paddle.Tensor):
        return value.numpy()
    return np.asarray(value)


def assert_bitwise(actual, expected, what="value"):
    if expected is None or actual is None:
        if not (expected is None and actual is None):
            raise AssertionError(f"{what}: {actual!r} vs {expected!r} (one is None)")
        return
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            raise AssertionError(f"{what}: keys {sorted(actual)} != {sorted(expected)}")
        for k in expected:
            assert_bitwise(actual[k], expected[k], f"{what}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{what}: {type(actual).__name__}[{len(actual)}] != {type(expected).__name__}[{len(expected)}]")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{what}[{i}]")
        return
    if isinstance(expected, paddle.Tensor) or isinstance(expected, np.ndarray):
        a, e = to_numpy(actual), to_numpy(expected)
        if a.dtype != e.dtype or a.shape != e.shape:
            raise AssertionError(f"{what}: {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}")
        np.testing.assert_array_equal(a, e, err_msg=what, strict=True)
        return
    if actual != expected:
        raise AssertionError(f"{what}: {actual!r} != {expected!r}")


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


def clear_grads(layer, set_to_zero=True):
    """``layer.clear_gradients(set_to_zero)`` in a spelling every Paddle has: Paddle 2.6's
    Layer.clear_gradients() takes no argument (it always zeroes), Tensor.clear_gradient(flag)
    exists on 2.6 and 3.x alike."""
    for p in layer.parameters():
        if p.trainable:
            p.clear_gradient(set_to_zero)


def params_of(layer):
    return {n: p.numpy() for n, p in layer.named_parameters()}


__all__ = [
    "BACKENDS",
    "BackendCase",
    "assert_bitwise",
    "backend_classes",
    "clear_grads",
    "clone_leaf",
    "cuda_skip_reason",
    "grads_of",
    "numpy_random_after_paddle_kills_the_process",
    "parameterized_class",
    "params_of",
    "storageless_numpy_is_empty",
    "paddle_device",
    "twin_layers",
]
