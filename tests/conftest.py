"""Suite-wide switch: PADDLEFLEET_CUDAGRAPH_BACKEND=cuda runs the suite on the real backend.

Where the cuda backend cannot run (no CUDA build, or a GPU its Paddle has no kernels for) every
test is skipped with that reason. Where it can, the backend-parameterised tests run their cuda
variants, and tests written for the simulated backend only (multi-process CPU jobs, CPU-specific
behaviour) are skipped with the reason.
"""

import os

import pytest

from paddlefleet.cudagraph.options import ENV_BACKEND

from .harness import BackendCase, cuda_skip_reason


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENV_BACKEND) != "cuda":
        return
    reason = cuda_skip_reason()
    for item in items:
        cls = getattr(item, "cls", None)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"{ENV_BACKEND}=cuda: {reason}"))
        elif cls is None or not issubclass(cls, BackendCase):
            item.add_marker(pytest.mark.skip(reason=f"{ENV_BACKEND}=cuda: this test is written for the simulated backend"))
