"""GraphGradScaler: dynamic loss scaling with every decision on the device, so a training step
that uses it can be captured whole.

NOTE [ Loss scaling without host syncs ]
``paddle.amp.GradScaler`` decides on the host (read in Paddle 2.6.2 and 3.3.1's
``amp/grad_scaler.py`` and ``optimizer/optimizer.py``):

* ``step()`` hands ``found_inf`` to the optimizer, whose ``_create_optimization_pass`` does
  ``if found_inf:`` (a device-to-host read) and skips every update op on the host;
* ``update()`` keeps its good/bad step counters as Python ints, branches on the host, and
  rebinds ``self._scale`` to a new tensor when the scale changes (a graph would keep the old
  one); on an overflow it prints ``float(self._scale)``, which raises ``TypeError: only
  0-dimensional arrays can be converted to Python scalars`` with NumPy 2 (measured: NumPy
  2.4.6 with Paddle 2.6.2 and 3.3.1);
* the kernels' own skip input (``skip_update`` of adam/adamw/lamb) is read back to the host
  inside the kernel (``TensorToVector``), and ``check_finite_and_unscale`` /
  ``update_loss_scaling`` copy per-call tables from pageable host memory on the GPU.

GraphGradScaler has the same API and the same arithmetic, with no host read:

* ``unscale_``: each grad is multiplied by ``float32(1.0 / float64(scale))`` (what Paddle's
  kernels compute) and ``found_inf`` is an OR of ``not all(isfinite(grad))`` on the device;
* ``step``: runs ``optimizer.step()`` and then puts every tensor the update wrote (parameters,
  moments, beta powers, master weights) back to its value before the update where
  ``found_inf`` is set - ``paddle.where`` with a 0-d condition, bit-exact both ways. The copies
  are taken after the optimizer created its state and before its first update op. This costs a
  copy and a select of the optimizer state per step: the price of no host sync;

  NOTE [ Parameter groups and the overflow undo ]
  With parameter groups (``parameters=[{"params": decay}, {"params": no_decay, "weight_decay":
  0.0}]``) ``step()`` runs one optimization pass per group, and each pass creates its group's
  state (moments, beta powers, master weights) right before that group's update ops. So the
  copies are taken before *every* update op, of each state tensor not copied yet: a tensor is
  always copied before the first op that can write it, whichever group it belongs to;
* ``update``: the good/bad counters are int32 device tensors and the scale is updated in place
  with Paddle's rule (on ``decr_every_n_nan_or_inf`` overflows in a row: ``scale * decr_ratio``;
  on ``incr_every_n_steps`` good steps in a row: ``scale * incr_ratio``), the same multiplication
  Paddle's Python performs.

Differences from paddle.amp.GradScaler: it scales on every device (Paddle's turns itself off
on the CPU and whenever the AMP dtype is not float16); after a skipped step the grads hold the
unscaled (possibly clipped) values where Paddle's CPU kernel leaves zeros; it never prints.
"""

import collections
import enum
import weakref

import numpy as np
import paddle

from .optimizer_state import inner_optimizer, optimizer_params, state_tensors

__all__ = ["GraphGradScaler", "live_scalers"]

_LIVE = weakref.WeakSet()


def _getter(attribute):
    """A method returning the attribute ``attribute`` (one of Paddle's GradScaler getters)."""

    def get(self):
        return getattr(self, attribute)

    return get


def live_scalers():
    """Every GraphGradScaler alive now (their state is put back after a failed capture)."""
    return list(_LIVE)


class _Stage(enum.Enum):
    INIT = 0
    UNSCALED = 1
    STEPPED = 2


class GraphGradScaler:
    """A drop-in for ``paddle.amp.GradScaler`` that a whole-step graph can capture
    (NOTE [ Loss scaling without host syncs ]).

    Args:
        enable, init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps,
        decr_every_n_nan_or_inf, use_dynamic_loss_scaling: as for paddle.amp.GradScaler.
    """

    def __init__(self, enable=True, init_loss_scaling=2.0**16, incr_ratio=2.0, decr_ratio=0.5,
                 incr_every_n_steps=2000, decr_every_n_nan_or_inf=1, use_dynamic_loss_scaling=True):
        if enable and not incr_ratio > 1.0:
            raise ValueError(f"GraphGradScaler: incr_ratio must be > 1.0, got {incr_ratio}.")
        if enable and not decr_ratio < 1.0:
            raise ValueError(f"GraphGradScaler: decr_ratio must be < 1.0, got {decr_ratio}.")
        self._enable = bool(enable)
        self._init_loss_scaling = float(init_loss_scaling)
        self._incr_ratio = float(incr_ratio)
        self._decr_ratio = float(decr_ratio)
        self._incr_every_n_steps = int(incr_every_n_steps)
        self._decr_every_n_nan_or_inf = int(decr_every_n_nan_or_inf)
        self._use_dynamic_loss_scaling = bool(use_dynamic_loss_scaling)
        self._scale = paddle.to_tensor(np.array([self._init_loss_scaling], dtype=np.float32))
        self._good = paddle.to_tensor(np.array([0], dtype=np.int32))
        self._bad = paddle.to_tensor(np.array([0], dtype=np.int32))
        self._found_inf = paddle.to_tensor(np.array([False]))
        self._stages = collections.defaultdict(lambda: _Stage.INIT)
        _LIVE.add(self)

    # ------------------------------------------------------------------ the step
    def scale(self, var):
        """``var * scale`` (``var`` unchanged when disabled)."""
        if not self._enable:
            return var
        return var * self._scale

    def unscale_(self, optimizer):
        """Divides the grads of ``optimizer``'s parameters by the scale and sets found_inf."""
        if not self._enable:
            return
        stage = self._stages[id(optimizer)]
        if stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        params = optimizer_params(inner_optimizer(optimizer) or optimizer)
        grads = [p.grad for p in params if not p.stop_gradient and p.grad is not None]
        with paddle.no_grad():
            inverse = (1.0 / self._scale.astype("float64")).astype("float32")
            finite = None
            for g in grads:
                unscaled = g * inverse if g.dtype == paddle.float32 else (g.astype("float32") * inverse).astype(g.dtype)
                g.copy_(unscaled, False)
                ok = paddle.isfinite(unscaled).all()
                finite = ok if finite is None else paddle.logical_and(finite, ok)
            if finite is None:
                self._found_inf.copy_(paddle.zeros([1], dtype="bool"), False)
            else:
                self._found_inf.copy_(paddle.logical_not(finite).reshape([1]), False)
        self._stages[id(optimizer)] = _Stage.UNSCALED

    def step(self, optimizer):
        """Unscales (unless unscale_ ran) and runs ``optimizer.step()``; on an overflow the
        update is undone on the device."""
        if not self._enable:
            return optimizer.step()
        stage = self._stages[id(optimizer)]
        if stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if stage is _Stage.INIT:
            self.unscale_(optimizer)
        self._step_or_undo(optimizer)
        self._stages[id(optimizer)] = _Stage.STEPPED
        if not self._use_dynamic_loss_scaling:
            self._stages = collections.defaultdict(lambda: _Stage.INIT)
        return None

    def _step_or_undo(self, optimizer):
        saved = {}
        inner = inner_optimizer(optimizer) or optimizer  # Fleet's wrappers step the optimizer inside
        original = inner._append_optimize_op

        def before_update(block, param_and_grad):
            # NOTE [ Parameter groups and the overflow undo ]: each group creates its state just
            # before its own updates, so what is new since the last update op is saved now.
            with paddle.no_grad():
                for _, t in state_tensors(inner):
                    if id(t) not in saved and t._is_initialized():
                        saved[id(t)] = (t, t.clone())
            return original(block, param_and_grad)

        inner._append_optimize_op = before_update
        try:
            optimizer.step()
        finally:
            del inner._append_optimize_op
        skip = self._found_inf.reshape([])
        with paddle.no_grad():
            for t, before in saved.values():
                t.copy_(paddle.where(skip, before, t), False)

    def update(self):
        """Updates the scale on the device from the last found_inf (dynamic scaling only)."""
        if not self._enable:
            return
        if self._use_dynamic_loss_scaling:
            with paddle.no_grad():
                self._update_scale()
        self._stages = collections.defaultdict(lambda: _Stage.INIT)

    def _update_scale(self):
        found = self._found_inf.astype("int32")
        bad = (self._bad + 1) * found
        good = (self._good + 1) * (1 - found)
        decrease = bad == self._decr_every_n_nan_or_inf
        increase = good == self._incr_every_n_steps
        scale = paddle.where(decrease, self._scale * self._decr_ratio,
                             paddle.where(increase, self._scale * self._incr_ratio, self._scale))
        self._scale.copy_(scale, False)
        self._bad.copy_(bad * (1 - decrease.astype("int32")), False)
        self._good.copy_(good * (1 - increase.astype("int32")), False)

    def minimize(self, optimizer, *args, **kwargs):
        """``step(optimizer)`` then ``update()``, as paddle.amp.GradScaler.minimize."""
        if not self._enable:
            return optimizer.minimize(*args, **kwargs)
        self.step(optimizer)
        self.update()
        return None

    # ------------------------------------------------------------------ state
    @property
    def loss_scaling(self):
        """The scale, a float32 tensor of shape [1] updated in place."""
        return self._scale

    def state_tensors(self):
        """The device tensors this scaler keeps across steps."""
        return [self._scale, self._good, self._bad, self._found_inf]

    def python_state(self):
        return dict(self._stages)

    def set_python_state(self, stages):
        self._stages = collections.defaultdict(lambda: _Stage.INIT, stages)

    def state_dict(self):
        """As paddle.amp.GradScaler.state_dict (reads the device: call it outside a step)."""
        if not self._enable:
            return {}
        return {
            "scale": self._scale.numpy(),
            "incr_ratio": self._incr_ratio,
            "decr_ratio": self._decr_ratio,
            "incr_every_n_steps": self._incr_every_n_steps,
            "decr_every_n_nan_or_inf": self._decr_every_n_nan_or_inf,
            "incr_count": int(self._good.numpy()[0]),
            "decr_count": int(self._bad.numpy()[0]),
            "use_dynamic_loss_scaling": self._use_dynamic_loss_scaling,
        }

    def load_state_dict(self, state_dict):
        """Loads a state from state_dict() (of this class or of paddle.amp.GradScaler), in place."""
        if not self._enable:
            return
        if not state_dict:
            raise RuntimeError("The input state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        self._init_loss_scaling = float(np.asarray(state_dict["scale"]).reshape(-1)[0])
        with paddle.no_grad():
            self._scale.copy_(paddle.to_tensor(np.asarray(state_dict["scale"], dtype=np.float32).reshape([1])), False)
            self._good.copy_(paddle.to_tensor(np.array([state_dict["incr_count"]], dtype=np.int32)), False)
            self._bad.copy_(paddle.to_tensor(np.array([state_dict["decr_count"]], dtype=np.int32)), False)
        self._incr_ratio = state_dict["incr_ratio"]
        self._decr_ratio = state_dict["decr_ratio"]
        self._incr_every_n_steps = state_dict["incr_every_n_steps"]
        self._decr_every_n_nan_or_inf = state_dict["decr_every_n_nan_or_inf"]
        self._use_dynamic_loss_scaling = state_dict["use_dynamic_loss_scaling"]

    # Paddle's GradScaler getters, each returning one setting.
    is_enable = _getter("_enable")
    is_use_dynamic_loss_scaling = _getter("_use_dynamic_loss_scaling")
    get_init_loss_scaling = _getter("_init_loss_scaling")
    get_incr_ratio = _getter("_incr_ratio")
    get_decr_ratio = _getter("_decr_ratio")
    get_incr_every_n_steps = _getter("_incr_every_n_steps")
    get_decr_every_n_nan_or_inf = _getter("_decr_every_n_nan_or_inf")
