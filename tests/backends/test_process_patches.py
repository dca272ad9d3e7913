"""NOTE [ Paddle patches ] (guards/paddle_patches.py): importing paddlefleet.cudagraph replaces
nothing of Paddle; the first wrapper installs the process-wide patches, and only those; the patches
only chains need are installed by the first wrapper with chain_calls=True."""

import json
import os
import subprocess
import sys
import textwrap
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The attributes the first wrapper replaces for the rest of the process (docs/design/architecture.md,
# "Paddle patches", the rows in force "from the first wrapper").
PROCESS_PATCHES = sorted([
    "Tensor._register_grad_hook", "Tensor._remove_grad_hook",
    "core.eager.register_saved_tensors_hooks", "core.eager.reset_saved_tensors_hooks", "core.eager.run_partial_grad",
    "Layer.__setattr__", "Layer.__delattr__", "Layer.register_forward_pre_hook", "Layer.register_forward_post_hook",
    "HookRemoveHelper.remove", "LayerHelperBase.set_default_dtype",
])
# What the first wrapper with chain_calls=True adds (NOTE [ Hooks on a chain's outputs ] in chains/outputs.py).
CHAIN_PATCHES = ["Tensor.retain_grads"]

SCRIPT = textwrap.dedent(
    """
    import inspect, json, sys
    import paddle
    from paddle.base import core
    import paddle.nn.functional as F

    # Every class and module the package patches at some point (NOTE [ Paddle patches ]).
    OWNERS = {
        "Tensor": paddle.Tensor, "core.eager": core.eager, "PyLayer": paddle.autograd.PyLayer,
        "paddle": paddle, "paddle.autograd": paddle.autograd, "Layer": paddle.nn.Layer, "F": F,
        "F.loss": getattr(F, "loss", F), "_C_ops": paddle._C_ops, "Optimizer": paddle.optimizer.Optimizer,
        "GradScaler": paddle.amp.GradScaler, "paddle.device": paddle.device, "paddle.device.cuda": paddle.device.cuda,
        "HookRemoveHelper": paddle.nn.layer.layers.HookRemoveHelper,
        "LayerHelperBase": paddle.base.layer_helper_base.LayerHelperBase,
    }

    def snapshot():
        return {f"{owner}.{name}": value for owner, obj in OWNERS.items() for name, value in list(vars(obj).items())}

    def changed(before, after):
        keys = set(before) | set(after)
        return sorted(k for k in keys if k not in before or k not in after or before[k] is not after[k])

    before = snapshot()
    def resolve(name):
        owner, _, attr = name.rpartition(".")
        return inspect.getattr_static(OWNERS[owner], attr)

    named = {name: resolve(name) for name in ("Tensor.copy_", "Tensor.set_value", "Tensor.retain_grads",
                                              "Tensor._register_grad_hook", "Tensor._remove_grad_hook",
                                              "PyLayer.apply", "core.eager.run_partial_grad")}
    import paddlefleet.cudagraph as cg
    from paddlefleet.cudagraph.guards import paddle_patches
    after_import = snapshot()
    report = {
        "import": changed(before, after_import),
        "named_after_import": sorted(n for n, v in named.items() if resolve(n) is not v),
        "installed_after_import": paddle_patches.process_patches_installed(),
    }
    how = sys.argv[1]
    if how == "function":
        cg.autocudagraph(lambda x: x * 2, backend="simulate")
    elif how == "unchained":
        cg.autocudagraph(lambda x: x * 2, backend="simulate", chain_calls=False)
    elif how == "step":
        cg.autocudagraph_step(lambda x: x * 2, optimizers=[], backend="simulate")
    elif how == "method":
        class Net(paddle.nn.Layer):
            @cg.autocudagraph(backend="simulate")
            def forward(self, x):
                return x * 2
    report["wrapper"] = changed(after_import, snapshot())
    report["installed_after_wrapper"] = paddle_patches.process_patches_installed()
    cg.autocudagraph(lambda x: x + 1, backend="simulate")
    report["second_wrapper"] = changed(after_import, snapshot())
    print(json.dumps(report))
    """
)


# NOTE [ Traced entry points ] (guards/traced_ops.py): a whole step traces its warmup and capture runs; on a
# backend whose replays run no Python the wrappers are taken back after each, on the simulated backend they stay.
# "recording" stands in for such a backend on the CPU: the simulated backend's capture records without executing
# and its replay does nothing (the static outputs keep what the capture wrote), as tools/cpu_host_time.py's
# stand-in graph.
STEP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import paddle
    import paddlefleet.cudagraph as cg
    from paddlefleet.cudagraph.backends import simulated
    from paddlefleet.cudagraph.guards import traced_ops

    if sys.argv[1] == "recording":
        class Recorded(simulated._SimulatedGraph):
            def replay(self):
                pass

        simulated.SimulatedBackend.new_graph = lambda self, pool: Recorded()
        simulated.SimulatedBackend.capture_executes = False
    OWNERS = {"Tensor": paddle.Tensor, "_C_ops": paddle._C_ops, "PyLayer": paddle.autograd.PyLayer, "paddle": paddle}
    OWNERS.update({f"Tensor base {k}": c for k, c in enumerate(paddle.Tensor.__mro__[1:-1])})

    def snapshot():
        return {f"{owner}.{name}": value for owner, obj in OWNERS.items() for name, value in list(vars(obj).items())}

    paddle.seed(0)
    model = paddle.nn.Linear(4, 4)

    def step(x, dy):
        y = model(x)
        y.backward(dy)
        for p in model.parameters():
            p.clear_gradient(False)
        return y

    graphed = cg.autocudagraph_step(step, optimizers=[], warmup_steps=2, backend="simulate")
    x, dy = paddle.to_tensor(np.ones([2, 4], "float32")), paddle.to_tensor(np.ones([2, 4], "float32"))
    before = snapshot()
    for _ in range(6):
        graphed(x, dy)
    after = snapshot()
    changed = sorted(k for k in set(before) | set(after) if k not in before or k not in after or before[k] is not after[k])
    stats = graphed.stats()
    print(json.dumps({"changed": changed, "captures": stats["captures"], "replays": stats["replays"],
                      "installed": traced_ops.installed()}))
    """
)


class ProcessPatchesTest(unittest.TestCase):
    def run_script(self, how, script=SCRIPT):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PADDLEFLEET_CUDAGRAPH_BACKEND", None)
        out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, env=env,
                             timeout=300, cwd=ROOT)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def check(self, how, chains=True):
        report = self.run_script(how)
        self.assertEqual(report["import"], [], "importing the package replaced these Paddle attributes")
        self.assertEqual(report["named_after_import"], [])
        self.assertFalse(report["installed_after_import"])
        first = sorted(PROCESS_PATCHES + (CHAIN_PATCHES if chains else []))
        self.assertEqual(report["wrapper"], first, "the first wrapper installs exactly these")
        self.assertTrue(report["installed_after_wrapper"])
        # The second wrapper is a function's, with chain_calls=True: the chains' patches come with it.
        self.assertEqual(report["second_wrapper"], sorted(PROCESS_PATCHES + CHAIN_PATCHES),
                         "a second wrapper installs nothing again but the chains' patches a first chaining wrapper needs")

    def test_import_replaces_nothing_and_the_first_function_wrapper_installs_the_patches(self):
        self.check("function")

    def test_the_first_step_wrapper_installs_them_but_the_chains(self):
        self.check("step", chains=False)

    def test_a_wrapper_with_chain_calls_false_installs_them_but_the_chains(self):
        self.check("unchained", chains=False)

    def test_a_graphed_method_installs_them_when_its_class_is_defined(self):
        self.check("method")

    def test_a_whole_step_on_a_recording_backend_leaves_paddles_ops_unwrapped(self):
        """Its warmup and capture runs were traced (the capture is checked against the last warmup), yet every
        op of the process runs Paddle's own function afterwards: a wrapper left would add about 1 us to each."""
        report = self.run_script("recording", STEP_SCRIPT)
        self.assertEqual((report["captures"], report["replays"]), (1, 3))
        self.assertEqual(report["changed"], [], "a whole step on a recording backend left these wrapped")
        self.assertFalse(report["installed"])

    def test_a_whole_step_on_the_simulated_backend_keeps_the_trace_wrappers(self):
        """Its replays re-run the step under a trace: the wrappers stay for the process."""
        report = self.run_script("simulate", STEP_SCRIPT)
        self.assertEqual((report["captures"], report["replays"]), (1, 3))
        self.assertIn("_C_ops.matmul", report["changed"])
        self.assertIn("Tensor.backward", report["changed"])
        self.assertTrue(report["installed"])


if __name__ == "__main__":
    unittest.main()
