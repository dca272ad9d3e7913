"""Compiled tensor reads for the checks every call makes (NOTE [ Compiled tensor reads ]).

NOTE [ Compiled tensor reads ]
Every call of a wrapper reads each argument tensor's shape, dtype, place and stop_gradient (its key, or
KeyMaker.is_key_of against the latest key), every replay reads each parameter's data pointer and
stop_gradient (ParamSet.moved), and every backward replay the data pointer, in-place version or state of each
grad view it handed out before (GradPlan: NOTE [ Reused aliases ], NOTE [ Freed aliases re-pointed ]). Each
such read is a Python property or method of Paddle's Tensor that makes a Python object (a shape list, a dtype
enum, a Place, an int): 0.1-0.5 us alone and 2-3x that inside a call, whose other work has pushed them out of
the CPU's caches (measured on the CPU with Paddle 2.6.2: is_key_of of one tensor 3.5 us alone, 7.8 inside a
training step). tensor_reads.cc reads the same values from the C++ tensor (Paddle's extension headers:
paddle::Tensor, and the Tensor object's layout of paddle/utils/pybind.h) and compares them with the key's values
without making Python objects: ``match(tensors, metas)`` and ``moved(homes)`` ~0.07 us; ``key_of`` compares a
whole call with a key (its tensors, grad mode, autocast and the Layers' training flags: KeyMaker.is_key_of) in one
call; ``versions``, ``unchanged`` and ``freed_unchanged`` read a whole hand-out's views in one call; ``ptrs_hold`` and
``flags_hold`` a whole step's parameters' data pointers and ``stop_gradient`` flags (NOTE [ Step replay checks ] in
step/replay_checks.py; tools/cpu_host_time.py times the step's preconditions both ways); ``empty_like_each``
makes the unfilled outputs a chain's head call hands its later members (chains/bridge.py: Paddle's own ``empty()``
per tensor, the Python objects made as Paddle makes an op's output): with its copy, 9.8 us a tensor against 12.5
through ``_C_ops.empty`` on an H200 host (docs/reports/copy_probe.md). Grad mode and the autocast state,
which every key and every replay read (``paddle.is_grad_enabled()``, ``amp_state()`` in core/state.py: pybind
properties of the tracer, ~1 us each alone and 3-4 us inside a call), come from ``state()``: Paddle's own getters
of the tracer (public members of paddle::imperative::Tracer, bound by their symbols, weakly: the header declaring
them is not shipped), ~0.08 us, None where Python's tracer is None (static mode). A graphed layer call costs
13.8 us less host time with them (16 parameters; 12.1 us with 6) on an H200 host, timed side by side
(docs/reports/host_breakdown.md); the state read alone took a fallen-back key's eager call from +16 to +8 us over the
Layer's own forward on the CPU (tools/cpu_host_time.py --eager-calls, Paddle 2.6.2, runs minutes apart).

It answers exactly what the Python reads answer, or None where it cannot tell, and the caller then reads in
Python as before (the same values, the same errors): a tensor that is not a defined, initialized dense tensor
(an uninitialized one raises in Python; a zero-size one holds no memory), a 4-D tensor (Paddle's layout autotune
may permute the shape Python reports), a place other than CPU and GPU, a dtype missing from the table. The table
of ``int(t.dtype)`` by Paddle's C++ DataType code is made at load from tensors of each dtype (Paddle 2.6 reports
the proto VarType, 3.x the DataType), and the module is checked against the Python reads of a few tensors, and
``state()`` against Python's in every grad mode, autocast level and dtype (set on the tracer and put back), before
it is used.

Built on first use (the first wrapper made in a process) with the machine's C++ compiler, against the installed
Paddle's headers, into ``$PADDLEFLEET_CACHE_DIR`` (default ``~/.cache/paddlefleet``), one file per source, Paddle
and Python (about 1.5 s once); loaded from there afterwards. Where it cannot be built or loaded (no compiler, a
Paddle without its headers, a failed check) every read stays in Python, and ``status()`` (and the doctor) says
why. ``PADDLEFLEET_CUDAGRAPH_NATIVE=0`` keeps the reads in Python; ``=require`` makes an unavailable module an
error (CI and the GPU checks use it, so that a silent fallback cannot pass for the compiled path). The Python
reads stay the tested fallback: tests/native compares both on every kind of tensor above, and trains graphed
Layers (grads freed, grads zeroed) bitwise eager's with the module and without it.
"""

import logging
import operator
import os
import threading

import numpy as np
import paddle

from ..errors import CudaGraphError
from ..io.static_inputs import key_meta  # the Python read the module replaces, for its check

__all__ = ["ENV_NATIVE", "reads", "state_read", "load", "status", "disabled", "ptrs_hold", "flags_hold"]

logger = logging.getLogger(__name__)

#: ``0``: reads in Python; ``1`` (default): compiled where it can be built; ``require``: compiled or an error.
ENV_NATIVE = "PADDLEFLEET_CUDAGRAPH_NATIVE"
_VALUES = ("0", "1", "require")

#: The compiled module once loaded and checked, else None (every read in Python). Read on every call.
reads = None

#: The module's ``state()`` once bound and checked: ``(grad enabled, amp_state())`` read from Paddle's tracer, or
#: None where it cannot tell; None where the module or the tracer's getters are unavailable (read in Python).
state_read = None

_state = {"loaded": False, "why": "not loaded yet (no wrapper made in this process)"}
_lock = threading.Lock()

# dtypes whose codes go into the table (those this Paddle has: 3.x adds float8 types)
_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")


def _mode():
    value = os.environ.get(ENV_NATIVE, "1").strip().lower()
    if value not in _VALUES:
        raise ValueError(f"{ENV_NATIVE}={value!r}: expected one of {', '.join(_VALUES)} (0 keeps the tensor reads "
                         "in Python, 1 compiles them where it can, require fails where it cannot).")
    return value


def _dtype_table(module):
    """``int(t.dtype)`` by C++ DataType code, as a tuple (None where no dtype of this Paddle has the code)."""
    ints = {}
    for name in _DTYPES:
        dtype = getattr(paddle, name, None)
        if dtype is None:
            continue
        try:  # made on the CPU: a copy and a CPU cast (a GPU may lack this Paddle's kernels)
            t = paddle.to_tensor(np.zeros([1], "float32"), place=paddle.CPUPlace()).astype(dtype)
        except Exception:  # noqa: BLE001 - a dtype this build cannot make on the CPU stays out of the table
            continue
        code = module.dtype_code(paddle.Tensor, t)
        if code is not None and code >= 0:
            ints[code] = int(t.dtype)
    return tuple(ints.get(code) for code in range(max(ints, default=-1) + 1))


def _check(module):
    """None when the module reads what Python reads on a few tensors, else what differed."""
    # copies from numpy only: no kernel runs (a GPU may lack this Paddle's kernels)
    arrays = [np.zeros([3, 5], "float32"), np.zeros([7], "int64"), np.array(1.5, "float32"),
              np.zeros([2, 3, 4], "float16"), np.zeros([1, 2], "bool")]
    places = [paddle.CPUPlace()]
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        places.append(paddle.CUDAPlace(0))
    probes = [paddle.to_tensor(a, place=place) for place in places for a in arrays]
    probes[0].stop_gradient = False
    for t in probes:
        want = key_meta(t)
        got = module.meta(t)
        if got != want or type(got[0]) is not tuple:
            return f"the compiled read of a {t.dtype} tensor {want} gave {got}"
        other = (want[0] + (1,), want[1], want[2], want[3])
        if module.match((t,), (want,)) is not True or module.match((t,), (other,)) is not False:
            return f"the compiled match of a {t.dtype} tensor {want} was wrong"
        if module.data_ptr(t) != t.data_ptr():
            return f"the compiled data pointer of a {t.dtype} tensor differs"
        if module.ptrs_hold((t,), [t.data_ptr()]) is not True or module.flags_hold((t,), [t.stop_gradient]) is not True:
            return f"the compiled pointer or flag walk of a {t.dtype} tensor differs"
    made = module.empty_like_each(probes)
    for t, got in zip(probes, made or ()):
        want = paddle._C_ops.empty(t.shape, t.dtype, t.place)
        if key_meta(got) != key_meta(want) or not got._is_initialized() or got.data_ptr() == t.data_ptr():
            return f"the compiled empty_like_each of a {t.dtype} tensor gave {key_meta(got)}, Python {key_meta(want)}"
    if made is None or len(made) != len(probes):
        return "the compiled empty_like_each made no tensors"
    return None


def _check_state(module):
    """None when the module's ``state()`` reads what Python reads in every grad mode, autocast level and dtype
    (each set on the tracer and put back), else why not."""
    from ..core import state  # the Python reads the module replaces

    framework = paddle.base.framework
    global_var = getattr(framework, "global_var", None)
    if global_var is None or not module.setup_state(global_var):
        return "this Paddle lacks a getter of the tracer's grad mode or autocast state"
    tracer = framework._dygraph_tracer()
    if tracer is None:
        return "no dygraph tracer when the module was loaded"
    amp_levels = getattr(paddle.base.core, "AmpLevel", None)  # a Paddle without the enum: its current level only
    levels = list(amp_levels.__members__.values()) if amp_levels is not None else [tracer._amp_level]
    saved = tracer._amp_level, tracer._amp_dtype
    try:
        for grad in (True, False):
            with paddle.set_grad_enabled(grad):
                for level in levels:
                    for dtype in ("float16", "bfloat16", "float32"):
                        tracer._amp_level, tracer._amp_dtype = level, dtype
                        want, got = (paddle.is_grad_enabled(), state.amp_state()), module.state()
                        if got != want:
                            return f"the compiled read of grad mode and autocast gave {got}, Python {want}"
    finally:
        tracer._amp_level, tracer._amp_dtype = saved
    return None


def load():
    """Builds (first use on this machine) and loads the module once per process; sets ``reads`` and ``state_read``.

    Raises:
        ValueError: for a value of PADDLEFLEET_CUDAGRAPH_NATIVE other than 0, 1, require.
        CudaGraphError: with ``require``, when the module is unavailable.
    """
    global reads, state_read
    if _state["loaded"]:
        return
    mode = _mode()
    with _lock:
        if _state["loaded"]:
            return
        module, why = None, None
        if mode == "0":
            why = f"{ENV_NATIVE}=0: tensor reads in Python"
        else:
            from .build import NotBuilt, built_module

            try:
                module = built_module()
                module.setup(paddle.Tensor, _dtype_table(module))
                why = _check(module) or _check_state(module)
            except NotBuilt as err:
                why = str(err)
            except Exception as err:  # noqa: BLE001 - any failure of the check leaves the reads in Python
                why = f"checking the compiled reads failed: {type(err).__name__}: {err}"
            if why is not None:
                module = None
                logger.info("paddlefleet.cudagraph: compiled tensor reads unavailable (%s); reading in Python", why)
        reads = module
        state_read = None if module is None else module.state
        _state.update(loaded=True, why=why)
    if module is None and mode == "require":
        raise CudaGraphError(f"{ENV_NATIVE}=require, but the compiled tensor reads are unavailable: {why}. "
                             f"Install a C++ compiler (g++) and a Paddle with its headers, or unset {ENV_NATIVE}.")


def status():
    """``(active, why not)``: whether the compiled reads are in use in this process, and the reason where not."""
    return reads is not None, _state["why"]


_data_ptr = paddle.Tensor.data_ptr
_stop_gradient = operator.attrgetter("stop_gradient")


def ptrs_hold(tensors, ptrs):
    """``[t.data_ptr() for t in tensors] == ptrs`` (``ptrs`` a list), read in one compiled call where it can be, else
    in Python (step/replay_checks.py's walks, chains/link_graphs.py's link check)."""
    same = None if reads is None else reads.ptrs_hold(tensors, ptrs)
    return same if same is not None else list(map(_data_ptr, tensors)) == ptrs


def flags_hold(tensors, flags):
    """``[t.stop_gradient for t in tensors] == flags`` (``flags`` a list), read in one compiled call where it can be,
    else in Python."""
    same = None if reads is None else reads.flags_hold(tensors, flags)
    return same if same is not None else list(map(_stop_gradient, tensors)) == flags


class disabled:
    """``with native.disabled():`` every read in Python inside the block (tests of the fallback)."""

    def __enter__(self):
        global reads, state_read
        self._saved = reads, state_read
        reads = state_read = None
        return self

    def __exit__(self, *exc):
        global reads, state_read
        reads, state_read = self._saved
        return False
