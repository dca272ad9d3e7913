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

import numpy as np
import paddle

__all__ = ["extra_references", "grad_node"]

_DECREF = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))
_EXTRA = []  # [references a grad_fn read adds], measured once


def extra_references():
    """How many references one ``Tensor.grad_fn`` read adds that its caller does not own (0 or 1), measured
    the first time it is asked on a probe leaf's node (its accumulation node: no kernel runs, so a capture
    in progress or a host without CPU kernels is no problem); the probe's own extra references are given
    back. A probe that fails measures 0: nothing is ever given back then."""
    if not _EXTRA:
        extra = 0
        try:
            leaf = paddle.to_tensor(np.zeros([1], "float32"), place=paddle.CPUPlace(), stop_gradient=False)
            first = leaf.grad_fn
            before = sys.getrefcount(first)
            second = leaf.grad_fn  # the same object: one reference ours, and whatever the getter keeps
            if second is first and sys.getrefcount(first) - before - 1 == 1:
                extra = 1
                _DECREF(first)
                _DECREF(first)
            del first, second
        except Exception:  # a Paddle without grad nodes on leaves: nothing measured, nothing given back
            extra = 0
        _EXTRA.append(extra)
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
