"""The one entry point of chains (NOTE [ Chains of graphed calls ] in chains/chain.py): the block
hooks the API gives every graphed block (block/hooks.py)."""

from ..block.hooks import CallHooks
from .chain import start_chain
from .links import current_run, observe, remember, watch
from .table import TABLE

__all__ = ["CHAINS", "ChainHooks"]


class ChainHooks(CallHooks):
    """Serves a chain's later calls, starts chains at a replay of their first key, and remembers
    each replay's output for the links."""

    __slots__ = ()

    def claim(self, body, args, kwargs, keys):
        run = current_run()
        j = None if run is None else run.claim(body, args, kwargs, keys)
        return None if j is None else (run.members[j].entry, (run, j))

    def idle(self):
        return current_run() is None  # claim() acts only on an open run

    def idle_holder(self):
        return TABLE.thread  # current_run() is its run

    def serve(self, plan, args):
        run, j = plan
        return run.hand_out(j, args)

    def head(self, body, entry, call):
        observe(body, entry, call)
        return start_chain(body, entry, call)

    def replayed(self, body, entry, call, result):
        if body.options.chain_calls:
            token = entry.graphs.current.inflight  # this replay's (block/bridge.py's Token, weakly)
            watch(entry, token() if token is not None else None)
            remember(entry, result, call.tensors[1:], token)

    def __reduce__(self):  # pickled by reference: one instance per process
        return "CHAINS"


CHAINS = ChainHooks()
