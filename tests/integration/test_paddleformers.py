"""PaddleFormers LLaMA graphed whole (the model, the training step) and under its ``Trainer``.

Each test trains a graphed set-up and the same eager one from the same state and seed and compares
every parameter, the optimizer's state, the learning rate and the scheduler bit for bit (the whole
step after every step, with testkit.differential); counters pin what was captured and replayed.
PaddleFormers is optional (``pip install --no-deps -r requirements-real-models.txt``); where it does
not import (Paddle 2.6.2) every test here skips with the reason.
"""

import os
import tempfile
import unittest
import warnings
from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph
from testkit.differential import assert_same_state, differential_run, state_of
from testkit.harness import BackendCase, for_each_backend

from testkit.real_models import Rows, llama_step_twins, paddleformers_skip_reason, tiny_llama, token_batches, train_lm


class _NeedsPaddleFormers(BackendCase):
    def setUp(self):
        super().setUp()
        reason = paddleformers_skip_reason()
        if reason:
            self.skipTest(reason)


@for_each_backend
class LlamaWholeTest(_NeedsPaddleFormers):
    def test_the_whole_model_graphed_trains_like_eager(self):
        paddle.seed(5)
        eager = tiny_llama()
        graphed = tiny_llama()
        graphed.set_state_dict(eager.state_dict())
        autocudagraph(graphed, backend=self.backend, warmup_steps=1)
        batches = token_batches(10)
        self.assertBitwise(train_lm(graphed, batches), train_lm(eager, batches))
        # The attention-mask helper's paddle.where(mask, 0.0, finfo.min) is captured as device fills.
        self.assertCounters(graphed.forward, captures=1, replays=8, warmup_calls=1, eager=0)

    def test_the_whole_training_step_over_20_steps(self):
        """Forward, loss, backward, global-norm clipping, AdamW with weight decay, a cosine LR schedule
        stepped between steps and attention dropout: every piece of state bitwise after every step."""
        build, graph, after_step, wrappers = llama_step_twins(self.backend)
        differential_run(build, token_batches(20), graph, after_step=after_step)
        self.assertCounters(wrappers[0], captures=1, replays=17, warmup_calls=2, eager=0)


# ---------------------------------------------------------------------------- Trainer
def _run_trainer(trainer_cls, steps=6, accumulation=1, **kwargs):
    """Trains a tiny LLaMA with ``trainer_cls``; returns the trainer, the state after every optimizer step
    and the logged losses."""
    from paddleformers.trainer import TrainerCallback, TrainingArguments

    args = dict(max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
                learning_rate=1e-3, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01,
                logging_steps=1, save_strategy="no", report_to=[], seed=5, amp_master_grad=False, device="cpu",
                disable_tqdm=True)
    args.update(kwargs.pop("args", {}))
    states = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            states.append(state_of({"model": trainer.model, "opt": trainer.optimizer, "sched": trainer.lr_scheduler}))

    paddle.seed(5)
    model = tiny_llama(attention_dropout=0.1)
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_cls(model=model, args=TrainingArguments(output_dir=out, **args), train_dataset=Rows(),
                              callbacks=[Snapshot()], **kwargs)
        # The Trainer calls paddle.device.synchronize() before scaling accumulated grads, which raises on a
        # CPU ("device should be gpu, xpu, ..."): both the plain and the graphed Trainer run without it here.
        with mock.patch.object(paddle.device, "synchronize", lambda *a, **k: None):
            trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainer, states, losses


class TrainerTest(_NeedsPaddleFormers):
    backend = "simulate"

    def setUp(self):
        super().setUp()
        from paddlefleet.cudagraph.integrations.paddleformers import graphed_trainer_class

        self.graphed_cls = graphed_trainer_class()

    def compare(self, accumulation=1, steps=6, args=None, **options):
        from paddleformers.trainer import Trainer

        _, want, want_losses = _run_trainer(Trainer, steps=steps, accumulation=accumulation, args=dict(args or {}))
        options.setdefault("cudagraph_options", {"backend": self.backend})
        trainer, got, got_losses = _run_trainer(self.graphed_cls, steps=steps, accumulation=accumulation,
                                                args=dict(args or {}), **options)
        self.assertEqual(len(got), steps)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"after optimizer step {i}")
        self.assertEqual(got_losses, want_losses)
        return trainer

    def totals(self, trainer, *names):
        stats = trainer.cudagraph_stats()
        return {n: sum(s[n] for s in stats) for n in names}

    def test_graphed_whole_step(self):
        trainer = self.compare(cudagraph="step")
        self.assertEqual(self.totals(trainer, "captures", "replays", "warmup_calls", "eager_calls"),
                         {"captures": 1, "replays": 3, "warmup_calls": 2, "eager_calls": 0})

    def test_graphed_whole_step_with_gradient_accumulation(self):
        # Two graphs: the micro-batch that accumulates, and the one that also updates.
        trainer = self.compare(cudagraph="step", accumulation=2)
        self.assertEqual(self.totals(trainer, "captures", "replays", "warmup_calls", "eager_calls"),
                         {"captures": 2, "replays": 6, "warmup_calls": 4, "eager_calls": 0})
        self.assertIn("apply=False", trainer.cudagraph_explain())

    def test_graphed_whole_step_with_bf16_settings(self):
        # The Trainer's bf16 O1 set-up (its autocast context inside the graphed step, the AMP state in the
        # key). A CPU build of Paddle makes autocast a no-op ("amp_guard can only be enabled on CUDAPlace,
        # XPUPlace, and CustomPlace"), so bf16 arithmetic itself is not exercised here.
        trainer = self.compare(cudagraph="step", args={"bf16": True, "fp16_opt_level": "O1"})
        self.assertEqual(self.totals(trainer, "captures", "replays", "eager_calls"),
                         {"captures": 1, "replays": 3, "eager_calls": 0})

    def test_fp16_loss_scaling_runs_the_trainers_own_code_naming_the_grad_scaler(self):
        # On a CPU the plain Trainer itself fails with fp16 (Paddle disables its GradScaler there and the
        # Trainer then reads a flag the scaler never set): the graphed Trainer runs that same eager code,
        # fails the same way, and has logged why it did not graph.
        from paddleformers.trainer import Trainer

        args = {"fp16": True, "fp16_opt_level": "O1"}
        with self.assertRaises(AttributeError) as plain:
            _run_trainer(Trainer, steps=2, args=dict(args))
        with self.assertLogs("paddlefleet.cudagraph.integrations.paddleformers", level="WARNING") as logs:
            with self.assertRaises(AttributeError) as graphed:
                _run_trainer(self.graphed_cls, steps=2, args=dict(args), cudagraph="step",
                             cudagraph_options={"backend": self.backend})
        self.assertEqual(str(graphed.exception), str(plain.exception))
        self.assertTrue(any("fp16 loss scaling uses Paddle's GradScaler" in line for line in logs.output), logs.output)

    def test_graphed_decoder_layers(self):
        trainer = self.compare(cudagraph="layers", cudagraph_options={"backend": self.backend, "warmup_steps": 1})
        stats = trainer.cudagraph_stats()
        self.assertEqual(len(stats), 2)  # one per decoder layer
        for s in stats:
            self.assertEqual((s["captures"], s["replays"], s["warmup_calls"], s["eager_calls"]), (1, 4, 1, 0))

    def test_graphed_decoder_layers_with_gradient_accumulation(self):
        trainer = self.compare(cudagraph="layers", accumulation=2,
                               cudagraph_options={"backend": self.backend, "warmup_steps": 1})
        for s in trainer.cudagraph_stats():
            self.assertEqual((s["captures"], s["replays"], s["warmup_calls"], s["eager_calls"]), (1, 10, 1, 0))

    def test_what_cannot_be_graphed_runs_eagerly_with_the_reason_in_the_log(self):
        from paddleformers.trainer import Trainer

        _, want, _ = _run_trainer(Trainer, steps=3, args={"release_grads": True})
        with self.assertLogs("paddlefleet.cudagraph.integrations.paddleformers", level="WARNING") as logs:
            trainer, got, _ = _run_trainer(self.graphed_cls, steps=3, args={"release_grads": True}, cudagraph="step",
                                           cudagraph_options={"backend": self.backend})
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"after optimizer step {i}")
        self.assertEqual(len(got), 3)
        self.assertTrue(any("steps run eagerly: release_grads frees the grads" in line for line in logs.output),
                        logs.output)
        self.assertIn("release_grads", trainer.cudagraph_explain())
        self.assertEqual(trainer.cudagraph_stats(), [])

    def test_backend_none_on_a_cpu_warns_once(self):
        """The Trainer's graphed steps with ``backend=None`` on a CPU run eagerly; the end-of-training warning saying
        so reaches the user once: through this package's logger where a handler shows it, else through the
        Trainer's log (both at once printed it twice)."""
        import logging

        from paddleformers.utils import log as pf_log

        ours = logging.getLogger("paddlefleet.cudagraph.integrations.paddleformers")
        for shown_by_ours in (True, False):
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            trainer_log = mock.Mock(wraps=pf_log.logger)
            with mock.patch.object(pf_log, "logger", trainer_log), \
                    mock.patch.object(ours, "hasHandlers", lambda: shown_by_ours), \
                    mock.patch.dict(os.environ, {}, clear=False):
                os.environ.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)  # backend=None itself, not the override
                ours.addHandler(handler)
                try:
                    _run_trainer(self.graphed_cls, steps=2, cudagraph="step", cudagraph_options={})
                finally:
                    ours.removeHandler(handler)
            said = [r.getMessage() for r in records] + [c.args[0] for c in trainer_log.warning.call_args_list]
            eager = [m for m in said if m.startswith("autocudagraph: calls ran eagerly")]
            self.assertEqual(len(eager), 1, (shown_by_ours, said))
            self.assertIn("no GPU tensors or no CUDA build (backend=None runs eagerly)", eager[0])
            self.assertEqual(len(records) == 1, shown_by_ours, said)

    def test_a_bad_mode_names_the_argument(self):
        from paddleformers.trainer import TrainingArguments

        with tempfile.TemporaryDirectory() as out:
            with self.assertRaisesRegex(ValueError, "cudagraph must be one of 'layers', 'step', 'off', got 'whole'"):
                self.graphed_cls(model=tiny_llama(), args=TrainingArguments(output_dir=out, amp_master_grad=False,
                                                                           device="cpu", report_to=[]),
                                 cudagraph="whole")


if __name__ == "__main__":
    unittest.main()
