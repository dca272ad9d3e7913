"""The one owner of chain state (NOTE [ Chains of graphed calls ] in chains/chain.py): per thread,
the latest graphed call and the open run; per process, the links seen between keys and their
version, the runs whose outputs may still get hooks or be differentiated, and the ids of the hooks
chains took. Each chain itself is held by its first key's entry (released with it).
"""

import itertools
import threading
import weakref

__all__ = ["TABLE", "Table"]


class _PerThread(threading.local):
    """What one thread's graphed calls tell: its latest call and its open run."""

    def __init__(self):
        super().__init__()
        self.last = None  # links._Seen of the latest replay through the bridge
        self.run = None  # run.ChainRun whose next member was not handed out yet
        self.feeding = None  # what links.observe saw for the replay about to run (links.watch)


class Table:
    """Chain state; one instance per process, TABLE."""

    __slots__ = ("thread", "links", "version", "runs", "hook_ids")

    def __init__(self):
        self.thread = _PerThread()
        self.links = weakref.WeakKeyDictionary()  # entry -> links._Link to the entry of the call it feeds
        self.version = 0  # bumped whenever a link is made, confirmed or forgotten: chains are built again
        self.runs = weakref.WeakSet()  # runs whose outputs may still get hooks or be differentiated
        self.hook_ids = itertools.count(1 << 40)  # ids of hooks chains took: far from Paddle's own


TABLE = Table()
