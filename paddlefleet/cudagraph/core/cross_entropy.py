"""``paddle.nn.functional.cross_entropy`` without its host read, while a capture or a whole step runs.

NOTE [ Cross entropy decides on the host ]
On some Paddles (2.6.2) ``F.cross_entropy`` with integer labels and ``reduction="mean"`` picks its
formula in Python from the batch's labels::

    if paddle.count_nonzero(label == ignore_index) > 0:    # a device-to-host read
        ret = sum(loss) / (count of kept labels + (count == 0))          # (A)
    elif weight is not None:
        ret = sum(loss) / (sum of sample weights + (sum == 0))           # (B, weighted)
    else:
        ret = mean_all(loss)                                             # (B)

A capturing CUDA stream refuses the read (CUDA error 900), so every graphed block or step that
uses the most common loss ran eagerly; and a graph could not freeze the branch anyway, since
whether a batch holds an ignored label changes from batch to batch. (Paddle 3.x decides on
``ignore_index >= 0``, a Python int: nothing to do there.)

While our capture is open, a whole step runs (its warmup, capture and replays must trace the same
ops: NOTE [ Host values of a step ] in guards/host_reads.py) or a simulated replay re-runs Python,
``cross_entropy`` is replaced by one that decides on the device and gives eager's bits for both
outcomes. Paddle's own function still computes the per-sample loss (``reduction="none"``); only
the mean is taken here, with eager's kernels on eager's inputs:

* with a class weight, (A) is always taken. Without ignored labels its kept-label mask is all
  ones, so ``sum(mask * w)`` multiplies every sample weight by 1.0 (exact) and sums the same
  bits with the same kernel as (B); the backward differs only by that exact multiply by one.
* without a weight, (A) and (B) are different kernels (``mean_all`` is not ``sum / n`` bit for
  bit: measured on the 2.6.2 CPU build), so both run and ``where(any ignored, A, B)`` hands out
  the bits of the one eager would have computed. The grad of the branch eager did not take
  would be +0.0 from ``where``, and ``x + 0.0`` is not ``x`` for ``x = -0.0``: a hook on each
  branch turns it into -0.0, and ``x + (-0.0) == x`` for every ``x``, so the loss' input gets
  eager's grad bit for bit. (A PyLayer would say this more directly, but a second backward
  through a PyLayer crashes Paddle: docs/guides/compat.md.)

The replacement applies only where that reasoning holds: dynamic mode, ``reduction="mean"``,
integer labels (no ``soft_label``, no ``label_smoothing``), no AMP, and for a weight: the last
axis as class axis, a weight that needs no grad and has the logits' dtype. Every other call goes
to Paddle's function unchanged (a ``mean`` among them still reads the host and is refused at
capture, as before). Found by feature, never by version: ``needed()`` runs Paddle's function
once on CPU tensors under the host-read guard, and the replacement is only used after it gave
Paddle's bits (loss and logits grad) on probe cases with and without ignored labels, with and
without a weight. The module attributes ``paddle.nn.functional.cross_entropy`` and
``paddle.nn.functional.loss.cross_entropy`` (which ``paddle.nn.CrossEntropyLoss`` calls) are
replaced; a name bound before (``from paddle.nn.functional import cross_entropy``) keeps Paddle's.
The replacement is process-wide while in force: another thread calling the loss meanwhile gets it
too, with eager's bits.
"""

import contextlib
import functools
import inspect
import logging
import threading

import numpy as np
import paddle
from paddle import _C_ops

from ..backends.base import own_grad, register_device_decisions
from ..guards.paddle_patches import Patches

__all__ = ["device_decisions", "needed"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state = {"depth": 0, "patches": Patches(), "verdict": None}


def _functional_modules():
    import paddle.nn.functional as functional

    return [m for m in (functional, getattr(functional, "loss", None)) if m is not None]


def _paddles_cross_entropy():
    return getattr(paddle.nn.functional.loss, "cross_entropy", None)


# ----------------------------------------------------------------------------- the replacement
def _amp_off():
    tracer = paddle.base.framework._dygraph_tracer()
    level = getattr(tracer, "_amp_level", None)
    return level is None or level == paddle.base.core.AmpLevel.O0


def _decidable(a):
    """True when the mean of this call can be taken on the device with eager's bits."""
    x, label, weight, axis = a.get("input"), a.get("label"), a.get("weight"), a.get("axis", -1)
    if not (paddle.in_dynamic_mode() and a.get("reduction") == "mean" and not a.get("soft_label")):
        return False
    if a.get("label_smoothing", 0.0) > 0.0 or not _amp_off():
        return False
    if not (isinstance(x, paddle.Tensor) and isinstance(label, paddle.Tensor)) or x.ndim == 0 or 0 in x.shape:
        return False
    if label.ndim not in (x.ndim - 1, x.ndim) or not isinstance(a.get("ignore_index", -100), int):
        return False
    if weight is None:
        return True
    return (isinstance(weight, paddle.Tensor) and weight.stop_gradient and weight.dtype == x.dtype
            and axis in (-1, x.ndim - 1))


def _sample_weights(weight, label, ignore_index, dtype):
    """Paddle's per-sample class weight for integer labels (0 where ignored), as eager computes it."""
    kept = label != ignore_index
    valid_label = paddle.cast(kept, dtype=label.dtype) * label
    ignore_weight_mask = paddle.cast(kept, dtype)
    if ignore_weight_mask.ndim > 1 and ignore_weight_mask.shape[-1] == 1:
        ignore_weight_mask = paddle.squeeze(ignore_weight_mask, -1)
    weight_gather = _C_ops.multiply(_C_ops.gather_nd(weight, valid_label), ignore_weight_mask)
    return paddle.reshape(weight_gather, shape=list(label.shape))


def _selected(any_ignored, with_ignored, without):
    """``where(any_ignored, with_ignored, without)`` whose untaken branch gets a -0.0 grad."""
    if not with_ignored.stop_gradient:
        with_ignored.register_hook(lambda g: paddle.where(any_ignored, g, paddle.full_like(g, -0.0)))
        without.register_hook(lambda g: paddle.where(any_ignored, paddle.full_like(g, -0.0), g))
    return paddle.where(any_ignored, with_ignored, without)


def _mean_on_device(original, a):
    x, label, weight = a["input"], a["label"], a["weight"]
    ignore_index, axis = a.get("ignore_index", -100), a.get("axis", -1)
    out = original(**dict(a, reduction="none"))  # Paddle's per-sample loss, weighted
    if label.ndim == x.ndim - 1:  # Paddle unsqueezed the label and squeezed the loss back
        label = paddle.unsqueeze(label, axis=axis)
        out = paddle.unsqueeze(out, axis=axis)
    is_ignore = label == ignore_index
    mask = ~is_ignore
    out_sum = _C_ops.sum(out, [], None, False)
    if weight is None:
        mask = paddle.cast(mask, dtype=out_sum.dtype)
        count = _C_ops.sum(mask, [], None, False)
        with_ignored = out_sum / (count + (count == 0.0))
        return _selected(paddle.any(is_ignore), with_ignored, _C_ops.mean_all(out))
    per_sample = _sample_weights(weight, label, ignore_index, x.dtype)
    mask = paddle.cast(mask, per_sample.dtype)
    weight_sum = _C_ops.sum(_C_ops.multiply(mask, per_sample), [], None, False)
    return out_sum / (weight_sum + (weight_sum == 0.0))


def _replacement(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def cross_entropy(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # Paddle raises its own error
        bound.apply_defaults()
        if not _decidable(bound.arguments):
            return original(*args, **kwargs)
        return _mean_on_device(original, bound.arguments)

    cross_entropy.__paddlefleet_replaces__ = original
    return cross_entropy


# ----------------------------------------------------------------------------- detection
def _probe_cases():
    """Logits, labels (none ignored, some ignored, shaped [N, 1]) and class weights; 64 samples,
    since below about 24 ``mean_all`` and ``sum / n`` agree on the CPU."""
    rs = np.random.RandomState(5)  # a batch whose mean_all and sum / n differ (2.6.2, CPU)
    logits = rs.randn(64, 5).astype("float32") * 3
    labels = rs.randint(0, 5, 64).astype("int64")
    ignored = labels.copy()
    ignored[[1, 4, 30]] = -100
    weight = rs.rand(5).astype("float32") + 0.5
    for lab in (labels, ignored, ignored.reshape(64, 1)):
        for w in (None, weight):
            yield logits, lab, w


def _run(fn, logits, labels, weight):
    cpu = paddle.CPUPlace()
    x = paddle.to_tensor(logits, place=cpu, stop_gradient=False)
    w = None if weight is None else paddle.to_tensor(weight, place=cpu)
    loss = fn(x, paddle.to_tensor(labels, place=cpu), weight=w)
    with own_grad():
        (grad,) = paddle.grad([loss], [x])
    return loss.numpy().tobytes(), grad.numpy().tobytes()


def _reads_host(original):
    from ..backends.simulated import refuse_host_sync
    from ..errors import CaptureError

    logits, labels, _ = next(_probe_cases())
    try:
        with refuse_host_sync():
            original(paddle.to_tensor(logits, place=paddle.CPUPlace()),
                     paddle.to_tensor(labels, place=paddle.CPUPlace()))
    except CaptureError:
        return True
    return False


def _probe(original):
    """True when ``original`` reads the host and the replacement reproduces it on the probes."""
    with paddle.amp.auto_cast(enable=False), paddle.set_grad_enabled(True):
        if not _reads_host(original):
            return False
        replacement = _replacement(original)
        for case in _probe_cases():
            if _run(original, *case) != _run(replacement, *case):
                logger.warning("paddlefleet.cudagraph: this Paddle's cross_entropy reads the host and the device-side "
                               "mean does not reproduce it; a graph using it with reduction='mean' runs eagerly.")
                return False
    return True


def needed():
    """True when this Paddle's ``cross_entropy`` reads the host and the replacement reproduces it.

    Probed once. A probe that meets a host-read refusal already in force (it needs Paddle's
    function to run, host read included) is not remembered: the next call probes again.
    """
    from ..errors import CaptureError

    if _state["verdict"] is None:
        original = _paddles_cross_entropy()
        if original is None:
            _state["verdict"] = False
            return False
        try:
            verdict = _probe(original)
        except CaptureError:
            return False
        except Exception:  # a Paddle this probe cannot run on: leave its function alone
            logger.debug("cross_entropy probe failed", exc_info=True)
            verdict = False
        _state["verdict"] = verdict
    return _state["verdict"]


# ----------------------------------------------------------------------------- install
def _install():
    original = _paddles_cross_entropy()
    replacement = _replacement(original)
    for module in _functional_modules():
        if getattr(module, "cross_entropy", None) is original:
            _state["patches"].set(module, "cross_entropy", replacement)


def _restore():
    _state["patches"].restore()


@contextlib.contextmanager
def device_decisions():
    """Replaces ``cross_entropy`` (NOTE [ Cross entropy decides on the host ]) until the outermost
    block exits, where this Paddle needs it; nests, and is restored however the block exits."""
    with _lock:
        if _state["depth"] == 0 and needed():
            _install()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                _restore()


register_device_decisions(device_decisions)
