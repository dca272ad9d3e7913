"""Tensors the simulated backend treats as host (CPU) memory.

On the simulated backend every tensor is on the CPU. A test marks the ones a GPU program would
keep on the host (NOTE [ Host tensors ] in io/host_tensors.py); the simulated graph then freezes reads of
them at capture, as a GPU graph does. Marks do not propagate to the results of ops.
"""

import weakref

__all__ = ["mark_host", "is_marked_host", "any_marked", "marks"]

# id -> weakref of the marked tensors.
_marked = {}


def mark_host(t):
    """Marks ``t`` as a host tensor for the simulated backend and returns it."""
    key = id(t)
    _marked[key] = weakref.ref(t, lambda _, key=key: _marked.pop(key, None))
    return t


def is_marked_host(t):
    """True when ``t`` was marked with mark_host()."""
    if not _marked:
        return False
    ref = _marked.get(id(t))
    return ref is not None and ref() is t


def marks():
    """The dict any_marked() reads (a compiled check reads it too: NOTE [ The front door ] in core/front.py)."""
    return _marked


def any_marked():
    """True while any marked tensor is alive (lets callers skip the per-tensor check)."""
    return bool(_marked)
