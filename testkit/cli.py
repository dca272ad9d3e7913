"""What every tool in tools/ does first: refuse the cuda backend where there is no GPU (exit 2,
naming --backend simulate), and pick small smoke defaults for a simulated run."""

import contextlib
import sys
import warnings

import paddle

__all__ = ["BACKEND_HELP", "NO_GPU_EXIT", "no_gpu_reason", "require_gpu", "sized", "sized_help", "expected_refusals",
           "refusal_lines"]

#: --help of every tool's --backend.
BACKEND_HELP = ("cuda (default): run on this machine's GPU (exits 2 where there is none); simulate: a CPU smoke run "
                "on the simulated backend, with small defaults (its timings are not GPU timings)")

#: Exit code of a tool asked for the cuda backend where there is no GPU.
NO_GPU_EXIT = 2


def no_gpu_reason():
    """None when this Paddle is a CUDA build that sees a GPU, else why not."""
    if not paddle.is_compiled_with_cuda():
        return f"paddle {paddle.__version__} is a CPU build"
    try:
        count = paddle.device.cuda.device_count()
    except Exception as err:  # noqa: BLE001 - a broken driver reads as no GPU
        return f"no GPU visible ({type(err).__name__}: {err})"
    return None if count > 0 else "no GPU visible to Paddle"


def require_gpu(tool, backend, gpus=1):
    """Exits with NO_GPU_EXIT and a one-line message when ``backend`` is "cuda" and this machine
    has fewer than ``gpus`` GPUs usable by Paddle."""
    if backend != "cuda":
        return
    reason = no_gpu_reason()
    if reason is None and gpus > 1 and paddle.device.cuda.device_count() < gpus:
        reason = f"{paddle.device.cuda.device_count()} GPU(s) visible, {gpus} needed"
    if reason is not None:
        sys.stderr.write(f"{tool}: no GPU here ({reason}): use --backend simulate for a CPU smoke run "
                         "(python -m paddlefleet.cudagraph doctor says more).\n")
        raise SystemExit(NO_GPU_EXIT)


def sized(value, backend, full, smoke):
    """``value`` when given, else the full size on cuda and the smoke size on simulate."""
    if value is not None:
        return value
    return full if backend == "cuda" else smoke


def sized_help(text, full, smoke):
    """``text`` with both defaults, for --help."""
    return f"{text} (default {full}; {smoke} with --backend simulate)"


@contextlib.contextmanager
def expected_refusals():
    """For a case that makes autocudagraph refuse a capture on purpose: its RuntimeWarnings (``autocudagraph...``)
    are kept in the list this yields, to print with ``refusal_lines()`` as expected, instead of reaching stderr
    as ``RuntimeWarning:`` lines that read like a failure; any other warning is shown as usual."""
    caught, refusals = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield refusals
    for w in caught:
        if issubclass(w.category, RuntimeWarning) and str(w.message).startswith("autocudagraph"):
            refusals.append(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def refusal_lines(refusals, indent="    "):
    """``expected refusal: <warning>`` lines, each warning cut to its first sentence after the wrapper's name."""
    lines = []
    for message in refusals:
        head = message.split(". ", 1)[0]
        lines.append(f"{indent}expected refusal: {head if len(head) <= 300 else head[:297] + '...'}")
    return lines
