"""Checking autocudagraph against eager: shared by the test suite (testkit/harness.py) and tools/.

Bitwise comparison, matmul-only models that a GPU without Paddle's arithmetic kernels can run,
device placement, the probes that say whether the cuda backend can run here, which speed options
this version has, and the facts about a run that the reports print. Imports paddle and numpy
only, so the tools run on a bare GPU host with the repository on PYTHONPATH.

NOTE [ Kernel-less GPUs ]
Paddle 2.6.2 ships GPU kernels for sm_61..sm_86 and no PTX: on Hopper (sm_90) its own kernels
(add, fill, random, reductions) fail with CUDA error 209 or silently return garbage, while cuBLAS
matmuls, memory copies and CUDA-graph capture/replay of them work. A check meant for such a GPU
uses only those: chains of matmuls (no bias, no activation, each tensor used once so backward
adds nothing), parameters made on the CPU from numpy and moved by copy, explicit loss grads
(``y.backward(dy)``), and grads released with ``clear_gradient(False)`` (zeroing needs a fill).
"""

import contextlib
import dataclasses
import datetime
import functools
import os
import platform
import subprocess
import tempfile

import numpy as np
import paddle

from paddlefleet.cudagraph.backends import cuda_available, pool_sharing_supported
from paddlefleet.cudagraph.options import GraphOptions

__all__ = [
    "RECORD",
    "Record",
    "GENERATED_MARK",
    "SPEED_OPTIONS",
    "MatLayer",
    "MatMLP",
    "SpeedOption",
    "assert_bitwise",
    "bitwise_failures",
    "build",
    "check_smoke_path",
    "close_error",
    "cuda_skip_reason",
    "device",
    "eager_calls",
    "host_tensor",
    "info_lines",
    "normal",
    "option_unsupported",
    "release_grads",
    "run_info",
    "short",
    "write_generated",
]


# ----------------------------------------------------------------------------- device, errors
@contextlib.contextmanager
def device(name):
    """Sets Paddle's current device for the block, restoring the previous one."""
    old = paddle.get_device()
    paddle.set_device(name)
    try:
        yield
    finally:
        paddle.set_device(old)


def short(err, limit=300):
    """The informative line of a (long, multi-line) Paddle error, with the error's type."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    pick = next((line for line in lines if line.startswith("(") and ")" in line[:40]), None)
    pick = pick or next((line for line in lines if "rror" in line), None) or (lines[-1] if lines else "")
    return f"{type(err).__name__}: {pick}"[:limit]


# ----------------------------------------------------------------------------- comparison
def _to_numpy(value):
    return value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}") if a.itemsize in (1, 2, 4, 8) else a


def _array_failure(what, actual, expected):
    a, e = _to_numpy(actual), _to_numpy(expected)
    if a.dtype != e.dtype or a.shape != e.shape:
        return f"{what}: {a.dtype}{list(a.shape)} != eager {e.dtype}{list(e.shape)}"
    if a.tobytes() == e.tobytes():
        return None
    n = int(np.count_nonzero(_bits(a) != _bits(e)))
    diff = np.abs(a.astype("float64") - e.astype("float64")) if a.dtype.kind in "fiub" else None
    biggest = f", max |diff| {np.nanmax(diff):.3g}" if diff is not None and diff.size else ""
    return f"{what}: {n} of {a.size} elements differ in their bits{biggest}"


class Record:
    """What the running test compared and pinned, for tools/gpu_check.py's report (via conftest)."""

    def __init__(self):
        self.compared = 0
        self.notes = []


RECORD = Record()


def bitwise_failures(actual, expected, what="value"):
    """Compares nests of tensors/arrays/scalars bit for bit, None matching None.

    Returns ``(compared, failures)``: how many leaves were compared and a message per mismatch.
    """
    if expected is None or actual is None:
        same = expected is None and actual is None
        return 1, [] if same else [f"{what}: {actual!r} vs eager {expected!r} (one is None)"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            return 1, [f"{what}: keys {sorted(actual) if isinstance(actual, dict) else actual!r} != {sorted(expected)}"]
        pairs = [(actual[k], expected[k], f"{what}[{k!r}]") for k in expected]
    elif isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return 1, [f"{what}: {type(actual).__name__} of {len(actual) if hasattr(actual, '__len__') else '?'} "
                       f"!= {type(expected).__name__} of {len(expected)}"]
        pairs = [(a, e, f"{what}[{i}]") for i, (a, e) in enumerate(zip(actual, expected))]
    elif isinstance(expected, (paddle.Tensor, np.ndarray)):
        failure = _array_failure(what, actual, expected)
        return 1, [] if failure is None else [failure]
    else:
        return 1, [] if actual == expected else [f"{what}: {actual!r} != {expected!r}"]
    compared, failures = 0, []
    for a, e, name in pairs:
        n, f = bitwise_failures(a, e, name)
        compared += n
        failures += f
    return compared, failures


def assert_bitwise(actual, expected, what="value"):
    """Raises AssertionError unless the nests are equal bit for bit; returns the leaves compared."""
    compared, failures = bitwise_failures(actual, expected, what)
    if failures:
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        raise AssertionError("; ".join(failures[:3]) + more)
    return compared


def close_error(actual, reference):
    """Max |actual - reference| relative to max |reference|, in float64 (inf on a shape mismatch).

    For checking that a GPU's kernels compute at all (TF32 matmuls differ from float64 by ~3e-4)."""
    a = _to_numpy(actual).astype("float64")
    ref = np.asarray(reference, dtype="float64")
    if a.shape != ref.shape:
        return float("inf")
    err = float(np.abs(a - ref).max()) if a.size else 0.0
    return err / max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-6) if np.isfinite(err) else float("inf")


# ----------------------------------------------------------------------------- tensors and models
def host_tensor(array, stop_gradient=True):
    """A float32 tensor on the current device from numpy: a host-to-device copy, no kernel."""
    return paddle.to_tensor(np.ascontiguousarray(array, dtype="float32"), stop_gradient=stop_gradient)


def normal(seed):
    """``draw(*shape, scale=1.0)``: float32 standard-normal numpy arrays from one seeded stream."""
    gen = np.random.default_rng(seed)
    return lambda *shape, scale=1.0: (gen.standard_normal(shape) * scale).astype("float32")


class MatLayer(paddle.nn.Layer):
    """y = x @ w: one parameter, no bias, no activation."""

    def __init__(self, din, dout):
        super().__init__()
        self.w = self.create_parameter([din, dout], dtype="float32")

    def forward(self, x):
        return paddle.matmul(x, self.w)


class MatMLP(paddle.nn.Layer):
    """A chain of MatLayers of widths ``dims``: each tensor is used once, so backward adds nothing."""

    def __init__(self, dims):
        super().__init__()
        self.layers = paddle.nn.LayerList([MatLayer(a, b) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(factory, seed):
    """``factory()`` with numpy-random parameters (scale 1/sqrt(rows)), on the current device.

    Made on the CPU and moved by copies: Paddle's initialiser kernels may not run on the GPU
    (NOTE [ Kernel-less GPUs ]). The same seed gives the same parameters."""
    draw = normal(seed)
    target = paddle.get_device()
    with device("cpu"):
        layer = factory()
        for p in layer.parameters():
            p.set_value(draw(*p.shape, scale=1.0 / np.sqrt(p.shape[0])))
    if not target.startswith("cpu"):
        layer.to(device=target)
    return layer


def layer_stack(n, dims, graph=None):
    """``n`` MatMLP(``dims``) Layers in a LayerList (parameters from seed 0), each graphed on its own with
    ``autocudagraph(layer, **graph)`` unless ``graph`` is None: a model graphed layer by layer."""
    layers = build(lambda: paddle.nn.LayerList([MatMLP(dims) for _ in range(n)]), 0)
    if graph is not None:
        from paddlefleet.cudagraph import autocudagraph

        for layer in layers:
            autocudagraph(layer, **graph)
    return layers


def through(layers, x, dy):
    """``x`` through each of ``layers`` in turn, then the backward of the last output with grad ``dy``; that output."""
    h = x
    for layer in layers:
        h = layer(h)
    h.backward(dy)
    return h


def release_grads(*layers):
    """Frees the parameter grads of ``layers`` (clear_gradient(False): no fill kernel)."""
    for layer in layers:
        for p in layer.parameters():
            p.clear_gradient(False)


# ----------------------------------------------------------------------------- what runs here
def _matmul_problem():
    draw = normal(0)
    an, bn = draw(16, 8), draw(8, 4)
    y = paddle.matmul(host_tensor(an), host_tensor(bn))
    err = close_error(y, an.astype("float64") @ bn)
    if err > 2e-2:
        return f"Paddle's matmul is off by {err:.2g} (relative) on this GPU"
    if y.clone().numpy().tobytes() != y.numpy().tobytes():
        return "a device copy (clone) changes values on this GPU"
    return None


@functools.lru_cache(maxsize=None)
def cuda_skip_reason(kernels="all"):
    """None when the cuda backend can run checks needing ``kernels`` here, else why not.

    ``kernels``: "matmul" (cuBLAS matmuls and copies only, NOTE [ Kernel-less GPUs ]) or "all"."""
    if kernels not in ("matmul", "all"):
        raise ValueError(f"cuda_skip_reason: kernels must be 'matmul' or 'all', got {kernels!r}")
    if not cuda_available():
        return f"paddle {paddle.__version__} has no CUDA graphs (CPU build or no GPU)"
    try:
        with device("gpu"):
            problem = _matmul_problem()
            if problem is None and kernels == "all":
                a = paddle.to_tensor([1.0, 2.0])
                if not np.array_equal((a + a).numpy(), [2.0, 4.0]):
                    problem = "Paddle's add kernel returns wrong values on this GPU (no kernels for its architecture)"
    except Exception as err:  # noqa: BLE001 - e.g. CUDA error 209: no kernel image for this GPU
        problem = f"Paddle's kernels do not run on this GPU: {str(err).splitlines()[0][:120]}"
    return problem


@dataclasses.dataclass(frozen=True)
class SpeedOption:
    """An option that trades safety margin for speed, as the tools and the suite exercise it.

    ``keeps_grads``: parameter grads are persistent accumulators the graph adds into, so a
    step must not free them, and accumulation needs Paddle's add kernel. ``per_layer``: timed on
    the models graphed layer by layer too, where it matters most."""

    name: str
    options: dict
    keeps_grads: bool = False
    per_layer: bool = False


SPEED_OPTIONS = (
    SpeedOption("clone_param_grads_false", {"clone_param_grads": False}),
    SpeedOption("clone_param_grads_true", {"clone_param_grads": True}),
    SpeedOption("accumulate_in_graph", {"accumulate_in_graph": True}, keeps_grads=True),
    SpeedOption("clone_outputs_false", {"clone_outputs": False}),
    SpeedOption("chain_calls_false", {"chain_calls": False}, per_layer=True),
)


def option_unsupported(options):
    """None when this version's GraphOptions takes ``options``, else why not (feature detection)."""
    fields = {f.name for f in dataclasses.fields(GraphOptions)}
    missing = sorted(set(options) - fields)
    if missing:
        return f"GraphOptions has no {', '.join(missing)} in this version"
    try:
        GraphOptions(**options)
    except (TypeError, ValueError) as err:
        return f"GraphOptions refuses {options}: {short(err, 160)}"
    return None


def eager_calls(stats):
    """Eager calls after warmup in a wrapper's stats(): the one place that knows the counter's name."""
    return stats["eager_calls"]


# ----------------------------------------------------------------------------- reports
def _command(args, cwd=None):
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu_facts():
    cap = paddle.device.cuda.get_device_capability()
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"gpu": f"{paddle.device.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})",
            "driver": driver.splitlines()[0] if driver else None}


#: Names the commit a report states where the checkout's git cannot (a copy of the working tree on
#: another machine whose .git names an older base): set it to ``git rev-parse --short HEAD`` taken here.
COMMIT_ENV = "PADDLEFLEET_REPORT_COMMIT"


def run_info(on_gpu, repo=None):
    """Facts a report states about its run: versions, GPU, library commit (``COMMIT_ENV`` where set), date."""
    named = os.environ.get(COMMIT_ENV)
    head = _command(["git", "rev-parse", "--short", "HEAD"], cwd=repo) if repo and not named else None
    dirty = _command(["git", "status", "--porcelain", "paddlefleet"], cwd=repo) if head else None
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": named or ((head + (" (+ uncommitted changes in paddlefleet/)" if dirty else "")) if head else None),
        "paddle": paddle.__version__,
        "paddle_commit": str(getattr(paddle.version, "commit", "?"))[:12],
        "paddle_cuda": paddle.version.cuda() if paddle.is_compiled_with_cuda() else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cuda_graphs": cuda_available(),
        "pool_sharing": pool_sharing_supported(),
        "gpu": None,
        "driver": None,
        "tf32_override": os.environ.get("NVIDIA_TF32_OVERRIDE", "unset"),
        "compiled_reads": _compiled_reads(),
    }
    if on_gpu:
        try:
            info.update(_gpu_facts())
        except Exception as err:  # noqa: BLE001 - the report still says what it could
            info["gpu"] = f"? ({short(err)})"
    return info


def _compiled_reads():
    """"in use", or why not (NOTE [ Compiled tensor reads ] in native/__init__.py; loaded here if no wrapper did)."""
    from paddlefleet.cudagraph import native

    try:
        native.load()
    except Exception as err:  # noqa: BLE001 - PADDLEFLEET_CUDAGRAPH_NATIVE=require on a machine that cannot build
        return f"unavailable ({short(err)})"
    active, why = native.status()
    return "in use" if active else f"not in use ({why})"


def info_lines(info):
    """Markdown bullet lines for ``run_info()``'s facts ("?" for any that are missing)."""
    get = lambda key, none="?": none if info.get(key) is None else info[key]  # noqa: E731
    return [
        f"- date: {get('date')}; paddlefleet at {get('commit', '? (no git checkout here)')}",
        f"- paddle {get('paddle')} (commit {get('paddle_commit')}, CUDA {get('paddle_cuda', 'none')}), "
        f"python {get('python')}, numpy {get('numpy')}",
        f"- GPU: {get('gpu', 'none (CPU)')}; driver {get('driver')}; NVIDIA_TF32_OVERRIDE={get('tf32_override')}",
        f"- CUDA graphs: {get('cuda_graphs')}; forward and backward share a pool: {get('pool_sharing')}; "
        f"compiled tensor reads: {get('compiled_reads')}",
    ]


GENERATED_MARK = "<!-- Generated below by {tool}; text above this line is kept when it rewrites the file. -->"


#: Where results are kept: the repository's docs/ (also when the checkout itself lies under the
#: temp directory, as CI's clone may).
_RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "")


def check_smoke_path(path, tool):
    """Raises ValueError unless ``path`` is under the temp directory and outside the repository's
    docs/: a smoke run's numbers say nothing about a GPU and must never land where results are kept."""
    full = os.path.abspath(path)
    if not full.startswith(os.path.join(tempfile.gettempdir(), "")) or full.startswith(_RESULTS_DIR):
        raise ValueError(f"{tool}: a smoke run writes only under {tempfile.gettempdir()}, not to {path}: "
                         "its results say nothing about a GPU. Pass a path under it, or run on the cuda backend.")


def write_generated(path, lines, tool, smoke=False):
    """Writes ``lines`` to ``path`` below the generated-text mark, keeping any text above it.

    ``smoke``: the run was a smoke test (simulated backend, CPU): see ``check_smoke_path``."""
    if smoke:
        check_smoke_path(path, tool)
    mark = GENERATED_MARK.format(tool=tool)
    kept = []
    if os.path.exists(path):
        with open(path) as fh:
            old = fh.read().splitlines()
        if mark in old:
            kept = old[: old.index(mark)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(kept + [mark, ""] + list(lines)) + "\n")
