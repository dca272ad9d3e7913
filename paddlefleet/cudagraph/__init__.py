"""Automatic CUDA graphs for PaddlePaddle training: ``autocudagraph`` (blocks) and
``autocudagraph_step`` (the whole training step).

``paddlefleet`` itself is a namespace package (no ``paddlefleet/__init__.py``): this project only
adds ``paddlefleet.cudagraph`` to it, so Paddle's own PaddleFleet (a regular ``paddlefleet``
package) is not shadowed and PaddleFormers' probe for it stays False (docs/guides/recipes.md).
"""

__version__ = "0.1.0"

import logging as _logging

# The package logger "paddlefleet.cudagraph" starts at WARNING; setLevel(logging.INFO) shows one line per
# capture (README.md, section "Logging").
_logging.getLogger(__name__).setLevel(_logging.WARNING)


def _without_paddle(err):
    """What importing the package raises where ``import paddle`` failed: an ImportError saying what to install,
    or, under ``python -m paddlefleet.cudagraph`` (doctor, demo), SystemExit with that text and no traceback."""
    import sys

    missing = isinstance(err, ModuleNotFoundError) and err.name == "paddle"
    what = "Paddle is not installed" if missing else f"Paddle is installed but does not import ({err})"
    text = (f"{what}: paddlefleet.cudagraph needs PaddlePaddle. Install one build: 'pip install paddlepaddle' on a "
            "CPU; on a GPU a Paddle 3.x GPU build for your CUDA version from Paddle's package index ('pip install "
            "paddlepaddle-gpu -i https://www.paddlepaddle.org.cn/packages/stable/cu126/', cu118 or cu129 for other "
            "CUDA versions), or PyPI's 'paddlepaddle-gpu==2.6.2' as the fallback up to Ampere (README.md, section "
            "'Install on a GPU'). Then check with 'python -m paddlefleet.cudagraph doctor'.")
    argv = list(getattr(sys, "orig_argv", ()))
    command = "-m" in argv[:-1] and argv[argv.index("-m") + 1] in (__name__, __name__ + ".__main__")
    return SystemExit(text) if command else ImportError(text)


try:
    import paddle  # noqa: F401
except ImportError as _err:
    raise _without_paddle(_err) from _err

from .core import cross_entropy  # noqa: F401  (cross_entropy registers its device decisions)
from .guards import layer_attrs, paddle_patches, saved_hooks
from .grads import hook_registry
from .block import partial_grad
from .chains import outputs as chain_outputs
from .api import autocudagraph
from .core.explain import explain_model, report_model
from .backends import is_capturing
from .step.grad_scaler import GraphGradScaler
from .errors import CaptureError, CudaGraphError, InputMismatchError, PendingBackwardError, StaleOutputError
from .options import GraphOptions
from .step.graphed_step import autocudagraph_step

# The patches that stay for the rest of the process, installed by the first wrapper, not by this import
# (NOTE [ Paddle patches ] in guards/paddle_patches.py):
paddle_patches.on_first_wrapper(
    hook_registry.install,  # NOTE [ Grad consumers ] in grads/hook_registry.py
    saved_hooks.install,  # NOTE [ Saved-tensors hooks ] in guards/saved_hooks.py: calls under them run eagerly
    partial_grad.install,  # NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py
    layer_attrs.install,  # NOTE [ Layer attributes a replay freezes ] in guards/layer_attrs.py
)
# Only chains need these: the first wrapper with chain_calls=True installs them.
paddle_patches.on_first_wrapper_with("chain_calls", chain_outputs.install)  # NOTE [ Hooks on a chain's outputs ]

__all__ = [
    "__version__",
    "autocudagraph",
    "autocudagraph_step",
    "explain_model",
    "report_model",
    "GraphGradScaler",
    "is_capturing",
    "GraphOptions",
    "CudaGraphError",
    "CaptureError",
    "InputMismatchError",
    "PendingBackwardError",
    "StaleOutputError",
]
