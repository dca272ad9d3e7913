"""Every tensor a training step can reach, so that a simulated capture that fails after running
can be taken back completely (step/rollback.py).

NOTE [ What a failed simulated capture may have written ]
A CUDA capture records kernels without running them: a capture that fails leaves every tensor as
it was. The simulated capture runs the step, so a failure after the first write (a host read
after ``opt.step()``, a refusal found once the step ran) leaves that write behind, and the eager
re-run of the call would apply it a second time: an EMA updated with ``paddle.assign``, a metric
accumulated with ``add_``, a second model's optimizer, BatchNorm statistics. Which tensors a step
writes is not known in advance, so the rollback copies *every* tensor the step can reach before
the capture and writes all of them back after a failure:

* the step function itself: the objects its closure cells hold, the global names its code (and
  the code of functions nested in it) uses, its defaults; a bound method's object; a callable
  object's attributes;
* recursively, through lists, tuples, sets, dict values and the attributes of objects (Layers,
  optimizers, schedulers, ``types.SimpleNamespace``, user classes), and the functions found there
  (their closures and globals); the functions of a user class (one not defined by Paddle) are
  walked too, since its methods may write the class module's globals;
* the optimizers of ``optimizers=`` and the graph-safe loss scalers.

Modules and classes are not entered (``paddle`` alone would reach every tensor of the process).
A second net, ``InPlaceWrites``, catches what the walk cannot reach (``some_module.STATE.add_()``):
during the capture it copies every tensor handed to an in-place op - a ``paddle._C_ops`` (or
``_legacy_C_ops``) function whose name ends in ``_``, a Tensor method ending in ``_``
(``add_``, ``copy_``, ``zero_``), ``set_value`` and ``__setitem__`` - before the op runs. Its
copies are written back first, the walk's (taken before the capture) last. A write that is
neither reachable nor made by such an op (a kernel writing an input in place under another
name, as BatchNorm's statistics, on a tensor the step cannot reach) is not covered. Parameters also contribute
their grads, and learning-rate schedulers their ``state_dict()`` (a scheduler stepped inside the
step advanced at the capture). This costs one copy of the reachable state per simulated capture;
a CUDA capture needs none.
"""

import types

import paddle

__all__ = ["Reachable", "reachable"]

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType, range, slice)
_LIBRARY_PREFIXES = ("paddle", "numpy", "builtins", "collections", "typing", "functools", "abc", "enum",
                     "threading", "weakref")
#: Objects visited at most (a guard against walking a huge data structure for ever; past it, only
#: the in-place op net covers what the step writes).
LIMIT = 500000


class Reachable:
    """What ``reachable()`` found: ``tensors`` (by id), the ``params`` among them (leaf tensors
    with grads) and the learning-rate ``schedulers``."""

    def __init__(self):
        self.tensors = {}
        self.params = {}
        self.schedulers = {}


def _code_globals(fn, stack):
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    names, codes = set(), [code]
    while codes:
        c = codes.pop()
        names.update(c.co_names)
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    g = getattr(fn, "__globals__", None) or {}
    stack.extend(g[n] for n in names if n in g)


def _function(fn, stack):
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            stack.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    stack.extend(getattr(fn, "__defaults__", None) or ())
    stack.extend((getattr(fn, "__kwdefaults__", None) or {}).values())
    _code_globals(fn, stack)


def _is_library_type(cls):
    return (getattr(cls, "__module__", "") or "").startswith(_LIBRARY_PREFIXES)


def reachable(roots, limit=LIMIT):
    """Walks from ``roots`` (NOTE [ What a failed simulated capture may have written ]); returns a
    Reachable."""
    found = Reachable()
    seen, walked_types = set(), set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > limit:  # the in-place net (InPlaceWrites) still covers the rest
            break
        if isinstance(obj, paddle.Tensor):
            found.tensors[id(obj)] = obj
            if obj.is_leaf and not obj.stop_gradient:
                found.params[id(obj)] = obj
            continue
        if isinstance(obj, paddle.optimizer.lr.LRScheduler):
            found.schedulers[id(obj)] = obj
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
            continue
        if isinstance(obj, types.FunctionType):
            _function(obj, stack)
            continue
        cls = type(obj)
        if not _is_library_type(cls) and cls not in walked_types:
            walked_types.add(cls)
            for klass in cls.__mro__:
                if not _is_library_type(klass):
                    stack.extend(v for v in vars(klass).values() if isinstance(v, types.FunctionType))
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            stack.extend(attrs.values())
        for name in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
            if hasattr(obj, name):
                stack.append(getattr(obj, name))
    return found
