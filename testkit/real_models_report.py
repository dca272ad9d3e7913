"""docs/reports/real_models.md: what is graphed in each real model we run, the replays seen and whether
the graphed training is bitwise eager's. Each row is a run (``ROWS``) on the simulated backend;
``tools/real_models_report.py`` writes the report, tests/integration/test_real_models_report.py reruns
every row it can and checks the committed report says the same.
"""

import dataclasses
import tempfile
from typing import Callable, Optional
from unittest import mock

import paddle

from paddlefleet.cudagraph import autocudagraph

from .common import bitwise_failures
from .differential import differential_run, state_of as full_state
from .real_models import (Rows, graph_all, llama_step_twins, paddleformers_skip_reason, tiny_llama, token_batches,
                          train_lm, vision_run)

__all__ = ["Row", "ROWS", "run_row", "render", "parse_rows", "HEADER"]

BACKEND = "simulate"
HEADER = ("| model | graphed | run | captures | replays | eager calls | bitwise to eager | speed (GPU) |\n"
          "|---|---|---|---|---|---|---|---|")
NO_GPU_RUN = "none: no GPU run"


@dataclasses.dataclass
class Row:
    model: str
    graphed: str
    run: str
    measure: Callable[[], tuple]  # () -> (list of stats dicts, bitwise failures)
    needs: Optional[Callable[[], Optional[str]]] = None  # () -> why it cannot run here, or None


def _sum(stats, name):
    return sum(s[name] for s in stats)


def _cells(stats, failures):
    n = len(stats)
    per = f" ({n} wrappers)" if n > 1 else ""
    eager = sum(s["eager_calls"] for s in stats)
    return [f"{_sum(stats, 'captures')}{per}", str(_sum(stats, "replays")), str(eager),
            "yes" if not failures else f"no: {failures[0][:80]}"]


# ----------------------------------------------------------------------------- LLaMA
def _llama_twins():
    paddle.seed(5)
    eager = tiny_llama(attention_dropout=0.1)
    graphed = tiny_llama(attention_dropout=0.1)
    graphed.set_state_dict(eager.state_dict())
    return eager, graphed


def _llama_layers():
    eager, graphed = _llama_twins()
    layers = graph_all(list(graphed.model.layers), BACKEND, warmup_steps=1)
    batches = token_batches(10)
    want, got = train_lm(eager, batches), train_lm(graphed, batches)
    return [layer.forward.stats() for layer in layers], bitwise_failures(got, want)[1]


def _llama_model():
    eager, graphed = _llama_twins()
    autocudagraph(graphed, backend=BACKEND, warmup_steps=1)
    batches = token_batches(10)
    want, got = train_lm(eager, batches), train_lm(graphed, batches)
    return [graphed.forward.stats()], bitwise_failures(got, want)[1]


def _llama_step():
    build, graph, after_step, wrappers = llama_step_twins(BACKEND)
    try:
        differential_run(build, token_batches(20), graph, after_step=after_step)
        failures = []
    except AssertionError as err:  # StateMismatch: the first difference
        failures = [str(err)]
    return [wrappers[0].stats()], failures


def _trainer(mode, accumulation):
    def measure():
        from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments

        from paddlefleet.cudagraph.integrations.paddleformers import graphed_trainer_class

        def run(cls, **kwargs):
            states = []

            class Snapshot(TrainerCallback):
                def on_step_end(self, args, state, control, **kw):
                    states.append(full_state({"model": trainer.model, "opt": trainer.optimizer,
                                              "sched": trainer.lr_scheduler}))

            paddle.seed(5)
            with tempfile.TemporaryDirectory() as out:
                args = TrainingArguments(
                    output_dir=out, max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
                    learning_rate=1e-3, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01,
                    logging_steps=1, save_strategy="no", report_to=[], seed=5, amp_master_grad=False, device="cpu",
                    disable_tqdm=True)
                trainer = cls(model=tiny_llama(attention_dropout=0.1), args=args, train_dataset=Rows(),
                              callbacks=[Snapshot()], **kwargs)
                # The Trainer's paddle.device.synchronize() raises on a CPU (plain Trainer too).
                with mock.patch.object(paddle.device, "synchronize", lambda *a, **k: None):
                    trainer.train()
            return trainer, states

        _, want = run(Trainer)
        options = {"backend": BACKEND, **({"warmup_steps": 1} if mode == "layers" else {})}
        trainer, got = run(graphed_trainer_class(), cudagraph=mode, cudagraph_options=options)
        return trainer.cudagraph_stats(), bitwise_failures(got, want)[1]

    return measure


# ----------------------------------------------------------------------------- vision
def _vision(name, whole):
    def measure():
        run = vision_run(name, BACKEND, whole)  # 4 steps, as VISION says
        return list(run.stats), list(run.failures)

    return measure


# ----------------------------------------------------------------------------- the demo's transformer
def _demo_block():
    from paddlefleet.cudagraph.demo.transformer_blocks import compare_transformer

    result = compare_transformer(steps=20, accumulate=2, backend=BACKEND, warmup_steps=1)
    return [result.graphed.stats], [] if result.equal else [result.first_mismatch]


def _demo_step():
    from paddlefleet.cudagraph.demo.transformer_steps import compare_transformer_steps

    result = compare_transformer_steps(steps=30, accumulate=2, backend=BACKEND)
    return [result.graphed.stats], [] if result.equal else [result.first_mismatch]


LLAMA = "PaddleFormers LLaMA (tiny: 2 layers, width 32, dropout 0.1)"
TRAIN_LM = "10 AdamW steps"
TRAINER = "6 Trainer steps: cosine LR with warmup, max_grad_norm, weight decay"
VISION = "4 Momentum steps (BatchNorm train), 3 eval calls"
ROWS = [
    Row(LLAMA, "each decoder layer", TRAIN_LM, _llama_layers, paddleformers_skip_reason),
    Row(LLAMA, "whole model", TRAIN_LM, _llama_model, paddleformers_skip_reason),
    Row(LLAMA, "whole step", "20 steps: AdamW, global-norm clip, cosine LR", _llama_step, paddleformers_skip_reason),
    Row(LLAMA, "Trainer, decoder layers", TRAINER, _trainer("layers", 1), paddleformers_skip_reason),
    Row(LLAMA, "Trainer, whole step", TRAINER, _trainer("step", 1), paddleformers_skip_reason),
    Row(LLAMA, "Trainer, whole step", TRAINER + ", 2 micro-batches a step", _trainer("step", 2),
        paddleformers_skip_reason),
    Row("paddle.vision resnet18 (32x32, batch 4)", "each stage (layer1..layer4)", VISION, _vision("resnet18", False)),
    Row("paddle.vision resnet18 (32x32, batch 4)", "whole model", VISION, _vision("resnet18", True)),
    Row("paddle.vision mobilenet_v2 (32x32, batch 4)", "each inverted residual", VISION, _vision("mobilenet_v2", False)),
    Row("paddle.vision mobilenet_v2 (32x32, batch 4)", "whole model", VISION, _vision("mobilenet_v2", True)),
    Row("demo transformer block (width 32, dropout)", "the block (autocudagraph)", "20 AdamW steps, 2 micro-batches each",
        _demo_block),
    Row("demo transformer block (width 16)", "whole step", "30 steps: GraphGradScaler with an overflow, warmup + cosine "
        "LR, 2 micro-batches", _demo_step),
]


def run_row(row):
    """The row's table line, measured now."""
    stats, failures = row.measure()
    cells = [row.model, row.graphed, row.run] + _cells(stats, failures) + [NO_GPU_RUN]
    return "| " + " | ".join(cells) + " |"


def render(lines):
    """The report from the table lines."""
    return "\n".join([
        "# Real models: what is graphed, replays, bitwise",
        "",
        "Generated by `python tools/real_models_report.py --out docs/reports/real_models.md` (simulated backend,",
        "CPU); tests/integration/test_real_models_report.py reruns every row and fails when this table is not what",
        "the run gives. Each row trains a graphed model and the same eager model from the same state and seed",
        "and compares losses, outputs, every parameter and buffer (the whole-step and Trainer rows: also the",
        "optimizer's state, the learning rate and the scheduler, after every step) bit for bit. `captures`,",
        "`replays` and `eager calls` add up the counters of every wrapper of the row (one per graphed layer).",
        "Recipes: docs/guides/recipes.md.",
        "",
        "**Speed: none measured.** None of these models has run on a GPU: on the workplace's Hopper GPUs only",
        "PyPI's Paddle 2.6.2 was available, which has no kernels for Hopper (its cuBLAS matmuls and copies run,",
        "nothing else: README, \"Install on a GPU\"), and each of these models needs Paddle's own kernels.",
        "`tools/real_models_bench.py` measures them on a GPU whose Paddle has kernels for it. The matmul-only",
        "models that do run there are in docs/reports/gpu_check.md and docs/reports/benchmarks.md.",
        "",
        HEADER,
        *lines,
        "",
    ])


def parse_rows(text):
    """The table lines of a report, in order."""
    table = text.split(HEADER, 1)[1] if HEADER in text else ""
    return [line for line in table.strip().splitlines() if line.startswith("| ")]
