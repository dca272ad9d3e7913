"""Reading a tensor's grad node without keeping it alive (NOTE [ Reading grad nodes ]).

NOTE [ Reading grad nodes ]
Paddle's ``Tensor.grad_fn`` getter (2.6 and 3.x) hands its caller the node's Python object with one
reference more than the caller owns: ``sys.getrefcount`` of the node grows by one with every read,
and that object holds the node itself (its holder is the node's shared pointer). A node read once is
therefore never freed, nor anything its edges reach: the nodes below it and every tensor they saved
for the backward (a matmul's weight, say). Only a ``backward()`` that frees the saved tensors as it
runs gives their memory back; ``paddle.grad``, or a graph nobody runs backward through, leaves them
allocated for the rest of the process (measured on the CPU, both Paddles: a dropped model of four
graphed 256-wide layers kept one weight's size per layer, 1.03 MiB a model; on an H200, 16.1 MiB for
four 1024-wide layers). A capture reads the nodes of its outputs (unknown leaves, shared parameters, grad
stacks), so every dropped graphed model kept that much. ``next_functions`` and the node's own methods
add no such reference.

The package reads grad nodes only through ``grad_node(t)``, which gives the extra references back where
this Paddle adds them, and nothing that was not measured to be extra: every read is made twice, and
only where both reads return the same object and its count grew by one more than the second reference
explains are the two reads' extra references given back (a Paddle that adds none is left alone). The
measure is taken on the node itself, not once on a probe: a probe tensor multiplied on the CPU failed
every capture on the GPU host (its CPU kernels need an MKL it lacks), and a read may come inside a
capture. Another thread that reads the same node between the two reads adds two references under
this Paddle (nothing is given back then, the node is kept as before); it could pass for the extra one
only under a Paddle that adds none, and the nodes read are a capture's own or its parameters', read
while it holds the capture lock.
Reading a stop-gradient tensor's ``grad_fn`` makes Paddle give it an accumulation node, read the same
way.
"""

import ctypes
import sys

__all__ = ["grad_node"]

_DECREF = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))


def grad_node(tensor):
    """``tensor.grad_fn`` (None for a tensor without one), read without keeping the node alive past the
    caller's own reference (NOTE [ Reading grad nodes ])."""
    node = getattr(tensor, "grad_fn", None)
    if node is None:
        return None
    before = sys.getrefcount(node)
    again = getattr(tensor, "grad_fn", None)
    if again is node and sys.getrefcount(node) - before - 1 == 1:
        _DECREF(node)  # the two reads' extra references
        _DECREF(node)
    del again
    return node
