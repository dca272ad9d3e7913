"""What a graph would freeze, seen by comparing runs: the dataflow of a call (``OpTrace``) and
the bindings of a step function (``BindingWatch``).

NOTE [ Host values of a step ]
A CUDA graph replays kernels with the arguments they had at capture. Whatever the step computes
on the host - a Python counter, ``random.random()``, a branch on Python state, a value read from
a global - reaches the device as a kernel argument or as a choice of kernels, and a replay
repeats the capture-time choice. Two checks make that visible instead of silent:

* ``OpTrace`` records the step's dataflow (NOTE [ The dataflow of a trace ]). The capture's trace
  must equal the last warmup step's: a differing op, argument or tensor means the step reads a host
  value that changes, and the capture is refused naming the op, both values and the user's line.
  On the simulated backend every replay re-runs the step's Python, so each replay is traced too: a
  replay whose trace differs from the capture's is one a GPU would have replayed wrong, and its key
  falls back to eager with a warning (that call's result, from the re-run, is eager's).
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

NOTE [ The dataflow of a trace ]
A GPU replay runs the capture's kernels on the capture's tensors with the capture's scalars, so a
replay equals its capture only if it would launch the same ops, with the same scalar arguments, on
the same tensors. ``OpTrace`` records, for every op the function calls (NOTE [ Traced entry points ]
in guards/traced_ops.py), its name, its non-tensor arguments (floats by their bits, arrays by value)
and the *role* of each tensor operand: input slot k (``inputs``; a tensor given as several arguments
holds all their slots, and agrees with a run that read any one of them, as a capture reads the static
buffer of one: ``InputSlots``), output k of op j of the same trace (ops returning lists give each
element its own k, so ``paddle.split(x, 3)[k]`` with another k differs), or a tensor from outside
numbered by first read and kept as a weak reference with its data pointer (where a GPU reads it) -
a parameter, a buffer, a global, a closure's tensor. Two traces agree when their records are equal
and each outside tensor is the same object at the same address; where the capture's is gone, the
other must be gone too (each run's own temporary, made where no traced op shows it: a hook's grad,
``core.eager.Tensor(...)``) or carry its lasting name (an optimizer accumulator the package moved to
the device before the capture). The Python values a block returns are one more record. The
difference names the first op that differs or reads another tensor, what it got at both and the
user's line. The package's own ops inside a traced call (buffer snapshots, the learning-rate feed,
host_guard's copies) run under ``traced_ops.paused()``.
"""

import functools
import math
import operator
import sys
import types
import weakref

import numpy as np
import paddle

from .host_marks import is_marked_host
from .location import _is_library
from . import traced_ops
from .trace_difference import _IN, _OBJ, _OP, InputSlots, describe_trace_difference

__all__ = ["OpTrace", "BindingWatch", "describe_trace_difference", "short_repr"]

_MAX_ELEMENTS = 64  # host arrays larger than this are compared by a digest
_BY_TEXT = ("paddle", "numpy", "builtins", "enum")  # modules whose objects' text is cheap and says what they are
_RAW = ("DenseTensor", "LoDTensor", "SelectedRows")  # raw tensors: their text is their values (a host read)

# In-place ops: their first tensor argument is written (``Tensor.add_``, ``_C_ops.scale_``, ...).
_WRITES = "_"
_WRITERS = ("Tensor.__setitem__", "Tensor.set_value", "Tensor._setitem_dygraph")



def _norm(value, hosts, role):
    """A hashable, comparable form of one op argument: tensors by role (``role(t)``; a host tensor is
    also appended to ``hosts`` when it is a list), host values by value."""
    if isinstance(value, paddle.Tensor):
        if hosts is not None and (is_marked_host(value) or (hosts.on_gpu and value.place.is_cpu_place())):
            hosts.append(value)
        return role(value)
    if isinstance(value, float):
        return ("f", value.hex() if math.isfinite(value) else repr(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v, hosts, role) for v in value)
    if isinstance(value, dict):
        return tuple((k, _norm(v, hosts, role)) for k, v in value.items())
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        data = arr.tobytes() if arr.size <= _MAX_ELEMENTS else hash(arr.tobytes())
        return ("nd", str(arr.dtype), arr.shape, data)
    if isinstance(value, (slice, range)):
        return (type(value).__name__, _norm(value.start, hosts, role), _norm(value.stop, hosts, role),
                _norm(value.step, hosts, role))
    if value is Ellipsis:
        return "..."
    if isinstance(value, (types.FunctionType, types.MethodType, type)):
        return ("callable", getattr(value, "__qualname__", type(value).__name__))
    if not type(value).__module__.startswith(_BY_TEXT) or type(value).__name__ in _RAW:  # itself, not its text
        return ("obj", type(value).__name__, id(value))
    text = str(value)  # dtypes, places, enums: their text is their identity
    return ("obj", type(value).__name__, text if len(text) <= 80 else text[:80])


def _user_line():
    frame = sys._getframe(2)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_DATA_PTR = traced_ops.original(paddle.Tensor, "data_ptr") if hasattr(paddle.Tensor, "data_ptr") else None


def _address(t):
    """Where a GPU would read ``t`` (its data pointer), or None where Paddle does not say."""
    try:
        return _DATA_PTR(t) if _DATA_PTR is not None else None
    except (RuntimeError, ValueError):  # not initialized
        return None


_GENERATED = ("eager_tmp", "generated_tensor", "tmp_")


def _lasting_name(t):
    """``t``'s name where Paddle did not make it up for a temporary (parameters, accumulators), else None."""
    name = t.name
    return None if not name or name.startswith(_GENERATED) else name


def _ref(t):
    try:
        return weakref.ref(t)
    except TypeError:
        return lambda: t


class OpTrace:
    """While active (on its thread), records every Paddle op called: its name, its non-tensor
    arguments and the role of each tensor operand (NOTE [ The dataflow of a trace ]).

    Args:
        on_gpu: whether the step runs on a GPU (CPU tensors then count as host values).
        where: also record the user's line of each op (for messages; costs a frame walk per op).
        inputs: the tensors that are input slot 0, 1, ... (the same slot across traces compared).
        names: ``{id(tensor): name}`` of tensors to name in messages (parameters, buffers), or None.
        identities: False records a tensor from outside as such, without which one it is (a
            backward, whose tensors from outside are the forward's, new on every call).
        keep_writes: copy each tensor from outside that an in-place op writes, before the op, so
            that ``undo_writes()`` can put it back (a simulated replay that runs eagerly instead).
    """

    def __init__(self, on_gpu=False, where=True, inputs=(), names=None, identities=True, keep_writes=False):
        self.ops = []
        self.lines = []
        self.host_ops = []
        self.objects = []  # [(weak reference, address, lasting name)] of the tensors from outside, by first read
        self._on_gpu = on_gpu
        self._where = where
        self._names = names
        self._depth = 0
        slots = {}  # one tensor given as several arguments holds several slots
        for k, t in enumerate(inputs):
            slots.setdefault(id(t), (t, []))[1].append(k)
        self._known = {key: (t, (_IN, InputSlots(ks))) for key, (t, ks) in slots.items()}
        self._made = {}  # id -> (weak reference, role) of op outputs
        self._seen = {}  # id -> index into objects
        self._outer = None
        self._identities = identities
        self._written = {} if keep_writes else None

    def _role(self, t):
        key = id(t)
        hit = self._made.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        hit = self._known.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        if not self._identities:
            return (_OBJ, -1)
        n = self._seen.get(key)
        if n is not None and self.objects[n][0]() is t:
            return (_OBJ, n)
        n = len(self.objects)
        self.objects.append((_ref(t), _address(t), _lasting_name(t)))
        self._seen[key] = n
        return (_OBJ, n)

    def _made_by(self, j, out):
        if isinstance(out, paddle.Tensor):
            self._made[id(out)] = (_ref(out), (_OP, j, 0))
        elif isinstance(out, (list, tuple)):
            for k, t in enumerate(out):
                if isinstance(t, paddle.Tensor):
                    self._made[id(t)] = (_ref(t), (_OP, j, k))

    def record(self, label, original, args, kwargs, see_inside=False):
        """Runs ``original(*args, **kwargs)`` as the traced op ``label`` (NOTE [ Traced entry points ]
        in guards/traced_ops.py); ``see_inside``: the ops it calls are traced too (PyLayer.apply)."""
        if self._depth:  # an op called by an op: one record
            return original(*args, **kwargs) if self._outer is None else self._outer.record(
                label, original, args, kwargs, see_inside)
        call = original if self._outer is None else functools.partial(self._outer.record, label, original)
        hosts = _Hosts(self._on_gpu)
        j = len(self.ops)
        self.ops.append((label, _norm(args, hosts, self._role), _norm(kwargs, hosts, self._role) if kwargs else ()))
        if self._written is not None and args and (label.endswith(_WRITES) or label in _WRITERS):
            self._keep(args[0], self.ops[-1][1][0])
        if self._where:
            self.lines.append(_user_line())
        if hosts:
            self.host_ops.append((j, label))
        self._depth += not see_inside
        try:
            out = call(*args, **kwargs) if self._outer is None else call(args, kwargs, see_inside)
        finally:
            self._depth -= not see_inside
        self._made_by(j, out)
        return out

    def _keep(self, t, role):
        if isinstance(t, paddle.Tensor) and role[0] == _OBJ and id(t) not in self._written:
            with traced_ops.paused(), paddle.no_grad():
                self._written[id(t)] = (t, t.clone())

    def undo_writes(self):
        """Puts back every tensor from outside that an in-place op wrote while the trace was open."""
        with traced_ops.paused(), paddle.no_grad():
            for t, saved in (self._written or {}).values():
                t.copy_(saved, False)
        self._written = {}

    def note_result(self, consts):
        """Records the Python values a call returned (numbers, strings) as one more entry."""
        self.ops.append(("returned values", _norm(tuple(consts), None, self._role), ()))
        if self._where:
            self.lines.append(None)

    def __enter__(self):
        traced_ops.hold()
        self._outer = traced_ops.set_current(self)
        return self

    def __exit__(self, *exc):
        traced_ops.set_current(self._outer)
        self._outer = None
        traced_ops.release()
        self._made, self._seen, self._known = {}, {}, {}
        return False

    def name_of(self, n):
        """A readable name of outside tensor ``n`` (a parameter's name where known)."""
        if n < 0:
            return "a tensor from outside"
        t = self.objects[n][0]()
        if t is None:
            return f"a tensor from outside (freed since)"
        name = self._names.get(id(t)) if self._names else None
        return name or f"a tensor from outside ({t.name}, shape {list(t.shape)})"

    def requiring_grad(self):
        """The tensors from outside that the trace read and that require grad (still alive)."""
        found = [ref() for ref, _, _ in self.objects]
        return [t for t in found if t is not None and not t.stop_gradient]

    def host_inputs(self):
        """``[(index, op, line)]`` of ops that read a host tensor (a CPU tensor on a GPU step, or
        one marked with mark_host on the simulated backend)."""
        return [(i, op, self.lines[i] if i < len(self.lines) else None) for i, op in self.host_ops]


class _Hosts(list):
    """The host tensors among one op's arguments."""

    def __init__(self, on_gpu):
        super().__init__()
        self.on_gpu = on_gpu


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
