"""The state a training step keeps between calls: which tensors it is (so that a step that
creates or replaces state is refused), and its values (so that a failed simulated capture can
be taken back).

NOTE [ Persistent state of a step ]
A whole-step graph reads and writes the tensors that exist when it is captured - parameters,
Layer buffers, optimizer accumulators and master weights, the learning-rate tensor, and (in
persistent grad mode, NOTE [ Grad slots across steps ]) the grads - at their capture-time
addresses, on every replay. A step that creates such a tensor (Adam's moments on the first
``opt.step()``, a Layer that makes a parameter on some call) or rebinds one (``self.w =
self.w * 2``) would leave Python holding tensors the graph never touches. So:

* a warmup step is *stable* when the fingerprint (identity and address of every such tensor)
  is the same before and after it; a key is captured only after a stable warmup step (an
  unstable one - the first step, which creates the optimizer state - earns up to
  ``EXTRA_WARMUPS`` more warmup steps);
* the capture step itself must leave the fingerprint unchanged, else it is refused, naming
  what was created or replaced.

On the simulated backend a capture *executes* the step; when it fails after running (a host
read, a refusal above), ``Rollback`` puts back the values of that state and the RNG, so the
eager call that replaces it does not apply the step twice.
"""

import copy

import paddle

from ..core import state
from .grad_slots import grad_ptr
from .optimizer_state import load_scheduler_state, optimizer_params, state_tensors
from ..guards.in_place_writes import InPlaceWrites
from .reachable import reachable

__all__ = ["EXTRA_WARMUPS", "fingerprint", "describe_changes", "GradValues", "LayerWatch", "Rollback", "step_params"]

#: Warmup steps a key may add when its warmup steps keep creating state.
EXTRA_WARMUPS = 3


def _ptr(t):
    return t.data_ptr() if t._is_initialized() else None


def fingerprint(optimizers, layers=(), with_grads=False, lr_tensors=True):
    """``{label: identity}`` of the persistent state of a step."""
    out = {}
    for k, opt in enumerate(optimizers):
        for label, t in state_tensors(opt):
            out[f"optimizer {k}: {label}"] = (id(t), _ptr(t))
        if lr_tensors:
            lr = opt._global_learning_rate()
            out[f"optimizer {k}: learning-rate tensor"] = None if lr is None else (id(lr), _ptr(lr))
        if with_grads:
            for p in optimizer_params(opt):
                out[f"grad of {p.name}"] = grad_ptr(p)
    for layer in layers:
        out.update(_layer_identity(layer))
    return out


def _layer_identity(layer):
    out = {}
    owner = type(layer).__name__
    for name, p in layer.named_parameters():
        out[f"parameter '{name}' of {owner}"] = (id(p), _ptr(p))
    for name, b in layer.named_buffers():
        out[f"buffer '{name}' of {owner}"] = (id(b), _ptr(b) if b is not None else None)
    return out


def describe_changes(before, after, limit=3):
    """A readable list of what differs between two fingerprints ("" when nothing does)."""
    changes = []
    for label, value in after.items():
        if label not in before:
            changes.append(f"{label} was created")
        elif before[label] != value:
            old = before[label]
            if old is None:
                changes.append(f"{label} was created")
            elif value is None:
                changes.append(f"{label} was released")
            else:
                changes.append(f"{label} was replaced by another tensor")
    for label in before:
        if label not in after:
            changes.append(f"{label} was removed")
    if len(changes) > limit:
        changes = changes[:limit] + [f"and {len(changes) - limit} more"]
    return "; ".join(changes)


class LayerWatch:
    """Collects the Layers a step calls and their state identity before their first call (use
    as the ``snapshot`` of guards/layer_attrs.LayerRecorder); ``values`` also snapshots buffer values."""

    def __init__(self, values=None):
        self.before = {}
        self.layers = []
        self._values = values

    def add(self, layer):
        self.layers.append(layer)
        self.before.update(_layer_identity(layer))
        if self._values is not None:
            self._values.add(layer)

    def after(self):
        out = {}
        for layer in self.layers:
            out.update(_layer_identity(layer))
        return out


class _Nothing:
    def add(self, layer):
        pass

    def check(self):
        pass


NO_WATCH = _Nothing()


class Rollback:
    """Values of a step's state taken before a simulated capture, put back by ``restore()``
    (NOTE [ What a failed simulated capture may have written ] in step/reachable.py): every
    tensor reachable from ``roots`` (the step function), the optimizers and the graph-safe loss
    scalers, the grads of the parameters among them and learning-rate schedulers; every tensor an
    in-place op is handed during the capture (``writes``, entered around it); Layer buffers
    (``buffers``: those of the Layers the capture calls); the scalers' Python state and every
    RNG state."""

    def __init__(self, optimizers, scalers=(), roots=()):
        self.buffers = state.BufferSnapshot(enabled=True)
        self.writes = InPlaceWrites()  # entered around the capture
        self._rng = state.rng_snapshot()
        found = reachable([*roots, *optimizers, *scalers])
        tensors, params = dict(found.tensors), dict(found.params)
        for opt in optimizers:
            lr = opt._global_learning_rate()
            for t in [t for _, t in state_tensors(opt)] + ([lr] if lr is not None else []):
                tensors[id(t)] = t
            params.update((id(p), p) for p in optimizer_params(opt))
            if isinstance(opt._learning_rate, paddle.optimizer.lr.LRScheduler):
                found.schedulers[id(opt._learning_rate)] = opt._learning_rate
        for scaler in scalers:
            tensors.update((id(t), t) for t in scaler.state_tensors())
        with paddle.no_grad():
            self._tensors = [(t, t.clone()) for t in tensors.values() if t._is_initialized()]
        self._grads = GradValues(params.values())
        self._schedulers = [(s, copy.deepcopy(s.state_dict())) for s in found.schedulers.values()]
        self._scaler_states = [(s, s.python_state()) for s in scalers]

    def restore(self):
        self.writes.restore()  # first: a copy it took may follow a write it did not see
        with paddle.no_grad():
            for t, saved in self._tensors:
                if t._is_initialized():
                    t.copy_(saved, False)
        self._grads.restore()
        for sched, saved in self._schedulers:
            load_scheduler_state(sched, saved)
        for scaler, py_state in self._scaler_states:
            scaler.set_python_state(py_state)
        self.buffers.restore()
        state.restore_rng(self._rng)


class GradValues:
    """The grads of ``params`` (None, or their values), put back by ``restore()``; ``recording``:
    the capture writes no device memory (NOTE [ What a failed recording capture leaves ]).

    NOTE [ What a failed recording capture leaves ]
    A CUDA capture records kernels without running them, so no tensor's values change; but the
    step's Python ran: its backward bound grads from the graph's pool to parameters whose grad was
    None, a clear released others. Left so, the eager call that replaces a failed capture would
    add its grads into those (measured: wrong parameters from the capture step on, two H200s,
    Paddle 2.6.2). So the grads of the step's parameters are taken before every capture, also a
    recording one, and put back when it fails. A recording capture writes no device memory, so a
    device grad is kept by its storage (a tensor of its own over the same memory, ``_slice``;
    ``detach()`` shares the grad's tensor itself, which a clear releases), not copied: copies were
    a whole set of grads more at the capture, which the allocator kept reserved after it. A host
    grad is copied (host kernels run during a capture)."""

    def __init__(self, params, recording=False):
        with paddle.no_grad():
            self._grads = [(p, _grad_copy(p, recording)) for p in params]

    def restore(self):
        with paddle.no_grad():
            for p, saved in self._grads:
                g = p.grad
                if saved is None:
                    if g is not None:
                        p.clear_gradient(False)
                elif g is not None and g._is_initialized():
                    if g.data_ptr() != saved.data_ptr():  # a shared storage holds its values already
                        g.copy_(saved, False)
                else:  # released by the capture step (clear_grad(set_to_zero=False))
                    p.grad = saved


def step_params(optimizers, roots=()):
    """The parameters a step can reach: those of its optimizers and those reachable from ``roots``."""
    params = dict(reachable([*roots, *optimizers]).params)
    for opt in optimizers:
        params.update((id(p), p) for p in optimizer_params(opt))
    return list(params.values())


def _grad_copy(p, recording=False):
    g = p.grad
    if g is None or not g._is_initialized():
        return None
    if recording and not _on_host(g) and len(g.shape) > 0 and hasattr(g, "_slice"):
        return g._slice(0, g.shape[0])  # no copy: NOTE [ What a failed recording capture leaves ]
    return g.clone()


def _on_host(t):
    return t.place.is_cpu_place()
