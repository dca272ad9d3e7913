"""autocudagraph_step(): the whole training step - forward, backward, clipping, optimizer, loss
scaling, data-parallel all-reduce - in one graph, on the same phase machine as block graphs
(core/lifecycle.py) with a body of its own (step/body.py). docs/train_step.md says when to use it.
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import paddle

from ..core.lifecycle import Lifecycle
from .optimizer_state import inner_optimizer
from ..options import BACKEND_NAMES, check_key_fn, check_option_names
from .body import StepBody

__all__ = ["autocudagraph_step", "StepOptions", "GraphedStep"]


def _fail(kind, message):
    raise kind(f"autocudagraph_step: {message}")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Options of one autocudagraph_step wrapper, validated when it is made.

    Attributes:
        optimizers: the optimizers the step function steps (their learning rates are fed and
            their state checked); Fleet's wrappers (fleet.distributed_optimizer) are accepted;
            ``[]`` for a step without a Paddle optimizer.
        warmup_steps: eager steps per key before the capture (at least 1: the first step
            creates the optimizer state, and the capture is compared with a warmup step).
        max_graphs: keys (batch shapes, phases) that may warm up or hold graphs at once.
        backend: "cuda", "simulate", "eager" or None (cuda for GPU tensors of a CUDA build,
            else eager); PADDLEFLEET_CUDAGRAPH_BACKEND overrides it.
        dispatch_key_fn: ``fn(bound_arguments) -> hashable | None`` replacing the default key.
        capture_hooks: context-manager factories entered around every capture.
    """

    optimizers: Tuple[Any, ...] = ()
    warmup_steps: int = 2
    max_graphs: int = 8
    backend: Optional[str] = None
    dispatch_key_fn: Optional[Callable[[Any], Any]] = None
    capture_hooks: Tuple[Callable[[], Any], ...] = ()
    # Read by the phase machine; fixed for steps (a step cannot be re-run to verify it).
    verify_replays: int = dataclasses.field(default=0, init=False)
    max_bytes: Optional[int] = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        self._check_optimizers()
        for name, minimum, hint in (("warmup_steps", 1, "The first step creates the optimizer state and the capture "
                                     "is compared with a warmup step; warmup_steps=2 is a good default."),
                                    ("max_graphs", 0, "Pass how many keys may hold graphs, e.g. max_graphs=8.")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                _fail(TypeError, f"{name} must be an int, got {value!r} ({type(value).__name__}). {hint}")
            if value < minimum:
                _fail(ValueError, f"{name} must be >= {minimum}, got {value}. {hint}")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            _fail(ValueError, f"backend must be one of {BACKEND_NAMES} or None, got {self.backend!r}. "
                              "Use backend=None to graph on a GPU and run eagerly elsewhere.")
        check_key_fn("autocudagraph_step", self.dispatch_key_fn)
        hooks = () if self.capture_hooks is None else self.capture_hooks
        if callable(hooks) or not isinstance(hooks, Sequence) or not all(callable(h) for h in hooks):
            _fail(TypeError, f"capture_hooks must be a list of context-manager factories, got {hooks!r}.")
        object.__setattr__(self, "capture_hooks", tuple(hooks))

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

    kind = "autocudagraph_step"

    def __init__(self, fn, options):
        if not isinstance(options, StepOptions):
            raise TypeError(f"GraphedStep: options must be StepOptions, got {options!r}")
        if isinstance(fn, paddle.nn.Layer) or not callable(fn):
            _fail(TypeError, f"expected the training-step function, got {fn!r} ({type(fn).__name__}). Wrap the "
                             "function that runs forward, backward and opt.step(); graph a Layer with autocudagraph.")
        if isinstance(fn, (Lifecycle,)):
            _fail(TypeError, f"{getattr(fn, '__name__', fn)} is already graphed. Apply autocudagraph_step once.")
        super().__init__(StepBody(fn, options), fn)

    def explain(self):
        """As for blocks (stats.explain), naming the wrapper autocudagraph_step."""
        text = super().explain()
        return "autocudagraph_step" + text[len("autocudagraph"):]


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
        See docs/train_step.md: what the step function may and may not do (host values, grads
        cleared inside the step, paddle.amp.GradScaler replaced by GraphGradScaler).
    """
    check_option_names("autocudagraph_step", unknown,
                       [f.name for f in dataclasses.fields(StepOptions) if f.init])
    options = StepOptions(optimizers=optimizers, warmup_steps=warmup_steps, max_graphs=max_graphs,
                          backend=backend, dispatch_key_fn=dispatch_key_fn, capture_hooks=capture_hooks)
    if train_step_fn is None:
        return lambda fn: GraphedStep(fn, options)
    return GraphedStep(train_step_fn, options)
