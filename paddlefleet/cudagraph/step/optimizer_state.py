"""Optimizer state around a whole-step graph: the learning rate fed through its device tensor,
Adam's beta powers moved to the device, and the optimizer configurations a graph cannot replay.

NOTE [ Learning rate under a step graph ]
A dygraph optimizer keeps its learning rate in a 0-d tensor (``opt._global_learning_rate()``,
created by the first ``step()``) that every update kernel reads on the device. For a float
learning rate nothing writes that tensor again (``set_lr`` fills it, outside the step). With a
``paddle.optimizer.lr`` scheduler, every ``step()`` calls ``_create_global_learning_rate``,
which fills the tensor with ``float(scheduler())`` (``_C_ops.full_`` with the value as a host
argument; verified on Paddle 2.6.2 and 3.3.1 by tracing). Captured, that fill would be replayed
with the capture-time value: the scheduler would be frozen. So while a step runs under
autocudagraph_step, ``_create_global_learning_rate`` does nothing once the tensor exists
(``suppress_lr_fill``), and before every run - warmup, capture, replay, eager - ``LRFeed``
writes ``float(opt.get_lr())`` into the tensor with a host-to-device copy outside the graph,
skipped when the value has not changed. The value is the one Paddle's fill would write
(``float(scheduler())`` rounded to the tensor's dtype), so the learning rate is bitwise what
eager uses.

NOTE [ Feed only what the step updates ]
Eager Paddle writes the tensor only in ``step()``: a micro-batch that does not step the
optimizer (gradient accumulation) leaves the previous rate in it. So the wrapper writes it only
for runs that step that optimizer: an eager or warmup run prepares the value before the run
(``LRFeed.prepare``, no device op) and writes it where Paddle's fill would be (``on_fill`` of
``suppress_lr_fill``: one copy, which the op trace does not record); a capture and its replays
feed before the run the optimizers whose rate the key's last warmup step filled (a capture
that fills another one is refused).

NOTE [ Beta powers on the host ]
Adam, AdamW and Lamb create ``beta1_pow_acc`` / ``beta2_pow_acc`` with ``device='cpu'``
(``_add_moments_pows``, Paddle 2.6.2 and 3.3.1). With CPU beta powers the GPU adam/adamw kernel
takes their values by value and updates them on the host (read in Paddle's
``phi/kernels/gpu/adamw_kernel.cu``): a graph would replay a frozen bias correction while the
host copy advanced only at capture - silently wrong. With device beta powers the kernel reads
them from device memory and updates them with a device kernel (same arithmetic, so the same
bits). ``move_beta_pows_to_device`` replaces each host beta-power accumulator by a device copy
of the same name before the capture; eager steps afterwards use the device copy too.
"""

import copy
import warnings

import numpy as np
import paddle

from ..guards.host_marks import is_marked_host, mark_host
from ..guards.paddle_patches import Patches
from ..errors import CaptureError
from ..guards.traced_ops import paused

__all__ = [
    "inner_optimizer",
    "load_scheduler_state",
    "optimizer_params",
    "state_tensors",
    "LRFeed",
    "suppress_lr_fill",
    "move_beta_pows_to_device",
    "check_supported",
    "watch_steps",
    "SchedulerWatch",
    "unlisted_message",
]

_BETA_POWS = ("beta1_pow_acc", "beta2_pow_acc")


def inner_optimizer(opt):
    """The paddle.optimizer.Optimizer inside Fleet's wrappers (HybridParallelOptimizer and
    friends keep it in ``_inner_opt``), or None when there is none."""
    seen = 0
    while not isinstance(opt, paddle.optimizer.Optimizer) and seen < 8:
        opt = getattr(opt, "_inner_opt", None)
        if opt is None:
            return None
        seen += 1
    return opt if isinstance(opt, paddle.optimizer.Optimizer) else None


def optimizer_params(opt):
    """The parameters an optimizer updates, in its order (parameter groups flattened)."""
    groups = getattr(opt, "_param_groups", None)
    if groups and isinstance(groups[0], dict):
        return [p for group in groups for p in group["params"]]
    return list(opt._parameter_list or [])


def state_tensors(opt):
    """``[(label, tensor)]`` of what an update writes: parameters, accumulators (moments, beta
    powers, velocities) and master weights; the learning rate is not among them."""
    out = [(f"parameter {p.name}", p) for p in optimizer_params(opt)]
    for acc_name, per_param in getattr(opt, "_accumulators", {}).items():
        for pname, t in per_param.items():
            out.append((f"{acc_name} of {pname}", t))
    for pname, t in getattr(opt, "_master_weights", {}).items():
        out.append((f"master weight of {pname}", t))
    return out


def _numpy_dtype(t):
    for dtype, np_dtype in ((paddle.float32, np.float32), (paddle.float64, np.float64), (paddle.float16, np.float16)):
        if t.dtype == dtype:
            return np_dtype
    raise CaptureError(
        f"autocudagraph_step: the learning-rate tensor has dtype {t.dtype}, which autocudagraph_step cannot feed. "
        "Paddle's optimizers keep it in float32 or float64; use one of those."
    )


def current_lr(opt):
    """``float`` of what Paddle writes into the learning-rate tensor at a step."""
    lr = opt._learning_rate
    if isinstance(lr, _LRScheduler):
        return float(lr())
    return float(lr)


_LRScheduler = paddle.optimizer.lr.LRScheduler


class LRFeed:
    """Writes an optimizer's learning rate into its device tensor before a run (NOTE [ Learning
    rate under a step graph ]); ``feed()`` returns True when it wrote."""

    def __init__(self, opt):
        self.opt = opt
        self._tensor = None
        self._dtype = None
        self._written = None
        self._value = None
        self._seen = None  # the float object whose hex() is _value (one identity test per replay)

    def feed(self):
        pending = self.prepare()
        if pending is not None:
            self.commit(pending)
        return pending is not None

    def prepare(self):
        """What ``commit()`` would write now (a host tensor and the value), or None when the
        tensor already holds the rate or does not exist yet. Makes no Paddle op on the device:
        ``commit()`` is then one copy, made where the op trace does not record it."""
        t = self.opt._global_learning_rate()
        if t is None:  # before the first step: the step creates and fills it itself
            return None
        value = current_lr(self.opt)
        if t is not self._tensor:
            self._tensor, self._dtype, self._written, self._value, self._seen = t, _numpy_dtype(t), None, None, None
        elif value is self._seen:  # the very float last found written: its hex() is _value
            return None
        elif self._value is not None and value.hex() == self._value:  # unchanged: nothing to write
            self._seen = value
            return None
        bits = np.array(value, dtype=self._dtype)
        if self._written is not None and bits.tobytes() == self._written:
            self._value, self._seen = value.hex(), value
            return None
        return paddle.to_tensor(bits, place=paddle.CPUPlace()).reshape(t.shape), value, bits.tobytes()

    def commit(self, pending):
        host, value, self._written = pending
        self._value, self._seen = value.hex(), value
        with paddle.no_grad(), paused():  # the package's write of the rate: no op of the step's trace
            self._tensor.copy_(host, False)

    def forget(self):
        """Forgets what was written: the next ``feed()`` writes (after a rollback put an older
        value back into the tensor)."""
        self._tensor = self._written = self._value = self._seen = None


class suppress_lr_fill:
    """While active, the optimizers' ``_create_global_learning_rate`` does nothing once their
    learning-rate tensor exists (it is fed by LRFeed instead); ``on_fill(opt)``, when given, is
    called in its place (an eager run feeds there: NOTE [ Feed only what the step updates ])."""

    def __init__(self, optimizers, on_fill=None):
        self._optimizers = list(optimizers)
        self._on_fill = on_fill
        self._saved = []

    def __enter__(self):
        for opt in self._optimizers:
            own = opt.__dict__.get("_create_global_learning_rate")
            original = opt._create_global_learning_rate

            def guarded(opt=opt, original=original, on_fill=self._on_fill):
                if opt._global_learning_rate() is None:
                    return original()
                if on_fill is not None:
                    on_fill(opt)
                return None

            self._saved.append((opt, own))
            opt._create_global_learning_rate = guarded
        return self

    def __exit__(self, *exc):
        for opt, own in reversed(self._saved):
            if own is None:
                opt.__dict__.pop("_create_global_learning_rate", None)
            else:
                opt._create_global_learning_rate = own
        self._saved = []
        return False


def _is_host(t, on_gpu):
    return is_marked_host(t) or (on_gpu and t.place.is_cpu_place())


def move_beta_pows_to_device(opt, place, on_gpu):
    """Replaces host beta-power accumulators by device copies of the same name (NOTE [ Beta
    powers on the host ]); returns how many were moved. ``place``: the graph's device (None on
    the simulated backend, where host tensors are those marked with mark_host)."""
    moved = 0
    for acc_name, per_param in getattr(opt, "_accumulators", {}).items():
        if not any(acc_name.endswith(b) for b in _BETA_POWS):
            continue
        for pname, t in list(per_param.items()):
            if not _is_host(t, on_gpu):
                continue
            with paddle.no_grad():
                new = t._copy_to(place, True) if place is not None else t.clone()
            new.name = t.name
            new.stop_gradient = True
            per_param[pname] = new
            moved += 1
    return moved


def check_supported(opt):
    """Raises CaptureError for optimizer settings whose state a graph cannot keep current."""
    name = type(opt).__name__
    if getattr(opt, "_use_multi_tensor", False):
        raise CaptureError(
            f"autocudagraph_step: {name}(use_multi_tensor=True) keeps its state in merged lists "
            "(_beta1_pow_acc_dict ...) that autocudagraph_step does not move to the device or check. "
            "Use use_multi_tensor=False for a graphed step."
        )
    for attr in ("_beta1", "_beta2"):
        if isinstance(getattr(opt, attr, None), paddle.Tensor):
            raise CaptureError(
                f"autocudagraph_step: {name} has {attr[1:]} as a Tensor; its step reads it with .item() on the host, "
                "so a graph would freeze it. Pass a Python float."
            )


def mark_beta_pows_host(opt):
    """Marks an optimizer's beta powers as host tensors (tests on the simulated backend model
    the CPU beta powers a GPU build keeps)."""
    for acc_name, per_param in getattr(opt, "_accumulators", {}).items():
        if any(acc_name.endswith(b) for b in _BETA_POWS):
            for t in per_param.values():
                mark_host(t)


class watch_steps:
    """While active, calls ``on_step(opt)`` when an optimizer starts an update
    (``Optimizer._apply_optimize``: before its clipping, state creation and update ops), then
    lets it run; ``on_step`` raises to stop it before it writes anything.

    NOTE [ Optimizers outside optimizers= ]
    The wrapper feeds the learning rate of, moves the beta powers of, and checks the state of
    the optimizers it is given. One the step steps without being listed would be captured with
    its learning-rate fill frozen and its host beta powers read once. Warmup steps note every
    such optimizer (they are eager: their update is eager's), and the capture is refused before
    it starts, naming the optimizer and the fix; one first stepped at the capture is stopped
    before its update."""

    def __init__(self, on_step):
        self._on_step = on_step
        self._patches = Patches()

    def __enter__(self):
        cls = paddle.optimizer.Optimizer
        original = cls.__dict__["_apply_optimize"]
        on_step = self._on_step

        def apply_optimize(opt, *args, **kwargs):
            on_step(opt)
            return original(opt, *args, **kwargs)

        self._patches.set(cls, "_apply_optimize", apply_optimize)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False


def _name_of(obj, bindings):
    for name, value in bindings.items():
        if value is obj:
            return name
    for name, value in bindings.items():
        for attr, inner in (getattr(value, "__dict__", None) or {}).items():
            if inner is obj:
                return f"{name}.{attr}"
    return None


def unlisted_message(unlisted, listed, bindings):
    """The refusal of a step that steps the optimizers ``unlisted`` (not in optimizers=);
    ``bindings``: the step function's ``{global or closure name: object}``, for their names."""
    described, names = [], []
    for k, opt in enumerate(unlisted):
        params = optimizer_params(opt)
        shown = ", ".join(p.name for p in params[:3]) + (", ..." if len(params) > 3 else "")
        name = _name_of(opt, bindings) or f"<the {type(opt).__name__}>"
        described.append(f"{name} ({type(opt).__name__} over {len(params)} parameter(s): {shown})")
        names.append(name)
    ours = [_name_of(opt, bindings) or f"<optimizer {k}>" for k, opt in enumerate(listed)]
    return (
        f"autocudagraph_step: the step steps {' and '.join(described)}, which is not in optimizers=. A graph would "
        "freeze its learning rate and its host-side state, and a failed capture could not take its update back. "
        f"Pass every optimizer the step steps: optimizers=[{', '.join(ours + names)}]."
    )


class SchedulerWatch:
    """The learning-rate schedulers of some optimizers and their ``last_epoch`` now;
    ``stepped()`` names those stepped since (inside the step).

    NOTE [ A scheduler stepped inside the step ]
    The rate is fed from ``opt.get_lr()`` before every run (NOTE [ Learning rate under a step
    graph ]). A ``sched.step()`` *inside* the step function is host code that a replay does not
    run: on a GPU the scheduler would stop at its capture-time epoch and the rate with it. So a
    warmup step or a capture that steps a scheduler refuses the capture, naming it; the fix is to
    step it after the call, as eager code usually does. ``state()`` / ``restore()`` put its state
    back after a capture that stepped it (its eager re-run steps it once)."""

    def __init__(self, optimizers):
        self._schedulers = {}
        for opt in optimizers:
            sched = opt._learning_rate
            if isinstance(sched, paddle.optimizer.lr.LRScheduler):
                self._schedulers[id(sched)] = (sched, sched.last_epoch, copy.deepcopy(sched.state_dict()))

    def stepped(self):
        return [sched for sched, epoch, _ in self._schedulers.values() if sched.last_epoch != epoch]

    def restore(self):
        for sched, _, saved in self._schedulers.values():
            load_scheduler_state(sched, saved)

    @staticmethod
    def message(stepped):
        names = ", ".join(type(s).__name__ for s in stepped)
        return (
            f"autocudagraph_step: the step function steps its learning-rate scheduler ({names}) inside. A replay "
            "does not run the step's Python, so on a GPU the scheduler, and the rate, would stop at the capture. "
            "Call sched.step() after the graphed step, outside the step function."
        )


def load_scheduler_state(sched, saved):
    """Puts back a scheduler's own ``state_dict()`` taken before a capture. Paddle warns of "unused
    values" for a scheduler whose state_dict holds more than its keys (LinearWarmup's nests the wrapped
    scheduler's): this is the scheduler's own state, so that one warning is not passed on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There are some unused values in state_dict")
        sched.set_state_dict(copy.deepcopy(saved))
