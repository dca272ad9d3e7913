"""The front door of a Layer graphed in place: a compiled callable in front of its wrapper (NOTE [ The front door ]).

NOTE [ The front door ]
A Layer graphed in place holds its wrapper (a Lifecycle) as its ``forward``, and Paddle's ``Layer.__call__`` calls it. A
wrapper whose calls pass straight through (a keyless rule: every key slower graphed than eager, max_graphs=0,
backend=None without a CUDA build: NOTE [ Pass-through wrappers ] in core/pass_through.py) costs what its Python costs
around the Layer's own forward: the wrapper's ``__call__``, the rule's check, the body's eager runner, three frames
measured at 1.3-1.9 us a call on an H200 host (docs/reports/pass_through_probe.md), which for a model of one-matmul
layers that eager_if_slower sent eager left the step 3% slower than eager's. Where the compiled module is loaded
(NOTE [ Compiled tensor reads ] in native/__init__.py) the Layer holds a ``Front`` instead: a C callable that reads the
wrapper's ``_keyless`` rule ``(reason, when, Decision, tally, gate)`` and ``_eager_parts`` ``(fn, owner weakref, calls)``
(the body's eager runner laid out: Body.eager_parts), and where the rule holds (``when`` None, or ``when()`` true: the
same function the wrapper asks; the conditions of core/pass_through.py read in C from the rule's ``gate`` instead of
called: this thread's nesting, the saved-tensors hooks' state, the stale outputs and, for a wrapper without a backend
on a machine without CUDA graphs, the environment's variable, which ``when()`` reads at 0.3-0.5 us a call on the
CPU) and the owner is alive, counts the call in the rule's tally and in ``calls`` and returns
``fn(owner, *args, **kwargs)``, what the wrapper's own pass-through returns. Without a rule, a call of positional
arguments that the wrapper's key known to run eagerly takes is counted in that key's tally and run the same way. Whether
it takes the call is ``KnownEager.take``'s answer (NOTE [ Calls of a key that runs eagerly ] in core/dispatch.py), read
in C from the key's ``gate`` (``known_gate``): the entry still in FALLBACK with the same reason, this thread's nesting
count (backends.thread_nesting), the saved-tensors hooks' state, the stale outputs and the host marks (their dicts),
what the body's idle() reads (Body.idle_holder: a chain's thread state, or nothing), the positional specs by count and
the tracked Layers; the key read from the entry on every call and compared as ``key_of`` compares it; and the books kept
as take() keeps them (the wrapper's tick, the entry's last use, the entry moved last and made the latest where another
key's call came between). A key refused under max_graphs without an entry (``KnownRefused``) has a gate too
(``refused_gate``): the same reads of the thread, hooks, outputs, marks, idle() and the call against its key, then the
key still without an entry and every place still taken with no key it may displace (``refused_again``:
Places.refused_again in C, the call remembered as it remembers it), and the wrapper's last refusal set, as take() sets
it. Where a value is not what the gate expects (a tensor marked host, a body whose idle() it cannot read, a tensor the
compiled reads leave to Python) the front asks ``take()`` itself. Any other call goes to the wrapper, unchanged; where
the front has asked what the wrapper's ``__call__`` asks first (the rule's ``when``, the known key's take) and was told
no, it calls the wrapper's ``_dispatched`` instead, which goes straight to dispatch(): a graphed call beside a key that
runs eagerly is not asked about twice. Every attribute of the front is the wrapper's (read, set, deleted):
``layer.forward.stats()``, ``.explain()``, ``.reset()``, ``inspect.signature(layer.forward)`` and the wrapper's
internals read as before; ``copy.deepcopy`` of the Layer gives its copy a front in front of the wrapper's copy, and a
pickled Layer gets a front again in front of its unpickled wrapper (``unpickled``). ``behind(obj)`` is the wrapper
behind a front (``obj`` itself otherwise). Without the module the Layer holds the wrapper itself, as before: the
pure-Python path stays the fallback, and tests/core/test_front.py compares the two.
"""

from .. import native
from ..backends import thread_nesting
from ..guards import saved_hooks
from ..guards.host_marks import marks
from ..io.stale_outputs import stale_registry
from .call import positional_forms
from .entry import Phase

__all__ = ["behind", "front", "is_front", "known_gate", "refused_gate", "unpickled"]


def front(wrapper):
    """What a Layer graphed in place holds as its forward: a Front in front of ``wrapper`` where the compiled module
    is loaded, else ``wrapper`` itself."""
    made = getattr(native.reads, "Front", None)
    return wrapper if made is None else made(wrapper)


def is_front(obj):
    """True for a Front (of any loaded module)."""
    return type(obj).__name__ == "Front" and hasattr(type(obj), "_front_target")


def behind(obj):
    """The wrapper behind the front ``obj``, or ``obj`` itself."""
    return obj._front_target if is_front(obj) else obj


def _surroundings(wrapper):
    """What every gate reads besides its key (both take() answers ask the same of a call's surroundings): this
    thread's nesting, the saved-tensors hooks' state, the stale outputs, the host marks, what ``wrapper``'s idle()
    reads, the positional specs by count, the tracked Layers."""
    return (thread_nesting(), saved_hooks.registration(), stale_registry(), marks(), wrapper._body.idle_holder(),
            positional_forms(), wrapper._keys.layers)


def known_gate(entry, wrapper, fallback_phase):
    """What the front door reads to answer ``KnownEager.take`` for ``entry`` (a key of ``wrapper`` in
    ``fallback_phase``) in C (NOTE [ The front door ])."""
    return (entry, fallback_phase, entry.fallback_reason) + _surroundings(wrapper)


def refused_gate(key, wrapper, reason):
    """What the front door reads to answer ``KnownRefused.take`` for ``key`` (refused under max_graphs, without an
    entry, in ``wrapper``; ``reason``: the refusal's) in C (NOTE [ The front door ])."""
    places = (wrapper._places.waiting(), wrapper._body, Phase.WARMUP, Phase.REPLAY, reason)
    return (None, key, places) + _surroundings(wrapper)


def unpickled(wrapper):
    """A Front's pickle: ``front(wrapper)`` again, in the loading process."""
    return front(wrapper)
