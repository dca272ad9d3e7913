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
A CUDA graph replays its capture's kernels on the capture's tensors with the Python values they
were launched with; the simulated backend re-runs the function, so a value that changed since
capture (a global, a closure, a dict changed in place, a config int indexing a table, a flag that
picks another weight) reaches its ops and the replay looks right on a CPU where a GPU would be
silently wrong. So on a backend whose capture executes, the forward runs under ``OpTrace``
(guards/host_reads.py) at capture and at every replay: each op, its scalar arguments and the role
of every tensor it reads (NOTE [ The dataflow of a trace ]), and the Python values the function
returns. A replay whose trace differs from the capture's is one a GPU would have got wrong: it
raises ReplayTraceError (a ReplayShapeError) from inside the replay, before anything is copied into
the static outputs, so nothing the caller holds is written (a static output that is a view of an
input never receives a copy, NOTE [ Simulated static buffers ] in backends/simulated.py); the RNG
states and the Layers' buffers are put back as above, the call runs eagerly (forward and
backward: eager's grads, ``None`` for a parameter the call no longer uses), and the key runs
eagerly from then on with one warning naming the op, what it read at both and the user's line.
The function's Python ran once more for that call (its host side effects, a print, happen twice);
what the failed replay wrote in place into tensors from outside (a closure's, a global's) is put
back first (``OpTrace(keep_writes=True)``), so the eager run writes them once.
"""

import contextlib

import paddle

from ..core import state
from ..guards.host_reads import OpTrace, describe_trace_difference
from ..guards.paddle_patches import patched
from ..errors import ReplayShapeError, ReplayTraceError

__all__ = ["state_restored_on_refusal", "check_replay_trace", "traced_backward"]


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
    except ReplayShapeError:  # ReplayTraceError too
        state.restore_rng(rng)
        with paddle.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value, False)  # keeps the inplace version, as a replay's writes do
        raise


def traced_backward(body, live):
    """``body`` (a backward graph's) run under an op trace at capture and at every simulated replay
    (NOTE [ Values a simulated replay reads ]): a replay whose backward ran other ops or values than
    the capture's (a gradient hook or a PyLayer backward reading a schedule) leaves the difference in
    ``live``, and the key's next forward replay raises ReplayTraceError before it runs."""

    def traced():
        replay = "backward_trace" in live
        trace = OpTrace(where=not replay, identities=False)

        def armed(original):
            def run(*args, **kwargs):
                with trace:  # what autograd runs of the user's Python (the package's own work is not traced)
                    return original(*args, **kwargs)

            return run

        with patched((paddle, "grad", armed(paddle.grad)), (paddle.autograd, "backward", armed(paddle.autograd.backward))):
            out = body()
        if not replay:
            live["backward_trace"] = trace
        elif "backward_differs" not in live:
            diff = describe_trace_difference(live["backward_trace"], trace, "capture", "replay")
            if diff is not None:
                live["backward_differs"] = diff
        return out

    return traced


def check_replay_trace(captured, replayed):
    """Raises ReplayTraceError when a simulated replay's forward ran other ops than its capture, read
    other tensors or other scalar arguments, or returned other Python values (NOTE [ Values a
    simulated replay reads ]); called before anything is copied into the static outputs."""
    diff = describe_trace_difference(captured, replayed, "capture", "replay")
    if diff is not None:
        replayed.undo_writes()  # the eager run that replaces this replay writes them once
        raise ReplayTraceError(
            f"a replay read other values than the capture: {diff}. On a GPU this replay would reuse the capture's "
            "values, ops and tensors; this call runs eagerly instead. Pass values that change as arguments (they "
            "become part of the key) or as tensors updated in place")
