"""Probe: Fleet's interleaved pipeline schedule (PipelineParallelWithInterleave) on gloo CPU ranks,
eager, then with every block graphed (slots, simulated backend), compared bit for bit.

    python -m paddle.distributed.launch --nproc_per_node 4 tools/probes/interleaved_pipeline_probe.py 4

The argument is pp_degree (the number of ranks launched) (>= 3: Fleet asserts ``num_stages > 2`` for virtual stages); two chunks per
stage, 2 * pp_degree micro-batches. Each rank prints ``MODEL``, ``SAME_LOSS ... SAME_PARAMS ...`` and one
``BLOCK`` line per graphed block. Measured on Paddle 3.3.1 (CPU build): the *eager* run already times
out in gloo's p2p (3 ranks: ``isend`` in ``send_forward_recv_forward``; 4 ranks: ``send_meta`` /
``recv_meta``), so Fleet's interleaved schedule cannot be checked on CPU ranks (docs/guides/pipeline.md).
A one-off probe kept as the record of that measurement; exit code 0 when the ranks finished.
"""

import argparse
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "dist_scripts")]
import pipeline_worker as worker  # noqa: E402  (the Block and the CPU set-up of the two-rank test)
from paddlefleet.cudagraph import autocudagraph  # noqa: E402

V = 2  # chunks per stage


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     epilog="launch: python -m paddle.distributed.launch --nproc_per_node P "
                                            "tools/probes/interleaved_pipeline_probe.py P")
    parser.add_argument("pp_degree", nargs="?", type=int, default=3,
                        help="pipeline stages, one per launched rank (default 3; at least 3: Fleet asserts "
                             "num_stages > 2 for virtual stages)")
    args = parser.parse_args(argv)
    if args.pp_degree < 3:
        parser.error(f"pp_degree must be at least 3 (got {args.pp_degree}): Fleet's interleaved schedule asserts "
                     "num_stages > 2")
    return args


P = M = None  # set by main(): pp_degree and its 2 * pp_degree micro-batches


def train(graphed):
    paddle.seed(5)
    pipe = PipelineLayer(layers=[LayerDesc(worker.Block) for _ in range(P * V)], num_stages=P,
                         loss_fn=paddle.nn.MSELoss(), num_virtual_pipeline_stages=V, seg_method="layer:Block")
    blocks = [layer for layer in pipe.sublayers() if isinstance(layer, worker.Block)]
    for block in blocks if graphed else ():
        autocudagraph(block, backend="simulate", max_inflight=M)
    model = fleet.distributed_model(pipe)
    opt = fleet.distributed_optimizer(paddle.optimizer.AdamW(learning_rate=0.01, parameters=pipe.parameters()))
    print("MODEL", type(model).__name__, flush=True)
    losses, params = [], []
    for step in range(4):
        rs = np.random.RandomState(step)
        x = paddle.to_tensor(rs.randn(M * 2, worker.WIDTH).astype("float32"))
        y = paddle.to_tensor(rs.randn(M * 2, worker.WIDTH).astype("float32"))
        paddle.seed(1000 + step + 10 * dist.get_rank())
        losses.append(np.asarray(model.train_batch([x, y], opt).numpy()).tolist())
        params.append([p.numpy().tobytes() for p in model.parameters()])
    return losses, params, [dict(b.forward.stats()) for b in blocks] if graphed else []


def main():
    global P, M
    P = parse().pp_degree
    M = 2 * P
    if not hasattr(dist.ParallelEnv(), "_device_id"):  # NOTE [ Fleet pipeline parallel on the CPU ]
        dist.ParallelEnv._device_id = 0
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": P,
                               "pp_configs": {"use_batch_p2p_comm": False}}
    strategy.pipeline_configs = {"accumulate_steps": M, "micro_batch_size": 2}
    fleet.init(is_collective=True, strategy=strategy)
    eager_losses, eager_params, _ = train(False)
    losses, params, stats = train(True)
    print("SAME_LOSS", losses == eager_losses, "SAME_PARAMS", params == eager_params, flush=True)
    for s in stats:
        print("BLOCK", {k: s[k] for k in ("captures", "replays", "eager_calls", "slots", "eager_reasons")}, flush=True)


if __name__ == "__main__":
    main()
