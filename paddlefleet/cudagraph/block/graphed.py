"""Block graphs: one function (or Layer method) whose forward and backward are captured and
replayed through the autograd bridge. ``GraphedCallable`` is what autocudagraph() returns;
``BlockBody`` is what its phases run.

A body is what the phase machine in core/lifecycle.py runs for each phase of one kind of call:
``run`` (eager: fallback), ``warmup``, ``ready`` (may a warmed-up key capture now?),
``capture``, ``blocker`` (may this call replay now?), ``replay`` and ``verified_replay``. Blocks
use block/capture.py, block/replay.py and block/verify.py; the whole training step has a body of its own
(step/body.py).
"""

import weakref

import paddle

from .capture import capture_block, capture_second_backward
from ..grads.accumulate import note_call
from ..errors import CudaGraphError
from ..core.lifecycle import Lifecycle
from ..options import GraphOptions
from .replay import replay_blocker, run_graphs
from .replay_fallback import state_restored_on_refusal
from .verify import verified_run

__all__ = ["BlockBody", "GraphedCallable"]


class BlockBody:
    """Capture, replay and eager run of one wrapped function.

    Args:
        fn: the function; for a bound method or Layer, the unbound function taking ``owner`` first.
        options: GraphOptions.
        owner: the Layer (or object) ``fn`` is bound to, or None; held weakly.
    """

    def __init__(self, fn, options, owner=None):
        self.fn = fn
        self.options = options
        self._owner_ref = weakref.ref(owner) if owner is not None else None
        self.name = getattr(fn, "__name__", type(fn).__name__)

    @property
    def bound(self):
        return self._owner_ref is not None

    def owner(self):
        """The object ``fn`` is bound to (None for a plain function)."""
        if self._owner_ref is None:
            return None
        owner = self._owner_ref()
        if owner is None:
            raise CudaGraphError(
                f"autocudagraph({self.name}): the Layer this wrapper was bound to was garbage-collected; "
                "the wrapper holds it weakly so that it does not keep the Layer alive. Keep a reference to "
                "the Layer, or apply autocudagraph to the Layer you call."
            )
        return owner

    def layers(self):
        """Layers whose training flag keys every call from the start (the owner)."""
        owner = self.owner()
        return [owner] if isinstance(owner, paddle.nn.Layer) else []

    def run(self, args, kwargs):
        """The function itself, eagerly."""
        note_call()  # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py
        if self._owner_ref is None:
            return self.fn(*args, **kwargs)
        return self.fn(self.owner(), *args, **kwargs)

    def warmup(self, entry, call):
        """A warmup call: the function itself, eagerly."""
        return self.run(call.args, call.kwargs)

    def ready(self, entry):
        """A block captures as soon as its warmup calls are done."""
        return True

    def capture(self, entry, call, named, last_inputs, warn_once):
        """Captures ``entry``'s key from ``call`` (``named``: its ``[(argument name, value)]``);
        returns its BlockGraphs or raises."""
        return capture_block(self.fn, self.owner(), self.options, entry.backend, call, named, last_inputs,
                             warn_once, entry.label)

    def blocker(self, entry, call):
        """None when ``call`` can replay ``entry``'s graphs now, else a replay.Blocked."""
        return replay_blocker(entry.graphs, call, check_inputs=self.options.dispatch_key_fn is not None)

    def replay(self, entry, call, copy):
        """Runs ``entry``'s graphs for ``call``: ``(result, inputs copied, copies skipped)``."""
        graphs = entry.graphs
        note_call()
        if graphs.second_wanted:  # NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py
            capture_second_backward(graphs)
        # NOTE [ A replay that changes shape ] in block/replay_fallback.py
        with state_restored_on_refusal(graphs.layers, entry.backend.capture_executes):
            return run_graphs(graphs, call, copy, self.name, entry.label)

    def verified_replay(self, entry, call, run_graphs):
        """``run_graphs()`` (which replays and returns the call's result), checked against an eager
        re-run: ``(result, None)``, or ``(None, reason)`` for a mismatch (block/verify.py)."""
        return verified_run(entry.graphs, call, run_graphs, self.run)


class GraphedCallable(Lifecycle):
    """A callable with per-key CUDA graphs. Made by autocudagraph(); see its docstring.

    Args:
        fn: the function; for a bound method or Layer, the unbound function taking ``owner``
            first.
        options: validated GraphOptions.
        owner: the Layer (or object) ``fn`` is bound to, or None.
    """

    def __init__(self, fn, options, owner=None):
        if not isinstance(options, GraphOptions):
            raise TypeError(f"GraphedCallable: options must be GraphOptions, got {options!r}")
        super().__init__(BlockBody(fn, options, owner), fn)

    def __get__(self, obj, objtype=None):
        # A wrapper stored as a class attribute and read through an instance would be called
        # without the instance; say how to graph a method instead.
        if obj is None:
            return self
        raise TypeError(
            f"autocudagraph: {self.__name__} was wrapped as a plain function but is read as an attribute of "
            f"{type(obj).__name__}, so it would be called without the instance. Decorate the method in the "
            "class body (@autocudagraph above def), or apply autocudagraph to the Layer instance."
        )

    def __deepcopy__(self, memo):
        # NOTE [ Copies of a graphed Layer ]: copy.deepcopy(layer) copies the wrapper that its
        # __dict__ holds. A copy bound to the original Layer would silently compute with the
        # original's parameters, so the copy is a fresh wrapper (no graphs, same options) bound
        # to the Layer's copy.
        owner = self._body.owner()
        clone = GraphedCallable(self._body.fn, self._options, owner=memo.get(id(owner), owner))
        memo[id(self)] = clone
        return clone

    def __reduce__(self):
        # Pickling (e.g. paddle.save of a whole Layer) keeps the binding and drops the graphs.
        return (GraphedCallable, (self._body.fn, self._options, self._body.owner()))
