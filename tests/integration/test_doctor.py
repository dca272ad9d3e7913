"""``python -m paddlefleet.cudagraph doctor`` on this machine (a CPU): it says so, names the
backend autocudagraph picks and why, and never crashes."""

import io
import os
import subprocess
import sys
import unittest
from unittest import mock

import paddle

from paddlefleet.cudagraph import doctor
from paddlefleet.cudagraph.backends import ENV_BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(env=None):
    out = io.StringIO()
    with mock.patch.dict(os.environ, env or {}, clear=False):
        if env is None:
            os.environ.pop(ENV_BACKEND, None)
        rc = doctor.run_doctor(out=out)
    return rc, out.getvalue()


@unittest.skipIf(paddle.is_compiled_with_cuda(), "checks the CPU report; a CUDA build reports its GPU instead")
class TestDoctorOnCPU(unittest.TestCase):
    def test_reports_version_build_and_the_eager_choice(self):
        rc, text = run()
        self.assertEqual(rc, 0, text)
        self.assertIn(f"paddle: {paddle.__version__}", text)
        self.assertIn("build: CPU build (no CUDA)", text)
        self.assertIn("this is a CPU build of Paddle", text)
        self.assertIn("Install on a GPU", text)
        self.assertIn("backend: eager for CPU tensors", text)
        self.assertIn("unless you pass backend='simulate'", text)
        self.assertIn("verdict: nothing wrong found", text)

    def test_names_the_environment_override(self):
        rc, text = run({ENV_BACKEND: "simulate"})
        self.assertEqual(rc, 0, text)
        self.assertIn(f"backend: simulate for CPU tensors ({ENV_BACKEND}=simulate overrides every wrapper)", text)

    def test_a_bad_override_is_a_failed_check_not_a_crash(self):
        rc, text = run({ENV_BACKEND: "bogus"})
        self.assertEqual(rc, 1, text)
        self.assertIn("backend: FAIL CudaGraphError", text)
        self.assertIn("'bogus' is not a backend", text)

    def test_a_check_that_raises_is_reported(self):
        with mock.patch.object(doctor, "pool_sharing_supported", side_effect=RuntimeError("boom")):
            rc, text = run()
        self.assertIn("pool sharing: RuntimeError: boom", text)
        self.assertIn("verdict:", text)

    def test_module_command(self):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop(ENV_BACKEND, None)
        proc = subprocess.run([sys.executable, "-m", "paddlefleet.cudagraph", "doctor"], capture_output=True,
                              text=True, timeout=120, env=env, cwd=ROOT)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("build: CPU build (no CUDA)", proc.stdout)


class TestDoctorWithKernelsThatFail(unittest.TestCase):
    def test_a_gpu_whose_kernels_fail_is_a_failed_check_with_the_install_hint(self):
        with mock.patch.object(doctor, "_build", return_value=(True, "CUDA build (CUDA 12.0, cuDNN 8.9)")), \
                mock.patch.object(doctor, "_gpu", return_value=(1, "NVIDIA H100, compute capability 9.0 (sm_90)")), \
                mock.patch.object(doctor, "_kernels_run", side_effect=OSError("(External) CUDA error(209), no "
                                                                              "kernel image is available")), \
                mock.patch.object(doctor, "cuda_available", return_value=True), \
                mock.patch.object(doctor, "_backend_choice", return_value="cuda for GPU tensors"):
            rc, text = run()
        self.assertEqual(rc, 1, text)
        self.assertIn("Paddle kernels: FAIL do NOT run on this GPU: OSError: (External) CUDA error(209)", text)
        self.assertIn("Hopper sm_90 and newer need one", text)


class TestDoctorPoolSharing(unittest.TestCase):
    """Which pool sharing applies (NOTE [ Sharing a pool safely ] in backends/shared_pool.py)."""

    def gpu_report(self, shared):
        with mock.patch.object(doctor, "_build", return_value=(True, "CUDA build (CUDA 12.0, cuDNN 8.9)")), \
                mock.patch.object(doctor, "_gpu", return_value=(1, "NVIDIA H100, compute capability 9.0 (sm_90)")), \
                mock.patch.object(doctor, "_kernels_run", return_value=None), \
                mock.patch.object(doctor, "cuda_available", return_value=True), \
                mock.patch.object(doctor, "pool_sharing_supported", return_value=shared), \
                mock.patch.object(doctor, "_backend_choice", return_value="cuda for GPU tensors"):
            return run()[1]

    def test_shared_pools_are_named_with_when_they_apply(self):
        text = self.gpu_report(True)
        self.assertIn("pool sharing: yes: the forward graphs of keys (a model graphed layer by layer) share one "
                      "memory pool per GPU, checked before every forward replay", text)
        self.assertIn("a key's forward and backward graphs share one pool where its backward hands out copies "
                      "(clone_param_grads=True, or accumulate_in_graph=True)", text)
        self.assertIn("backward graphs, further slots (max_inflight) and keys with clone_outputs=False keep their own",
                      text)

    def test_private_pools_on_paddle_without_pool_ids(self):
        self.assertIn("pool sharing: no: each graph gets its own memory pool (Paddle < 3.1", self.gpu_report(False))

    def test_how_grad_stacks_are_held_is_said(self):
        # NOTE [ Stacking grads as they arrive ], NOTE [ Stacks after paddle.grad only for copied grads ]
        # in grads/stacks.py
        said = {True: "grad stacks: each same-shape parameter grad is copied into its stack as the backward makes it",
                False: "grad stacks: no node post hooks in this Paddle: grads handed out as aliases (the default) "
                       "go one by one"}
        for arrive, words in said.items():
            with mock.patch.object(doctor, "stacks_as_grads_arrive", return_value=arrive):
                self.assertIn(words, run()[1])


class CompiledReadsRowTest(unittest.TestCase):
    """The doctor says whether the per-call tensor reads are compiled, and why not (NOTE [ Compiled tensor reads ] in
    native/__init__.py)."""

    def test_in_use_or_why_not(self):
        from paddlefleet.cudagraph import native

        for active, why, words in [(True, None, "compiled reads: in use: each call's key and parameter checks read "
                                                "tensors in C++"),
                                   (False, "no C++ compiler found (set CXX, or install g++)",
                                    "compiled reads: not in use (no C++ compiler found (set CXX, or install g++)): "
                                    "the same reads run in Python")]:
            with mock.patch.object(native, "status", return_value=(active, why)):
                self.assertIn(words, run()[1])


if __name__ == "__main__":
    unittest.main()


class DoctorWithoutPaddleTest(unittest.TestCase):
    """``python -m paddlefleet.cudagraph doctor`` where Paddle is not installed says so and how to install it, with
    no traceback (a sitecustomize on PYTHONPATH hides paddle from the child before anything imports)."""

    def run_without_paddle(self, *argv):
        import tempfile

        with tempfile.TemporaryDirectory() as hide:
            with open(os.path.join(hide, "sitecustomize.py"), "w") as fh:
                fh.write("import sys\nsys.modules['paddle'] = None  # import paddle: ModuleNotFoundError\n")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([hide, ROOT]))
            return subprocess.run([sys.executable, "-m", "paddlefleet.cudagraph", *argv], capture_output=True,
                                  text=True, timeout=120, cwd=ROOT, env=env)

    def test_doctor_says_paddle_is_not_installed_and_how_to_install_it(self):
        proc = self.run_without_paddle("doctor")
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertTrue(proc.stderr.startswith("Paddle is not installed: paddlefleet.cudagraph needs PaddlePaddle."),
                        proc.stderr)
        self.assertIn("'pip install paddlepaddle' on a CPU", proc.stderr)
        self.assertIn("a Paddle 3.x GPU build for your CUDA version", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertEqual(proc.stdout, "")

    def test_the_demo_says_the_same(self):
        proc = self.run_without_paddle("demo")
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertTrue(proc.stderr.startswith("Paddle is not installed"), proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
