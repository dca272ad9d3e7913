"""Chains: consecutive graphed calls, each given the previous one's output, replayed through one
autograd bridge.

NOTE [ Chains of graphed calls ]
A model graphed layer by layer (``h = layer(h)`` for each graphed layer) pays the per-call toll
of a graphed block once per layer: the key, the replay checks, Paddle's PyLayer apply and, in
backward, one grad node per layer. Most of it does not depend on the layer, so a *chain* pays it
once for a run of consecutive graphed calls:

* **Links.** After each replay through the bridge, this thread remembers the call (weakly: its
  output, that output's inplace version and its other tensors). A replay whose first argument is
  that very output, unchanged, with the very same other tensors, is a *link* from the previous key
  to its own. A link seen CONFIRM times in a row is used; a chain is the longest run of used links
  from a key (no key twice). A link to a key that runs eagerly for good (it fell back) is not used:
  otherwise the key before it would build a chain of one at each call to find that out.
* **The head call** of a chain (a replay of its first key) checks the chain's structure (built
  once and kept on the head key's entry: each member may join - one output, its first argument
  needing grad, no parameter shared with another member, no other argument needing grad - and
  passed a replay's preconditions when the chain was built), replays its own forward graph and
  applies ONE PyLayer whose inputs are the head call's tensors and every member's parameters and
  whose outputs are every member's output (chains/bridge.py): the head's a copy of its
  static output, the others empty until their call comes. It returns the first output.
* **The later calls** are served before the wrapper looks up its entries (the dispatcher asks
  ``BlockBody.claim``, the runner ``serve``: NOTE [ One call through the dispatcher ] in core/dispatch.py):
  member ``j`` is served when its first argument is output ``j - 1`` (same object, still
  stop_gradient=False), its other tensors are the head's (same objects), **the key it would get
  itself is its member's key** (KeyMaker.key: every non-tensor argument by value as any call's key
  compares it - a config dict changed in place or a numpy buffer refilled between two calls gives
  another key -, each tensor's metadata, grad mode, AMP state and the training flags), its key still
  replays the same graphs (none waiting for a backward) and every precondition an alone replay
  checks holds (NOTE [ Replay preconditions ] in block/replay.py: no parameter moved, no Layer
  attribute or structure changed; ChainRun._mismatch is the one place a member's call is checked). Then its
  inputs are copied in, its forward graph replays - when the call comes, so that parameters,
  random numbers and running statistics are read and drawn at eager's moment - and its output is
  filled and handed out. Otherwise the chain *breaks* there: that call and the rest run through
  their own keys as usual, and the link is seen again before it is used again. Calls that never
  come (an early exit) leave their outputs unused: nothing reached autograd through them.
* **Backward** (chains/bridge.py) replays the backward graphs of the members that handed
  out their output, last first, feeding each the grad of its output: the grad the next member's
  backward gave its first input (copied by a link graph where nothing else reached the output), then
  the output's own hooks. A grad that reached an intermediate
  output from outside the chain bars that link for good (NOTE [ Outputs with consumers outside the
  chain ] in chains/links.py); in that one backward it is added to the next member's part (two
  terms commute exactly: one outside consumer sums as eagerly). Parameters get their grads
  from the one grad node, as the bridge hands them out (NOTE [ Grad hand-out ]).
* **Intermediate outputs** are ordinary tensors, but the grad the next member gives them never
  passes through autograd: hooks registered on them and ``retain_grads()`` are kept by the chain
  and applied to the whole grad (chains/outputs.py); ``paddle.grad`` with respect to one the
  next member consumed raises, naming ``chain_calls=False`` (the grad it would return misses the
  chain's part).

* **A root consumed by another root's node.** Some Paddles (2.6) crash in
  ``paddle.autograd.backward([b, a])`` when ``a`` is a root that ``b``'s own grad node consumes
  directly ("Unable to find next node in the GradTensorHolder"). Eager layers rarely meet it (a node
  per op sits between), but a chain collapses its members into one node: with an auxiliary loss on
  an intermediate output ``h`` (the link after it barred), a chain headed by the call given ``h``
  would be that node for the final output. So, where a probe run once shows the crash
  (``root_consumer_crashes``), a chain whose head is fed through a barred link takes the head's first
  argument through two reshapes (views: no kernel), whose grad nodes sit between, as an eager layer's do.

``chain_calls=False`` keeps a wrapper out of chains. Keys with accumulate_in_graph,
verify_replays, dispatch_key_fn, check_stale_outputs, host tensors or several slots do not chain.
"""


import paddle

from ..core.call_state import grad_enabled
from ..io.nested import unflatten
from .eligible import current, flags, may_join, member_now
from .links import confirmed, current_run
from .record import record
from .run import ChainRun
from .table import TABLE

__all__ = ["Chain", "Member", "start_chain"]


class Member:
    """A key of a chain: its body, entry, the one BlockGraphs it replays, its bridged parameters
    and the Layers (with the training flags) its key was made with."""

    __slots__ = ("body", "entry", "graphs", "params", "layers", "flags", "bare", "in_buf", "out_buf", "clone")

    def __init__(self, body, entry, graphs, flags_):
        self.body = body
        self.entry = entry
        self.graphs = graphs
        self.params = graphs.backward.bridged
        self.layers = graphs.layers
        self.flags = flags_
        self.in_buf = graphs.static_inputs.buffers[0]
        self.out_buf = graphs.static_outputs[0]
        self.clone = graphs.clone_outputs
        # The call returns its one output itself (not in a container): handed out as it is.
        self.bare = unflatten(graphs.out_spec, [self.out_buf], graphs.out_consts) is self.out_buf


def _member(body, entry, flags_):
    """The Member for ``entry`` when its key may join a chain now, else None."""
    return Member(body, entry, entry.graphs.all[0], flags_) if member_now(body, entry) else None


def start_chain(body, entry, call):
    """Starts a chain at this replay of ``entry`` (the head) when confirmed links lead on from
    it; returns the head's Replayed, or None (the call replays alone)."""
    run = current_run()
    if run is not None:  # a run nobody finished (an early exit): its calls never come
        run.break_at(run.handed, "a new chain started")
    if confirmed(entry) is None or not grad_enabled():
        return None
    held = record(entry)  # the entry's: its chain is forgotten when the entry releases its graphs
    chain = held.chain
    if chain is None or chain.version != TABLE.version or len(chain.members) < 2 or not current(chain.members[0]):
        members = _members(body, entry, call)
        through_view = len(members) >= 2 and _fed_through_barred_link(entry) and root_consumer_crashes()
        chain = held.chain = Chain(TABLE.version, members, through_view)
    if len(chain.members) < 2:
        return None
    started = ChainRun(chain, held, call).start()
    held.cost.headed(entry.host_cost)  # NOTE [ Graphed calls that cannot pay ] in core/host_cost.py
    return started


class Chain:
    """The members confirmed links lead to from one head (checked again at each call); held by the
    head's ChainRecord (chains/record.py)."""

    __slots__ = ("version", "members", "through_view", "__weakref__")

    def __init__(self, version, members, through_view=False):
        self.version = version
        self.members = members
        self.through_view = through_view  # NOTE [ Chains of graphed calls ]: a root consumed by another root's node

    def describe(self):
        """What explain() says of the chain this key heads ("" when it heads none)."""
        n = len(self.members)
        return f"heads a chain of {n} calls" if n >= 2 else ""


def _members(body, entry, call):
    """The head and the members the confirmed links lead to, as far as each may join (the later
    members are checked again when their call comes: ChainRun.claim)."""
    head = _member(body, entry, flags(entry.graphs.current))
    if head is None or not current(head):
        return []
    members, seen = [head], {id(entry)}
    params = {id(p) for p in head.params}
    params.update(id(t) for t in call.tensors)
    nxt = confirmed(entry)
    while nxt is not None:
        body, entry, link_flags = nxt
        member = None if id(entry) in seen else _member(body, entry, link_flags)
        if member is None or not may_join(member, head, call, params):
            break
        members.append(member)
        seen.add(id(entry))
        nxt = confirmed(entry)
    return members


def _fed_through_barred_link(entry):
    return any(link.barred and link.entry() is entry for link in TABLE.links.values())


_ROOT_CONSUMER = []  # [whether this Paddle's backward crashes on a root its other root's node consumes]


def root_consumer_crashes():
    """Whether ``paddle.autograd.backward([b, a])`` fails when ``b``'s grad node consumes the root
    ``a`` directly (NOTE [ Chains of graphed calls ]); probed once, on tiny tensors."""
    if not _ROOT_CONSUMER:
        with paddle.set_grad_enabled(True):
            x = paddle.ones([1])
            x.stop_gradient = False
            a = x * 3.0
            b = a * 5.0
            try:
                paddle.autograd.backward([b, a], [paddle.ones([1]), paddle.ones([1])])
                _ROOT_CONSUMER.append(False)
            except (SystemError, RuntimeError, OSError):
                _ROOT_CONSUMER.append(True)
    return _ROOT_CONSUMER[0]
