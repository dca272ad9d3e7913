"""Grad mode as each replay reads it: from Paddle's tracer in C++ where the compiled module can read it,
else ``paddle.is_grad_enabled()`` (NOTE [ Compiled tensor reads ] in native/__init__.py).

The key's own reads of grad mode and autocast (core/keys.py) are inlined there: they are every call's path.
"""

import paddle

from .. import native

__all__ = ["grad_enabled"]

_is_grad_enabled = paddle.is_grad_enabled


def grad_enabled():
    """``paddle.is_grad_enabled()``, read in C++ where it can be (a pybind property of the tracer, ~3 us inside a
    call in Python); read on every replay and every backward replay."""
    compiled = native.state_read
    read = None if compiled is None else compiled()
    return _is_grad_enabled() if read is None else read[0]
