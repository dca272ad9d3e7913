"""PaddleFormers' ``Trainer`` with CUDA graphs: graphed decoder layers, or a graphed whole step.

``CudaGraphTrainerMixin`` goes before PaddleFormers' ``Trainer`` (``graphed_trainer_class()`` builds
that class); the rest of a training script stays as it is::

    from paddlefleet.cudagraph.integrations.paddleformers import graphed_trainer_class

    Trainer = graphed_trainer_class()
    trainer = Trainer(model=model, args=args, train_dataset=data, cudagraph="step")
    trainer.train()
    print(trainer.cudagraph_explain())

NOTE [ Trainer steps ]
``cudagraph="layers"`` graphs every decoder layer in place (``autocudagraph``) when the trainer is
made; the Trainer runs unchanged around them. ``cudagraph="step"`` replaces ``training_step`` (one
micro-batch: forward, loss, backward) with ``autocudagraph_step`` of the same work, plus, on the
micro-batch after which the Trainer's loop steps the optimizer, the update the loop would run next:
the ``1 / gradient_accumulation_steps`` grad scaling (only when accumulating), ``optimizer.step()``
(its grad clip, AdamW and the learning rate the scheduler set) and ``optimizer.clear_grad()``.
``optimizer_step`` then only steps the LR scheduler, which stays on the host as in eager (the step
wrapper feeds the new rate before every replay). A Python bool argument (``apply``) keys the two
kinds of micro-batch: one graph each. The loop's own grad scaling, which runs after that micro-batch
on the grads the graph already cleared (zeros), leaves them zero.

What it cannot graph runs the Trainer's own eager code, and the reason is written to the Trainer's
log once: fp16 loss scaling with Paddle's ``GradScaler`` (its skip decision is read on the host:
NOTE [ Loss scaling without host syncs ] in step/grad_scaler.py; ``GraphGradScaler`` is its graphed form for a step you write yourself), pipeline parallel and auto parallel (their
schedules run outside ``training_step``), ``release_grads`` (grads freed by ``clear_grad(False)``
cannot be graphed, docs/guides/train_step.md), ``freeze_training`` and ``past_index``. A window the
loop closes early (the last micro-batches of an epoch shorter than ``gradient_accumulation_steps``)
is updated by the Trainer's own ``optimizer_step``, eagerly.
"""

import logging

import paddle

from ..api import autocudagraph
from ..step.graphed_step import autocudagraph_step

__all__ = ["CudaGraphTrainerMixin", "graphed_trainer_class", "decoder_layers", "MODES"]

logger = logging.getLogger(__name__)

#: The values of ``cudagraph=``.
MODES = ("layers", "step", "off")


def decoder_layers(model):
    """The decoder layers of a PaddleFormers causal LM (``model.model.layers`` of LLaMA, Qwen, ...),
    or every sublayer whose class name ends with ``DecoderLayer``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        return list(layers)
    return [layer for layer in model.sublayers() if type(layer).__name__.endswith("DecoderLayer")]


def _step_refusal(trainer):
    """Why ``cudagraph="step"`` cannot graph this Trainer's steps, or None."""
    args = trainer.args
    if getattr(trainer, "do_grad_scaling", False):
        return ("fp16 loss scaling uses Paddle's GradScaler, whose skip decision is read on the host (a graph would "
                "replay the capture-time decision); use bf16, or cudagraph='layers'")
    if getattr(args, "pipeline_model_parallel_size", 1) > 1 or getattr(trainer, "using_fleet_model", False):
        return "pipeline parallel runs its own schedule outside training_step; use cudagraph='layers'"
    if getattr(args, "enable_auto_parallel", False):
        return "auto parallel runs outside training_step; use cudagraph='layers'"
    if getattr(args, "release_grads", False):
        return ("release_grads frees the grads with clear_grad(set_to_zero=False), which a graphed step cannot "
                "replay; set release_grads=False")
    if getattr(args, "freeze_training", False):
        return "freeze_training skips the optimizer step"
    if getattr(args, "past_index", -1) >= 0:
        return "past_index keeps a model output between steps on the host"
    if getattr(trainer.model, "_prepare_unified_non_pp_data", None) is not None:
        return "the model prepares its data on the host in training_step (_prepare_unified_non_pp_data)"
    return None


class CudaGraphTrainerMixin:
    """Put before PaddleFormers' ``Trainer`` (NOTE [ Trainer steps ]).

    Args:
        cudagraph: ``"step"`` (the whole step graphed), ``"layers"`` (the decoder layers graphed) or
            ``"off"`` (the plain Trainer).
        cudagraph_layers: ``model -> [Layer]`` for ``"layers"``; default ``decoder_layers``.
        cudagraph_options: options for ``autocudagraph`` / ``autocudagraph_step`` (``backend``,
            ``warmup_steps``, ...).
    """

    def __init__(self, *args, cudagraph="step", cudagraph_layers=None, cudagraph_options=None, **kwargs):
        if cudagraph not in MODES:
            raise ValueError(f"cudagraph must be one of {', '.join(map(repr, MODES))}, got {cudagraph!r}; "
                             "'step' graphs the whole training step, 'layers' each decoder layer")
        if cudagraph_layers is not None and not callable(cudagraph_layers):
            raise TypeError(f"cudagraph_layers must be a callable model -> list of Layers, got "
                            f"{type(cudagraph_layers).__name__}")
        super().__init__(*args, **kwargs)
        self.cudagraph = cudagraph
        self.cudagraph_options = dict(cudagraph_options or {})
        self.cudagraph_wrappers = []  # what stats() and explain() report on
        self._cudagraph_step = None
        self._cudagraph_updated = False  # the last graphed micro-batch ran the optimizer update
        self._cudagraph_refusal = None
        self._cudagraph_model = None
        self._cudagraph_model_warned = False
        if cudagraph == "layers":
            layers = (cudagraph_layers or decoder_layers)(self.model)
            if not layers:
                raise ValueError("cudagraph='layers' found no decoder layers in the model; pass "
                                 "cudagraph_layers=lambda model: [...] naming the Layers to graph")
            options = dict(self.cudagraph_options)
            self.cudagraph_wrappers = [autocudagraph(layer, **options).forward for layer in layers]

    # ------------------------------------------------------------------ the whole step
    def _graphed_training_step(self, model):
        if self._cudagraph_step is None:
            trainer = self
            self._cudagraph_model = model  # the Trainer's model, or its wrapper (DataParallel)
            accumulation = self.args.gradient_accumulation_steps

            def train_step(inputs, apply):
                with trainer.autocast_smart_context_manager():
                    loss = trainer.compute_loss(model, inputs)
                loss.backward()
                if accumulation > 1:
                    loss = loss / accumulation
                if apply:
                    if accumulation > 1:  # what the Trainer's loop does before optimizer_step
                        with paddle.no_grad():
                            for p in model.parameters():
                                if p.grad is not None:
                                    p.grad.scale_(1.0 / accumulation)
                    trainer.optimizer.step()
                    trainer.optimizer.clear_grad()
                return loss.detach()

            self._cudagraph_step = autocudagraph_step(train_step, optimizers=[self.optimizer], **self.cudagraph_options)
            self.cudagraph_wrappers = [self._cudagraph_step]
        return self._cudagraph_step

    def training_step(self, model, inputs, step_control=0):
        if self.cudagraph != "step":
            return super().training_step(model, inputs, step_control=step_control)
        if self._cudagraph_refusal is None:
            self._cudagraph_refusal = _step_refusal(self) or ""
            if self._cudagraph_refusal:
                _log("warning", f"autocudagraph: the Trainer's steps run eagerly: {self._cudagraph_refusal}")
        if self._cudagraph_refusal:
            return super().training_step(model, inputs, step_control=step_control)
        if self._cudagraph_step is not None and model is not self._cudagraph_model:
            if not self._cudagraph_model_warned:
                self._cudagraph_model_warned = True
                _log("warning", "autocudagraph: training_step got another model object than the graphed step was "
                                "built for; those steps run eagerly")
            return super().training_step(model, inputs, step_control=step_control)
        apply = (step_control + 1) % self.args.gradient_accumulation_steps == 0
        model.train()
        loss = self._graphed_training_step(model)(self._prepare_inputs(inputs), apply)
        self._cudagraph_updated = apply
        return loss

    def optimizer_step(self, args, model, parameters_list=None):
        if not self._cudagraph_updated:
            return super().optimizer_step(args, model, parameters_list=parameters_list)
        self._cudagraph_updated = False
        self.lr_scheduler.step()  # the optimizer update ran in the graphed step (NOTE [ Trainer steps ])
        return None

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            for wrapper in self.cudagraph_wrappers:
                reasons = wrapper.stats()["eager_reasons"]
                if reasons:
                    _log("warning", "autocudagraph: calls ran eagerly: "
                         + "; ".join(f"{n} x {r}" for r, n in reasons.items()))
            if self.cudagraph_wrappers:
                _log("info", self.cudagraph_explain())

    # ------------------------------------------------------------------ reports
    def cudagraph_stats(self):
        """``stats()`` of every wrapper this Trainer made (one per graphed layer, or the step)."""
        return [wrapper.stats() for wrapper in self.cudagraph_wrappers]

    def cudagraph_explain(self):
        """``explain()`` of every wrapper this Trainer made, or why the steps ran eagerly."""
        if self._cudagraph_refusal:
            return f"autocudagraph: the Trainer's steps ran eagerly: {self._cudagraph_refusal}"
        return "\n".join(wrapper.explain() for wrapper in self.cudagraph_wrappers)


def _log(level, message):
    """Writes ``message`` once: to this module's logger where one of its handlers shows it (the program
    configured logging, or a test captures it), else to the Trainer's log (PaddleFormers' logger, which takes
    one formatted message), else to this module's logger. Both at once printed every line twice."""
    if logger.isEnabledFor(getattr(logging, level.upper())) and logger.hasHandlers():
        getattr(logger, level)("%s", message)
        return
    try:
        from paddleformers.utils.log import logger as trainer_logger
    except ImportError:
        getattr(logger, level)("%s", message)
        return
    getattr(trainer_logger, level)(message)


def graphed_trainer_class(base=None):
    """``CudaGraphTrainerMixin`` + ``base`` (default ``paddleformers.trainer.Trainer``)."""
    if base is None:
        from paddleformers.trainer import Trainer as base
    return type(f"CudaGraph{base.__name__}", (CudaGraphTrainerMixin, base), {})
