"""Host (CPU) tensors among a call's inputs and outputs.

NOTE [ Host tensors ]
A CUDA graph records device work only. Whatever the function computes on the host while it is
captured - a shape, a Python branch on a CPU tensor, ``int(cpu_tensor)`` - happens once, at
capture, and every replay repeats the device work that followed from it. So:

* a CPU tensor among the inputs is part of the key *by value* (at most
  ``MAX_HOST_KEY_ELEMENTS`` elements; a larger one is refused when a graph would be made), and
  it is never copied anywhere on replay: the graph was made for exactly that value;
* a CPU tensor among the outputs keeps the value it had at capture (correct when it depends only
  on shapes and keyed values); the caller gets a host copy of it, never a device transfer.

A tensor is a host tensor when it is on the CPU (or pinned memory) while the call has tensors on
a GPU. The simulated backend runs everything on the CPU, so there a test marks host tensors with
``mark_host``; the simulated graph then freezes reads of them at capture as a GPU would.
"""

import numpy as np
import paddle

from ..guards.host_marks import any_marked, is_marked_host, mark_host
from ..errors import CudaGraphError
from .nested import MAX_HOST_KEY_ELEMENTS
from .static_inputs import numel

__all__ = ["MAX_HOST_KEY_ELEMENTS", "mark_host", "is_marked_host", "host_mask", "host_key", "check_host_inputs",
           "check_host_arrays"]

_CUDA_BUILD = paddle.is_compiled_with_cuda()

def host_mask(tensors, on_gpu=None, places=None, place_keys=None):
    """One bool per tensor: is it a host tensor (NOTE [ Host tensors ])? None when none is.

    Args:
        tensors: the call's tensors.
        on_gpu: whether the graph runs on a GPU; None to decide from ``tensors`` (any on a GPU).
        places: the tensors' places when the caller has them (``Tensor.place`` costs ~1 us).
        place_keys: their ``static_inputs.place_key`` values when the caller has them (a GPU
            place's is its device id, an int: no ``is_gpu_place()`` call per tensor).
    """
    mask = None
    if any_marked():
        mask = [is_marked_host(t) for t in tensors]
    if _CUDA_BUILD:
        if place_keys is not None:
            gpu = [type(k) is int for k in place_keys]
        else:
            gpu = [p.is_gpu_place() for p in (places if places is not None else [t.place for t in tensors])]
        if on_gpu is None:
            on_gpu = any(gpu)
        if on_gpu and not all(gpu):
            cpu = [not g for g in gpu]
            mask = cpu if mask is None else [a or b for a, b in zip(mask, cpu)]
    if mask is None or not any(mask):
        return None
    return mask


def host_key(t):
    """The by-value key part of a host tensor, or ``("too large", numel)``."""
    n = numel(t)
    if n > MAX_HOST_KEY_ELEMENTS:
        return ("too large", n)
    return ("value", t.numpy().tobytes())


def check_host_inputs(tensors, mask, names):
    """Raises CudaGraphError for a host input too large to be keyed by value."""
    for i, (t, is_host) in enumerate(zip(tensors, mask)):
        if is_host and numel(t) > MAX_HOST_KEY_ELEMENTS:
            name = names[i] if i < len(names) else f"tensor #{i}"
            raise CudaGraphError(
                f"autocudagraph: input '{name}' is a CPU tensor with {numel(t)} elements, more than the "
                f"{MAX_HOST_KEY_ELEMENTS} a key can hold by value. A graph bakes in what the host read at "
                "capture, so CPU inputs select the graph by value. Move it to the GPU, pass a Python "
                "value, or return None from dispatch_key_fn for such calls."
            )


def check_host_arrays(named):
    """Raises CudaGraphError for a numpy array argument too large to be keyed by value (NOTE [ Numpy
    arguments ] in io/nested.py); ``named``: the call's ``[(argument name, value)]``."""
    for name, value in named:
        _check_array(name, value)


def _check_array(name, value):
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_array(f"{name}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_array(f"{name}[{k!r}]", v)
    elif type(value) is np.ndarray and value.size > MAX_HOST_KEY_ELEMENTS:
        raise CudaGraphError(
            f"autocudagraph: argument '{name}' is a numpy array with {value.size} elements (shape "
            f"{list(value.shape)}), more than the {MAX_HOST_KEY_ELEMENTS} a key can hold by value. A graph bakes in "
            "what the function reads from host data at capture, so host arrays select the graph by value. Pass it "
            "as a tensor (paddle.to_tensor(array) before the call: it is copied into the graph on every call), or "
            "return None from dispatch_key_fn for such calls."
        )
