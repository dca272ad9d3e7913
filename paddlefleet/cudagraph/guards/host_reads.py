"""Host values a whole-step graph would freeze: what a step reads on the host, compared across
steps, so that a value that changes is refused (or, on a replay, sent to eager) instead of
being replayed with the value capture saw.

NOTE [ Host values of a step ]
A CUDA graph replays kernels with the arguments they had at capture. Whatever the step computes
on the host - a Python counter, ``random.random()``, a branch on Python state, a value read from
a global - reaches the device as a kernel argument or as a choice of kernels, and a replay
repeats the capture-time choice. Two checks make that visible instead of silent:

* ``OpTrace`` records every Paddle op the step calls (``paddle._C_ops``, ``_legacy_C_ops``,
  the Tensor operators implemented in C++, ``t[i] = v``, ``paddle.to_tensor``) with its non-tensor
  arguments.
  The capture's trace must equal the last warmup step's: a differing argument or op sequence
  means the step reads a host value that changes, and the capture is refused naming the op,
  both values and the user's line. On the simulated backend every replay re-runs the step's
  Python, so each replay is traced too: a replay whose trace differs from the capture's is one
  a GPU would have replayed wrong, and its key falls back to eager with a warning.
* ``BindingWatch`` remembers which object each global name and closure variable of the step
  function is bound to. A rebinding between steps (``count += 1`` in the loop, a new ``batch``
  global) is refused at capture and sends later calls to eager; it costs a few dictionary
  reads per call, so it runs before every replay on every backend.

Only the thread that runs the step is traced: another thread's ops (a DataLoader's prefetch thread
collating the next batch with ``paddle.to_tensor``) are not part of the step, and a capture is
thread-local (NOTE [ Host access during capture ] in guards/host_guard.py).

Limits: ops reached without Python (custom C++ operators, the DataParallel reducer) are not
traced; a value that changes only every N steps is caught at capture only if it changed
between the last warmup step and the capture (the simulated backend catches it on the replay
where it changes); host side effects of the step (appending to a list, printing) happen at
warmup and capture only.
"""

import gc
import math
import threading
import operator
import sys
import types

import numpy as np
import paddle

from .host_marks import is_marked_host
from .location import _is_library
from .paddle_patches import Patches

__all__ = ["OpTrace", "BindingWatch", "describe_trace_difference", "short_repr"]

# Tensor operators implemented in C++ (their scalar operands never pass through _C_ops).
_TENSOR_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__div__", "__rdiv__", "__floordiv__", "__mod__", "__pow__", "__rpow__", "__matmul__", "__lt__", "__le__",
    "__gt__", "__ge__", "__eq__", "__ne__", "__and__", "__or__", "__xor__",
)
_NATIVE = ("method_descriptor", "wrapper_descriptor", "builtin_function_or_method")
_MAX_ELEMENTS = 64  # host arrays larger than this are compared by a digest


_OP_NAMES = []


def _op_names():
    """``[(prefix, module, [names of its public callables])]``, listed once (dir() is slow)."""
    if not _OP_NAMES:
        modules = [("_C_ops", paddle._C_ops)]
        legacy = getattr(paddle, "_legacy_C_ops", None)
        if legacy is not None:
            modules.append(("_legacy_C_ops", legacy))
        for prefix, module in modules:
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            _OP_NAMES.append((prefix, module, names))
    return _OP_NAMES


_TENSOR = ("T",)


def _norm(value, hosts):
    """A hashable, comparable form of one op argument: tensors by kind (a host tensor is also
    appended to ``hosts`` when it is a list), host values by value."""
    if isinstance(value, paddle.Tensor):
        if hosts is not None and (is_marked_host(value) or (hosts.on_gpu and value.place.is_cpu_place())):
            hosts.append(value)
        return _TENSOR
    if isinstance(value, float):
        return ("f", value.hex() if math.isfinite(value) else repr(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v, hosts) for v in value)
    if isinstance(value, dict):
        return tuple((k, _norm(v, hosts)) for k, v in value.items())
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        data = arr.tobytes() if arr.size <= _MAX_ELEMENTS else hash(arr.tobytes())
        return ("nd", str(arr.dtype), arr.shape, data)
    if isinstance(value, (slice, range)):
        return (type(value).__name__, _norm(value.start, hosts), _norm(value.stop, hosts), _norm(value.step, hosts))
    if value is Ellipsis:
        return "..."
    if isinstance(value, (types.FunctionType, types.MethodType, type)):
        return ("callable", getattr(value, "__qualname__", type(value).__name__))
    text = str(value)  # dtypes, places, enums: their text is their identity
    return ("obj", type(value).__name__, text if len(text) <= 80 else text[:80])


def _user_line():
    frame = sys._getframe(2)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class OpTrace:
    """While active, records ``(op, non-tensor arguments)`` of every Paddle op called.

    Args:
        on_gpu: whether the step runs on a GPU (CPU tensors then count as host values).
        where: also record the user's line of each op (for messages; costs a frame walk per op).
    """

    def __init__(self, on_gpu=False, where=True):
        self.ops = []
        self.lines = []
        self.host_ops = []
        self._on_gpu = on_gpu
        self._where = where
        self._patches = Patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        self._depth = 0
        self._thread = threading.get_ident()  # the step's thread: other threads' ops are theirs

    def _wrap(self, label, original):
        trace = self

        def traced(*args, **kwargs):
            if trace._depth or threading.get_ident() != trace._thread:  # an op called by an op: one record
                return original(*args, **kwargs)
            hosts = _Hosts(trace._on_gpu)
            trace.ops.append((label, _norm(args, hosts), _norm(kwargs, hosts) if kwargs else ()))
            if trace._where:
                trace.lines.append(_user_line())
            if hosts:
                trace.host_ops.append((len(trace.ops) - 1, label))
            trace._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                trace._depth -= 1

        return traced

    def __enter__(self):
        # ~2000 wrappers: allocating them would trigger collections over Paddle's whole heap (~3 ms).
        collecting = gc.isenabled()
        gc.disable()
        try:
            for prefix, module, names in _op_names():
                own = module.__dict__
                for name in names:
                    original = own.get(name)
                    if original is None:
                        original = getattr(module, name)
                    # Read now, not cached: another patch in force (DrawGuard) stays in force.
                    self._patches.set(module, name, self._wrap(f"{prefix}.{name}", original))
            for name in _TENSOR_OPERATORS:
                original = paddle.Tensor.__dict__.get(name)
                # A replacement that stands for a native operator (backends/simulated.py) is traced as it.
                if original is not None and type(getattr(original, "__native__", original)).__name__ in _NATIVE:
                    self._patches.set(paddle.Tensor, name, self._wrap(f"Tensor.{name}", original))
            # ``t[i] = v`` runs in C++ (no _C_ops call): its index and scalar value are kernel arguments.
            self._patches.set(paddle.Tensor, "__setitem__", self._wrap("Tensor.__setitem__", paddle.Tensor.__setitem__))
            self._patches.set(paddle, "to_tensor", self._wrap("paddle.to_tensor", paddle.to_tensor))
        except BaseException:
            self._restore()
            raise
        finally:
            if collecting:
                gc.enable()
        return self

    def _restore(self):
        self._patches.restore()

    def __exit__(self, *exc):
        self._restore()
        return False

    def host_inputs(self):
        """``[(index, op, line)]`` of ops that read a host tensor (a CPU tensor on a GPU step, or
        one marked with mark_host on the simulated backend)."""
        return [(i, op, self.lines[i] if i < len(self.lines) else None) for i, op in self.host_ops]


class _Hosts(list):
    """The host tensors among one op's arguments."""

    def __init__(self, on_gpu):
        super().__init__()
        self.on_gpu = on_gpu


def _show(value):
    """A readable form of a normalised argument."""
    if value == _TENSOR:
        return "<tensor>"
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "f":
        text = value[1]
        return repr(float.fromhex(text)) if text.startswith(("0x", "-0x")) else text
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _argument_difference(a, b):
    """``"argument 2: 2.0 -> 3.0"`` for the first differing argument of one op in two traces."""
    args_a, args_b = a[1], b[1]
    if len(args_a) == len(args_b):
        for k, (x, y) in enumerate(zip(args_a, args_b)):
            if x != y:
                return f"argument {k} {_show(x)} at the {{0}} and {_show(y)} at the {{1}}"
    return f"keyword arguments {_show(a[2])} at the {{0}} and {_show(b[2])} at the {{1}}"


def describe_trace_difference(before, after, before_name, after_name, lines=()):
    """None when the two traces record the same ops with the same host values, else a sentence
    naming the first difference (and the user's line, when ``lines`` of ``after`` or ``before``
    are known)."""
    if before.ops == after.ops:
        return None
    for i, (a, b) in enumerate(zip(before.ops, after.ops)):
        if a != b:
            where = (after.lines[i] if i < len(after.lines) else None) or (
                before.lines[i] if i < len(before.lines) else None) or (lines[i] if i < len(lines) else None)
            at = f" at {where}" if where else ""
            if a[0] != b[0]:
                return (f"op #{i} was {a[0]} at the {before_name} and {b[0]} at the {after_name}{at} (the code "
                        "takes another branch)")
            return f"op #{i} {a[0]}{at} got " + _argument_difference(a, b).format(before_name, after_name)
    longer, name = (before, before_name) if len(before.ops) > len(after.ops) else (after, after_name)
    i = min(len(before.ops), len(after.ops))
    return (f"the {before_name} ran {len(before.ops)} ops and the {after_name} {len(after.ops)}; the first extra op "
            f"at the {name} is {longer.ops[i][0]}")


class BindingWatch:
    """The objects the global names and closure variables of a function are bound to.

    ``changed(other)`` names the first binding that differs (by identity) between two snapshots.
    """

    def __init__(self, fn):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        self._globals = getattr(fn, "__globals__", {})
        self._names = sorted(_global_names(code)) if code is not None else []
        self._cells = list(zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()))

    def snapshot(self):
        """``{name: object}`` of every binding now (names not bound yet are left out)."""
        snap = {}
        g = self._globals
        for name in self._names:
            if name in g:
                snap[name] = g[name]
        for name, cell in self._cells:
            try:
                snap[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        return snap

    @staticmethod
    def changed(before, after):
        """``(name, old, new)`` of the first name bound to another object, or None."""
        for name, value in after.items():
            old = before.get(name, value)
            if old is not value:
                return name, old, value
        return None

    def unchanged_since(self, snapshot):
        """A function of no arguments that returns True only when ``changed(snapshot, snapshot())``
        would now return None, without building the snapshot: one C-level walk over the globals
        bound in ``snapshot`` and one over the cells (NOTE [ Step replay checks ] in
        step/replay_checks.py). False means "look": ``changed`` then says what moved, if anything.
        None when ``snapshot`` binds nothing (changed() can then find nothing)."""
        cell_names = [name for name, _ in self._cells]
        if any(name not in snapshot for name in cell_names):  # a cell empty then: always look
            return _look
        if not self._cells and not any(n in snapshot for n in self._names):
            return None  # nothing bound that could change
        # Names unbound in ``snapshot`` cannot count as changed (changed() skips them); a global
        # unbound now reads as its old object (likewise); a cell shadows the global of its name.
        names = tuple(n for n in self._names if n in snapshot and n not in cell_names)
        was = tuple(snapshot[n] for n in names)
        cells = tuple(cell for _, cell in self._cells)
        cells_were = tuple(snapshot[n] for n in cell_names)
        get = self._globals.get

        def globals_unchanged():
            return not any(map(operator.is_not, map(get, names, was), was))

        def cells_unchanged():
            try:  # an emptied cell raises: look (snapshot() would show the global of its name)
                return not any(map(operator.is_not, map(_CONTENTS, cells), cells_were))
            except ValueError:
                return False

        if not cells:
            return globals_unchanged
        if not names:
            return cells_unchanged
        return lambda: globals_unchanged() and cells_unchanged()


_CONTENTS = operator.attrgetter("cell_contents")


def _look():
    return False


def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def short_repr(value):
    """A short readable form of a bound value for messages."""
    text = repr(value) if isinstance(value, (int, float, str, bool, type(None))) else f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."
