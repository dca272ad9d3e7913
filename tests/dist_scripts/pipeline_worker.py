"""One rank of the two-process Fleet pipeline-parallel checks that tests/block/test_pipeline.py launches.

Launched by ``python -m paddle.distributed.launch --nproc_per_node 2`` (gloo on the CPU), with
Fleet's hybrid configuration pp_degree=2. Every case builds the same PipelineLayer twice in this
process - eagerly, then with its blocks graphed by autocudagraph on the simulated backend - and
trains both with ``PipelineParallel.train_batch`` from the same parameters, data and RNG state
(dropout on), comparing the losses and this rank's parameters bit for bit after every step. Each
case prints one line ``RESULT {json}``; the exit status is 1 when a case failed.

NOTE [ Fleet pipeline parallel on the CPU ]
Two things stand between Fleet's PipelineParallel and a CPU build of Paddle (3.3.1, measured):
* ``PipelineLayer.__init__`` reads ``ParallelEnv().device_id``, which a CPU build never sets
  (AttributeError: 'ParallelEnv' object has no attribute '_device_id'): this worker sets it to 0;
* the default batched p2p (``use_batch_p2p_comm=True``) sends with ``send_on_calc_stream``, which
  ProcessGroupGloo does not implement (NotImplementedError: "ProcessGroupGLOO does not support
  send with sync_op and use_calc_stream flag"): ``pp_configs.use_batch_p2p_comm=False`` makes it
  use ``isend`` / ``irecv``, which gloo has. Paddle 2.6.2 has only the batched p2p (no
  ``use_batch_p2p_comm``, no ``p2p_communication._p2p_ops``): its PipelineParallel cannot run on
  gloo, and every case is reported skipped with that reason.
Fleet's interleaved schedule (PipelineParallelWithInterleave, ``num_virtual_pipeline_stages=2``)
asserts ``num_stages > 2`` ("virtual pipeline must run under pp degree > 2", Paddle 2.6.2 and
3.3.1), and on three or four gloo ranks its eager run times out in p2p
(tools/probes/interleaved_pipeline_probe.py): two ranks run 1F1B only; tests/block/test_pipeline.py runs
the interleaved order in one process.
"""

import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

sys.path.insert(0, os.environ.get("PADDLEFLEET_ROOT", os.getcwd()))
from fleet_worker import fleet_unusable  # noqa: E402
from job import run_cases  # noqa: E402  (this script's folder is on sys.path)
from paddlefleet.cudagraph import autocudagraph  # noqa: E402

STEPS, MICRO, MICRO_BATCH, WIDTH = 4, 4, 2, 8
RANK = 0
model_of_last_run = []  # the PipelineParallel class Fleet picked, reported by each case


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(WIDTH, 2 * WIDTH)
        self.drop = paddle.nn.Dropout(0.25)
        self.fc2 = paddle.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(self.drop(paddle.nn.functional.gelu(self.fc1(x))))


def build(graphed, chunks=1, **options):
    paddle.seed(5)
    descs = [LayerDesc(Block) for _ in range(4)]
    pipe = PipelineLayer(layers=descs, num_stages=2, loss_fn=paddle.nn.MSELoss(),
                         num_virtual_pipeline_stages=chunks, seg_method="layer:Block")
    blocks = [layer for layer in pipe.sublayers() if isinstance(layer, Block)]
    if graphed:
        for block in blocks:
            autocudagraph(block, backend="simulate", **options)
    opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=pipe.parameters())
    return fleet.distributed_model(pipe), fleet.distributed_optimizer(opt), blocks


def train(graphed, chunks=1, **options):
    model, opt, blocks = build(graphed, chunks, **options)
    model_of_last_run[:] = [model]
    losses, params, stats = [], [], []
    for step in range(STEPS):
        rs = np.random.RandomState(step)
        x = paddle.to_tensor(rs.randn(MICRO * MICRO_BATCH, WIDTH).astype("float32"))
        y = paddle.to_tensor(rs.randn(MICRO * MICRO_BATCH, WIDTH).astype("float32"))
        paddle.seed(1000 + step + 10 * RANK)  # the same dropout masks for both runs of this rank
        loss = model.train_batch([x, y], opt)
        losses.append(np.asarray(loss.numpy()).tolist())
        params.append([p.numpy() for p in model.parameters()])
        if graphed:
            stats.append([dict(b.forward.stats()) for b in blocks])
    return losses, params, stats


def compare(chunks=1, **options):
    eager_losses, eager_params, _ = train(False, chunks)
    losses, params, stats = train(True, chunks, **options)
    if losses != eager_losses:
        raise AssertionError(f"losses differ: graphed {losses} vs eager {eager_losses}")
    for step, (got, want) in enumerate(zip(params, eager_params)):
        for i, (a, b) in enumerate(zip(got, want)):
            if a.tobytes() != b.tobytes():
                raise AssertionError(f"after step {step}: parameter {i} differs from eager")
    last, before = stats[-1], stats[-2]
    per_block = [{"replays": a["replays"] - b["replays"], "eager_calls": a["eager_calls"] - b["eager_calls"],
                  "slots": a["slots"], "reasons": a["eager_reasons"]} for a, b in zip(last, before)]
    return {"model": type(model_of_last_run[0]).__name__, "losses": losses, "blocks": per_block}


def case_one_f_one_b():
    return compare()


def case_one_f_one_b_accumulate_in_graph():
    return compare(accumulate_in_graph=True)


def case_one_f_one_b_max_inflight_one():
    return compare(max_inflight=1)


CASES = [case_one_f_one_b, case_one_f_one_b_accumulate_in_graph, case_one_f_one_b_max_inflight_one]


def pipeline_unusable():
    """None where Fleet's PipelineParallel can send over gloo, else why not (NOTE [ Fleet
    pipeline parallel on the CPU ])."""
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication

    if not hasattr(p2p_communication, "_p2p_ops"):
        return ("this Paddle's PipelineParallel sends only with send_on_calc_stream, which ProcessGroupGloo does "
                "not implement (no use_batch_p2p_comm=False path): Fleet pipeline parallel cannot run on CPU ranks")
    return fleet_unusable()


def main():
    global RANK
    no_fleet = pipeline_unusable()
    if no_fleet is not None:
        dist.init_parallel_env()
        sys.exit(run_cases(CASES, dist.get_rank(), set(sys.argv[1:]), skip=lambda name: no_fleet))
    if not hasattr(dist.ParallelEnv(), "_device_id"):  # NOTE [ Fleet pipeline parallel on the CPU ]
        dist.ParallelEnv._device_id = 0
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 2,
                               "pp_configs": {"use_batch_p2p_comm": False}}
    strategy.pipeline_configs = {"accumulate_steps": MICRO, "micro_batch_size": MICRO_BATCH}
    fleet.init(is_collective=True, strategy=strategy)
    RANK = dist.get_rank()
    sys.exit(run_cases(CASES, RANK, set(sys.argv[1:])))


if __name__ == "__main__":
    main()
