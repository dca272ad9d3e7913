"""Where in the user's code something happened: the innermost frame outside autocudagraph,
Paddle and the standard library, for messages and warnings."""

import os
import sys

import paddle

__all__ = ["user_location", "user_call_site", "user_stacklevel"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, not core/
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
