"""Wrappers that can only run eagerly pass calls straight through (NOTE [ Pass-through wrappers ]); a
wrapper whose every key runs eagerly as slower (core/host_cost.py) and one with max_graphs=0 do the same."""

from ..backends import backend_env_set, cuda_available, environment_reads, plain_call, plain_thread, thread_nesting
from ..guards import saved_hooks
from ..io.stale_outputs import any_stale, stale_registry

__all__ = ["NO_PLACES", "all_slower", "condition_gate", "no_places", "passes_through"]


# NOTE [ Pass-through wrappers ]
# With backend=None in a Paddle build without CUDA graphs, every call runs eagerly (no tensor of the process
# can be on a GPU), and the README promises such a wrapper leaves the code untouched: it must cost about what
# the Layer's own call costs, not a key per call (the key, the backend resolved from the environment and the
# AMP state cost about the Layer's own call again). Such a wrapper learns this once, from its first call that
# resolved no backend (Lifecycle._keyless: the reason with _untouched, and the dispatcher's Decision, made
# once), and from then on calls the function directly, counted with the same reason, while _untouched() holds:
# the environment names no backend (PADDLEFLEET_CUDAGRAPH_BACKEND is read when a key is first seen, and such a
# call's key is new every time, so setting it later still graphs the next call), nothing around the call would
# give it another reason (a capture, a whole step, a replay that re-runs Python, saved-tensors hooks), and no
# stale output exists that it would have to refuse. Not cached: a wrapper with dispatch_key_fn (its key
# function is called on every call, and may say None), with a backend option, in a CUDA build (a call's
# tensors decide), or that ever held a key (a chain may still name its body). A Layer graphed in place runs such
# calls from its compiled front door, without the wrapper's Python (NOTE [ The front door ] in core/front.py).


def _untouched():
    """True when a pass-through wrapper's call may skip the key (NOTE [ Pass-through wrappers ])."""
    return plain_call() and not saved_hooks.active() and not any_stale()


def _unnested():
    """True when a call of a wrapper with max_graphs=0 may skip the key: what _untouched() asks but the
    environment (with no place for any key, no backend the environment names could graph a call)."""
    return plain_thread() and not saved_hooks.active() and not any_stale()


def condition_gate(when):
    """What a compiled front door reads to answer ``when()`` of a keyless rule without calling it (NOTE [ The front
    door ] in core/front.py): ``(thread nesting, saved-tensors hooks state, stale outputs, environment)``, the
    environment None for _unnested (and ``environment_reads()`` for _untouched); None for any other condition (the
    front calls it)."""
    if when is _unnested:
        return thread_nesting(), saved_hooks.registration(), stale_registry(), None
    if when is _untouched:
        env = environment_reads()
        return None if env is None else (thread_nesting(), saved_hooks.registration(), stale_registry(), env)
    return None


#: The reason of every call of a wrapper with max_graphs=0.
NO_PLACES = "max_graphs=0: no key may hold graphs, every call runs eagerly"


def no_places(options):
    """The keyless rule of a wrapper whose ``options`` give no key a place (max_graphs=0): its calls run eagerly
    without a key while _unnested() holds (a call inside a whole step or a capture, or given a stale output, still
    goes through the dispatcher, which gives its own reason or error), or None."""
    return (NO_PLACES, _unnested) if options.max_graphs == 0 else None


def all_slower(reason):
    """The keyless rule of a wrapper whose every key runs eagerly as slower (host_cost.act's
    ``reason``; NOTE [ Graphed calls that cannot pay ] in core/host_cost.py), or None. Its ``when`` is None:
    it always holds (read without a call)."""
    return None if reason is None else (reason, None)


def passes_through(options, reason):
    """``(reason, _untouched)`` when every later call of a wrapper with ``options`` that never held a
    key, whose call resolved no backend for ``reason``, runs eagerly for it while _untouched() holds
    (NOTE [ Pass-through wrappers ]), else None."""
    if options.backend is not None or options.dispatch_key_fn is not None or cuda_available():
        return None
    return None if backend_env_set() else (reason, _untouched)
