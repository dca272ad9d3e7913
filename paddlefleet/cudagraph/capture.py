"""Helpers of a capture: what it records about the Layers a call uses, and how it finds the
tensors that need grad but would not get it through the bridge."""

import threading

import paddle

__all__ = [
    "CAPTURE_LOCK",
    "GradBodyFailed",
    "LayerRecorder",
    "param_homes",
    "accumulation_nodes",
    "name_unknown_leaves",
]

#: Capture patches process-wide entry points (Layer.__call__, host-sync methods, random ops)
#: for its duration: one capture at a time across threads.
CAPTURE_LOCK = threading.RLock()


class GradBodyFailed(Exception):
    """The paddle.grad backward body failed; the capture is retried with backward()."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class LayerRecorder:
    """While active, records every Layer called (and snapshots its buffers before it runs)."""

    def __init__(self, snapshot, watch):
        self.layers = []
        self._seen = set()
        self._snapshot = snapshot
        self._watch = watch
        self._original = None

    def __enter__(self):
        original = paddle.nn.Layer.__call__
        recorder = self

        def recording_call(layer, *args, **kwargs):
            if id(layer) not in recorder._seen:
                recorder._seen.add(id(layer))
                recorder.layers.append(layer)
                recorder._snapshot.add(layer)
                recorder._watch.add(layer)
            return original(layer, *args, **kwargs)

        self._original = original
        paddle.nn.Layer.__call__ = recording_call
        return self

    def __exit__(self, *exc):
        paddle.nn.Layer.__call__ = self._original
        return False


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


def accumulation_nodes(outputs):
    """node_ptr -> node of every leaf accumulation node reachable from ``outputs``."""
    found, seen = {}, set()
    stack = [o.grad_fn for o in outputs if getattr(o, "grad_fn", None) is not None]
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
        node = getattr(t, "grad_fn", None)
        if node is not None and node.node_ptr() in unknown_ptrs:
            names.append(name)
    missing = len(unknown_ptrs) - len(names)
    if missing > 0:
        names.append(f"{missing} unnamed tensor(s)")
    return names
