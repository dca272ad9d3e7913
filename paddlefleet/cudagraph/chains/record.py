"""What one key knows about chains (NOTE [ Chains of graphed calls ] in chains/chain.py): its
``ChainRecord``, held by its GraphEntry as ``entry.chain`` (the entry's one chain attribute) and made
by chains/ the first time they need it (``record``). Core reads it through ``describe``, ``cost`` and
``forget``; everything else about chains stays here.
"""

import weakref

from ..core.host_cost import SAMPLES, quartile_us
from ..core.slower import slower_message, slower_reason

__all__ = ["ChainCost", "ChainRecord", "record"]


def record(entry):
    """``entry``'s ChainRecord, made on first use."""
    held = entry.chain
    if held is None:
        held = entry.chain = ChainRecord(entry.host_cost.measure)
    return held


class ChainRecord:
    """One key's chain state.

    Attributes:
        chain: the Chain this key heads (chains/chain.py), or None; built again at its next head call.
        note: why calls after this key's are not chained to it (chains/links.py ``bar``), or "".
        cost: ChainCost, the host time of this key's calls chains served and the verdict on them.
    """

    __slots__ = ("chain", "note", "cost", "_never")

    def __init__(self, measure=True):
        self.chain = None
        self.note = ""
        self.cost = ChainCost(measure)
        self._never = None  # (weak reference to the BlockGraphs, why they never chain)

    def forget(self, chain=None):
        """The one invalidator of what a key caches about chains: drops the chain it heads (only when it
        is ``chain``, if given: a member of that chain no longer fits) and, without ``chain`` (the entry
        released its graphs), why its graphs never chain. The next head call builds the chain again."""
        if chain is None or self.chain is chain:
            self.chain = None
        if chain is None:
            self._never = None

    def never(self, graphs, why_never):
        """Why ``graphs`` never join a chain ("" when they may): ``why_never(graphs)``, asked once per capture."""
        never = self._never
        if never is None or never[0]() is not graphs:
            never = self._never = (weakref.ref(graphs), why_never(graphs))
        return never[1]

    def describe(self, has_graphs):
        """explain()'s words about this key's chains ("" for none)."""
        heads = self.chain.describe() if self.chain is not None and has_graphs else ""
        return "; ".join(filter(None, [heads, self.note]))


class ChainCost:
    """The host time of one key's calls that chains served, judged as its calls alone are (NOTE
    [ Graphed calls that cannot pay ] in core/host_cost.py): a key joins chains only once judged
    alone; then its first SAMPLES calls a chain served are timed and their lower quartile compared
    with the same eager quartile (each side's backward added where the key's was timed alone: a chained
    call's backward is taken to cost what a call alone's did). A key whose replay started a chain is not judged in chains (it paid
    the bridge of every member, a toll the chain pays once): its verdict is "head".

    ``verdict``: None while timed, "head", "graphed", "eager", or "not timed" (a backend whose
    replay re-runs the function)."""

    __slots__ = ("samples", "verdict")

    def __init__(self, measure=True):
        self.samples = []
        self.verdict = None if measure else "not timed"

    def timing(self, alone):
        """True while the calls chains serve are timed (``alone``: the key's HostCost, judged graphed)."""
        return self.verdict is None and alone.verdict == "graphed"

    def headed(self, alone):
        """A replay of this key just started a chain: its time is no sample of its calls alone, and
        the key is not judged in chains."""
        alone.not_a_sample()
        if self.verdict is None and alone.verdict in (None, "graphed"):
            self.verdict = "head"

    def add(self, alone, seconds):
        """Records one served call's host seconds; the verdict once SAMPLES are in."""
        self.samples.append(seconds)
        if len(self.samples) >= SAMPLES:
            self.verdict = "eager" if alone.slower_than_eager(self.samples) else "graphed"

    def us(self):
        return quartile_us(self.samples)

    def slower(self):
        return self.verdict == "eager"

    def describe(self):
        """What explain() adds to the key's host times ("" before any served call was timed)."""
        return f", chained {self.us():.1f} (lower quartile of {len(self.samples)})" if self.samples else ""

    def reason(self, alone):
        return slower_reason("graphed calls in chains", alone.total_us(self.us()), alone.total_us(None), alone.weighed(),
                             alone.slowdown())

    def warning(self, label, alone, acted):
        return slower_message(label, "a graphed call in a chain", alone.total_us(self.us()), alone.total_us(None), acted,
                              alone.weighed(), alone.slowdown())
