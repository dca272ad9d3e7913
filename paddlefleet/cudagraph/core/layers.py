"""The Layers a capture sees: which are called, where their parameters live (and whether they
moved since), and the tensors that need grad but would not get it through the bridge."""

import threading

import paddle

from .. import native
from .grad_nodes import grad_node

__all__ = [
    "CAPTURE_LOCK",
    "ParamSet",
    "param_homes",
    "accumulation_nodes",
    "name_unknown_leaves",
]

#: Capture patches process-wide entry points (Layer.__call__, host-sync methods, random ops)
#: for its duration: one capture at a time across threads.
CAPTURE_LOCK = threading.RLock()



def param_homes(layers):
    """``[(sublayer, name, param)]`` for every parameter of ``layers``, each parameter once."""
    homes, seen = [], set()
    for layer in layers:
        for _, sub in layer.named_sublayers(include_self=True):
            for name, p in sub._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    homes.append((sub, name, p))
    return homes


class ParamSet:
    """The parameters of the Layers one capture used, and where each lives.

    Attributes:
        params: the parameters handed through the bridge: every trainable one. A parameter the call also
            passes as an argument is read twice, through its Layer and through the argument's buffer, and
            gets both grads, which autograd adds as it adds eager's two.
    """

    def __init__(self, layers):
        homes = param_homes(layers)
        # NOTE [ The parameter-address check ]
        # moved() runs before every replay, over every parameter the capture saw, so what it reads
        # is bound once here: each Layer's ``_parameters.get`` and each parameter's ``data_ptr``
        # (no attribute lookups per call, measured 3.1 -> 2.3 us for 16 parameters on the CPU).
        self._homes = tuple((sub._parameters.get, name, p, p.stop_gradient, p.data_ptr, p.data_ptr())
                            for sub, name, p in homes)
        # the same for the compiled check (NOTE [ Compiled tensor reads ] in native/__init__.py)
        self._compiled_homes = tuple((sub._parameters, name, p, frozen, ptr)
                                     for (_, name, p, frozen, _, ptr), (sub, _, _) in zip(self._homes, homes))
        self._owners = [type(sub).__name__ for sub, _, _ in homes]
        self.params = [p for _, _, p in homes if not p.stop_gradient]

    def moved(self):
        """Why the graphs no longer fit the parameters (replaced, moved or (un)frozen), or None."""
        compiled = native.reads
        if compiled is not None:
            first = compiled.moved(self._compiled_homes)  # None where a parameter cannot be read there
            if first is not None:
                return None if first < 0 else self._why(self._homes[first][2])
        for get, name, p, frozen, data_ptr, ptr in self._homes:  # NOTE [ The parameter-address check ]
            if get(name) is not p or data_ptr() != ptr or p.stop_gradient is not frozen:
                return self._why(p)
        return None

    def _why(self, moved):
        i = next(i for i, home in enumerate(self._homes) if home[2] is moved)
        return f"parameter '{self._homes[i][1]}' of {self._owners[i]} was replaced, moved or (un)frozen"

    def names(self):
        """``{id(param): "'name' of Owner"}`` for messages."""
        return {id(home[2]): f"'{home[1]}' of {owner}" for home, owner in zip(self._homes, self._owners)}


def accumulation_nodes(outputs):
    """node_ptr -> node of every leaf accumulation node reachable from ``outputs``."""
    found, seen = {}, set()
    stack = [grad_node(o) for o in outputs]  # NOTE [ Reading grad nodes ] in core/grad_nodes.py
    while stack:
        node = stack.pop()
        if node is None:
            continue
        ptr = node.node_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if node.name() == "GradNodeAccumulation":
            found[ptr] = node
        stack.extend(node.next_functions)
    return found


def name_unknown_leaves(fn, unknown_ptrs):
    """Best-effort names for leaf tensors found in ``fn``'s globals and closure."""
    candidates = {}
    scopes = dict(getattr(fn, "__globals__", {}))
    code = getattr(fn, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            scopes[name] = cell.cell_contents
        except ValueError:
            pass
    for name, value in scopes.items():
        if isinstance(value, paddle.Tensor) and not value.stop_gradient:
            candidates[name] = value
        elif isinstance(value, paddle.nn.Layer):
            for pname, p in value.named_parameters():
                candidates[f"{name}.{pname}"] = p
    names = []
    for name, t in candidates.items():
        node = grad_node(t)
        if node is not None and node.node_ptr() in unknown_ptrs:
            names.append(name)
    missing = len(unknown_ptrs) - len(names)
    if missing > 0:
        names.append(f"{missing} unnamed tensor(s)")
    return names
