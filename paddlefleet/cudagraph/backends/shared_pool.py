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
"""

from ..errors import CudaGraphError

__all__ = ["SharedPool", "PoolConflictError"]


class PoolConflictError(CudaGraphError):
    """A replay would overwrite live data of a graph captured later into the same pool (NOTE [
    Sharing a pool safely ])."""


class SharedPool:
    """The graphs captured into one pool, in capture order."""

    def __init__(self):
        self.graphs = []

    def join(self, graph):
        """``graph`` was captured into this pool (after every graph already in it)."""
        self.graphs.append(graph)

    def leave(self, graph):
        """``graph`` was reset: its memory holds nothing any more."""
        self.graphs = [g for g in self.graphs if g is not graph]

    def conflict(self, graph):
        """Why replaying ``graph`` now would overwrite live data of another graph of this pool, or None."""
        try:
            later = self.graphs[next(i for i, g in enumerate(self.graphs) if g is graph) + 1:]
        except StopIteration:
            return None
        for other in later:
            if other.live is not None and other.live():
                return (f"replaying {graph.what or 'a graph'} would overwrite what {other.what or 'a graph'}, "
                        "captured after it into the same memory pool, still holds: a graph captured later may "
                        "sit in memory an earlier one uses as scratch space")
        return None
