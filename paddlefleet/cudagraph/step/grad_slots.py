"""What a parameter's ``.grad`` holds between steps, and the one place that decides it for a
graphed step.

NOTE [ Grad slots across steps ]
Where a backward puts a parameter's grad depends on host state that a graph replay never
updates (read in Paddle's eager accumulation node and ``clear_gradient``; the storage moves
were measured on Paddle 2.6.2 and 3.3.1):

* grad None, or cleared with ``clear_gradient(set_to_zero=True)`` (zero-filled and flagged
  "fake empty" in the C++ accumulation node): the backward *assigns* its result - the grad
  moves to new storage;
* grad holding a value: the backward *adds* in place - same storage.

A step that clears the grads it made (``opt.clear_grad()`` after ``opt.step()``) is *closed*:
every step starts from empty grad slots, its backward assigns, and all grad storage lives and
dies inside the graph. Nothing is changed for such steps ("closed" mode): they are exactly
Paddle's eager steps.

Gradient accumulation leaves grads holding values between calls (a micro-batch step without
``opt.step()``). One graph per micro-batch phase is then only correct if every graph adds into
the same storage and the host flag never decides between assign and add: a replay does not
reset the flag, so an eager backward after a replayed micro-batch would assign and lose the
accumulated grads, and a graph captured with "assign" would overwrite them when replayed in the
middle of an accumulation. So once a step function is seen to leave grads holding values,
the wrapper switches to "persistent" mode for good: inside every call of it (warmup, capture,
replay, eager) a ``clear_gradient``/``clear_grad`` zero-fills the grad in place and leaves the
flag alone (a freeing one frees: NOTE [ Freed grads under persistent slots ]), so grad storage is
allocated once and every later backward adds into it. Keys
captured in closed mode are captured again. The one numeric difference to Paddle's eager
steps: the first backward after a clear computes ``0 + g`` instead of taking ``g``, so a grad
element that is exactly -0.0 in eager is +0.0 here (parameters and optimizer state are
unaffected in practice: the tests compare them bit for bit).
"""

import contextlib

import paddle

from ..backends.base import is_capturing
from ..guards.paddle_patches import patched
from ..guards.location import user_call_site
from ..errors import CaptureError
from .optimizer_state import optimizer_params

__all__ = ["GradSlots", "CLOSED", "PERSISTENT", "FREED_AT_WINDOW_END", "representative_grads", "grad_ptr"]

CLOSED = "closed"
PERSISTENT = "persistent"

# NOTE [ Freed grads under persistent slots ]
# ``clear_grad(set_to_zero=False)`` frees a grad: eager's optimizer then skips that parameter until
# a backward gives it a grad again (a head unused in the next window keeps its weights, moments and
# beta powers). A zero-filled grad would be updated (AdamW decays it). So in persistent mode a
# freeing clear frees, as in eager, in every call that runs on the host; a capture that frees grads
# is refused (a graph would need new grad storage in every window), and the key runs eagerly.
FREED_UNDER_PERSISTENT = (
    "autocudagraph_step: the step frees grads with clear_grad(set_to_zero=False) while grads are kept between "
    "calls (gradient accumulation): a freed grad needs new storage in every window, which a graph cannot "
    "give, and a zero-filled one would be updated by the optimizer where eager skips it. This key runs "
    "eagerly. Use clear_grad() (set_to_zero=True) to graph it; parameters without a grad in a window are then "
    "updated with a zero grad, as eager does after clear_grad()."
)

#: The capture refusal of a key whose warmup steps found grads freed or made anew because the step
#: frees them with clear_grad(set_to_zero=False) at the end of an accumulation window.
FREED_AT_WINDOW_END = (
    "autocudagraph_step: the step frees its grads with clear_grad(set_to_zero=False) at the end of an "
    "accumulation window (at {where}), so every window starts from new grad storage ({changes}). A graph keeps reading and "
    "adding into the grad storage of its capture, which a freeing clear releases, and a zero-filled grad would "
    "be updated by the optimizer where eager skips it. This key runs eagerly. Use clear_grad() "
    "(set_to_zero=True) to graph it; parameters without a grad in a window are then updated with a zero grad, "
    "as eager does after clear_grad()."
)


class _CallRecord:
    """What one call did to grad slots: backwards run and clears after the last backward."""

    def __init__(self):
        self.seq = 0
        self.last_backward = 0
        self.last_clear = 0

    def backward(self):
        self.seq += 1
        self.last_backward = self.seq

    def clear(self):
        self.seq += 1
        self.last_clear = self.seq

    @property
    def leaves_grads(self):
        """True when a backward ran and no clear followed it: the call accumulates."""
        return self.last_backward > 0 and self.last_clear < self.last_backward


class GradSlots:
    """The grad-slot policy of one graphed step (NOTE [ Grad slots across steps ])."""

    def __init__(self):
        self.mode = CLOSED
        self.freed = None  # where a call freed grads (clear_grad(set_to_zero=False)) under persistent slots

    @contextlib.contextmanager
    def scope(self):
        """Runs one call of the step: records its backwards and clears, and in persistent mode
        zero-fills grads in place instead of clearing them. Yields the call's _CallRecord."""
        record = _CallRecord()
        slots = self
        persistent = self.mode == PERSISTENT
        tensor_backward = paddle.Tensor.backward
        autograd_backward = paddle.autograd.backward
        clear_gradient = paddle.Tensor.clear_gradient

        def backward(self_, *args, **kwargs):
            record.backward()
            return tensor_backward(self_, *args, **kwargs)

        def backward_fn(*args, **kwargs):
            record.backward()
            return autograd_backward(*args, **kwargs)

        def clear(self_, set_to_zero=True):
            record.clear()
            if not persistent:
                return clear_gradient(self_, set_to_zero)
            if not set_to_zero:  # NOTE [ Freed grads under persistent slots ]
                if is_capturing():
                    raise CaptureError(FREED_UNDER_PERSISTENT)
                slots.freed = user_call_site()
                return clear_gradient(self_, False)
            grad = self_.grad
            if grad is not None:
                with paddle.no_grad():
                    grad.zero_()
            return None

        # NOTE [ Paddle patches ] in guards/paddle_patches.py
        with patched((paddle.Tensor, "backward", backward), (paddle.autograd, "backward", backward_fn),
                     (paddle.Tensor, "clear_gradient", clear)):
            yield record

    def observe(self, record):
        """After a host-executing call: switches to persistent mode when it left grads holding
        values; returns True when the mode changed."""
        if self.mode == CLOSED and record.leaves_grads:
            self.mode = PERSISTENT
            return True
        return False


def representative_grads(optimizers):
    """``[(param, grad data_ptr or None)]``: one parameter per optimizer (the first with a grad,
    else the first), whose grad slot tells cheaply whether something outside the step ran a
    backward or cleared grads between calls."""
    out = []
    for opt in optimizers:
        params = [p for p in optimizer_params(opt) if not p.stop_gradient]
        if not params:
            continue
        chosen = next((p for p in params if p.grad is not None), params[0])
        out.append((chosen, grad_ptr(chosen)))
    return out


def grad_ptr(p):
    g = p.grad
    return None if g is None or not g._is_initialized() else g.data_ptr()
