"""The copy of a grad between two members of a chain, captured as a graph (NOTE [ Link graphs ]).

NOTE [ Link graphs ]
In a chain's backward, member ``j`` gets the grad member ``j + 1``'s backward graph wrote for its first input: a
static buffer of that member's grad set, which the launched copy moves into member ``j``'s grad-output buffer.
Both addresses are fixed, so the copy is captured once as a graph that holds that one copy and replayed at the
moment the copy would be launched: the host pays a graph launch instead of a copy's (2.1-2.8 us against 5.2-7.8
on an H200 host, 11.8-16 against 26-35 in a step's cold caches: docs/reports/launch_probe.md). The device copies
the same bytes between the same addresses, so the result is the same bit for bit.

A link graph replays only where it provably does what the launched copy would:
- its source and destination are the very tensors it was captured with, still at the data pointers they had
  (both checked at each use; a buffer given back or re-pointed gets a new capture or none);
- same shape and dtype on both sides (a copy that casts is launched, never captured);
- the grad the member gets is the next member's static input grad itself (no hook on the output, no grad from
  outside the chain: those make a tensor of their own);
- no capture is open (a whole step's, or another key's) and no simulated replay is re-running Python.
A capture that fails leaves the launched copy for good for that pair; the copy of that call is launched as
before. On the simulated backend the capture runs the copy and each replay runs it again, reading the source
when it replays, as a GPU's copy node does. The graphs are kept on the destination's BlockGraphs (``links``), by
source (one per grad buffer set of the next member), and freed with them.

A member's forward input copy stays launched. Where outputs are handed out as copies (``clone_outputs=True``, the
default) the tensor a member is given is one of its own, which ``copy_`` and ``set_value`` change without any
version count telling, so no link can prove it still holds the previous static output; where they are the static
buffers themselves, a link graph from the previous static output made the step no faster on an H200 (the 24 x 1024
and 32 x 512 per-layer models in docs/reports/per_layer_floor_probe.md: within 0.4% in latency), while the backward
links took 0.4-2.6% off a default step's latency (within 1% in throughput).
"""

import logging
import weakref

import paddle

from .. import native
from ..backends import capture_open, in_rerun_replay

__all__ = ["LinkGraphs", "copy_body", "linked_copy"]

logger = logging.getLogger(__name__)


def copy_body(dst, src):
    """What a link graph captures: one copy; returns ``dst``, its static result (``copy_`` returns None on
    some Paddles)."""
    dst.copy_(src, False)
    return dst


def _ptrs(tensors):
    return [t.data_ptr() for t in tensors]


class _Link:
    __slots__ = ("src", "dst", "ptrs", "graph")

    def __init__(self, src, dst, graph):
        self.src = weakref.ref(src)  # another key's buffer: it may be given back before this one
        self.dst = dst
        self.ptrs = _ptrs((src, dst))
        self.graph = graph


class LinkGraphs:
    """The link graphs that write one key's static buffers, by source (NOTE [ Link graphs ])."""

    __slots__ = ("backend", "by_src", "replays")

    def __init__(self, backend):
        self.backend = backend
        self.replays = 0  # copies made by a link graph
        self.by_src = {}  # id(src) -> _Link (graph None: its capture failed, the copy is launched)

    def copy(self, dst, src):
        """Copies ``src`` into ``dst`` by a link graph and returns True, or returns False (nothing done:
        the caller launches the copy)."""
        link = self.by_src.get(id(src))
        if link is None or link.src() is not src or link.dst is not dst:
            link = self._new(dst, src)
        if link.graph is None or not native.ptrs_hold((src, dst), link.ptrs):
            return False
        link.graph.replay()
        self.replays += 1
        return True

    def _new(self, dst, src):
        self.by_src = {k: v for k, v in self.by_src.items() if v.src() is not None}  # sources given back
        graph = None
        if list(dst.shape) == list(src.shape) and dst.dtype == src.dtype and dst.place._equals(src.place):
            graph = self.backend.new_graph(None)
            held = weakref.ref(src)  # a graph that re-runs its body must not keep another key's buffer alive
            try:
                with paddle.no_grad():
                    graph.capture(lambda: copy_body(dst, held()))
            except Exception as err:  # the copy is launched for this pair from now on
                logger.debug("autocudagraph: a link graph's capture failed (%s); its copy is launched", err)
                graph.reset()
                graph = None
        link = self.by_src[id(src)] = _Link(src, dst, graph)
        return link

    def count(self):
        """Link graphs held (captures that failed not counted)."""
        return sum(1 for link in self.by_src.values() if link.graph is not None)

    def release(self):
        for link in self.by_src.values():
            if link.graph is not None:
                link.graph.reset()
        self.by_src = {}


def linked_copy(graphs, dst, src):
    """``dst.copy_(src)`` by a link graph kept on ``graphs`` (the BlockGraphs ``dst`` belongs to) where one may
    serve (NOTE [ Link graphs ]); returns whether it did (False: nothing done)."""
    if capture_open() or in_rerun_replay():
        return False
    links = graphs.links
    if links is None:
        links = graphs.links = LinkGraphs(graphs.backend)
    return links.copy(dst, src)
