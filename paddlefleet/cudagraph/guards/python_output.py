"""print() and logging inside a graphed function, which a simulated replay repeats and a GPU replay does not.

NOTE [ Python output on replay ]
A GPU replay runs no Python: a ``print()`` or a logging call inside a graphed function runs once, at
capture, and never again. The simulated backend re-runs the function's Python at every replay, so there
the same line prints at every call: a log that a GPU run would not write. While a simulated graph
captures, ``python_output()`` records the ``print()`` calls and the log records (``Logger._log``: only
what the logger's level lets through) made by code outside autocudagraph, Paddle and the standard
library, in the capturing thread; after a capture that succeeds, one RuntimeWarning per line of code, for
the process, says so.
A capture that fails runs the function eagerly from then on, where printing is what eager does.
"""

import builtins
import contextlib
import logging
import sys
import threading
import warnings

from .location import _is_ours, user_stacklevel
from .paddle_patches import Patches

__all__ = ["python_output"]

# (file, line) of the print() and logging calls already warned about (NOTE [ Python output on replay ]).
_warned = set()


def _caller(skip_logging):
    """``(file, line)`` of the code that called print() or a Logger method, or None for a library's call."""
    frame = sys._getframe(2)
    while skip_logging and frame is not None and frame.f_code.co_filename == logging.__file__:
        frame = frame.f_back
    if frame is None or _is_ours(frame.f_code.co_filename):
        return None
    return frame.f_code.co_filename, frame.f_lineno


def _recording(original, seen, what, skip_logging):
    thread = threading.get_ident()  # the capturing thread: another thread's output is its own

    def call(*args, **kwargs):
        where = _caller(skip_logging) if threading.get_ident() == thread else None
        if where is not None:
            seen.setdefault(where, what)
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def python_output():
    """Records print() and logging calls of user code until the block exits; when it exits without an
    exception, warns once per line of code (NOTE [ Python output on replay ])."""
    seen = {}
    with Patches() as patches:  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        patches.set(builtins, "print", _recording(builtins.print, seen, "print()", False))
        patches.set(logging.Logger, "_log", _recording(logging.Logger._log, seen, "a logging call", True))
        yield
    for (path, line), what in seen.items():
        if (path, line) in _warned:
            continue
        _warned.add((path, line))
        warnings.warn(
            f"autocudagraph: {what} at {path}:{line} inside a graphed function runs at every replay on the "
            "simulated backend, which re-runs the function's Python; a GPU replay runs no Python, so on a GPU "
            "it runs once, at capture, and later calls print or log nothing. Print or log what the call "
            "returns, after it.", RuntimeWarning, stacklevel=user_stacklevel())
