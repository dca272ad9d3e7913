"""The body contract: what the phase machine (core/lifecycle.py) asks of one kind of call.

NOTE [ Bodies ]
The lifecycle owns the phases, their transitions and every warning; what a phase *does* is a
body's. Two bodies exist: BlockBody (block/graphed.py: a function or Layer method whose forward
and backward are graphed through the autograd bridge) and StepBody (step/body.py: a whole
training step in one graph). A capture returns the body's *graphs* record (BlockGraphs,
StepGraphs), which the key's entry holds until it is released. Before a replay the body says
whether the call may replay (``blocker``: None, or a Blocked with an Action); a replay may ask
the lifecycle to move the key to eager afterwards (``Replayed.then``). A body never moves an
entry nor warns itself: the lifecycle does both. The protocols below are the whole contract; the
members with a body are defaults a body may leave out.
"""

import enum
from typing import Any, Callable, List, NamedTuple, Optional, Protocol, Tuple

from ..guards.host_reads import describe_trace_difference

__all__ = ["Action", "Blocked", "Replayed", "Body", "Graphs", "replay_read_other_values"]


class Action(enum.Enum):
    """What the lifecycle does with a call that may not replay its key's graphs now."""

    RECAPTURE = "recapture"  # capture the key again (no warmup), then replay
    RECAPTURE_ONCE = "recapture_once"  # as RECAPTURE, but a key captured again before falls back
    REWARM = "rewarm"  # warm the key up again (this call is its first warmup call), then capture
    EAGER = "eager"  # this call runs eagerly; the key keeps its graphs
    FALL_BACK = "fall_back"  # the key runs eagerly from the next call on (Replayed.then)
    NEW_SLOT = "new_slot"  # capture another slot of the key for this call (NOTE [ Slots ] in block/slots.py)


class Blocked(NamedTuple):
    """Why a call cannot replay now: the Action, the reason (explain() and fallback reasons), a
    warning to give once, or None, and ``changed``: ``(where, attribute, old, new)`` when a Layer
    attribute changed (NOTE [ Attributes that change on every call ] in core/entry.py), else None."""

    action: Action
    reason: str
    warning: Optional[str] = None
    changed: Optional[tuple] = None


def replay_read_other_values(captured, replayed, values, gpu, fix, differs=None):
    """None when a replay that re-ran the function (the simulated backend's) ran the capture's ops
    with the capture's host values, else the Blocked(FALL_BACK) naming the first difference (NOTE
    [ Values a simulated replay reads ] in block/replay_fallback.py). ``values`` names what was read
    (``"values"``, ``"host values"``), ``gpu`` what a GPU's replay would have done, ``fix`` the fix;
    ``differs()`` is asked when the traces agree (a body's other difference, or None)."""
    if captured is None or replayed is None:
        return None
    diff = describe_trace_difference(captured, replayed, "capture", "replay")
    if diff is None and differs is not None:
        diff = differs()
    if diff is None:
        return None
    reason = f"a replay read other {values} than the capture: {diff}"
    return Blocked(Action.FALL_BACK, reason, (
        f"{reason}. On a GPU this replay would {gpu}; the simulated backend re-runs Python, so this result is "
        f"still eager's. The key runs eagerly from now on. {fix}"))


class Replayed(NamedTuple):
    """What a replay gives the lifecycle: the call's result, the input copies made and skipped,
    and ``then``: a Blocked(Action.FALL_BACK, ...) when the key must run eagerly from the next
    call on (the result is still this call's), else None."""

    result: Any
    copied: int = 0
    skipped: int = 0
    then: Optional[Blocked] = None


class Graphs(Protocol):
    """What one capture of a key made; held by the key's GraphEntry (core/entry.py)."""

    layers: List[Any]  # Layers whose training flags key later calls (core/keys.py)

    def release(self) -> None:
        """Frees the graphs and drops every static buffer."""

    def nbytes(self) -> int:
        """Bytes held by the static buffers (pool internals not included)."""

    def describe(self) -> str:
        """A line for explain() about this key, or ""."""

    def footprint(self) -> Any:
        """The device bytes held, by component: a Footprint (NOTE [ What a key holds ] in core/memory.py)."""

    def backward_pending(self) -> bool:
        """True while a forward replay waits for its backward (its graphs must stay); a body
        that runs its own backward never waits."""
        return False

    def grad_copies(self) -> int:
        """Device copies of parameter grads made so far (stats()['grad_copies'])."""
        return 0


class Body(Protocol):
    """What each phase runs for one kind of call.

    Attributes:
        name: the wrapped function's name; options: its options.
        api: the public name the wrapper is made with, which explain() shows.
        bound: whether the function is called with an owner that is not an argument.
    """

    name: str
    options: Any
    api: str = "autocudagraph"
    bound: bool = False

    def layers(self) -> List[Any]:
        """Layers whose training flag keys every call from the start."""
        return []

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The call, eagerly (fallback and calls without a key)."""

    def eager_runner(self) -> Callable[[tuple, dict], Any]:
        """A function doing what ``run`` does, for the wrapper's calls that run eagerly without a Decision
        (a pass-through or keyless rule, a key known to run eagerly): a body may lay out its work once."""
        return self.run

    def eager_parts(self) -> Optional[Tuple[Callable, Any, list]]:
        """``(fn, owner weakref, calls)`` where a call that runs eagerly without a Decision is ``fn(owner, *args,
        **kwargs)`` counted in ``calls[0]`` (what eager_runner() does), for a compiled front door (NOTE [ The front
        door ] in core/front.py); None: such calls go through eager_runner()."""
        return None

    def warmup(self, entry, call) -> Any:
        """One eager warmup call of ``entry``'s key."""
        return self.run(call.args, call.kwargs)

    def ready(self, entry) -> bool:
        """May ``entry``, whose warmup calls are done, capture now?"""
        return True

    def capture(self, entry, call, named: List[Tuple[str, Any]], last_inputs,
                warn_once: Callable[[Any, str], None]) -> Graphs:
        """Captures ``entry``'s key from ``call``; returns its Graphs or raises (the lifecycle
        moves the key to eager with the error as reason)."""

    def claim(self, args: tuple, kwargs: dict, keys) -> Optional[Tuple[Any, Any]]:
        """``(entry, plan)`` for a call the body serves before the entries are looked up (the next
        call of a chain: NOTE [ Chains of graphed calls ] in chains/chain.py; the lifecycle counts
        it as a replay of ``entry``), or None. Decides only (no device code: the dispatcher asks,
        core/dispatch.py). ``keys``: the wrapper's KeyMaker, which makes the key the call would get
        (served only under ``entry``'s key)."""
        return None

    def idle(self) -> bool:
        """True when ``claim`` would answer None for any call now, acting on nothing (no chain is open)."""
        return True

    def idle_holder(self) -> Any:
        """What idle() reads, for a compiled check (NOTE [ The front door ] in core/front.py): None where idle() is
        always true, an object whose ``run`` is None exactly when idle() is true, or False (ask idle())."""
        return None

    def serve(self, plan, args: tuple) -> Optional[Replayed]:
        """The Replayed of a call ``claim`` gave ``plan`` for, or None: the call runs as any other."""
        return None

    def blocker(self, entry, call) -> Optional[Blocked]:
        """None when ``call`` can replay ``entry``'s graphs now, else a Blocked."""

    def replay(self, entry, call, copy: bool) -> Replayed:
        """Runs ``entry``'s graphs for ``call`` (``copy``: copy its tensors into the static
        inputs first; False for the capture call, whose tensors are there already)."""

    def time_backward(self, entry, times) -> None:
        """Tells the backward of ``entry``'s replay just made to mark its start in ``times`` (a
        BackwardTimes: NOTE [ Graphed calls that cannot pay ] in core/host_cost.py); nothing where a
        replay has no backward of its own."""

    def add_slot(self, entry, call, named: List[Tuple[str, Any]], last_inputs,
                 warn_once: Callable[[Any, str], None]) -> Optional[str]:
        """Captures another slot of ``entry``'s key from ``call`` (a blocker asked for
        Action.NEW_SLOT); None, or why this call runs eagerly instead."""
        raise NotImplementedError(f"{self.api} has no slots")

    def verified_replay(self, entry, call, run_graphs: Callable[[], Any]) -> Tuple[Any, Optional[str]]:
        """``run_graphs()`` checked against an eager re-run: ``(result, None)`` or ``(None,
        mismatch)``. Only called with options.verify_replays > 0."""
        raise NotImplementedError(f"{self.api} does not verify replays")
