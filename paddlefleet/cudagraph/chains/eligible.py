"""Whether a key or a call may chain (NOTE [ Chains of graphed calls ] in chains/chain.py): every
predicate chains decide on, in one place. ``why_never``: once per capture, what keeps a key out of
chains for good; ``gone``: whether a key never replays again (it runs eagerly for good); ``member_now``: whether a key may join a chain now; ``may_join``: whether it may follow
a chain's head; ``current``: whether a member still replays the graphs it joined with; ``given_output``:
whether a call is a link from the latest replay; ``mismatch``: why a call cannot be served as its chain's
next call.
"""

from ..core.call import Call, positional_spec
from ..core.entry import Phase
from ..block.replay import replay_blocker
from .record import record

__all__ = ["current", "flags", "given_output", "gone", "may_join", "member_now", "mismatch", "why_never"]


def flags(graphs):
    """The training flags of the Layers a key's graphs use (its key was made with them)."""
    return tuple(layer.training for layer in graphs.layers)


def current(member):
    """Whether a member's key still replays its graphs, alone in its slots, and none waits for a backward."""
    slots = member.entry.graphs
    return (slots is not None and slots.current is member.graphs and len(slots.all) == 1
            and member.entry.phase is Phase.REPLAY and not member.graphs.backward_pending())


def gone(entry):
    """Whether ``entry``'s key runs eagerly for good (it fell back: a capture failed, eager_if_slower judged it
    slower, ...), so that no chain can reach it again (until reset(), which makes new keys)."""
    return entry.phase is Phase.FALLBACK


def why_never(graphs):
    """Why a key with ``graphs`` never joins a chain, or "" (decided once per capture)."""
    backward = graphs.backward
    if backward is None or backward.graph is None:
        return "no backward graph"
    if backward.accumulators is not None or backward.anchor is not None:
        return "accumulate_in_graph"
    if graphs.out_aliases is not None:  # NOTE [ Outputs handed back as they are ] in io/output_aliases.py
        return "an output that is an input, a Layer tensor or repeats another"
    if len(graphs.static_outputs) != 1 or not graphs.out_differentiable[0] or graphs.host_outputs:
        return "not one differentiable output"
    if graphs.handed_out is not None:
        return "check_stale_outputs"
    static = graphs.static_inputs
    if not static.buffers or static.host:
        return "host tensors among its arguments"
    if any(not b.stop_gradient for b in static.buffers[1:]):
        return "an argument other than the first needs grad"
    return ""


def member_now(body, entry):
    """Whether ``entry``'s key may join a chain now."""
    slots = entry.graphs
    options = body.options
    if (slots is None or len(slots.all) != 1 or entry.verify_left > 0 or not options.chain_calls
            or options.dispatch_key_fn is not None):
        return False
    if entry.host_cost.judging:  # judged alone first (NOTE [ Graphed calls that cannot pay ] in core/host_cost.py)
        return False
    return not record(entry).never(slots.all[0], why_never)


def may_join(member, head, call, params):
    """Whether ``member`` may follow ``head`` in a chain started by ``call`` (``params``: the ids of the
    parameters and call tensors of the members before it; its own are added when it may)."""
    graphs = member.graphs
    if not current(member) or graphs.in_spec != head.graphs.in_spec or flags(graphs) != member.flags:
        return False
    if member.entry.backend.name != head.entry.backend.name or 0 in graphs.static_inputs.adopted:
        return False
    if graphs.backward.grad_plan.slots[0] is None:  # its first argument gets no grad
        return False
    if any(id(p) in params for p in member.params):  # a parameter shared with another member
        return False
    params.update(id(p) for p in member.params)
    predicted = _Predicted([graphs.static_inputs.buffers[0]] + call.tensors[1:])
    return replay_blocker(graphs, predicted, check_inputs=False) is None


def mismatch(run, j, args, kwargs, keys):
    """Why call ``j`` cannot be replayed as the chain's (its key's) call now, or None.

    The call is served only under the key it would get itself (KeyMaker.key: every non-tensor
    argument by value, each tensor's metadata, grad mode, AMP state and training flags), equal to
    its member's key; its tensors other than the first are the first call's, which the chain
    copies in."""
    prev = run.outputs[j - 1]
    if not args or args[0] is not prev or prev.stop_gradient:
        return "its first argument is not the previous call's output"
    extras = run.extras
    if not kwargs and len(args) == len(extras) + 1 and all(a is b for a, b in zip(args[1:], extras)):
        # f(h, *the first call's other tensors): every argument a tensor, so they are the call's tensors, and its
        # spec is made only where the compiled reads cannot tell (KeyMaker.is_call_of)
        call, spec = _Predicted(list(args)), None
    else:
        spec = positional_spec(args, kwargs)
        call = Call(args, kwargs, spec)
        if not _same(call.tensors[1:], extras):
            return "its other tensor arguments are not the first call's"
    member = run.members[j]
    key = member.entry.key  # read part by part where it can be, else made (the same answer)
    if not (keys.is_call_of(key, args) if spec is None else keys.is_key_of(key, spec, args)):
        made = call if spec is not None else Call(args, kwargs, positional_spec(args, kwargs))
        if keys.key(args, kwargs, made.tensors, made.spec) != key:
            return ("the key it would get is not its key in the chain (an argument's value, grad mode, AMP state or "
                    "a training flag changed)")
    if not current(member):
        run.forget()
        return "its key's graphs changed or wait for a backward"
    # Every precondition an alone replay checks (NOTE [ Replay preconditions ] in block/replay.py):
    # parameters, adopted inputs, Layer attributes and structure. A blocked call runs alone, which acts on it.
    blocked = replay_blocker(member.graphs, call, check_inputs=False)
    return None if blocked is None else blocked.reason


def given_output(seen, call):
    """Whether ``call`` is given the output of the replay ``seen`` recorded (chains/links.py's _Seen, or
    None), unchanged since, with the same other tensors: a link (other arguments are compared by
    value, through the key, when a chain claims the call: ``mismatch``)."""
    if seen is None or not call.args:
        return False
    out = seen.output()
    if out is None or call.args[0] is not out or out._inplace_version() != seen.version:
        return False
    return _same(call.tensors[1:], seen.extras)


def _same(tensors, others):
    """The same tensor objects, in the same order."""
    return len(tensors) == len(others) and all(a is b for a, b in zip(tensors, others))


class _Predicted:
    """The tensors a member's call will have, for its replay preconditions."""

    __slots__ = ("tensors",)

    def __init__(self, tensors):
        self.tensors = tensors
