"""Safety checks around graphed calls: where in the user's code something happened, host (CPU)
tensors among a call's IO, inputs a function writes in place, and outputs a later replay
overwrote.

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

NOTE [ Stale outputs ]
With ``clone_outputs=False`` a call returns aliases of the graph's static output buffers, and
the next replay of the same key rewrites them. With ``check_stale_outputs=True`` every alias
handed out is remembered (weakly); the next replay of its key marks the aliases still alive as
stale and releases their storage handle (the static buffer itself is untouched). Afterwards:

* passing a stale tensor to any graphed call raises StaleOutputError naming the replay that
  overwrote it (checked before anything else reads the tensor);
* any Paddle op or backward that reads it fails loudly ("Tensor holds no memory") instead of
  reading the new values: this also covers autograd, e.g. ``loss = (y * w).sum()`` whose
  backward would otherwise use the overwritten ``y``;
* not detected: ``y.numpy()`` returns an empty array and ``print(y)`` shows "Not
  initialized" (Paddle's behaviour for a tensor without storage); ``y.shape`` still reads;
  views taken from ``y`` before the overwrite (``y[0]``, ``y.reshape(...)``, ``y.T``) share the
  static buffer's storage through their own handle and silently read the new values, in
  autograd too. Clone an output before taking views you keep across calls.
"""

import os
import sys
import weakref

import paddle

from .errors import CudaGraphError, StaleOutputError
from .static_io import numel

__all__ = [
    "MAX_HOST_KEY_ELEMENTS",
    "mark_host",
    "is_marked_host",
    "host_mask",
    "host_key",
    "check_host_inputs",
    "user_location",
    "user_call_site",
    "user_stacklevel",
    "StaleOutputs",
    "check_fresh",
]

#: Largest CPU input tensor (in elements) that a call's key holds by value.
MAX_HOST_KEY_ELEMENTS = 1024

_CUDA_BUILD = paddle.is_compiled_with_cuda()

# ---------------------------------------------------------------------------- user location

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PADDLE_DIR = os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _is_library(filename):
    """True for frames of autocudagraph, of Paddle and of the standard library."""
    path = os.path.abspath(filename)
    if path.startswith(_OWN_DIR) or path.startswith(_PADDLE_DIR):
        return True
    if path.startswith(_STDLIB_DIR) and "-packages" not in path[len(_STDLIB_DIR):]:
        return True
    return filename.startswith("<")  # <frozen importlib...>, <string>


def user_location(tb):
    """``"file:line in function"`` of the innermost traceback frame outside autocudagraph,
    Paddle and the standard library (where the user's code raised or called the op that
    failed), or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _is_library(code.co_filename):
            found = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found


def _first_user_frame():
    frame, depth = sys._getframe(1), 1
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, depth = frame.f_back, depth + 1
    return frame, depth


def user_call_site():
    """``"file:line"`` of the innermost stack frame outside autocudagraph and Paddle."""
    frame, _ = _first_user_frame()
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def user_stacklevel():
    """``stacklevel`` for warnings.warn called by the caller of this function, pointing at the
    user's frame (also through Layer.__call__ and other Paddle frames)."""
    _, depth = _first_user_frame()
    return max(depth - 1, 1)


# ---------------------------------------------------------------------------- host tensors

# id -> weakref of tensors marked as host tensors (simulated backend only).
_marked = {}


def mark_host(t):
    """Marks ``t`` as a host (CPU) tensor for the simulated backend and returns it.

    On the simulated backend every tensor is on the CPU; a test marks the ones a GPU program
    would keep on the host (NOTE [ Host tensors ]). Marks do not propagate to results of ops.
    """
    key = id(t)
    _marked[key] = weakref.ref(t, lambda _, key=key: _marked.pop(key, None))
    return t


def is_marked_host(t):
    """True when ``t`` was marked with mark_host()."""
    if not _marked:
        return False
    ref = _marked.get(id(t))
    return ref is not None and ref() is t


def host_mask(tensors, on_gpu=None, places=None):
    """One bool per tensor: is it a host tensor (NOTE [ Host tensors ])? None when none is.

    Args:
        tensors: the call's tensors.
        on_gpu: whether the graph runs on a GPU; None to decide from ``tensors`` (any on a GPU).
        places: the tensors' places when the caller has them (``Tensor.place`` costs ~1 us).
    """
    mask = None
    if _marked:
        mask = [is_marked_host(t) for t in tensors]
    if _CUDA_BUILD:
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


# ---------------------------------------------------------------------------- stale outputs

# id -> (weakref, message) of outputs a later replay overwrote (NOTE [ Stale outputs ]).
_stale = {}


def _forget(key):
    _stale.pop(key, None)


def check_fresh(tensors):
    """Raises StaleOutputError when one of ``tensors`` is an output a later replay overwrote."""
    if not _stale:
        return
    for t in tensors:
        rec = _stale.get(id(t))
        if rec is not None and rec[0]() is t:
            raise StaleOutputError(rec[1])


class StaleOutputs:
    """The aliases one key handed out at its latest replay, to mark stale at the next one."""

    def __init__(self):
        self._handed = []
        self._replay = 0

    def overwrite(self, name, label, call_site):
        """Called right before a replay rewrites the static outputs: marks the previous
        replay's aliases that are still alive as stale and releases their storage handle."""
        self._replay += 1
        handed, self._handed = self._handed, []
        for index, ref in handed:
            t = ref()
            if t is None or not t._is_initialized():
                continue
            message = (
                f"autocudagraph: this tensor is output {index} of {name} from run #{self._replay - 1} of the "
                f"graph of key {label}, and run #{self._replay} of that graph, called at {call_site}, "
                "overwrote it: with clone_outputs=False outputs are the graph's static buffers. Clone an "
                f"output you keep across calls (y = {name}(...).clone()), or use clone_outputs=True."
            )
            key = id(t)
            _stale[key] = (weakref.ref(t, lambda _, key=key: _forget(key)), message)
            t._clear_data()

    def hand_out(self, outputs, copies=()):
        """Remembers (weakly) the aliases given to the caller by this replay; ``copies``: indices
        of outputs handed out as copies (host outputs), which no replay overwrites."""
        self._handed = [(i, weakref.ref(o)) for i, o in enumerate(outputs) if i not in copies]
