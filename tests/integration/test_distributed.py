"""autocudagraph inside Paddle's distributed engine: two CPU processes, gloo, simulated backend.

One ``python -m paddle.distributed.launch`` job (tests/dist_scripts/data_parallel_job.py: the cases of
fleet_worker.py here and those of step_worker.py for tests/step/test_train_step.py) runs every case; each rank compares its graphed run with an eager run of the same model
bit for bit and prints one ``RESULT`` line per case. The tests here check those lines and what
must agree across ranks (averaged grads, broadcast parameters, all-reduced outputs). A failure
message carries both workers' logs.
"""

import atexit
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph
from paddlefleet.cudagraph.block.graphed import GraphedCallable
from paddlefleet.cudagraph.options import ENV_BACKEND

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_scripts" / "data_parallel_job.py"
TIMEOUT_S = 240  # the job takes ~10 s; a hang must not block CI
CASES = (
    "dp_paddle",
    "dp_accumulation_default_grad_policy",
    "dp_refuses_accumulation_in_graph",
    "dp_fleet_decorated_method_with_dropout",
    "dp_unused_block",
    "dp_reentrant_recompute",
    "all_reduce_in_graphed_function",
    "all_reduce_no_grad_in_place",
    "tensor_parallel_layers",
)
#: step_worker.py's cases, in the same launch (tests/step/test_train_step.py checks them).
STEP_CASES = ("dp_whole_step", "dp_whole_step_accumulation", "fleet_whole_step")


def launch_two_ranks(script, log_dir, timeout=TIMEOUT_S):
    """Runs ``script`` on two CPU ranks; returns (exit status or None on timeout, launcher output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", ENV_BACKEND)}
    env.update(
        PYTHONUNBUFFERED="1",
        PADDLEFLEET_ROOT=str(ROOT),
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # silences ColumnParallelLinear's GPU advice
        # Paddle 3.x's libuv TCP store aborts rank 0 now and then at exit (SIGSEGV after every case
        # passed: its daemon thread reads rank 1's closed connection while exit handlers run; about
        # 1 launch in 30 here). The classic store (Paddle 2.6's only one) exits cleanly.
        FLAGS_tcp_store_using_libuv="0",
    )
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
           "--log_dir", str(log_dir), str(script)]
    proc = subprocess.Popen(cmd, env=env, cwd=log_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the launcher stops its workers (SIGKILL would orphan them)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return None, out


_LAUNCHES = {}  # worker script -> (exit status, launcher output, {worker log: text})


def gloo_setup_failed(rc, logs):
    """True when a launch failed in Paddle's own process-group set-up before any case ran: gloo's TCP pair
    was refused its connection while ``fleet.init`` created a group (seen once on the two-core CI machine), in
    Paddle's code, before any case ran."""
    texts = list(logs.values())
    return (rc != 0 and not any("RESULT " in t for t in texts)
            and any("ProcessGroupGloo.create" in t and "Connection refused" in t for t in texts))


def launch_once(script):
    """One two-rank launch of ``script`` per test session, shared by every class that reads it; launched again,
    once, where the first failed in gloo's set-up (gloo_setup_failed), and said so in the launcher output."""
    if script not in _LAUNCHES:
        said = ""
        for attempt in range(2):
            tmp = pathlib.Path(tempfile.mkdtemp(prefix="paddlefleet_dist_"))
            atexit.register(shutil.rmtree, tmp, True)
            log_dir = tmp / "logs"
            rc, out = launch_two_ranks(script, log_dir)
            logs = {f.name: f.read_text(errors="replace") for f in sorted(log_dir.glob("workerlog.*"))}
            if attempt or not gloo_setup_failed(rc, logs):
                break
            said = "(the first launch failed in gloo's set-up, before any case: launched again)\n"
        _LAUNCHES[script] = rc, said + (out or ""), logs
    return _LAUNCHES[script]


class TwoRankJob(unittest.TestCase):
    """The two-rank launch of ``WORKER`` (once per session; tests/dist_scripts/job.py reports its
    cases); ``case(name)`` gives each rank's result."""

    WORKER = None

    @classmethod
    def setUpClass(cls):
        cls.rc, cls.launcher_out, cls.logs = launch_once(cls.WORKER)
        cls.results = {}
        for text in cls.logs.values():
            for line in text.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    cls.results[(r["case"], r["rank"])] = r

    def logs_text(self):
        tail = lambda s: s[-6000:]  # noqa: E731
        parts = [f"launcher exit status {self.rc} (None: killed after {TIMEOUT_S} s)",
                 "---- launcher ----", tail(self.launcher_out or "")]
        for name, text in self.logs.items():
            parts += [f"---- {name} ----", tail(text)]
        return "\n".join(parts)

    def case(self, name):
        """Both ranks' results for ``name``, asserting both passed."""
        got = [self.results.get((name, rank)) for rank in (0, 1)]
        for rank, r in enumerate(got):
            if r is None:
                self.fail(f"rank {rank} reported no result for {name}\n{self.logs_text()}")
            if not r["ok"]:
                self.fail(f"rank {rank}, {name}: {r['detail']}\n{r.get('traceback', '')}\n{self.logs_text()}")
        skipped = {r.get("skipped") for r in got}
        if skipped != {None}:  # the worker found what the case needs unusable on this Paddle
            self.assertEqual(len(skipped), 1, f"ranks disagree on skipping {name}: {skipped}")
            self.skipTest(skipped.pop())
        return [r["detail"] for r in got]


class GlooSetupRetryTest(unittest.TestCase):
    def test_only_a_gloo_set_up_failure_before_any_case_is_launched_again(self):
        refused = ("  pg = core.ProcessGroupGloo.create(store, rank, world_size, group_id)\n"
                   "RuntimeError: [gloo/transport/tcp/pair.cc:784] connect [127.0.0.1]:9131: Connection refused\n")
        self.assertTrue(gloo_setup_failed(1, {"workerlog.0": refused, "workerlog.1": ""}))
        self.assertFalse(gloo_setup_failed(None, {"workerlog.0": "RESULT {}\n" + refused}))  # a case ran first
        self.assertFalse(gloo_setup_failed(1, {"workerlog.0": "AssertionError: grads differ\n"}))
        self.assertFalse(gloo_setup_failed(0, {"workerlog.0": refused}))


@unittest.skipIf(paddle.is_compiled_with_cuda(), "CPU/gloo test; on GPUs run tools/dist_gpu_check.py")
class TestFleetTwoProcesses(TwoRankJob):
    WORKER = WORKER

    def test_job_ran_every_case_and_exited_cleanly(self):
        self.assertEqual(self.rc, 0, self.logs_text())
        self.assertEqual({c for c, _ in self.results}, set(CASES) | set(STEP_CASES), self.logs_text())

    def _check_data_parallel(self, name):
        r0, r1 = self.case(name)
        # Ranks train on different data (different losses) yet hold the same grads (averaged)
        # and the same parameters (rank 0's broadcast, then identical updates).
        self.assertNotEqual(r0["loss"], r1["loss"])
        self.assertEqual(r0["grads"], r1["grads"], "grads differ across ranks: not averaged")
        self.assertEqual(r0["params"], r1["params"], "parameters differ across ranks")

    def test_paddle_data_parallel_around_graphed_blocks_is_bitwise_eager(self):
        self._check_data_parallel("dp_paddle")

    def test_fleet_distributed_model_dp2_decorated_method_with_dropout(self):
        self._check_data_parallel("dp_fleet_decorated_method_with_dropout")

    def test_data_parallel_accumulation_with_the_default_grad_policy(self):
        self._check_data_parallel("dp_accumulation_default_grad_policy")

    def test_data_parallel_refuses_accumulation_in_graph(self):
        self._check_data_parallel("dp_refuses_accumulation_in_graph")

    def test_data_parallel_find_unused_parameters_with_a_skipped_graphed_block(self):
        self._check_data_parallel("dp_unused_block")

    def test_data_parallel_with_reentrant_recompute_the_documented_recipe(self):
        # no_sync() around forward and backward, then fused_allreduce_gradients (docs/guides/distributed.md).
        self._check_data_parallel("dp_reentrant_recompute")

    def test_all_reduce_inside_a_graphed_function_with_grads(self):
        r0, r1 = self.case("all_reduce_in_graphed_function")
        self.assertEqual(r0["replicated"], r1["replicated"], "all-reduced values differ across ranks")

    def test_in_place_all_reduce_inside_a_forward_only_graph(self):
        r0, r1 = self.case("all_reduce_no_grad_in_place")
        self.assertEqual(r0["replicated"], r1["replicated"])

    def test_tensor_parallel_layers_with_the_model_parallel_rng_tracker(self):
        r0, r1 = self.case("tensor_parallel_layers")
        self.assertEqual(r0["replicated"], r1["replicated"], "row-parallel outputs differ across ranks")
        self.assertNotEqual(r0["shard"], r1["shard"], "column shards should differ across ranks")


class TestDistributedWrappersAreRefused(unittest.TestCase):
    def test_graphing_the_data_parallel_wrapper_itself_is_refused_with_the_fix(self):
        # DataParallel.forward arms the reducer on the host after the model ran; a replay
        # would skip that, so the blocks (or the inner model) must be graphed instead.
        dp = paddle.DataParallel(paddle.nn.Linear(4, 4))
        with self.assertRaisesRegex(TypeError, r"distributed wrapper DataParallel.*paddle.DataParallel\(autocudagraph"):
            autocudagraph(dp)
        self.assertFalse(isinstance(dp.forward, GraphedCallable))


if __name__ == "__main__":
    unittest.main()
