"""Host time of the ways Paddle can copy a device tensor into a new one (a probe).

    python tools/probes/copy_probe.py [--shape 16x512] [--calls 2000] [--rounds 7]

A graphed call hands out a copy of each static output (a whole step's ``StepGraphs.hand_out``, a block's
``clone_outputs``): one new device tensor per output per call, which a step timed with a sync per step pays
after the launch. This times, interleaved, best of ``--rounds`` rounds of ``--calls`` calls each (no device
sync inside a round), the host us per copy of each way that makes a new tensor holding the same bytes, after
checking each copy bit for bit against its source: ``_C_ops.assign`` (what the package calls),
``Tensor.clone()``, ``Tensor._copy_to(place, False)``, ``paddle.empty`` + ``copy_``, ``_C_ops.empty`` + ``copy_``
and the compiled ``empty_like_each`` + ``copy_`` (NOTE [ Compiled tensor reads ] in native/__init__.py: one and
four tensors made per call, each copied, per copy); and, for scale,
the host time of a bare ``paddle.matmul`` of the same shape against its transpose.
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO]

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402

from paddlefleet.cudagraph import native  # noqa: E402
from testkit.common import host_tensor, normal  # noqa: E402


def ways(place):
    def empty_copy(t):
        out = paddle.empty(t.shape, t.dtype)
        out.copy_(t, False)
        return out

    def c_empty_copy(t):
        out = _C_ops.empty(t.shape, t.dtype, t.place)
        out.copy_(t, False)
        return out

    def compiled_copy(t):
        out = native.reads.empty_like_each([t])[0]
        out.copy_(t, False)
        return out

    def compiled_copies(t):  # four made in one call, each copied: what a chain's head and its members do
        outs = native.reads.empty_like_each([t, t, t, t])
        for out in outs:
            out.copy_(t, False)
        return outs[0]

    made = {
        "_C_ops.assign(t)": _C_ops.assign,
        "t.clone()": lambda t: t.clone(),
        "t._copy_to(place, False)": lambda t: t._copy_to(place, False),
        "paddle.empty + copy_": empty_copy,
        "_C_ops.empty + copy_": c_empty_copy,
    }
    native.load()
    if native.reads is not None:
        made["compiled empty_like_each + copy_"] = compiled_copy
        made["compiled empty_like_each of 4 + copy_ (per copy)"] = compiled_copies
    made["paddle.matmul(t, t.T) (scale)"] = None
    return made


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16x512", help="ROWSxCOLS of the copied float32 tensor (default 16x512)")
    parser.add_argument("--calls", type=int, default=2000, help="copies per timed round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds; best and median are shown (default 7)")
    args = parser.parse_args()
    rows, cols = (int(v) for v in args.shape.split("x"))
    src = host_tensor(normal(3)(rows, cols))
    wt = host_tensor(normal(4)(cols, rows))
    place = src.place
    runners = ways(place)
    runners["paddle.matmul(t, t.T) (scale)"] = lambda t: paddle.matmul(t, wt)
    want = src.numpy()
    for name, copy in runners.items():
        if "scale" in name:
            continue
        got = copy(src)
        assert got.numpy().tobytes() == want.tobytes(), name
        assert got.data_ptr() != src.data_ptr(), name
        assert got.stop_gradient, name
    times = {name: [] for name in runners}
    sync = paddle.device.cuda.synchronize if place.is_gpu_place() else (lambda: None)
    for _ in range(args.rounds):
        for name, copy in runners.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                copy(src)
            per = 4 if "of 4" in name else 1
            times[name].append((time.perf_counter() - start) / args.calls / per * 1e6)
            sync()
    print(f"paddle {paddle.__version__}, place {place}, shape {args.shape}, {args.calls} calls x {args.rounds} rounds; "
          f"compiled reads: {'in use' if native.reads is not None else native.status()[1]}")
    for name, us in times.items():
        print(f"  {name:34s} best {min(us):6.2f} us   median {statistics.median(us):6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
