"""autocudagraph_step(): the whole training step - forward, backward, clipping, optimizer, loss
scaling, data-parallel all-reduce - in one graph, on the same phase machine as block graphs
(core/lifecycle.py) with a body of its own (step/body.py). docs/guides/train_step.md says when to use it.
"""

import dataclasses
from typing import Any, Tuple

import paddle

from ..core.lifecycle import Lifecycle
from .optimizer_state import inner_optimizer
from ..options import OptionsCore, check_option_names
from .body import StepBody

__all__ = ["autocudagraph_step", "StepOptions", "GraphedStep"]


def _fail(kind, message):
    raise kind(f"autocudagraph_step: {message}")


@dataclasses.dataclass(frozen=True)
class StepOptions(OptionsCore):
    """Options of one autocudagraph_step wrapper, validated when it is made: OptionsCore's
    (warmup_steps, max_graphs, backend, dispatch_key_fn, capture_hooks) and ``optimizers``. A
    step has no verify_replays (it cannot be re-run to verify it) nor max_bytes.

    Attributes:
        optimizers: the optimizers the step function steps (their learning rates are fed and
            their state checked); Fleet's wrappers (fleet.distributed_optimizer) are accepted;
            ``[]`` for a step without a Paddle optimizer.
        warmup_steps: eager steps per key before the capture (at least 1: the first step
            creates the optimizer state, and the capture is compared with a warmup step).
    """

    warmup_steps: int = 2
    optimizers: Tuple[Any, ...] = ()

    API = "autocudagraph_step"
    MIN_WARMUP = 1
    WARMUP_HINT = ("The first step creates the optimizer state and the capture is compared with a warmup step; "
                   "warmup_steps=2 is a good default.")

    def __post_init__(self):
        self._check_optimizers()
        super().__post_init__()

    def _check_optimizers(self):
        opts = self.optimizers
        if isinstance(opts, paddle.optimizer.Optimizer):
            _fail(TypeError, f"optimizers must be a list, got the optimizer {type(opts).__name__} itself. "
                             "Pass optimizers=[opt].")
        if opts is None or not isinstance(opts, (list, tuple)):
            _fail(TypeError, f"optimizers must be a list of the step's paddle.optimizer.Optimizer objects, got "
                             f"{opts!r}. The wrapper feeds their learning rates and checks their state; pass "
                             "optimizers=[opt] (or [] for a step that updates nothing through a Paddle optimizer).")
        for i, opt in enumerate(opts):
            if inner_optimizer(opt) is None:
                _fail(TypeError, f"optimizers[{i}] is {opt!r} ({type(opt).__name__}), not a "
                                 "paddle.optimizer.Optimizer (or a Fleet wrapper of one). Pass the optimizers the "
                                 "step calls step() on.")
        object.__setattr__(self, "optimizers", tuple(opts))


class GraphedStep(Lifecycle):
    """A training step with per-key whole-step graphs. Made by autocudagraph_step()."""

    def __init__(self, fn, options):
        if not isinstance(options, StepOptions):
            raise TypeError(f"GraphedStep: options must be StepOptions, got {options!r}")
        if isinstance(fn, paddle.nn.Layer) or not callable(fn):
            _fail(TypeError, f"expected the training-step function, got {fn!r} ({type(fn).__name__}). Wrap the "
                             "function that runs forward, backward and opt.step(); graph a Layer with autocudagraph.")
        if isinstance(fn, (Lifecycle,)):
            _fail(TypeError, f"{getattr(fn, '__name__', fn)} is already graphed. Apply autocudagraph_step once.")
        super().__init__(StepBody(fn, options), fn)


def autocudagraph_step(train_step_fn=None, *, optimizers=None, warmup_steps=2, max_graphs=8, backend=None,
                       dispatch_key_fn=None, capture_hooks=(), **unknown):
    """Captures a whole training step into one graph per key and replays it.

    ``train_step_fn(*batch)`` runs forward, loss, ``backward()``, optional clipping,
    ``opt.step()`` and ``opt.clear_grad()`` (or leaves grads for the next micro-batch), and
    returns the loss and any metric tensors; ``step(*batch)`` returns what it returns, as
    detached copies. Learning-rate schedulers are stepped by the caller between steps, as in
    eager code. Usable as ``step = autocudagraph_step(fn, optimizers=[opt])`` or as a decorator
    ``@autocudagraph_step(optimizers=[opt], warmup_steps=2)``.

    Per key (the batch's shapes and dtypes, non-tensor arguments such as an ``apply`` flag, grad
    mode, AMP state and the training flags of the Layers the step calls) the first
    ``warmup_steps`` steps run eagerly, the next is captured and later ones replay. A step that
    cannot be graphed runs eagerly with one warning and the reason in ``explain()``.

    Args:
        train_step_fn: the step function; omitted when used as a decorator with options.
        optimizers: the optimizers the step steps (required; ``[]`` when it uses none).
        warmup_steps, max_graphs, backend, dispatch_key_fn, capture_hooks: see StepOptions.

    Returns:
        A GraphedStep with ``stats()``, ``explain()``, ``report()``, ``reset()`` and
        ``counters``, or a decorator.

    Raises:
        TypeError, ValueError: for a bad option, when the wrapper is made.

    Limitations:
        See docs/guides/train_step.md: what the step function may and may not do (host values, grads
        cleared inside the step, paddle.amp.GradScaler replaced by GraphGradScaler).
    """
    check_option_names("autocudagraph_step", unknown,
                       [f.name for f in dataclasses.fields(StepOptions) if f.init])
    options = StepOptions(optimizers=optimizers, warmup_steps=warmup_steps, max_graphs=max_graphs,
                          backend=backend, dispatch_key_fn=dispatch_key_fn, capture_hooks=capture_hooks)
    if train_step_fn is None:
        return lambda fn: GraphedStep(fn, options)
    return GraphedStep(train_step_fn, options)
