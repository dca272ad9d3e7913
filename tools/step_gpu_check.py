"""The whole training step in one graph (autocudagraph_step) on a real GPU, bitwise against eager.

Runs where only cuBLAS matmuls and copies work (Paddle 2.6.2 on Hopper, NOTE [ Kernel-less GPUs ]
in testkit/common.py): a matmul-only MLP, forward + backward with an explicit
``dy``, then either no update or SGD written as one matmul per parameter (NOTE [ SGD from
matmuls ] in testkit/step_gpu.py), grads released. Every step's output and every
parameter after every step must be equal bit for bit; the per-step time of eager and of the
whole-step graph is printed (throughput mode: N steps, then one sync)::

    python tools/step_gpu_check.py                       # cuda backend, 16 x 512, batch 16
    python tools/step_gpu_check.py --width 4096 --layers 8 --batch 64
    python tools/step_gpu_check.py --backend simulate    # CPU smoke test: 4 x 32, 6 steps, seconds

The rest of a training step - AdamW, clipping, the learning-rate feed, GraphGradScaler, dropout -
needs Paddle's elementwise, fill and random kernels: on a GPU whose Paddle has them, run the
suite on the real backend (``PADDLEFLEET_CUDAGRAPH_BACKEND=cuda python -m pytest
tests/step/test_train_step.py``), whose cuda variants run the transformer check there.

A third case, ``refused_capture``, refuses the capture after the step ran (a host value changes at
the capture call) in a step that also keeps an EMA outside any optimizer: every step must still be
eager's bit for bit (a refused capture writes nothing the eager re-run writes again).

Exit code: 0 when every case is bitwise equal to eager, 1 otherwise, 2 when asked for the cuda
backend where there is no GPU.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy.random  # noqa: E402,F401  (before paddle: Paddle 2.6 with NumPy 2 crashes otherwise, docs/guides/compat.md)
import paddle  # noqa: E402

from testkit.step_gpu import refused_capture_check, whole_step_check  # noqa: E402
from testkit.cli import BACKEND_HELP, expected_refusals, refusal_lines, require_gpu, sized, sized_help  # noqa: E402
from testkit.common import device  # noqa: E402

#: (full size on a GPU, smoke size with --backend simulate)
SIZES = {"width": (512, 32), "layers": (16, 4), "batch": (16, 8), "steps": (20, 6), "timed_steps": (600, 20)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "simulate"), help=BACKEND_HELP)
    for name, text in (("width", "MLP width"), ("layers", "matmul layers"), ("batch", "batch size"),
                       ("steps", "steps compared with eager"), ("timed_steps", "steps per timing")):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=sized_help(text, *SIZES[name]))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    require_gpu("tools/step_gpu_check.py", args.backend)
    for name, (full, smoke) in SIZES.items():
        setattr(args, name, sized(getattr(args, name), args.backend, full, smoke))
    with device("gpu" if args.backend == "cuda" else "cpu"):
        results = whole_step_check(width=args.width, layers=args.layers, batch=args.batch, steps=args.steps,
                                   backend=args.backend, timed_steps=args.timed_steps)
        with expected_refusals() as refusals:  # the case refuses its capture on purpose
            refused = refused_capture_check(width=min(args.width, 256), layers=min(args.layers, 4),
                                            batch=args.batch, backend=args.backend)
    print(f"paddle {paddle.__version__}, backend {args.backend}, MatMLP {args.layers} x {args.width}, "
          f"batch {args.batch}")
    ok = True
    for case, r in results.items():
        s = r["stats"]
        verdict = "bitwise equal to eager" if r["equal"] else f"DIFFERS: {r['first_mismatch']}"
        print(f"  {case}: {verdict}; warmup {s['warmup_calls']}, captures {s['captures']}, replays {s['replays']}, "
              f"eager {s['eager_calls']} {s['eager_reasons'] or ''}; eager {r['eager_us']:.0f} us/step, "
              f"whole-step graph {r['graphed_us']:.0f} us/step")
        ok = ok and r["equal"] and s["captures"] == 1 and s["eager_calls"] == 0
    s = refused["stats"]
    verdict = "bitwise equal to eager" if refused["equal"] else f"DIFFERS: {refused['first_mismatch']}"
    print(f"  refused_capture (matmul SGD + EMA outside the optimizer, capture refused after the step ran): "
          f"{verdict}; warmup {s['warmup_calls']}, captures {s['captures']}, eager {s['eager_calls']} "
          f"{s['eager_reasons'] or ''}")
    for line in refusal_lines(refusals):
        print(line)
    ok = ok and refused["equal"] and s["captures"] == 0 and s["eager_calls"] == 6
    results["refused_capture"] = refused
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
