"""A replay that a GPU graph could not have made falls back to eager, exactly.

NOTE [ A replay that changes shape ]
The simulated backend re-runs the function on every replay. When those results differ in shape
from the capture's (an op whose output shape depends on tensor values that the capture did not
refuse, NOTE [ Shapes from tensor values ] in backends/value_shapes.py), the replay raises
ReplayShapeError before copying anything into the static buffers. The call must then return
what eager returns and leave the state eager leaves, but the failed replay already ran the
function once: it drew random numbers and updated Layer buffers (BatchNorm statistics). So a
call on a backend whose replay executes the body first saves the RNG states and the buffers of
the key's Layers, and on ReplayShapeError puts them back (here); the lifecycle then moves the key
to eager with the reason (explain() shows it; one warning) and runs the call eagerly. A CUDA replay never
re-runs Python, so nothing is saved there.
"""

import contextlib

import paddle

from ..core import state
from ..errors import ReplayShapeError

__all__ = ["state_restored_on_refusal"]


def _buffers(layers):
    found, seen = [], set()
    for layer in layers:
        for _, t in state.written_in_place(layer):
            if id(t) not in seen:
                seen.add(id(t))
                found.append(t)
    return found


@contextlib.contextmanager
def state_restored_on_refusal(layers, enabled):
    """Around a replay whose backend executes the body: on ReplayShapeError, puts the RNG states
    and the buffers of ``layers`` back as they were, then re-raises (the lifecycle falls back)."""
    if not enabled:
        yield
        return
    rng = state.rng_snapshot()
    buffers = _buffers(layers)
    with paddle.no_grad():
        saved = [b.clone() for b in buffers]
    try:
        yield
    except ReplayShapeError:
        state.restore_rng(rng)
        with paddle.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value, False)  # keeps the inplace version, as a replay's writes do
        raise
