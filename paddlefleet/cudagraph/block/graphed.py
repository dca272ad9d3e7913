"""Block graphs: one function (or Layer method) whose forward and backward are captured and
replayed through the autograd bridge. ``GraphedCallable`` is what autocudagraph() returns;
``BlockBody`` is what its phases run.

A body is what the phase machine in core/lifecycle.py runs for each phase of one kind of call
(the Body protocol in core/body.py, NOTE [ Bodies ]). Blocks use block/capture.py, block/replay.py
and block/verify.py; the whole training step has a body of its own (step/body.py).
"""

import weakref

import paddle

from .hooks import NO_HOOKS
from .capture import CaptureRequest, capture_block, capture_second_backward
from ..core import state
from ..core.call_state import grad_enabled
from ..core.body import Body
from ..grads.accumulate import CALLS, note_call
from ..errors import CudaGraphError
from ..core.lifecycle import Lifecycle
from ..options import GraphOptions
from .replay import replay_blocker, run_graphs
from .replay_fallback import state_restored_on_refusal
from .slots import Slots
from .verify import verified_run

__all__ = ["BlockBody", "GraphedCallable"]


def _collected(name):
    return CudaGraphError(
        f"autocudagraph({name}): the Layer this wrapper was bound to was garbage-collected; "
        "the wrapper holds it weakly so that it does not keep the Layer alive. Keep a reference to "
        "the Layer, or apply autocudagraph to the Layer you call.")


class BlockBody(Body):
    """Capture, replay and eager run of one wrapped function.

    Args:
        fn: the function; for a bound method or Layer, the unbound function taking ``owner`` first.
        options: GraphOptions.
        owner: the Layer (or object) ``fn`` is bound to, or None; held weakly.
        hooks: what the room above does around its calls (block/hooks.py; the API gives chains').
    """

    def __init__(self, fn, options, owner=None, hooks=NO_HOOKS):
        self.fn = fn
        self.options = options
        self.hooks = hooks
        self._owner_ref = weakref.ref(owner) if owner is not None else None
        self.name = getattr(fn, "__name__", type(fn).__name__)
        if owner is not None:  # "FFN.forward": the class of the instance (or the class) it is bound to
            self.name = f"{owner.__name__ if isinstance(owner, type) else type(owner).__name__}.{self.name}"
        self._runners = (self._runner(False), self._runner(True))

    @property
    def bound(self):
        return self._owner_ref is not None

    def owner(self):
        """The object ``fn`` is bound to (None for a plain function)."""
        if self._owner_ref is None:
            return None
        owner = self._owner_ref()
        if owner is None:
            raise _collected(self.name)
        return owner

    def layers(self):
        """Layers whose training flag keys every call from the start (the owner)."""
        owner = self.owner()
        return [owner] if isinstance(owner, paddle.nn.Layer) else []

    def eager_runner(self):
        """``run(args, kwargs)`` with its lookups done once: a wrapper whose calls pass straight through costs
        about the function's own call (NOTE [ Pass-through wrappers ] in core/pass_through.py)."""
        return self._runners[1]

    def eager_parts(self):
        """``(fn, owner weakref, CALLS)`` of a bound block (what run_bound does, for a compiled front door: NOTE
        [ The front door ] in core/front.py), else None."""
        return None if self._owner_ref is None else (self.fn, self._owner_ref, CALLS)

    def _runner(self, count):
        """The function called eagerly on ``(args, kwargs)``, counted as a call of the block (``count``) or not."""
        fn, ref, calls, name = self.fn, self._owner_ref, CALLS, self.name  # no reference to self: no cycle
        if ref is None:
            if not count:
                return lambda args, kwargs: fn(*args, **kwargs)

            def run(args, kwargs):
                calls[0] += 1  # note_call()
                return fn(*args, **kwargs)
            return run

        def run_bound(args, kwargs):
            if count:
                calls[0] += 1  # note_call()
            owner = ref()
            if owner is None:
                raise _collected(name)
            return fn(owner, *args, **kwargs) if kwargs else fn(owner, *args)
        return run_bound

    def run(self, args, kwargs, count=True):
        """The function itself, eagerly; ``count=False``: not a call of the block (a recompute in
        a backward). Counted calls: NOTE [ Shared parameters leave the graph ] in grads/accumulate.py."""
        return self._runners[1 if count else 0](args, kwargs)

    def capture(self, entry, call, named, last_inputs, warn_once):
        """Captures ``entry``'s key from ``call`` (``named``: its ``[(argument name, value)]``);
        returns its Slots (one slot so far, NOTE [ Slots ] in block/slots.py) or raises."""
        first = capture_block(self._request(entry, call, named, last_inputs, warn_once))
        return Slots(first, self.options.max_inflight)

    def _request(self, entry, call, named, last_inputs, warn_once, first_slot=True):
        # Only a key's first capture of its first slot may join the pool other keys' forwards share: a key
        # captured again (a moved parameter, or a replay that pool would block) is out of its capture order
        # (NOTE [ Keys sharing a forward pool ] in backends/shared_pool.py).
        return CaptureRequest(self.fn, self.owner(), self.options, entry.backend, call, named, last_inputs,
                              warn_once, entry.label, share_pool=first_slot and not entry.recaptures)

    def add_slot(self, entry, call, named, last_inputs, warn_once):
        """Captures a new slot of ``entry``'s key from ``call`` (NOTE [ Slots ]); returns None, or
        why the call runs eagerly (the capture failed, or the slot would exceed max_bytes: no
        further slot is made for this key)."""
        slots = entry.graphs
        rng = state.rng_snapshot()  # a recording capture advances the generators (NOTE [ RNG across capture ])
        try:
            # A further slot keeps its own pool: its forwards are in flight with the other slots' by design.
            graphs = capture_block(self._request(entry, call, named, last_inputs, warn_once, first_slot=False))
        except Exception as err:  # contained: the key keeps its slots, calls past them run eagerly
            slots.refuse(f"capture of a new slot failed: {type(err).__name__}: {err}")
            warn_once(("slot", id(entry)), f"key {entry.label}: {slots.refused}. Calls that find every slot of "
                      "the key waiting for its backward run eagerly (results stay correct).")
            return "capture of a new slot failed"
        budget = self.options.max_bytes
        need = graphs.footprint().held  # NOTE [ What a key holds ] in core/memory.py
        if budget is not None and entry.held_bytes() + need > budget:
            graphs.release()
            state.restore_rng(rng)  # the eager call that replaces the slot draws what eager would
            slots.refuse(f"another slot needs {need} bytes, and the key's slots would exceed max_bytes={budget}")
            warn_once(("slot", id(entry)), f"key {entry.label}: {slots.refused}. Raise max_bytes, or lower "
                      "max_inflight.")
            return "a new slot would exceed max_bytes"
        slots.add(graphs)
        return None

    def blocker(self, entry, call):
        """None when ``call`` can replay ``entry``'s graphs now (and the slot it gets is current),
        else a Blocked."""
        slots = entry.graphs
        if not slots.select():  # NOTE [ Slots ] in block/slots.py
            return slots.blocked()
        return replay_blocker(slots.current, call, check_inputs=self.options.dispatch_key_fn is not None)

    def claim(self, args, kwargs, keys):
        """``(entry, plan)`` when the hooks serve this call (the next call of a chain), else None."""
        return self.hooks.claim(self, args, kwargs, keys)

    def idle(self):
        """True when the hooks claim no call now (no chain is open)."""
        return self.hooks.idle()

    def idle_holder(self):
        """The hooks' (CallHooks.idle_holder)."""
        return self.hooks.idle_holder()

    def serve(self, plan, args):
        """The Replayed of a call the hooks claimed, or None (it runs alone)."""
        return self.hooks.serve(plan, args)

    def replay(self, entry, call, copy):
        """Runs the current slot of ``entry`` for ``call`` (or the hooks do: a chain's first call)."""
        graphs = entry.graphs.current
        grad = grad_enabled()
        bridged = copy and grad and graphs.backward is not None
        python = entry.backend.replays_python  # a replay that re-runs the function: state put back on refusal
        if bridged:
            if python:  # a head that replays executes the body
                with state_restored_on_refusal(graphs.layers, True):
                    started = self.hooks.head(self, entry, call)
            else:  # nothing to put back (and no context manager's host time on every call)
                started = self.hooks.head(self, entry, call)
            if started is not None:
                return started
        note_call()
        if graphs.backward is not None and graphs.backward.sets.wanted:  # NOTE [ Two grad buffer sets ]
            capture_second_backward(graphs)
        if not python:  # a replay that does not re-run the function: nothing to restore
            replayed = run_graphs(graphs, call, copy, self.name, entry.label, grad)
        else:
            # NOTE [ A replay that changes shape ] in block/replay_fallback.py
            # NOTE [ Values a simulated replay reads ]: a replay that differs raises ReplayTraceError.
            with state_restored_on_refusal(graphs.layers, True):
                replayed = run_graphs(graphs, call, copy, self.name, entry.label, grad)
        if bridged and isinstance(replayed.result, paddle.Tensor):
            self.hooks.replayed(self, entry, call, replayed.result)
        return replayed

    def time_backward(self, entry, times):
        """The bridge's backward of the replay just made marks its start in ``times`` (its Token's ``timer``)."""
        graphs = entry.graphs.current
        token = graphs.inflight() if graphs.inflight is not None else None
        if token is not None and not token.done and grad_enabled():  # a bridged replay's token is the latest
            token.timer = (times, times.next_call())

    def verified_replay(self, entry, call, run_graphs):
        """``run_graphs()`` (which replays and returns the call's result), checked against an eager
        re-run: ``(result, None)``, or ``(None, reason)`` for a mismatch (block/verify.py)."""
        return verified_run(entry.graphs.current, call, run_graphs, self.run)


class GraphedCallable(Lifecycle):
    """A callable with per-key CUDA graphs. Made by autocudagraph(); see its docstring.

    Args:
        fn: the function; for a bound method or Layer, the unbound function taking ``owner``
            first.
        options: validated GraphOptions.
        owner: the Layer (or object) ``fn`` is bound to, or None.
        hooks: block/hooks.py's CallHooks (the API gives chains').
    """

    def __init__(self, fn, options, owner=None, hooks=NO_HOOKS):
        if not isinstance(options, GraphOptions):
            raise TypeError(f"GraphedCallable: options must be GraphOptions, got {options!r}")
        super().__init__(BlockBody(fn, options, owner, hooks), fn)

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
        clone = GraphedCallable(self._body.fn, self._options, memo.get(id(owner), owner), self._body.hooks)
        memo[id(self)] = clone
        return clone

    def __reduce__(self):
        # Pickling (e.g. paddle.save of a whole Layer) keeps the binding and drops the graphs.
        return (GraphedCallable, (self._body.fn, self._options, self._body.owner(), self._body.hooks))
