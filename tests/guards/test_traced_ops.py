"""Every attribute of paddle.Tensor that Paddle binds in C++ is traced, refused or harmless
(NOTE [ Traced entry points ] in guards/traced_ops.py), enumerated on the Paddle under test: a
Paddle that grows an unclassified method fails here until it is classified."""

import os
import subprocess
import sys
import textwrap
import unittest

import numpy as np
import paddle

from paddlefleet.cudagraph.errors import CaptureError
from paddlefleet.cudagraph.backends.simulated import refuse_host_sync
from paddlefleet.cudagraph.guards import traced_ops
from paddlefleet.cudagraph.guards.host_reads import OpTrace


class TracedOpsTest(unittest.TestCase):
    def setUp(self):
        traced_ops.install()

    def test_every_native_attribute_is_traced_refused_or_harmless(self):
        native = traced_ops.native_tensor_attributes()
        self.assertIn("_getitem_dygraph", native)  # x[k]'s C++ entry on both Paddles
        traced = set(traced_ops.traced_tensor_methods())
        for name in native:
            kinds = [name in traced, name in traced_ops.REFUSED, name in traced_ops.HARMLESS]
            self.assertEqual(sum(kinds), 1, f"paddle.Tensor.{name} ({native[name]}) is traced, refused, harmless: "
                             f"{kinds}; classify it in guards/traced_ops.py")
        for table in (traced_ops.REFUSED, traced_ops.HARMLESS):
            for name, reason in table.items():
                self.assertTrue(reason, name)

    def test_each_traced_attribute_is_wrapped_and_records_a_call(self):
        for name in traced_ops.traced_tensor_methods():
            value = paddle.Tensor.__dict__[name]
            self.assertTrue(isinstance(value, property) or hasattr(value, "__native__"),
                            f"paddle.Tensor.{name} is not wrapped: {value!r}")
        x = paddle.arange(6, dtype="float32").reshape([2, 3])
        with OpTrace() as trace:
            x[1]
            x.clone()
            x.detach()
        labels = [op[0] for op in trace.ops]
        self.assertEqual(labels, ["Tensor.__getitem__", "Tensor.clone", "Tensor.detach"])

    def test_refused_methods_are_refused_inside_a_capture(self):
        x = paddle.ones([1])
        for name in traced_ops.REFUSED:
            if name == "__init__":  # Paddle 2.6's C constructor is left alone (host_guard.constructor_guarded)
                if _constructor_guarded():
                    with refuse_host_sync(), self.assertRaises(CaptureError):
                        paddle.Tensor(np.ones([1], dtype="float32"))
                continue
            if getattr(paddle.Tensor, name, None) is None:
                continue
            with self.subTest(name=name), refuse_host_sync(), self.assertRaises(CaptureError):
                getattr(paddle.Tensor, name)(x) if name != "__format__" else format(x, "")

    def test_untraced_threads_and_paused_blocks_record_nothing(self):
        x = paddle.ones([2])
        with OpTrace() as trace:
            with traced_ops.paused():
                x.clone()
            y = x * 2.0
        self.assertEqual([op[0] for op in trace.ops], ["Tensor.__mul__"])
        self.assertIsNone(traced_ops.current())
        self.assertIsNotNone(y)


class InstallUnderAPatchTest(unittest.TestCase):
    def run_fresh(self, script):
        """Runs ``script`` in a fresh Python process (nothing wrapped or pinned yet); it prints ok at its end."""
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              cwd=repo, env={**os.environ, "PYTHONPATH": repo})
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertIn("ok", done.stdout)

    def test_installed_while_another_patch_is_in_force_it_goes_beneath(self):
        """A first capture while another thread's capture holds a temporary patch: the trace's wrapper
        goes beneath it, and is what the patch's restore puts back (a fresh process: installs once)."""
        script = textwrap.dedent("""
            import paddle
            from paddlefleet.cudagraph.guards.paddle_patches import Patches
            from paddlefleet.cudagraph.guards import traced_ops
            from paddlefleet.cudagraph.guards.host_reads import OpTrace
            orig = paddle._C_ops.matmul
            with Patches() as p:
                p.set(paddle._C_ops, "matmul", lambda *a, **k: orig(*a, **k))
                traced_ops.install()
            x = paddle.ones([2, 2])
            with OpTrace() as t:
                paddle._C_ops.matmul(x, x, False, False)
            assert [o[0] for o in t.ops] == ["_C_ops.matmul"], t.ops
            assert traced_ops.original(paddle._C_ops, "matmul") is orig
            print("ok")
        """)
        self.run_fresh(script)

    def test_held_wrappers_are_taken_back_by_the_last_release(self):
        """hold()/release() nest; the last release puts back what every owner held, beneath a temporary patch
        made meanwhile too; a wrapper a process-wide patch made later calls stays, and is not wrapped again;
        install() pins the wrappers for the process (a fresh process: nothing pinned yet)."""
        script = textwrap.dedent("""
            import paddle
            from paddlefleet.cudagraph.guards.paddle_patches import Patches, install_for_process
            from paddlefleet.cudagraph.guards import traced_ops
            from paddlefleet.cudagraph.guards.host_reads import OpTrace
            owners = (paddle.Tensor, paddle._C_ops, paddle, paddle.autograd.PyLayer) + paddle.Tensor.__mro__[1:-1]
            def snapshot():
                return [(o, dict(vars(o))) for o in owners]
            def changed(before):
                return sorted(n for o, own in before for n in set(own) | set(vars(o))
                              if own.get(n, None) is not vars(o).get(n, None))
            before, matmul = snapshot(), paddle._C_ops.matmul
            x = paddle.ones([2, 2])
            with traced_ops.held():
                assert paddle._C_ops.matmul is not matmul and traced_ops.installed()
                with OpTrace() as t:  # holds them too
                    paddle._C_ops.matmul(x, x, False, False)
                assert [o[0] for o in t.ops] == ["_C_ops.matmul"], t.ops
                assert paddle._C_ops.matmul is not matmul, "an inner release took them back"
            assert changed(before) == [], changed(before)
            assert not traced_ops.installed()
            patch = lambda *a, **k: matmul(*a, **k)
            with Patches() as p:
                traced_ops.hold()
                p.set(paddle._C_ops, "matmul", patch)
                traced_ops.release()
                assert paddle._C_ops.matmul is patch
            assert changed(before) == [], changed(before)
            traced_ops.hold()
            wrapped = paddle._C_ops.add
            cover = lambda *a, **k: wrapped(*a, **k)
            install_for_process(paddle._C_ops, "add", cover)
            traced_ops.release()
            assert changed(before) == ["add"], changed(before)
            with traced_ops.held():
                assert paddle._C_ops.add is cover
                with OpTrace() as t:
                    paddle._C_ops.add(x, x)
                assert [o[0] for o in t.ops] == ["_C_ops.add"], t.ops
            assert float((x + x).sum()) == 8.0
            traced_ops.install()
            with traced_ops.held():
                pass
            assert paddle._C_ops.matmul is not matmul and traced_ops.installed()
            print("ok")
        """)
        self.run_fresh(script)


    def test_a_hold_that_fails_midway_leaves_nothing_wrapped(self):
        """A wrapper that cannot be put (here the 100th) raises out of hold() with the ones put before taken
        back and no hold counted, so a later hold and release work as before."""
        self.run_fresh(textwrap.dedent("""
            import paddle
            from paddlefleet.cudagraph.guards import traced_ops
            owners = (paddle.Tensor, paddle._C_ops, paddle, paddle.autograd.PyLayer) + paddle.Tensor.__mro__[1:-1]
            before = [(o, dict(vars(o))) for o in owners]
            def changed():
                return sorted(n for o, own in before for n in set(own) | set(vars(o))
                              if own.get(n, None) is not vars(o).get(n, None))
            real, calls = traced_ops.install_beneath, [0]
            def failing(owner, name, replacement):
                calls[0] += 1
                if calls[0] == 100:
                    raise RuntimeError("cannot put")
                real(owner, name, replacement)
            traced_ops.install_beneath = failing
            try:
                traced_ops.hold()
            except RuntimeError:
                pass
            else:
                raise AssertionError("hold() did not raise")
            traced_ops.install_beneath = real
            assert changed() == [] and not traced_ops.installed(), changed()
            with traced_ops.held():
                assert traced_ops.installed()
            assert changed() == [] and not traced_ops.installed(), changed()
            print("ok")
        """))


def _constructor_guarded():
    from paddlefleet.cudagraph.guards.host_guard import constructor_guarded

    return constructor_guarded()


if __name__ == "__main__":
    unittest.main()
