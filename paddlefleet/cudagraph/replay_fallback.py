"""A replay that a GPU graph could not have made falls back to eager, exactly.

NOTE [ A replay that changes shape ]
The simulated backend re-runs the function on every replay. When those results differ in shape
from the capture's (an op whose output shape depends on tensor values that the capture did not
refuse, NOTE [ Shapes from tensor values ] in backends/value_shapes.py), the replay raises
ReplayShapeError before copying anything into the static buffers. The call must then return
what eager returns and leave the state eager leaves, but the failed replay already ran the
function once: it drew random numbers and updated Layer buffers (BatchNorm statistics). So a
call on a backend whose replay executes the body first saves the RNG states and the buffers of
the key's Layers, and on ReplayShapeError puts them back, moves the key to eager with the
reason (explain() shows it; one warning), and runs the call eagerly. A CUDA replay never
re-runs Python, so nothing is saved there.
"""

import paddle

from . import state, verify
from .errors import ReplayShapeError

__all__ = ["guarded_call"]


def _buffers(layers):
    found, seen = [], set()
    for layer in layers:
        for _, t in state.written_in_place(layer):
            if id(t) not in seen:
                seen.add(id(t))
                found.append(t)
    return found


def guarded_call(gc, entry, args, kwargs, tensors, copy):
    """GraphedCallable._graph_call on a backend whose replay executes the body."""
    rng = state.rng_snapshot()
    buffers = _buffers(entry.layers or ())
    with paddle.no_grad():
        saved = [b.clone() for b in buffers]
    try:
        if entry.verify_left > 0:
            return verify.verified_call(gc, entry, args, kwargs, tensors, copy)
        return gc._run_graphs(entry, tensors, copy)
    except ReplayShapeError as err:
        state.restore_rng(rng)
        with paddle.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value, False)  # keeps the inplace version, as a replay's writes do
        if copy:  # _run_graphs counted the replay before it failed
            entry.replays -= 1
            gc.counters.replays -= 1
        reason = f"{type(err).__name__}: {err}"
        entry.fall_back(reason)
        gc._warn_once(
            ("replay_shape", id(entry)),
            f"autocudagraph({gc.__name__}): replay of key {entry.label} failed: {reason.rstrip('.')}. The key runs "
            "eagerly from now on (results stay correct, without the speed-up).",
        )
        return gc._eager(args, kwargs, "a replay changed an output's shape")
