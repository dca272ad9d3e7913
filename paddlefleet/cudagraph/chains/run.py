"""One run of a chain (NOTE [ Chains of graphed calls ] in chains/chain.py): the one bridge applied
at the head call, and each later call checked, replayed and handed its output.
"""

import weakref

import paddle

from ..core.body import Replayed
from ..errors import ReplayShapeError
from ..grads.accumulate import note_call
from ..io.nested import unflatten
from . import outputs as chain_outputs
from ..block import partial_grad
from ..block.capture import capture_second_backward
from .bridge import ChainFunction, replay_forward
from .eligible import mismatch
from .links import current_run, forget_link, remember, set_run
from ..block.replay_fallback import state_restored_on_refusal

__all__ = ["ChainRun"]

class ChainRun:
    """The members of one run of a chain and what each call of it is handed.

    Args:
        chain: the Chain (chains/chain.py): its Members in call order, the head first, and whether the
            bridge takes the head's first argument through two reshapes (NOTE [ Chains of graphed
            calls ]: a root consumed by another root's node).
        held: the head's ChainRecord (chains/record.py), which forgets the chain when a member no longer fits.
        call: the head call (its Call).
    """

    __slots__ = ("chain", "held", "members", "call", "extras", "handed", "tokens", "generations", "outputs", "refs",
                 "ids", "order", "hooks", "args", "executes", "through_view", "__weakref__")

    def __init__(self, chain, held, call):
        self.chain = chain
        self.held = held
        members = self.members = chain.members
        self.through_view = chain.through_view
        self.call = call
        self.extras = call.tensors[1:]
        self.handed = 0
        self.tokens = []
        self.generations = []
        self.outputs = None  # strong only while calls may still be handed their output
        self.refs = []
        self.ids = {}
        self.order = {id(m.body): j for j, m in enumerate(members)}
        self.hooks = {}  # output index -> [(hook id, hook)]; hook None: retain_grads()
        self.args = None
        self.executes = members[0].entry.backend.replays_python

    def start(self):
        """Replays the head's forward, applies the bridge; returns the head call's Replayed."""
        note_call()
        try:
            outputs, copied, skipped = self._start()
        except BaseException:
            self.break_at(0, "the head's replay failed")
            raise
        if isinstance(outputs, paddle.Tensor):
            outputs = [outputs]
        self.outputs = list(outputs)
        self.refs = [weakref.ref(o) for o in self.outputs]
        self.ids = {id(o): j for j, o in enumerate(self.outputs)}
        chain_outputs.track(self)
        set_run(self)
        return Replayed(self._give(0), copied, skipped)

    def _start(self):
        head = self.members[0]
        self._second_set(head.graphs)
        copied, skipped = head.graphs.static_inputs.copy_in(self.call.tensors)
        # NOTE [ paddle.grad through a graphed call ] in block/partial_grad.py
        params = [p for m in self.members for p in m.params]
        tensors = self.call.tensors
        if self.through_view:
            first = tensors[0]
            tensors = [first.reshape([-1]).reshape(first.shape)] + tensors[1:]
        self.args = partial_grad.BridgeArgs(params + tensors, len(params))
        return ChainFunction.apply(self, *self.args.args), copied, skipped

    @staticmethod
    def _second_set(graphs):
        if graphs.backward.sets.wanted:  # NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py
            capture_second_backward(graphs)

    def _give(self, j):
        out = self.outputs[j]
        self.handed = j + 1
        member = self.members[j]
        if self.handed == len(self.members):  # a call after the chain may be given its output
            remember(member.entry, out, self.extras)
            self.close()
        if member.bare:
            return out
        graphs = member.graphs
        return unflatten(graphs.out_spec, [out], graphs.out_consts)

    def claim(self, body, args, kwargs, keys):
        """The index of ``body``'s member when this call is served as the chain's next call (by
        ``hand_out``), or None: the chain breaks here (or ``body`` is not the next member) and the
        call runs as usual. ``keys``: ``body``'s KeyMaker (the call is served only under its
        member's key). Runs no device code."""
        j = self.order.get(id(body))
        if j is None or j < self.handed:
            return None
        if j > self.handed:  # a later member called first: the calls in between never come
            self.break_at(self.handed, "a later member was called first")
            return None
        why = mismatch(self, j, args, kwargs, keys)
        if why is not None:
            self.break_at(j, why)
            return None
        return j

    def hand_out(self, j, args):
        """The Replayed of member ``j``'s call (``claim`` said so): its forward replayed, its output
        handed out; or None: its replay changed a shape, the chain breaks here and the call runs alone."""
        graphs = self.members[j].graphs
        self._second_set(graphs)
        note_call()
        try:
            if self.executes:  # NOTE [ A replay that changes shape ] in block/replay_fallback.py
                with state_restored_on_refusal(graphs.layers, True):
                    copied, skipped = self._replay(j, args[0])
            else:
                copied, skipped = self._replay(j, args[0])
        except ReplayShapeError:  # the call runs alone, which falls back
            self.break_at(j, "its replay changed an output's shape")
            return None
        return Replayed(self._give(j), copied, skipped)

    def _replay(self, j, first):
        """Member ``j``'s inputs copied in, its forward replayed, its output filled."""
        member = self.members[j]
        if self.extras:
            copied, skipped = member.graphs.static_inputs.copy_in([first] + self.extras)
        else:
            member.in_buf.copy_(first, False)  # launched: NOTE [ Link graphs ] in chains/link_graphs.py says why
            copied, skipped = 1, 0
        replay_forward(self, j)
        if member.clone:  # the head made it, empty, as an output of the one grad node
            self.outputs[j].copy_(member.out_buf, False)
        return copied, skipped

    def forget(self):
        """A member no longer fits: the head's next call builds the chain again."""
        self.held.forget(self.chain)

    def break_at(self, j, reason):
        """No call from member ``j`` on is handed its output: their graphs are free for their own
        calls, and the link into member ``j`` is seen again before it is used again."""
        for token in self.tokens[j:]:
            token.done = True
        self.handed = min(self.handed, j)
        if 0 < j < len(self.members):
            forget_link(self.members[j - 1].entry)
        self.close()

    def close(self):
        """No more hand-outs: the thread's open run is no longer this one, and the strong references
        to the outputs go (they and the bridge's context would otherwise keep each other alive)."""
        if current_run() is self:
            set_run(None)
        self.outputs = None

    def index_of(self, t):
        """The index of ``t`` among the outputs handed out so far, or None."""
        j = self.ids.get(id(t))
        if j is None or j >= self.handed or self.refs[j]() is not t:
            return None
        return j
