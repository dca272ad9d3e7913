"""A replay that a GPU graph could not have made falls back to eager, exactly.

NOTE [ A replay that changes shape ]
The simulated backend re-runs the function on every replay. When those results differ in shape
from the capture's (an op whose output shape depends on tensor values that the capture did not
refuse, NOTE [ Shapes from tensor values ] in guards/value_shapes.py), the replay raises
ReplayShapeError before copying anything into the static buffers. The call must then return
what eager returns and leave the state eager leaves, but the failed replay already ran the
function once: it drew random numbers and updated Layer buffers (BatchNorm statistics). So a
call on a backend whose replay executes the body first saves the RNG states and the buffers of
the key's Layers, and on ReplayShapeError puts them back (here); the lifecycle then moves the key
to eager with the reason (explain() shows it; one warning) and runs the call eagerly. A CUDA replay never
re-runs Python, so nothing is saved there.

NOTE [ Values a simulated replay reads ]
A CUDA graph replays its capture's kernels with the Python values they were launched with; the
simulated backend re-runs the function, so a value that changed since capture (a global, a
closure, a dict changed in place) reaches its ops and the replay looks right on a CPU where a
GPU would be silently wrong. So on a backend whose capture executes, the forward runs under
``OpTrace`` (guards/host_reads.py) at capture and at every replay: the op names and their scalar
arguments. A replay whose trace differs from the capture's is one a GPU would have got wrong:
its result (eager's) stands, the key runs eagerly from the next call on, and the warning names
the op, both values and the user's line. ``verify_replays`` does not count such a replay as
verified (core/lifecycle.py).
"""

import contextlib

import paddle

from ..core import state
from ..core.body import replay_read_other_values
from ..errors import ReplayShapeError

__all__ = ["state_restored_on_refusal", "simulated_trace_check"]


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


def simulated_trace_check(live):
    """None when a simulated replay's forward ran the capture's ops with the capture's scalar
    arguments, else the Blocked(FALL_BACK) naming the first difference (NOTE [ Values a simulated
    replay reads ]); ``live`` is the key's CaptureRecord (guards/session.py)."""
    return replay_read_other_values(
        live.get("trace"), live.take_replayed(), "values", "reuse the capture's value",
        "Pass values that change as arguments (they become part of the key) or as tensors updated in place.")
