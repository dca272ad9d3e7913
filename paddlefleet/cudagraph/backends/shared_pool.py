"""The liveness rule of a memory pool shared by several graphs, as a model the simulated backend
enforces (``SimulatedBackend.pool_model``) and the capture's pool choice follows (block/capture.py).

NOTE [ Sharing a pool safely ]
Graphs captured one after another into one pool share its memory the way a caching allocator
shares it: a graph captured later may be placed in memory an earlier graph of the pool freed by
the end of its capture (its temporaries), never in memory still allocated then. A replay writes
all of a graph's memory, temporaries included. So replaying a graph may overwrite data of any graph
captured *after* it into the same pool, and nothing of a graph captured before it: a replay is safe
exactly when no graph captured after it holds live data at that moment. A graph's data are live
while a later step still reads them: a forward's saved activations while its backward is pending,
its static outputs while they are handed out uncopied (clone_outputs=False), a backward's static
grads while ``p.grad`` aliases them (NOTE [ Grad hand-out ] in grads/hand_out_plan.py). Graphs
captured in the order they are replayed, each cycle consuming its data before the next begins (a
model's layers forward then backward, grads freed or copied before the next step), share safely;
anything else - micro-batches in flight, keys captured lazily and replayed in another order, grads
kept across micro-batches as aliases - does not.

``SharedPool`` keeps a pool's graphs in capture order, each with ``Graph.live`` (a callable: does it
hold live data now?) and ``Graph.what`` (words for messages), and names the conflict a replay would
cause. The simulated backend refuses such a replay (PoolConflictError) instead of running it: the
model has no addresses, so it assumes the worst placement, which is what a GPU may choose.

NOTE [ Keys sharing a forward pool ]
Where Paddle can name a pool at capture (begin_capture_with_pool_id, 3.1 and newer), the forward
graphs of the keys of a device are captured into one pool (``forward_pool``): a model graphed layer
by layer captures them in call order and replays them in it, so each forward may reuse what the
forwards captured before it freed (their temporaries, and the rounding of one pool per graph). Not
every order is that one: two micro-batches in flight, a key of another shape called between a
forward and its backward, a key captured again (a moved parameter) and so placed after the keys
it runs before. So before every forward replay the rule is checked (``blocked``: does a graph
captured after it still wait for its backward?), and a key it blocks is captured again for that
call into a pool of its own, where it stays (block/replay.py; explain() gives the reason): one
capture, never a replay over live data, and no key left running eagerly. Only a key's first
capture joins the shared pool. A forward's data are live from its replay until its
backward ran or its outputs were dropped, so the check needs only the graphs replayed since they
were last seen dead: ``blocked`` looks at the one with the highest capture index and drops it once
it is dead, a ``max`` over a few integers per call instead of a walk of every later graph. Only
forwards join: a backward replay cannot fall back to eager once its forward replayed, and a
backward's static grads live on in ``p.grad``. Keys whose forward data never die (outputs handed
out uncopied, clone_outputs=False), keys whose forward and backward share a pool of their own
(grads handed out as copies) and a key's further slots (forwards in flight by design) keep their
own pools. The pool's memory returns to the device only when every graph captured into it is reset.
The simulated backend's pool model (``SimulatedBackend.pool_model``) checks every replay against
every later graph (``conflict``), so a forward replayed past the rule fails there.
"""

import weakref

from ..errors import CudaGraphError

__all__ = ["SharedPool", "PoolConflictError", "forward_pool", "forget_forward_pools"]


class PoolConflictError(CudaGraphError):
    """A replay would overwrite live data of a graph captured later into the same pool (NOTE [
    Sharing a pool safely ])."""


class SharedPool:
    """The graphs captured into one pool, in capture order.

    Args:
        handle: the backend's name for the pool (a CUDA pool id), or None (the simulated model).
    """

    def __init__(self, handle=None):
        self.handle = handle
        self._refs = []  # weak references, capture order: a dropped graph leaves with its owner
        self._next = 0
        self._replayed = {}  # capture index -> weak reference of a graph whose data may be live

    @property
    def graphs(self):
        """The pool's graphs still alive, in capture order."""
        return [g for g in (r() for r in self._refs) if g is not None]

    def join(self, graph):
        """``graph`` was captured into this pool (after every graph already in it)."""
        graph.pool_index = self._next
        self._next += 1
        ref = weakref.ref(graph)
        self._refs = [r for r in self._refs if r() is not None] + [ref]
        self._replayed[graph.pool_index] = ref

    def leave(self, graph):
        """``graph`` was reset: its memory holds nothing any more."""
        self._refs = [r for r in self._refs if r() is not None and r() is not graph]
        self._replayed.pop(getattr(graph, "pool_index", None), None)

    def replayed(self, graph):
        """``graph`` replayed: its data may be live from now on (NOTE [ Keys sharing a forward pool ])."""
        self._replayed[graph.pool_index] = weakref.ref(graph)

    def blocked(self, graph):
        """Why replaying ``graph`` now would overwrite live data of a graph captured after it, or None;
        looks only at graphs replayed since last seen dead (NOTE [ Keys sharing a forward pool ])."""
        replayed = self._replayed
        index = graph.pool_index
        while replayed:
            top = max(replayed)
            if top <= index:
                return None
            other = replayed[top]()
            if other is not None and other.live is not None and other.live():
                return _words(graph, other)
            del replayed[top]
        return None

    def conflict(self, graph):
        """Why replaying ``graph`` now would overwrite live data of another graph of this pool, or None
        (every later graph asked)."""
        graphs = self.graphs
        try:
            later = graphs[next(i for i, g in enumerate(graphs) if g is graph) + 1:]
        except StopIteration:
            return None
        for other in later:
            if other.live is not None and other.live():
                return _words(graph, other)
        return None


def _words(graph, other):
    return (f"replaying {graph.what or 'a graph'} would overwrite what {other.what or 'a graph'}, "
            "captured after it into the same memory pool, still holds: a graph captured later may "
            "sit in memory an earlier one uses as scratch space")


_FORWARD_POOLS = {}


def forward_pool(device, make_handle=None):
    """The pool the forward graphs of keys on ``device`` (a string) share (NOTE [ Keys sharing a
    forward pool ]), made on first use with ``make_handle()`` as its handle."""
    pool = _FORWARD_POOLS.get(device)
    if pool is None:
        pool = _FORWARD_POOLS[device] = SharedPool(make_handle() if make_handle is not None else None)
    return pool


def forget_forward_pools():
    """Later forward captures start new pools (graphs already captured keep theirs)."""
    _FORWARD_POOLS.clear()

