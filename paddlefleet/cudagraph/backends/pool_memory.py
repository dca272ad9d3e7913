"""What one capture costs in device memory, measured where the graph is made: the bytes its pool made
the process reserve, and the allocator's cached blocks released before it (core/memory.py adds them
up per key).

NOTE [ Allocator cache before a capture ]
Eager calls (a key's warmup calls among them) leave the blocks they freed cached in Paddle's
allocator: reserved, unused, and ready for the next eager call. A graph cannot use them: on Paddle
2.6 every capture allocates from a private pool of its own, and on >= 3.1 from a pool its key's
graphs share, never from the eager allocator's cache. A model graphed layer by layer then holds
both: its warmup's cache and every graph's pool (the per-layer rows of docs/reports/benchmarks.md
reserved 1.7x eager's peak). So right before every CUDA capture (no capture open, no kernel of it
queued) the cached blocks are given back with ``paddle.device.cuda.empty_cache`` (feature-detected;
the simulated backend has no device memory): later eager calls allocate again what they need, and
graphs live beside them instead of beside a cache. It costs one device sync per capture, never a
replay. The bytes given back are recorded per graph (``Graph.cache_released``) and shown per key;
they are held by nobody afterwards, so max_bytes does not count them.
"""

import paddle

__all__ = ["CaptureMeter", "distinct_bytes", "release_cache", "reserved", "results_bytes"]


def _cuda_module():
    return getattr(getattr(paddle, "device", None), "cuda", None)


def reserved(place=None):
    """Device bytes Paddle's allocators have reserved now (all pools together), or None where this
    Paddle cannot say (a CPU build: its capture is a stand-in)."""
    try:
        return int(_cuda_module().memory_reserved(place))
    except Exception:  # no device memory to measure: nothing is measured, the capture goes on
        return None


def release_cache(measure=reserved):
    """Gives Paddle's cached, unused device blocks back (NOTE [ Allocator cache before a capture ]);
    returns the bytes given back, 0 where this Paddle has no ``empty_cache`` or no device memory."""
    empty = getattr(_cuda_module(), "empty_cache", None)
    before = measure() if empty is not None else None
    if before is None:
        return 0
    empty()
    after = measure()
    return 0 if after is None else max(before - after, 0)


def distinct_bytes(tensors, skip):
    """Bytes of the storage of ``tensors`` whose address is not in ``skip``, each byte once (views of
    one stack, a view and its base, a tensor given twice: their union); adds the addresses it
    counted to ``skip``."""
    spans = []
    for t in tensors:
        if t is None or not t._is_initialized():
            continue
        ptr = t.data_ptr()
        if ptr in skip:
            continue
        n = 1
        for d in t.shape:
            n *= d
        spans.append((ptr, ptr + n * t.element_size()))
    total, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    skip.update(start for start, _ in spans)
    return total


def results_bytes(tensors):
    """Bytes of the distinct allocations among ``tensors`` (one tensor returned twice counts once):
    the simulated backend's model of a pool, the least a capture that returned them allocates."""
    return distinct_bytes(tensors, set())


class CaptureMeter:
    """Around one capture (entered before the capture begins, left after it ended): releases the
    allocator's cache first where ``release`` is given, then sets ``graph.cache_released`` and, once
    the capture succeeded, ``graph.pool_bytes``: what the process reserved during it.

    Args:
        graph: the Graph being captured (its two attributes are set).
        measure: () -> reserved bytes now.
        release: (measure) -> bytes given back, or None: keep the cache.
    """

    def __init__(self, graph, measure, release=release_cache):
        self.graph, self.measure, self.release = graph, measure, release
        self.before = None

    def __enter__(self):
        if self.release is not None:
            self.graph.cache_released = self.release(self.measure)
        self.before = self.measure()
        return self

    def __exit__(self, kind, value, tb):
        after = self.measure() if kind is None and self.before is not None else None
        if after is not None:
            self.graph.pool_bytes = max(after - self.before, 0)
        return False
