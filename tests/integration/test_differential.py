"""The differential checker itself: it passes identical twins, names the first difference of
twins that diverge (a parameter, an optimizer moment, the LR, a grad that is None on one side),
and drives a graphed whole step against eager."""

import unittest

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step
from testkit.differential import StateMismatch, Trainee, assert_same_state, differential_run, state_of


def _build(lr=0.1):
    def build():
        paddle.seed(7)
        model = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 2))
        sched = paddle.optimizer.lr.CosineAnnealingDecay(lr, T_max=5)
        opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            return loss
        return Trainee(step, {"model": model, "opt": opt, "sched": sched})
    return build


BATCHES = [paddle.to_tensor(np.random.RandomState(i).randn(4, 6).astype("float32")) for i in range(6)]


class DifferentialCheckerTest(unittest.TestCase):
    def test_identical_eager_twins_pass_and_state_covers_every_kind(self):
        eager, _ = differential_run(_build(), BATCHES[:3], graph=lambda t: t.step)
        paths = list(state_of(eager.objects))
        for part in ("model.param[0", ".grad", "opt.moment1[param 0]", "opt.beta1_pow_acc[param 3]",
                     "opt.lr", "opt.scheduler", "sched.state_dict", "model.training"):
            self.assertTrue(any(part in p for p in paths), (part, paths[:8]))

    def test_a_different_learning_rate_is_named(self):
        a, b = _build(lr=0.1)(), _build(lr=0.2)()
        with self.assertRaisesRegex(StateMismatch, r"opt\.lr|scheduler"):
            assert_same_state(state_of(b.objects), state_of(a.objects))

    def test_a_parameter_that_drifts_after_a_step_is_named_with_the_step(self):
        def graph(t):
            calls = []

            def step(x):
                out = t.step(x)
                i = len(calls)
                calls.append(i)
                if i == 2:
                    w = t.objects["model"][2].weight
                    w.set_value(w.numpy() + np.float32(1e-7) * np.sign(w.numpy()))
                return out
            return step
        with self.assertRaisesRegex(StateMismatch, r"after step 2: model\.param\[2 "):
            differential_run(_build(), BATCHES[:4], graph=graph)

    def test_a_grad_that_is_none_on_one_side_only_is_a_difference(self):
        a, b = _build()(), _build()()
        for t in (a, b):
            t.step(BATCHES[0])
        w = b.objects["model"][0].weight
        (w * 1.0).sum().backward()  # a grad where the eager twin has None
        with self.assertRaisesRegex(StateMismatch, r"\.grad"):
            assert_same_state(state_of(b.objects), state_of(a.objects))

    def test_a_graphed_whole_step_matches_eager_state_after_every_step(self):
        graphed_steps = []

        def graph(t):
            graphed_steps.append(autocudagraph_step(t.step, optimizers=[t.objects["opt"]], warmup_steps=1,
                                                    backend="simulate"))
            return graphed_steps[0]

        def after(i, eager, graphed):
            eager.objects["sched"].step()
            graphed.objects["sched"].step()
        differential_run(_build(), BATCHES[:5], graph=graph, after_step=after)
        self.assertEqual(graphed_steps[0].stats()["replays"], 2, graphed_steps[0].explain())  # 2 warmups, capture, 2 replays



if __name__ == "__main__":
    unittest.main()
