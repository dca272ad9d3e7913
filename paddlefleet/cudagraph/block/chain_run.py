"""One run of a chain (NOTE [ Chains of graphed calls ] in block/chain.py): the one bridge applied
at the head call, and each later call checked, replayed and handed its output.
"""

import weakref

import paddle

from ..core.body import Replayed
from ..core.state import amp_snapshot, grad_and_amp
from ..errors import ReplayShapeError
from ..grads.accumulate import note_call
from ..io.static_inputs import unflatten
from . import chain_outputs, partial_grad
from .capture import capture_second_backward
from .bridge import bridge_args
from .chain_bridge import ChainFunction, replay_forward
from .chain_fused import WRITES, FusedFunction
from .chain_links import current_run, forget_link, remember, set_run
from .replay_fallback import state_restored_on_refusal

__all__ = ["ChainRun"]

_MISSING = object()


class ChainRun:
    """The members of one run of a chain and what each call of it is handed.

    Args:
        members: the chain's Members (block/chain.py), in call order, the head first.
        call: the head call (its Call).
        amp: the AMP state at the head call.
        forget: drops the head's cached members (a member no longer fits).
        fused: the chain's fused graphs this run replays, or None (NOTE [ Fused chains ] in
            block/chain_fused.py).
    """

    __slots__ = ("members", "call", "amp", "rest", "extras", "handed", "tokens", "generations", "outputs", "refs",
                 "ids", "order", "hooks", "args", "forget", "executes", "fused", "writes", "versions", "given",
                 "amp_snapshot", "fused_token",
                 "__weakref__")

    def __init__(self, members, call, amp, forget, fused=None):
        self.members = members
        self.call = call
        self.amp = amp
        self.forget = forget
        self.rest = call.args[1:]
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
        self.executes = members[0].entry.backend.capture_executes
        self.fused = fused
        self.writes = self.versions = self.given = self.amp_snapshot = self.fused_token = None

    def start(self):
        """Replays the head's forward (or the fused one), applies the bridge; returns the head
        call's Replayed."""
        note_call()
        try:
            outputs, copied, skipped = self._fused_start() if self.fused is not None else self._start()
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
        self.args = partial_grad.BridgeArgs(params + self.call.tensors, len(params))
        return ChainFunction.apply(self, *self.args.args), copied, skipped

    def _fused_start(self):
        """NOTE [ Fused chains ] in block/chain_fused.py: every forward now, what they read noted."""
        fused = self.fused
        self._second_set(fused)
        copied, skipped = fused.static_inputs.copy_in(self.call.tensors)
        self.args = bridge_args(fused, self.call.tensors)
        self.versions = [[p._inplace_version() for p in m.graphs.params.params] for m in self.members]
        self.amp_snapshot = amp_snapshot()  # NOTE [ Recomputing a fused run ] in block/chain_recompute.py
        outputs = FusedFunction.apply(self, fused, self.args, *self.args.args)
        self.writes = WRITES[0]
        return outputs, copied, skipped

    @staticmethod
    def _second_set(graphs):
        if graphs.backward.sets.wanted:  # NOTE [ Two grad buffer sets ] in grads/hand_out_plan.py
            capture_second_backward(graphs)

    def _give(self, j):
        out = self.outputs[j]
        self.handed = j + 1
        self.given = out._inplace_version()
        member = self.members[j]
        if self.handed == len(self.members):  # a call after the chain may be given its output
            remember(member.entry, out, self.call.args, self.call.kwargs)
            self.close()
        if member.bare:
            return out
        graphs = member.graphs
        return unflatten(graphs.out_spec, [out], graphs.out_consts)

    def hand_out(self, body, args, kwargs):
        """``(entry, Replayed)`` for this call of ``body``: its forward replayed, its output handed
        out; or None: the chain breaks here (or ``body`` is not the next member) and the call runs
        as usual."""
        j = self.order.get(id(body))
        if j is None or j < self.handed:
            return None
        if j > self.handed:  # a later member called first: the calls in between never come
            self.break_at(self.handed, "a later member was called first")
            return None
        why = self._mismatch(j, args, kwargs)
        if why is not None:
            self.break_at(j, why)
            return None
        member = self.members[j]
        if self.fused is not None:
            why = self._changed_since_first(j)
            if why is not None:
                self.break_at(j, why)
                return None
            note_call()
            return member.entry, Replayed(self._give(j), 0, 0)
        graphs = member.graphs
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
        return member.entry, Replayed(self._give(j), copied, skipped)

    def _changed_since_first(self, j):
        """Why member ``j``'s forward, run at the first call of a fused run, may differ from what
        this call would compute now, or None (NOTE [ Fused chains ] in block/chain_fused.py)."""
        if WRITES[0] != self.writes:
            return "a tensor was written (set_value, copy_) since the first call"
        if self.outputs[j - 1]._inplace_version() != self.given:
            return "the previous output was written in place"
        for p, version in zip(self.members[j].graphs.params.params, self.versions[j]):
            if p._inplace_version() != version:
                return "a parameter was written in place since the first call"
        return None

    def needs_eager_recompute(self):
        """Whether this fused run waits for its backward and one of its members' graphs was taken
        since (NOTE [ Recomputing a fused run ] in block/chain_recompute.py)."""
        token = self.fused_token
        return (token is not None and not token.done
                and not all(m.current() for m in self.members[:self.handed]))

    def regular(self, grads):
        """Whether a fused run's backward may replay the fused backward graph (see the NOTE)."""
        return (self.handed == len(self.members) and grads[-1] is not None and not self.hooks
                and all(g is None for g in grads[:-1]))

    def _replay(self, j, first):
        """Member ``j``'s inputs copied in, its forward replayed, its output filled."""
        member = self.members[j]
        if self.extras:
            copied, skipped = member.graphs.static_inputs.copy_in([first] + self.extras)
        else:
            member.in_buf.copy_(first, False)
            copied, skipped = 1, 0
        replay_forward(self, j)
        if member.clone:  # the head made it, empty, as an output of the one grad node
            self.outputs[j].copy_(member.out_buf, False)
        return copied, skipped

    def _mismatch(self, j, args, kwargs):
        """Why call ``j`` cannot be replayed as the chain's (its key's) call now, or None."""
        prev = self.outputs[j - 1]
        if not args or args[0] is not prev or prev.stop_gradient:
            return "its first argument is not the previous call's output"
        rest = self.rest
        if len(args) != len(rest) + 1 or (rest and any(a is not b for a, b in zip(args[1:], rest))):
            return "its other arguments differ from the first call's"
        first = self.call.kwargs
        if kwargs is not first and (len(kwargs) != len(first) or any(first.get(k, _MISSING) is not v
                                                                      for k, v in kwargs.items())):
            return "its keyword arguments differ from the first call's"
        if self.extras and not all(t.stop_gradient for t in self.extras):
            return "an argument other than the first needs grad"
        grad, amp = grad_and_amp()
        if not grad or amp != self.amp:
            return "grad mode or AMP state changed"
        member = self.members[j]
        if not member.current():
            self.forget()
            return "its key's graphs changed or wait for a backward"
        for layer, flag in zip(member.layers, member.flags):
            if layer.training != flag:
                return "a Layer's training flag changed"
        return member.graphs.params.moved()

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
