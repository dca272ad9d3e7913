"""Verification mode (``verify_replays=N``): the first N calls that run a key's graphs are
compared with an eager re-run of the same call; a difference disables the key.

NOTE [ Verifying a replay ]
For a call that runs a key's graphs (its capture call included):

1. RNG states (default generator, Fleet's tracker) and the buffers of the key's Layers are
   saved: state S0.
2. The graphs run as for any call; the caller will get these outputs. When the call records
   grads, the backward graph is also replayed once with fixed grad_outputs (the same for both
   sides); the static grad and grad-output buffers are saved before and put back after, so grads
   already handed out (clone_param_grads=False) and the caller's own backward are undisturbed.
3. The state the graphs left (S1) is saved and S0 put back, so the eager re-run sees the same
   random numbers and buffers. The function then runs eagerly on detached copies of the call's
   tensors, and its grads are taken with ``paddle.grad`` under GradSwap: no ``.grad`` of the
   caller's changes, no accumulation node (and so no gradient hook) runs.
4. Outputs, grads and buffers are compared bit for bit. Equal: S1 is put back and the graph's
   outputs are returned. Different: S0 is put back, the key falls back to eager with one warning
   giving the largest difference, and the call returns a plain eager run.

Limitations: only the first N calls of each key are checked, so a difference that shows only
later or for other values is missed; the backward is checked with synthetic grad_outputs, not the
caller's; a reentrant inner backward (recompute) still accumulates through its own nodes; a check
costs about one eager forward and backward plus host copies of every output, grad and buffer.
Graph-unsafe code caught this way: Python branches or values read from host (CPU) tensors or
Python state at capture, reads of tensors the caller rebinds between calls, code that behaves
differently under ``is_capturing()``.
"""

import numpy as np
import paddle

from ..backends import own_grad
from ..core import state
from ..grads.accumulate import own_backward
from ..grads.handles import GradSwap, copy, merge_leaf_grads
from ..io.nested import flatten

__all__ = ["verified_run"]


def _pattern_like(t):
    """Fixed, varied grad_outputs for ``t`` (1/8 ... 7/8), made on the host and copied to t's
    place: no RNG, and no arithmetic kernel (a GPU that Paddle has no kernels for still copies)."""
    n = int(np.prod(t.shape)) if t.shape else 1
    values = ((np.arange(1, n + 1) % 7 + 1) * 0.125).astype("float32").reshape(t.shape)
    g = paddle.to_tensor(values, place=t.place)
    return g if g.dtype == t.dtype else g.astype(t.dtype)


def _layer_buffers(layers):
    """``[(name, tensor)]`` of what a forward may write in place: every initialised buffer and
    non-trainable parameter (BatchNorm's running statistics) of ``layers``, each once."""
    found, seen = [], set()
    for layer in layers:
        for name, buf in state.written_in_place(layer):
            if id(buf) not in seen:
                seen.add(id(buf))
                found.append((f"buffer '{name}' of {type(layer).__name__}", buf))
    return found


def _save(buffers):
    with paddle.no_grad():
        return [copy(b) for _, b in buffers]


def _put(buffers, saved):
    # copy_ keeps the inplace version: the graph's autograd saved some of these tensors (e.g.
    # BatchNorm statistics) and checks their version in the caller's backward.
    with paddle.no_grad():
        for (_, b), value in zip(buffers, saved):
            b.copy_(value, False)


def _host(t):
    """A float64 (floating types) or native numpy copy of ``t``. Copied to the host first and
    widened there, except bfloat16, which numpy cannot hold (widened on the device)."""
    if t.dtype == paddle.bfloat16:
        return t.astype("float64").numpy()
    a = t.numpy()
    return a.astype(np.float64) if t.is_floating_point() else a


def _difference(a, b):
    """None when ``a`` and ``b`` (tensors or None) are equal, else the largest difference."""
    if a is None or b is None:
        return None if a is None and b is None else "one side is None"
    if list(a.shape) != list(b.shape) or a.dtype != b.dtype:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = _host(a), _host(b)
    if x.dtype.kind in "fc":
        if np.array_equal(x, y, equal_nan=True):
            return None
        if not np.array_equal(np.isnan(x), np.isnan(y)):
            return "NaN in one side only"
        return float(np.max(np.abs(x - y)))
    if np.array_equal(x, y):
        return None
    return float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))


def _graph_grads(graphs, grad_outputs):
    """Replays the backward graph with ``grad_outputs``; returns copies of its grads and puts
    every static grad buffer and grad-output buffer back as it was."""
    backward = graphs.backward
    static_grads = backward.grad_plan.static_grads
    acc = backward.accumulators
    saved_acc = acc.snapshot() if acc is not None else None  # the replay adds into them
    with paddle.no_grad():
        saved_grads = [None if g is None else copy(g) for g in static_grads]
        saved_outs = [copy(b) for b in backward.grad_outputs]
        for buf, g in zip(backward.grad_outputs, grad_outputs):
            buf.copy_(g, False)
    backward.graph.replay()
    if acc is not None:
        acc.restore(saved_acc)
    with paddle.no_grad():
        grads = [None if g is None else copy(g) for g in static_grads]
        for buf, value in zip(static_grads, saved_grads):
            if buf is not None:
                buf.copy_(value, False)
        for buf, value in zip(backward.grad_outputs, saved_outs):
            buf.copy_(value, False)
    return grads


def _eager_grads(outputs, leaves, grad_outputs):
    """Grads of ``outputs`` w.r.t. ``leaves`` by paddle.grad, plus what an inner backward
    accumulated into ``.grad`` meanwhile; every ``.grad`` is left as it was."""
    swap = GradSwap(leaves)
    with swap, own_grad():
        raw = paddle.grad(outputs, leaves, grad_outputs, retain_graph=False, allow_unused=True)
    return merge_leaf_grads(raw, swap.collected)


def _grad_names(graphs, needs_grad):
    names = [f"grad of input '{n}'" for n, need in zip(graphs.static_inputs.names, needs_grad) if need]
    homes = graphs.params.names()
    for p in graphs.leaf_params():
        names.append(f"grad of parameter {homes.get(id(p), repr(p.name))}")
    return names


def _compare(pairs):
    """``pairs`` of (what, graph value, eager value): ``(first difference, largest)`` or None."""
    first, largest = None, None
    for what, g, e in pairs:
        diff = _difference(g, e)
        if diff is None:
            continue
        if first is None:
            first = (what, diff)
        if isinstance(diff, float) and (largest is None or diff > largest):
            largest = diff
    if first is None:
        return None
    return first, largest


def verified_run(graphs, call, run_graphs, run_eager):
    """Runs the graphs for ``call`` (``run_graphs()`` returns what the call returns) and checks
    them against an eager re-run (``run_eager(args, kwargs)``), NOTE [ Verifying a replay ].

    Returns:
        ``(result, None)`` when they agree; ``(None, reason)`` when they do not, with RNG states
        and the Layers' buffers put back as they were before the graphs ran.
    """
    buffers = _layer_buffers(graphs.layers)
    rng_before = state.rng_snapshot()
    buffers_before = _save(buffers)
    result = run_graphs()
    try:
        with own_backward():  # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py
            mismatch = _check(graphs, call, run_eager, result, buffers, rng_before, buffers_before)
    except Exception as err:  # the eager re-run or the check itself failed: trust neither
        mismatch = (("the eager re-run", f"raised {type(err).__name__}: {err}"), None)
    if mismatch is None:
        return result, None
    state.restore_rng(rng_before)
    _put(buffers, buffers_before)
    (what, diff), largest = mismatch
    detail = f"max abs difference {diff:.6g}" if isinstance(diff, float) else diff
    reason = f"verify_replays: {what} differs from an eager re-run ({detail})"
    if largest is not None and largest != diff:
        reason += f"; largest difference {largest:.6g}"
    return None, reason


def _check(graphs, call, run_eager, result, buffers, rng_before, buffers_before):
    graph_outputs, _, graph_spec = flatten(result)
    graph_needs_grad = [not t.stop_gradient for t in graph_outputs]
    graph_outputs = [copy(t) for t in graph_outputs]
    diff_index = [i for i, d in enumerate(graphs.out_differentiable) if d]
    with_grads = graphs.backward is not None and paddle.is_grad_enabled() and bool(diff_index)
    needs_grad = [not b.stop_gradient for b in graphs.static_inputs.buffers]
    grad_outputs, graph_grads = None, None
    if with_grads:
        grad_outputs = [_pattern_like(graphs.static_outputs[i]) for i in diff_index]
        with state.preserved_rng():
            graph_grads = _graph_grads(graphs, grad_outputs)
    rng_after = state.rng_snapshot()
    buffers_after = _save(buffers)

    # The eager re-run, from the state the graphs started from.
    state.restore_rng(rng_before)
    _put(buffers, buffers_before)
    with paddle.no_grad():
        clones = [copy(t) for t in call.tensors]
    for c, t in zip(clones, call.tensors):
        c.stop_gradient = t.stop_gradient
    eager_result = run_eager(*call.rebuild(clones))
    eager_outputs, _, eager_spec = flatten(eager_result)
    if eager_spec != graph_spec or len(eager_outputs) != len(graph_outputs):
        return ("the output structure", "eager returned a different structure or non-tensor values"), None
    for i, (needs, e) in enumerate(zip(graph_needs_grad, eager_outputs)):
        # A graph captured without grads returns outputs that need none: the caller's backward
        # would silently stop there (no grads compared below, since the graph has none).
        if needs != (not e.stop_gradient):
            side = "eager but not in the graph" if needs is False else "the graph but not in eager"
            return (f"output {i}", f"it requires grad in {side}"), None
    pairs = [(f"output {i}", g, e.detach()) for i, (g, e) in enumerate(zip(graph_outputs, eager_outputs))]
    if with_grads:
        leaves = [c for c, need in zip(clones, needs_grad) if need] + graphs.leaf_params()
        at = graphs.out_aliases.first if graphs.out_aliases is not None else range(len(graphs.static_outputs))
        diff_outputs = [eager_outputs[at[i]] for i in diff_index]
        if any(o.stop_gradient for o in diff_outputs):
            return ("an output", "it requires grad in the graph but not in eager"), None
        eager_grads = _eager_grads(diff_outputs, leaves, grad_outputs)
        pairs.extend(zip(_grad_names(graphs, needs_grad), graph_grads, eager_grads))
    eager_buffers = _save(buffers)
    pairs.extend((name, g, e) for (name, _), g, e in zip(buffers, buffers_after, eager_buffers))
    mismatch = _compare(pairs)
    if mismatch is None:
        state.restore_rng(rng_after)
        _put(buffers, buffers_after)
    return mismatch
