"""What a new user's mistakes produce: an option typo names the nearest valid option, a Layer
class is refused with the fix, a dispatch_key_fn of the wrong shape says what it receives, a step
missing an optimizer in optimizers= says which, importing without Paddle says what to install,
stats() and explain() count eager calls alike, and the old counter name warns at the caller."""

import os
import subprocess
import sys
import unittest
import warnings

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from testkit.differential import Trainee, differential_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mm(x, w):
    return paddle.matmul(x, w)


class OptionTypoTest(unittest.TestCase):
    def test_autocudagraph_names_the_nearest_option_and_all_valid_ones(self):
        for call in (lambda: autocudagraph(mm, warmup=2), lambda: autocudagraph(warmup=2)):
            with self.assertRaises(TypeError) as ctx:
                call()
            text = str(ctx.exception)
            self.assertIn("autocudagraph: unknown option 'warmup' (did you mean 'warmup_steps'?)", text)
            self.assertIn("Valid options: warmup_steps, max_graphs, dispatch_key_fn, backend,", text)

    def test_autocudagraph_step_names_the_nearest_option(self):
        with self.assertRaises(TypeError) as ctx:
            autocudagraph_step(optimizers=[], max_graph=2, warmups=1)
        text = str(ctx.exception)
        self.assertIn("autocudagraph_step: unknown options 'max_graph' (did you mean 'max_graphs'?), "
                      "'warmups' (did you mean 'warmup_steps'?)", text)
        self.assertIn("Valid options: warmup_steps, max_graphs, dispatch_key_fn, backend, capture_hooks, "
                      "optimizers.", text)

    def test_a_name_far_from_every_option_lists_them_without_a_guess(self):
        with self.assertRaisesRegex(TypeError, r"unknown option 'zzz'\. Valid options: warmup_steps"):
            autocudagraph(mm, zzz=1)


class LayerClassTest(unittest.TestCase):
    def test_decorating_a_layer_class_is_refused_with_the_fix(self):
        with self.assertRaises(TypeError) as ctx:
            @autocudagraph
            class Net(paddle.nn.Layer):
                def forward(self, x):
                    return x
        text = str(ctx.exception)
        self.assertIn("got the Layer class Net, not an instance", text)
        self.assertIn("model = autocudagraph(Net(...))", text)
        self.assertIn("@autocudagraph above 'def forward(self, ...)'", text)
        with self.assertRaisesRegex(TypeError, "got the Layer class Linear"):
            autocudagraph(warmup_steps=1)(paddle.nn.Linear)

    def test_any_other_class_is_refused(self):
        with self.assertRaisesRegex(TypeError, "got the class Plain. Decorate a function"):
            @autocudagraph
            class Plain:
                pass


class DispatchKeyFnSignatureTest(unittest.TestCase):
    def test_a_key_fn_taking_the_call_arguments_is_refused_at_decoration(self):
        for wrap in (lambda fn: autocudagraph(mm, dispatch_key_fn=fn),
                     lambda fn: autocudagraph_step(optimizers=[], dispatch_key_fn=fn)):
            with self.assertRaises(TypeError) as ctx:
                wrap(lambda x, w: x.shape[0])
            text = str(ctx.exception)
            self.assertIn("dispatch_key_fn <lambda>(x, w) cannot be called with one argument", text)
            self.assertIn("receives ONE argument, the call's inspect.BoundArguments", text)
        with self.assertRaisesRegex(TypeError, r"key\(\) cannot be called with one argument"):
            def key():
                return 1
            autocudagraph(mm, dispatch_key_fn=key)

    def test_one_argument_forms_are_accepted(self):
        for fn in (lambda bound: 1, lambda *a: 1, lambda bound, extra=0: 1, len):
            autocudagraph(mm, dispatch_key_fn=fn)

    def test_a_signature_unknown_at_decoration_fails_at_the_first_call_with_the_same_hint(self):
        class NoSignature:
            __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature")))

            def __call__(self, a, b):
                return 1
        g = autocudagraph(mm, dispatch_key_fn=NoSignature(), backend="simulate")
        with self.assertRaisesRegex(TypeError, "calling dispatch_key_fn .* failed: .*receives ONE argument"):
            g(paddle.ones([2, 2]), paddle.ones([2, 2]))

    def test_an_error_inside_the_key_fn_is_its_own(self):
        def key(bound):
            return len(3)
        g = autocudagraph(mm, dispatch_key_fn=key, backend="simulate")
        with self.assertRaisesRegex(TypeError, "object of type 'int' has no len"):
            g(paddle.ones([2, 2]), paddle.ones([2, 2]))


def _two_optimizers():
    paddle.seed(3)
    m1, m2 = paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 4)
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1)
    opt1 = paddle.optimizer.SGD(learning_rate=0.1, parameters=m1.parameters())
    opt2 = paddle.optimizer.AdamW(learning_rate=sched, parameters=m2.parameters())

    def step(x):
        loss = (m2(m1(x)) ** 2).mean()
        loss.backward()
        opt1.step()
        opt2.step()
        opt1.clear_grad()
        opt2.clear_grad()
        return loss
    return Trainee(step, {"m1": m1, "m2": m2, "opt1": opt1, "opt2": opt2, "sched": sched})


class MissingOptimizerTest(unittest.TestCase):
    def test_a_step_stepping_an_unlisted_optimizer_names_it_and_stays_eager_exact(self):
        batches = [paddle.to_tensor(np.random.RandomState(i).randn(2, 4).astype("float32")) for i in range(5)]
        wrapped = {}

        def graph(t):
            wrapped["step"] = autocudagraph_step(t.step, optimizers=[t.objects["opt1"]], backend="simulate")
            return wrapped["step"]

        def after_step(i, eager, graphed):  # the scheduler steps outside the step, as in eager code
            eager.objects["sched"].step()
            graphed.objects["sched"].step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            differential_run(_two_optimizers, batches, graph, after_step=after_step)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.assertEqual(len(messages), 1, messages)
        self.assertTrue(messages[0].startswith("autocudagraph_step(step): capture of key"), messages[0])
        self.assertIn("the step steps opt2 (AdamW over 2 parameter(s)", messages[0])
        self.assertIn("optimizers=[opt1, opt2]", messages[0])
        self.assertNotIn("paddlefleet", caught[0].filename)  # the warning points at the caller's line
        self.assertTrue(wrapped["step"].explain().startswith("autocudagraph_step(step)"))


class ImportWithoutPaddleTest(unittest.TestCase):
    def test_the_import_error_names_the_packages_to_install(self):
        code = "import sys; sys.modules['paddle'] = None; import paddlefleet.cudagraph"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("ImportError: Paddle is not installed: paddlefleet.cudagraph needs PaddlePaddle", proc.stderr)
        self.assertIn("'pip install paddlepaddle' on a CPU; on a GPU a Paddle 3.x GPU build", proc.stderr)
        self.assertIn("Install on a GPU", proc.stderr)


class EagerCallCountsTest(unittest.TestCase):
    def test_stats_and_explain_count_eager_calls_alike(self):
        g = autocudagraph(mm, backend="simulate", warmup_steps=2,
                          dispatch_key_fn=lambda b: None if b.arguments["x"].shape[0] == 3 else 1)
        w = paddle.ones([2, 2])
        for rows in (2, 2, 3, 2, 3, 2):
            g(paddle.ones([rows, 2]), w)
        stats, text = g.stats(), g.explain()
        self.assertEqual((stats["warmup_calls"], stats["eager_calls"]), (2, 2))
        self.assertIn(f"{stats['eager_calls']} ran eagerly, {stats['warmup_calls']} warmed up, 1 capture", text)
        self.assertIn("; eager because dispatch_key_fn returned None", text)


class DeprecatedCounterNameTest(unittest.TestCase):
    def test_the_warning_points_at_the_callers_line(self):
        g = autocudagraph(mm, backend="simulate")
        g(paddle.ones([2, 2]), paddle.ones([2, 2]))
        stats = g.stats()
        reads = (lambda: stats["fallbacks"], lambda: stats.get("fallbacks"), lambda: g.counters.fallbacks)
        for read in reads:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                read()
            self.assertEqual([w.filename for w in caught], [__file__], [str(w.message) for w in caught])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with g.counters.expect(fallbacks=0):
                pass
        self.assertEqual([w.filename for w in caught], [__file__])

    def test_the_projects_own_code_never_uses_the_old_name(self):
        users = []
        for top in ("tests", "tools", "testkit", "paddlefleet"):
            for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if not name.endswith(".py") or path == __file__:
                        continue
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    if "fallbacks=" in text or "['fallbacks']" in text or '["fallbacks"]' in text:
                        users.append(os.path.relpath(path, ROOT))
        # tests/core/test_foundation.py pins the deprecated name on purpose (under assertWarns).
        self.assertEqual(users, ["tests/core/test_foundation.py"])


if __name__ == "__main__":
    unittest.main()
