"""Reading a tensor's grad node without keeping it alive (NOTE [ Reading grad nodes ]).

NOTE [ Reading grad nodes ]
Paddle's ``Tensor.grad_fn`` getter (2.6 and 3.x) hands its caller the node's Python object with one
reference more than the caller owns: ``sys.getrefcount`` of the node grows by one with every read,
and that object holds the node itself (its holder is the node's shared pointer). A node read once is
therefore never freed, nor anything its edges reach: the nodes below it and every tensor they saved
for the backward (a matmul's weight, say). Only a ``backward()`` that frees the saved tensors as it
runs gives their memory back; ``paddle.grad``, or a graph nobody runs backward through, leaves them
allocated for the rest of the process (measured on the CPU, both Paddles: a dropped model of four
graphed 256-wide layers kept one weight's size per layer, 1.03 MiB, and 16.1 MiB on an H200 for four
1024-wide layers). A capture reads the nodes of its outputs (unknown leaves, shared parameters, grad
stacks), so every dropped graphed model kept that much. ``next_functions`` and the node's own methods
add no such reference.

The package reads grad nodes only through ``grad_node(t)``, which gives the extra references back where
this Paddle adds them. Nothing is given back that was not measured to be extra: once per process, two
reads of a probe's node must have added exactly one each (``extra_references()``; a Paddle that adds
none is left alone), and every read is measured again the same way (two reads of the tensor's node, the
same object, its count one more than the second reference explains). Reading a stop-gradient tensor's
``grad_fn`` makes Paddle give it an accumulation node, read the same way.
"""

import ctypes
import sys

import paddle

__all__ = ["extra_references", "grad_node"]

_DECREF = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))
_EXTRA = []  # [references a grad_fn read adds], measured once


def extra_references():
    """How many references one ``Tensor.grad_fn`` read adds that its caller does not own (0 or 1), measured
    on a probe's node the first time it is asked; the probe's own extra references are given back."""
    if not _EXTRA:
        w = paddle.to_tensor([1.0], place=paddle.CPUPlace(), stop_gradient=False)
        y = w * w
        first = y.grad_fn
        before = sys.getrefcount(first)
        second = y.grad_fn  # the same object: one reference ours, and whatever the getter keeps
        extra = sys.getrefcount(first) - before - 1
        _EXTRA.append(extra if extra == 1 else 0)
        for _ in range(2 * _EXTRA[0]):
            _DECREF(first)
        del first, second
    return _EXTRA[0]


def grad_node(tensor):
    """``tensor.grad_fn`` (None for a tensor without one), read without keeping the node alive past the
    caller's own reference (NOTE [ Reading grad nodes ])."""
    node = getattr(tensor, "grad_fn", None)
    if node is None or not (_EXTRA[0] if _EXTRA else extra_references()):
        return node
    before = sys.getrefcount(node)
    again = getattr(tensor, "grad_fn", None)
    if again is node and sys.getrefcount(node) - before - 1 == 1:
        _DECREF(node)  # the two reads' extra references
        _DECREF(node)
    del again
    return node
