"""Where in the user's code something happened: the innermost frame outside autocudagraph,
Paddle, the standard library and installed packages, for messages and warnings.

NOTE [ The user's line ]
A refusal names the line of the user's own code that did what was refused. Frames of this
package, of Paddle and of the standard library are never that line, nor are frames of installed
packages (``site-packages``, ``dist-packages``): Paddle 2.6 runs ``paddle.nn.utils.clip_grad_norm_``
through the ``decorator`` package, whose generated wrapper would otherwise be the innermost
"user" frame. Where no frame of the user's own code is on the stack (a model that lives entirely
in an installed package), the innermost frame of an installed package is named instead.
"""

import os
import sys

import paddle

__all__ = ["user_location", "user_call_site", "user_stacklevel"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package, not core/
_PADDLE_DIR = os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _is_ours(filename):
    """True for frames of autocudagraph, of Paddle and of the standard library."""
    path = os.path.abspath(filename)
    if path.startswith(_OWN_DIR) or path.startswith(_PADDLE_DIR):
        return True
    if path.startswith(_STDLIB_DIR) and "-packages" not in path[len(_STDLIB_DIR):]:
        return True
    return filename.startswith("<")  # <frozen importlib...>, <string>, <decorator-gen-12>


def _is_library(filename):
    """True for frames of autocudagraph, Paddle, the standard library and installed packages."""
    return _is_ours(filename) or any(part in os.path.abspath(filename) for part in _INSTALLED)


def user_location(tb):
    """``"file:line in function"`` of the innermost traceback frame of the user's own code (where
    it raised or called the op that failed; NOTE [ The user's line ]), else of an installed
    package, or None."""
    found = installed = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _is_library(code.co_filename):
            found = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        elif not _is_ours(code.co_filename):
            installed = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found or installed


def _first_user_frame():
    frame, depth = sys._getframe(1), 1
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, depth = frame.f_back, depth + 1
    return frame, depth


def user_call_site():
    """``"file:line"`` of the innermost stack frame of the user's own code."""
    frame, _ = _first_user_frame()
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def user_stacklevel():
    """``stacklevel`` for warnings.warn called by the caller of this function, pointing at the
    user's frame (also through Layer.__call__ and other Paddle frames)."""
    _, depth = _first_user_frame()
    return max(depth - 1, 1)
