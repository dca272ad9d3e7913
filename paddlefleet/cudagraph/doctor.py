"""``python -m paddlefleet.cudagraph doctor``: what this machine's Paddle can do for autocudagraph.

Reports Paddle's version and build (CUDA or CPU), the GPU and its compute capability, whether
Paddle's own kernels run on it (a tiny elementwise op and a matmul, compared with numpy), whether
the graphs of one wrapper can share a memory pool, and which backend ``autocudagraph`` picks with
``backend=None`` and why (the environment override included). Every check is guarded: a failing
check is reported as such, never raised, so the command works on any machine with Paddle.
"""

import os
import platform
import sys

import numpy as np
import paddle

from . import native
from .backends import ENV_BACKEND, cuda_available, pool_sharing_supported, resolve_backend
from .errors import CudaGraphError
from .grads.stacks import stacks_as_grads_arrive

__all__ = ["run_doctor"]

INSTALL_HINT = (
    "README.md, section 'Install on a GPU': install a Paddle 3.x GPU build from Paddle's package index for your "
    "CUDA version (any GPU it has a build for; Hopper sm_90 and newer need one); PyPI's paddlepaddle-gpu 2.6.2, "
    "with kernels up to sm_86 (Ampere) only, is the fallback."
)


def _guarded(fn):
    """``(value, None)`` or ``(None, "ExceptionName: first line")``."""
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - the doctor reports every failure instead of raising
        return None, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def _build():
    cuda = paddle.is_compiled_with_cuda()
    if not cuda:
        return False, "CPU build (no CUDA)"
    version = getattr(paddle, "version", None)
    cuda_v = version.cuda() if version is not None and hasattr(version, "cuda") else "?"
    cudnn_v = version.cudnn() if version is not None and hasattr(version, "cudnn") else "?"
    return True, f"CUDA build (CUDA {cuda_v}, cuDNN {cudnn_v})"


def _gpu():
    """``(count, "name, compute capability X.Y (sm_XY)")`` of GPU 0, or (0, reason)."""
    count = paddle.device.cuda.device_count()
    if count == 0:
        return 0, "none visible to Paddle"
    major, minor = paddle.device.cuda.get_device_capability(0)
    name = paddle.device.cuda.get_device_name(0)
    return count, f"{name}, compute capability {major}.{minor} (sm_{major}{minor}); {count} GPU(s)"


def _kernels_run():
    """None when Paddle's elementwise and matmul kernels give numpy's values on GPU 0, else why not."""
    place = paddle.CUDAPlace(0)
    a = np.arange(1, 9, dtype="float32").reshape(2, 4)
    x = paddle.to_tensor(a, place=place)
    problems = []
    if not np.array_equal((x * 2.0 + 1.0).numpy(), a * 2.0 + 1.0):
        problems.append("an elementwise op (x * 2 + 1) returned wrong values")
    if not np.allclose(paddle.matmul(x, x, transpose_y=True).numpy(), a @ a.T):
        problems.append("a matmul returned wrong values")
    return "; ".join(problems) or None


def _backend_choice(gpu_ok):
    """What autocudagraph(backend=None) picks for a call on GPU tensors (or CPU ones here)."""
    env = os.environ.get(ENV_BACKEND)
    tensors = [paddle.to_tensor([1.0], place=paddle.CUDAPlace(0))] if gpu_ok else [paddle.to_tensor([1.0])]
    backend, reason = resolve_backend(None, tensors)
    name = backend.name if backend is not None else "eager"
    where = "GPU" if gpu_ok else "CPU"
    why = f"{ENV_BACKEND}={env} overrides every wrapper" if env else reason
    text = f"{name} for {where} tensors ({why})"
    if name == "eager":
        text += "; your code runs eagerly, untouched, unless you pass backend='simulate' (a CPU stand-in)"
    return text


def _checks():
    """``[(label, text, ok)]``; ok is None for information."""
    rows = [("python", f"{platform.python_version()} ({sys.executable})", None)]
    rows.append(("paddle", f"{paddle.__version__} ({os.path.dirname(paddle.__file__)})", None))
    built, err = _guarded(_build)
    cuda, build = built or (False, err)
    rows.append(("build", build, None if err is None else False))
    gpu_ok = False
    if cuda:
        gpu, err = _guarded(_gpu)
        rows.append(("GPU", (gpu[1] if gpu else err), None if err is None else False))
        if gpu and gpu[0] > 0:
            problem, err = _guarded(_kernels_run)
            problem = problem or err
            gpu_ok = problem is None
            rows.append(("Paddle kernels", "run (elementwise and matmul equal numpy)" if gpu_ok else
                         f"do NOT run on this GPU: {problem}. Install a Paddle build with kernels for it: "
                         f"{INSTALL_HINT}", gpu_ok))
        graphs, err = _guarded(cuda_available)
        rows.append(("CUDA graphs", "available" if graphs else f"not available{': ' + err if err else ''}",
                     bool(graphs)))
    else:
        rows.append(("GPU", "none usable: this is a CPU build of Paddle. On a GPU machine uninstall it and install "
                     f"a GPU build ({INSTALL_HINT})", None))
    shared, err = _guarded(pool_sharing_supported)
    if not cuda:
        shared_text = "n/a (a CPU build has no CUDA graphs)"
    elif shared:
        shared_text = ("yes: the forward graphs of keys (a model graphed layer by layer) share one memory pool per "
                       "GPU, checked before every forward replay: a key whose replay would overwrite what a forward "
                       "captured after it still holds (micro-batches in flight, a key captured again) is captured "
                       "again into a pool of its own; a key's forward and backward graphs share one pool where its "
                       "backward hands out copies (clone_param_grads=True, or accumulate_in_graph=True); backward "
                       "graphs, further slots (max_inflight) and keys with clone_outputs=False keep their own")
    else:
        shared_text = "no: each graph gets its own memory pool (Paddle < 3.1; correct, uses more memory)"
    rows.append(("pool sharing", err or shared_text, None))
    arrive, err = _guarded(stacks_as_grads_arrive)
    rows.append(("grad stacks", err or (
        "each same-shape parameter grad is copied into its stack as the backward makes it (node post hooks): "
        "a graph's pool holds it once" if arrive else
        "no node post hooks in this Paddle: grads handed out as aliases (the default) go one by one and a graph's "
        "pool holds each once; grads handed out as copies (clone_param_grads=True, a hook that keeps its grad) "
        "are stacked after the backward, one copy per stack, and held twice, as computed and stacked"), None))
    compiled, err = _guarded(_compiled_reads)
    rows.append(("compiled reads", compiled or err, None))
    choice, err = _guarded(lambda: _backend_choice(gpu_ok))
    rows.append(("backend", choice or err, None if err is None else False))
    return rows


def _compiled_reads():
    """Whether the per-call tensor reads are compiled here (NOTE [ Compiled tensor reads ] in native/__init__.py)."""
    try:
        native.load()
    except CudaGraphError as err:  # PADDLEFLEET_CUDAGRAPH_NATIVE=require: the reason is the report
        return f"unavailable: {err}"
    active, why = native.status()
    if active:
        return "in use: each call's key and parameter checks read tensors in C++ (built for this Paddle and Python)"
    return f"not in use ({why}): the same reads run in Python, a few us more host time per call"


def run_doctor(out=None):
    """Writes the report; returns 0 when nothing is wrong (a CPU-only machine included), 1 when a
    check failed (e.g. Paddle's kernels do not run on this GPU)."""
    out = out or sys.stdout
    rows, err = _guarded(_checks)
    if err is not None:
        rows = [("doctor", f"a check failed unexpectedly: {err}", False)]
    width = max(len(label) for label, _, _ in rows)
    for label, text, ok in rows:
        mark = "" if ok is None else ("ok   " if ok else "FAIL ")
        out.write(f"{label:>{width}}: {mark}{text}\n")
    failed = any(ok is False for _, _, ok in rows)
    out.write("verdict: " + ("problems found (see FAIL above)\n" if failed else "nothing wrong found\n"))
    return 1 if failed else 0
