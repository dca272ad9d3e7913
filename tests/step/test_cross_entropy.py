"""``F.cross_entropy`` / ``paddle.nn.CrossEntropyLoss`` with integer labels graphed on every Paddle:
in blocks and in the whole step, replays bitwise equal to eager, also when batches hold another
count of ignored labels than the capture did (NOTE [ Cross entropy decides on the host ] in
core/cross_entropy.py).

Each graphed result is compared bit for bit with an eager run, and the phases are pinned with the
counters, so that no test can pass by running eagerly.
"""

import unittest

import numpy as np
import paddle
import paddle.nn.functional as F

from paddlefleet.cudagraph import CaptureError, autocudagraph, autocudagraph_step
from paddlefleet.cudagraph.backends.simulated import refuse_host_sync
from paddlefleet.cudagraph.core import cross_entropy

from testkit.differential import Trainee, differential_run
from testkit.harness import BackendCase, backend_variants, clone_leaf
from tests.grads.test_training import gpu_amp_state

CLASSES = 7
N = 48  # from about 24 samples on, mean_all is not sum / n bit for bit (Paddle 2.6.2, CPU)
# Labels per call: the first two calls are the warmup and the capture; the replays hold other
# counts of ignored labels (none, some, all but one, all, none again).
IGNORED = ([1, 3], [], [0, 2, 5, 40], [], list(range(N - 1)), list(range(N)), [4], [])


def _labels(n, seed, ignored, shape=None):
    labels = np.random.RandomState(seed).randint(0, CLASSES, n).astype("int64")
    labels[ignored] = -100
    return paddle.to_tensor(labels.reshape(shape or [n]))


def _logits(shape, seed):
    return paddle.to_tensor(np.random.RandomState(100 + seed).randn(*shape).astype("float32") * 2)


class CrossEntropyBlockTest(BackendCase):
    """A graphed loss function against eager F.cross_entropy, one case per option set."""

    def _check_loss(self, logits_shape, label_shape=None, **options):
        weight = options.pop("weight", None)

        def loss_fn(logits, labels):
            return F.cross_entropy(logits, labels, weight=weight, **options)

        graphed = self.graphed(loss_fn, warmup_steps=1)
        n = int(np.prod(logits_shape[:-1]))
        for i, ignored in enumerate(IGNORED):
            logits, labels = _logits(logits_shape, i), _labels(n, i, ignored, label_shape)
            x_g, x_e = clone_leaf(logits, False), clone_leaf(logits, False)
            out_g, out_e = graphed(x_g, labels), loss_fn(x_e, labels)
            cotangent = paddle.to_tensor(np.asarray(np.random.RandomState(i).randn(*out_e.shape), dtype="float32"))
            (out_g * cotangent).sum().backward()
            (out_e * cotangent).sum().backward()
            self.assertBitwise(out_g, out_e, f"loss {i}")
            self.assertBitwise(x_g.grad, x_e.grad, f"logits grad {i}")
        self.assertCounters(graphed, captures=1, replays=len(IGNORED) - 2, eager=0)

    def test_mean_default_ignore_index(self):
        self._check_loss([N, CLASSES])

    def test_mean_labels_shaped_n_1(self):
        self._check_loss([N, CLASSES], label_shape=[N, 1])

    def test_mean_with_a_class_weight(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))
        self._check_loss([N, CLASSES], weight=weight)

    def test_mean_with_a_class_weight_labels_shaped_n_1(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))
        self._check_loss([N, CLASSES], label_shape=[N, 1], weight=weight)

    def test_mean_language_model_logits(self):
        self._check_loss([4, 12, CLASSES], label_shape=[4, 12])

    def test_mean_language_model_logits_with_a_class_weight(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))
        self._check_loss([4, 12, CLASSES], label_shape=[4, 12], weight=weight)

    def test_mean_with_an_explicit_ignore_index_and_axis(self):
        self._check_loss([N, CLASSES], ignore_index=-100, axis=-1, use_softmax=True)

    def test_sum(self):
        self._check_loss([N, CLASSES], reduction="sum")

    def test_sum_with_a_class_weight(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))
        self._check_loss([4, 12, CLASSES], label_shape=[4, 12], reduction="sum", weight=weight)

    def test_none(self):
        self._check_loss([N, CLASSES], reduction="none")

    def test_none_language_model_logits_labels_shaped_n_1(self):
        self._check_loss([4, 12, CLASSES], label_shape=[4, 12, 1], reduction="none")

    def test_verified_replays_find_eager_equal(self):
        graphed = self.graphed(lambda x, y: F.cross_entropy(x, y), warmup_steps=1, verify_replays=3)
        for i, ignored in enumerate(IGNORED):
            x = clone_leaf(_logits([N, CLASSES], i), False)
            graphed(x, _labels(N, i, ignored)).backward()
        self.assertCounters(graphed, captures=1, verified_replays=3, verify_mismatches=0, eager=0)

    def test_cross_entropy_loss_layer_in_a_graphed_layer(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))

        class Classifier(paddle.nn.Layer):
            def __init__(self, class_weight):
                super().__init__()
                self.fc = paddle.nn.Linear(5, CLASSES)
                self.loss = paddle.nn.CrossEntropyLoss(weight=class_weight)

            def forward(self, x, labels):
                return self.loss(self.fc(x), labels)

        for class_weight in (None, weight):
            paddle.seed(3)
            eager = Classifier(class_weight)
            graphed_layer = Classifier(class_weight)
            graphed_layer.set_state_dict(eager.state_dict())
            graphed = self.graphed(graphed_layer, warmup_steps=1)
            for i, ignored in enumerate(IGNORED):
                x, labels = _logits([N, 5], i), _labels(N, i, ignored)
                out_g, out_e = graphed(x, labels), eager(x, labels)
                out_g.backward()
                out_e.backward()
                self.assertBitwise(out_g, out_e, f"loss {i}")
                for (name, p_g), p_e in zip(graphed_layer.named_parameters(), eager.parameters()):
                    self.assertBitwise(p_g.grad, p_e.grad, f"{name}.grad {i}")
            self.assertCounters(graphed.forward, captures=1, replays=len(IGNORED) - 2, eager=0)


globals().update(backend_variants(CrossEntropyBlockTest))


# ----------------------------------------------------------------------------- whole step
def _lm(seed):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Embedding(CLASSES, 8), paddle.nn.Linear(8, 8), paddle.nn.Tanh(),
                                paddle.nn.Linear(8, CLASSES))


def _lm_batches(n, batch=4, seq=12):
    batches = []
    for i in range(n):
        rs = np.random.RandomState(i)
        tokens = rs.randint(0, CLASSES, (batch, seq + 1)).astype("int64")
        labels = tokens[:, 1:].copy()
        labels[rs.rand(batch, seq) < [0.0, 0.3, 0.0, 0.6, 0.1, 0.0, 0.45][i % 7]] = -100  # padding, varying
        batches.append((paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(labels)))
    return batches


class CrossEntropyStepTest(BackendCase):
    def _differential(self, build, batches, warmup_steps=2):
        wrappers = []

        def graph(trainee):
            wrappers.append(autocudagraph_step(trainee.step, optimizers=[trainee.objects["opt"]],
                                               warmup_steps=warmup_steps, backend=self.backend))
            return wrappers[0]

        differential_run(build, batches, graph=graph)
        self.assertCounters(wrappers[0], captures=1, replays=len(batches) - warmup_steps - 1, eager=0)

    def test_language_model_step_with_adamw(self):
        def build():
            model = _lm(11)
            opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), weight_decay=0.01)

            def step(tokens, labels):
                loss = F.cross_entropy(model(tokens), labels)
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss
            return Trainee(step, {"model": model, "opt": opt})

        self._differential(build, _lm_batches(7))

    def test_classification_step_with_cross_entropy_loss_and_a_class_weight(self):
        weight = paddle.to_tensor(np.linspace(0.5, 2.0, CLASSES).astype("float32"))

        def build():
            paddle.seed(5)
            model = paddle.nn.Sequential(paddle.nn.Linear(6, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, CLASSES))
            loss_fn = paddle.nn.CrossEntropyLoss(weight=weight)
            opt = paddle.optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=model.parameters())

            def step(x, labels):
                loss = loss_fn(model(x), labels)
                loss.backward()
                opt.step()
                opt.clear_grad()
                return loss
            return Trainee(step, {"model": model, "opt": opt})

        batches = [(_logits([N, 6], i), _labels(N, i, ignored, [N, 1])) for i, ignored in enumerate(IGNORED)]
        self._differential(build, batches)


globals().update(backend_variants(CrossEntropyStepTest))


# ----------------------------------------------------------------------------- the replacement itself
class CrossEntropyPatchTest(unittest.TestCase):
    def assertBitwise(self, a, b):
        self.assertEqual(a.numpy().tobytes(), b.numpy().tobytes())

    def test_capture_is_no_longer_refused_where_paddle_reads_the_host(self):
        if not cross_entropy.needed():
            self.skipTest("this Paddle's cross_entropy reads no host value (it decides on ignore_index, a Python int)")
        logits, labels = _logits([4, CLASSES], 0), _labels(4, 0, [1])
        with self.assertRaisesRegex(CaptureError, "__bool__"), refuse_host_sync():
            F.cross_entropy(logits, labels)  # Paddle's own function reads the host
        with cross_entropy.device_decisions(), refuse_host_sync():
            loss = F.cross_entropy(logits, labels)
        self.assertBitwise(loss, F.cross_entropy(logits, labels))

        graphed = autocudagraph(lambda x, y: F.cross_entropy(x, y), warmup_steps=1, backend="simulate")
        for i in range(3):
            graphed(logits, labels)
        stats = graphed.stats()
        self.assertEqual((stats["captures"], stats["replays"], stats["eager_calls"]), (1, 1, 0), graphed.explain())

    def test_paddles_function_is_back_after_a_capture_that_fails(self):
        original = F.cross_entropy

        def fails(x, y):
            loss = F.cross_entropy(x, y)
            float(loss)  # a host read: the capture fails
            return loss

        graphed = autocudagraph(fails, warmup_steps=1, backend="simulate")
        logits, labels = _logits([4, CLASSES], 0), _labels(4, 0, [])
        for _ in range(3):
            graphed(logits, labels)
        self.assertEqual(graphed.stats()["captures"], 0)
        self.assertIs(F.cross_entropy, original)
        self.assertIs(paddle.nn.functional.loss.cross_entropy, original)

    def test_nested_scopes_restore_once_at_the_outermost(self):
        original = F.cross_entropy
        with cross_entropy.device_decisions():
            inner = F.cross_entropy
            with cross_entropy.device_decisions():
                self.assertIs(F.cross_entropy, inner)
            self.assertIs(F.cross_entropy, inner)
        self.assertIs(F.cross_entropy, original)
        self.assertEqual(inner is not original, cross_entropy.needed())

    def test_calls_it_cannot_decide_on_the_device_go_to_paddle(self):
        logits, labels = _logits([4, CLASSES], 1), _labels(4, 1, [2])
        soft = F.softmax(_logits([4, CLASSES], 2))
        smoothed = _labels(4, 1, [])
        with cross_entropy.device_decisions():
            got = [F.cross_entropy(logits, labels, reduction="sum"),
                   F.cross_entropy(logits, soft, soft_label=True, reduction="none"),
                   F.cross_entropy(logits, smoothed, label_smoothing=0.1)]
        want = [F.cross_entropy(logits, labels, reduction="sum"),
                F.cross_entropy(logits, soft, soft_label=True, reduction="none"),
                F.cross_entropy(logits, smoothed, label_smoothing=0.1)]
        for g, w in zip(got, want):
            self.assertBitwise(g, w)

    def test_under_amp_the_mean_is_left_to_paddle(self):
        # Which dtype Paddle's loss has under AMP is the GPU's business: the call is not replaced
        # (where Paddle reads the host, its capture stays refused and the key runs eagerly).
        if not cross_entropy.needed():
            self.skipTest("this Paddle's cross_entropy reads no host value")
        logits, labels = _logits([4, CLASSES], 0), _labels(4, 0, [1])
        with gpu_amp_state("O1", "float16"), cross_entropy.device_decisions(), refuse_host_sync():
            with self.assertRaisesRegex(CaptureError, "__bool__"):
                F.cross_entropy(logits, labels)

    def test_the_branch_eager_did_not_take_hands_back_a_negative_zero_grad(self):
        # where() gives the untaken branch +0.0, and +0.0 + -0.0 is +0.0: without the hooks a -0.0
        # grad of the taken branch would come out +0.0.
        scale = paddle.to_tensor(-0.0)
        for flag in (False, True):
            x = paddle.to_tensor([1.0, 2.0, 3.0], stop_gradient=False)
            cond = paddle.any(paddle.to_tensor([False, flag]))
            (got,) = paddle.grad([cross_entropy._selected(cond, x.sum(), x.mean()) * scale], [x])
            x = paddle.to_tensor([1.0, 2.0, 3.0], stop_gradient=False)
            (want,) = paddle.grad([(x.sum() if flag else x.mean()) * scale], [x])
            self.assertBitwise(got, want)


if __name__ == "__main__":
    unittest.main()
