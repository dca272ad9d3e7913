"""In-graph grad accumulation (``accumulate_in_graph=True``): the backward graph adds each
parameter's grad into a persistent accumulator, and those parameters leave the autograd bridge.

NOTE [ Accumulation inside the graph ]
The accumulator of a parameter is ``p.main_grad`` where Fleet keeps one (the attribute exists, as
``MixPrecisionLayer`` sets it), else ``p.grad``. Missing accumulators are made before the capture
(and installed by the first backward replay), filled with -0.0: ``-0.0 + g`` is ``g`` bit for bit
(also for ``g == -0.0``), so the first accumulation equals eager's "first grad is assigned" (and
Fleet's hook's ``cast`` of its first grad). The captured backward then runs ``acc.add_(g)`` - the
op Fleet's main_grad hook runs - for each parameter, and the bridge neither takes nor returns these
parameters: no per-parameter autograd work on the host at all.

What the user must keep:
* an accumulator is zeroed in place (``optimizer.clear_grad()``, ``MixPrecisionOptimizer.
  clear_grad()``, ``main_grad.zero_()``) or freed (``clear_grad(set_to_zero=False)``,
  ``p.main_grad = None``); never rebound to another tensor (``p.grad_ = t``). The accumulator's
  storage is kept by this object (an alias of the grad or ``main_grad``: Fleet frees ``main_grad``
  with ``_clear()``, which frees only that tensor's hold on it), so freeing a grad frees nothing
  the graph writes: before a backward replay a freed accumulator
  is filled with -0.0 and put back as ``p.grad`` / ``p.main_grad`` (eager's "first grad is
  assigned"), and a parameter whose grad is freed and not used again keeps ``grad`` None, as in
  eager. A rebound accumulator is detected before every replay: before a forward replay the key is
  captured again (with a warning), before a backward replay a CudaGraphError is raised.
* the parameters' gradient hooks no longer run for grads of these calls (user hooks,
  ``register_hook``, Fleet's main_grad hook - its work is what the graph does, DataParallel's
  reducer). Graphing under ``paddle.DataParallel`` / ``fleet.distributed_model`` with pure data
  parallelism is therefore refused at capture; Fleet's hybrid-parallel optimizers, which
  all-reduce ``main_grad`` themselves in ``step()``, are fine.
* with ``p.grad`` as accumulator, Paddle's "fake empty" flag of a cleared grad is reset after each
  backward replay (``Tensor._unset_fake_empty``), so eager backward passes through the same
  parameter outside the graph add to what the graph accumulated.

Parameters the call does not differentiate (``paddle.grad`` returns None for them: unused by the
forward, or used only where no grad flows) get no accumulator: their grad stays as eager leaves it.

NOTE [ Shared parameters leave the graph ]
Eager autograd sums every grad a parameter gets in one backward pass first (in the order the
pass reaches them) and then adds that sum to ``p.grad``: ``P + (a + b)``. A graph that adds its
own part into the accumulator computes ``(P + a) + b`` when the parameter also gets a grad from
elsewhere - another graphed block, or an eager use such as a tied embedding weight reused by an
eager output head - which differs in the last bit. So a parameter seen to get grads from outside
one graph is *shared*, for good, and goes through the autograd bridge instead (NOTE [ Parameters
through the bridge ] in block/bridge.py), where Paddle sums it as eager does. Sharing is seen
(0) at a capture, when the call's inputs were computed from the parameter (an eager use before
the graph), (1) at a capture or forward replay, when another graph that accumulates the parameter has its
backward pending (both feed one backward pass; that graph is captured again at its next call, this
one at once), and (2) at a backward: a hook on each accumulated parameter fires when an eager use
hands it a grad in the same backward pass (the key is captured again at its next call): while the
graph's backward is pending, or after it with no graphed call in between (grads from a later pass,
such as another key's eager warmup, are not sharing). Keys of one block that never share a
backward pass (one key per sequence length, say) keep accumulating in their graphs. In the backward pass where the
sharing is first seen, the graph still adds into the accumulator, and the two grads are summed
first as eager does: an eager grad that comes while the graph's backward is pending is kept by
the hook (autograd gets zeros instead), and the graph's backward puts back the accumulator's value
from before its replay plus the sum; a grad that another graph hands to autograd after this
graph's backward finds the graph's own grad held by the hook, which hands autograd the sum. What
stays different: an eager grad that comes after the graph's backward in a pass where nothing
announced it (an eager use after the block whose grad autograd happens to deliver after the
block's backward) is added after the graph's, and a -0.0 accumulator element can read +0.0 where
the hook handed autograd zeros.
"""

import gc
import weakref

import numpy as np
import paddle

from ..core.grad_nodes import grad_node
from ..core.layers import accumulation_nodes
from ..errors import CaptureError, CudaGraphError
from .handles import alias, copy

__all__ = ["CALLS", "Accumulators", "is_shared", "note_call", "own_backward", "split_params"]


def _neg_zeros(p, dtype):
    """A tensor of -0.0 like ``p`` (made on the host and copied: no fill kernel on the device)."""
    value = np.full(p.shape, -0.0, dtype="float32")
    t = paddle.to_tensor(value, place=p.place)
    if t.dtype != dtype:
        t = t.astype(dtype)
    t.stop_gradient = True
    return t


def _data_parallel_of(params):
    """The name of a DataParallel wrapper whose reducer manages one of ``params``, or None."""
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, paddle.DataParallel):
            if any(id(p) in ids for p in obj.parameters()):
                return type(obj).__name__
    return None


# NOTE [ Shared parameters leave the graph ]: id(p) -> weakref(p) of the parameters known shared,
# and id(p) -> weakrefs of the live Accumulators that add p's grad in their graph.
_SHARED = {}
_OWNERS = {}


def _live(p):
    return p.grad is not None and p.grad._is_initialized()


def is_shared(p):
    ref = _SHARED.get(id(p))
    return ref is not None and ref() is p


def _mark_shared(p):
    key = id(p)
    _SHARED[key] = weakref.ref(p, lambda _, key=key: _SHARED.pop(key, None))


def _other_owners(acc, p):
    """The other live Accumulators that add ``p``'s grad in their graph."""
    found = []
    for ref in _OWNERS.get(id(p), ()):
        other = ref()
        if other is not None and other is not acc and any(q is p for q in other.params):
            found.append(other)
    return found


def split_params(params, inputs=()):
    """``(bridged, accumulated)``: the shared parameters, which go through the bridge, and the
    others, whose grads the graph accumulates. A parameter that a graph whose backward is pending
    accumulates becomes shared here, and that graph is captured again at its next call; so does one
    the call's ``inputs`` were computed from (an eager use before the graph in the same pass: NOTE
    [ Shared parameters leave the graph ])."""
    upstream = accumulation_nodes([t for t in inputs if not t.stop_gradient])
    for p in params:
        node = grad_node(p)
        if node is not None and node.node_ptr() in upstream:
            _mark_shared(p)
    for p in params:
        for other in _other_owners(None, p):
            if other.in_flight():
                _mark_shared(p)
                other.expect_from_autograd(p)
    bridged = [p for p in params if is_shared(p)]
    return bridged, [p for p in params if not is_shared(p)]


_QUIET = [0]  # > 0 while a graph's own backward body runs eagerly (simulated replay, verification)


class _OwnBackward:
    """The context manager own_backward() returns: a class with __enter__/__exit__ costs a
    fraction of a generator-based one, and every backward replay enters it."""

    __slots__ = ()

    def __enter__(self):
        _QUIET[0] += 1
        return self

    def __exit__(self, *exc):
        _QUIET[0] -= 1
        return False


_OWN_BACKWARD = _OwnBackward()


def own_backward():
    """Marks a backward run of a graph's own body: an inner ``backward()`` in it (reentrant
    recompute) runs the parameters' accumulation nodes, which is no use from outside the graph."""
    return _OWN_BACKWARD


#: Graphed block calls so far (eager or replayed): a new call starts a new forward. A list, so that a caller on a
#: hot path (BlockBody's eager runners) counts through a reference it took once.
CALLS = [0]


def note_call():
    """Counts a call of a graphed block (NOTE [ Shared parameters leave the graph ])."""
    CALLS[0] += 1


def _eager_use_hook(acc, p, i):
    """A gradient hook for ``p`` (index ``i`` in acc): autograd runs it only for grads from outside
    acc's graph (or from an inner backward of the graph's own body, see own_backward()). The grad is
    shared with the graph's when it comes while the graph's backward is pending, or after it with
    no graphed call since (the same backward pass); a later pass (another key's eager warmup, say)
    is not. In the pass that shows the sharing, the two grads are summed first, as eager does
    (NOTE [ Shared parameters leave the graph ])."""

    ref = weakref.ref(acc)  # a hook left on a parameter after its graphs were dropped does nothing

    def hook(grad):
        acc = ref()
        if acc is None:
            return None
        in_flight = acc.in_flight()
        if _QUIET[0] or not (in_flight or acc.backward_calls == CALLS[0]):
            return None
        _mark_shared(p)
        acc.eager_seen = True
        acc.shared_seen = f"parameter '{p.name}' also gets a grad from an eager use"
        mine = acc.deferred.pop(i, None)
        if mine is not None:  # the graph's grad came first: autograd adds the sum
            return mine + grad
        if in_flight:  # this one came first: the graph's backward adds the sum (combine())
            acc.stash[i] = copy(grad)
            return paddle.zeros_like(grad)
        return None

    return hook


class Accumulators:
    """The accumulator of each in-graph parameter (NOTE [ Accumulation inside the graph ]).

    Args:
        params: the trainable parameters of the call whose grads the graph accumulates.

    Attributes:
        tensors: per parameter, the tensor the graph adds into (it owns the storage).
        shared_seen: why a parameter turned out shared (the key must be captured again), or None.
    """

    def __init__(self, params):
        wrapper = _data_parallel_of(params)
        if wrapper is not None:
            raise CaptureError(
                f"autocudagraph: accumulate_in_graph=True with parameters managed by {wrapper}: their grads "
                "would be added inside the graph and never reach the data-parallel reducer's hooks, so they "
                "would not be all-reduced. Use accumulate_in_graph=False (the default) under DataParallel, or "
                "all-reduce main_grad in the optimizer (Fleet's hybrid-parallel optimizer does)."
            )
        self.params = list(params)
        self.main = [hasattr(p, "main_grad") for p in self.params]
        self.tensors = []
        for p, main in zip(self.params, self.main):
            if main:
                current = p.main_grad
                live = current is not None and current._is_initialized()
                self.tensors.append(alias(current) if live else _neg_zeros(p, paddle.float32))
            else:
                self.tensors.append(alias(p.grad) if _live(p) else _neg_zeros(p, p.dtype))
        self._ptrs = [t.data_ptr() for t in self.tensors]
        self.used = None  # per parameter: whether the graph differentiates it (set by add())
        self._used_idx = []
        self.shared_seen = None
        self.eager_seen = False
        self._hooks = []
        self._graphs = None  # weakref to the BlockGraphs whose backward adds into these
        self._overlaps = []  # in-use parameters that other live Accumulators add into too
        self.backward_calls = None  # _CALLS at the last backward replay
        # NOTE [ Shared parameters leave the graph ]: the pass that shows a sharing, by index.
        self.expect = set()  # another graph hands this parameter's grad to autograd in this pass
        self.stash = {}  # an eager grad that came before this graph's backward (autograd added zeros)
        self.deferred = {}  # this graph's grad, waiting for the other one (the hook adds the sum)
        self._before = {}  # the accumulator before this backward replay

    def add(self, grads):
        """Inside the backward body: ``acc.add_(g)`` for every parameter with a grad."""
        if self.used is None:
            self.used = [g is not None for g in grads]
            self._used_idx = [i for i, u in enumerate(self.used) if u]
        with paddle.no_grad():
            for acc, g in zip(self.tensors, grads):
                if g is not None:
                    acc.add_(g)

    def count(self):
        """How many parameters the graph accumulates."""
        return len(self._in_use())

    def _in_use(self):
        return self._used_idx

    def register(self, graphs):
        """After a successful capture of ``graphs``: watches the accumulated parameters for grads
        from outside the graph (NOTE [ Shared parameters leave the graph ])."""
        self._graphs = weakref.ref(graphs)
        me = weakref.ref(self)
        for i, used in enumerate(self.used or ()):
            if not used:  # never written: no accumulator to keep
                self.tensors[i] = None
        for i in self._in_use():
            p = self.params[i]
            self._hooks.append((p, p._register_grad_hook(_eager_use_hook(self, p, i))))
            for other in _other_owners(self, p):
                other._overlaps.append(p)
                self._overlaps.append(p)
            _OWNERS.setdefault(id(p), []).append(me)

    def in_flight(self):
        """Whether the backward of this graph's last forward replay is pending."""
        graphs = self._graphs() if self._graphs is not None else None
        return graphs is not None and graphs.backward_pending()

    def shared_now(self):
        """Before a forward replay: why a parameter is shared, when another graph that adds into
        it has its backward pending (both are in one backward pass), or an earlier reason; else None."""
        for p in self._overlaps:
            for other in _other_owners(self, p):
                if other.in_flight():
                    _mark_shared(p)
                    other.expect_from_autograd(p)
                    self.shared_seen = other.shared_seen
        return self.shared_seen

    def expect_from_autograd(self, p):
        """``p`` turned shared while this graph's backward is pending: its grad in this pass also
        comes through autograd, from another graph (NOTE [ Shared parameters leave the graph ])."""
        self.shared_seen = f"parameter '{p.name}' is also used by another graphed call in the same backward"
        self.expect.update(i for i in self._in_use() if self.params[i] is p)

    def release(self):
        """Stops watching (the graphs are released); a grad still held for the pass is added."""
        with paddle.no_grad():
            for i, g in list(self.deferred.items()) + list(self.stash.items()):
                current = self.params[i].main_grad if self.main[i] else self.params[i].grad
                if current is not None and current._is_initialized():
                    current.add_(g)
        self.deferred, self.stash, self.expect, self._before = {}, {}, set(), {}
        for p, hook_id in self._hooks:
            p._remove_grad_hook(hook_id)
        for p in self.params:
            owners = _OWNERS.get(id(p), [])
            owners[:] = [r for r in owners if r() is not None and r() is not self]
            if not owners:
                _OWNERS.pop(id(p), None)
            for other in _other_owners(self, p):
                other._overlaps = [q for q in other._overlaps if q is not p]
        self._hooks = []
        self._overlaps = []
        self.params = []
        self._used_idx = []

    def undo(self):
        """A capture that failed leaves no trace: nothing was installed, nothing is watched."""
        self.release()

    def moved(self):
        """Why the graph can no longer serve (an accumulator rebound), or None. A freed accumulator
        is not a reason: prepare() puts it back."""
        for i in self._in_use():
            p, main, ptr = self.params[i], self.main[i], self._ptrs[i]
            current = p.main_grad if main else p.grad
            if current is None or not current._is_initialized():
                continue
            if current.data_ptr() != ptr:
                what = "main_grad" if main else "grad"
                return f"the {what} of parameter '{p.name}' was rebound to another tensor"
        return None

    def prepare(self):
        """Before a backward replay: puts freed accumulators back (filled with -0.0), takes over a
        grad an eager use assigned in this pass; raises CudaGraphError for a rebound one."""
        for i in self._in_use():
            p, main, acc, current = self._put_back_if_freed(i)
            if current is not None and current.data_ptr() != self._ptrs[i]:
                if i in self.stash:  # was freed: autograd assigned the zeros the hook returned
                    with paddle.no_grad():
                        acc.fill_(-0.0)
                    self._install(p, main, acc)
                    continue
                if not self.eager_seen:
                    what = "main_grad" if main else "grad"
                    raise CudaGraphError(
                        f"autocudagraph: the {what} of parameter '{p.name}' was rebound to another tensor between "
                        "the forward and the backward of a graphed call with accumulate_in_graph=True; the "
                        "backward graph adds into the accumulator it was captured with. Zero grads in place "
                        "(optimizer.clear_grad()) or free them (clear_grad(set_to_zero=False)) instead."
                    )
                with paddle.no_grad():  # an eager use assigned its grad first in this pass
                    acc.copy_(current, False)
                self._install(p, main, acc)
        for i in self.expect | set(self.stash):
            self._before[i] = copy(self.tensors[i])

    def combine(self, grads):
        """After a backward replay, for the parameters whose grad this pass also gets from outside
        the graph: the accumulator gets back its value from before the replay plus the sum of both
        grads, as eager sums them (``grads``: this replay's grad per parameter; NOTE [ Shared
        parameters leave the graph ])."""
        with paddle.no_grad():
            for i, before in self._before.items():
                acc, mine = self.tensors[i], grads[i]
                other = self.stash.pop(i, None)
                if other is None:  # the other grad comes later: the hook adds the sum
                    self.deferred[i] = copy(mine)
                    acc.copy_(before, False)
                else:
                    acc.copy_(paddle.add(before, paddle.add(other, mine)), False)
        self._before = {}
        self.expect = set()

    def _put_back_if_freed(self, i):
        """``(p, main, acc, current)`` of the i-th accumulated parameter: its grad (``main_grad`` or
        ``grad``) now, or None where it was freed, after putting the accumulator back filled with -0.0
        (``-0.0 + g`` is eager's first grad bit for bit)."""
        p, main, acc = self.params[i], self.main[i], self.tensors[i]
        current = p.main_grad if main else p.grad
        if current is not None and current._is_initialized():
            return p, main, acc, current
        with paddle.no_grad():
            acc.fill_(-0.0)
        self._install(p, main, acc)
        return p, main, acc, None

    @staticmethod
    def _install(p, main, acc):
        if main:
            p.main_grad = alias(acc)
        else:
            p.grad_ = alias(acc)

    def after_backward(self):
        """Resets Paddle's "fake empty" flag of cleared grads (NOTE [ Accumulation inside the graph ])."""
        self.eager_seen = False
        self.backward_calls = CALLS[0]
        for i in self._in_use():
            if not self.main[i]:
                self.params[i]._unset_fake_empty()

    def snapshot(self):
        """Copies of the accumulators, for restore()."""
        with paddle.no_grad():
            return [None if t is None else t.clone() for t in self.tensors]

    def restore(self, saved):
        with paddle.no_grad():
            for t, value in zip(self.tensors, saved):
                if t is not None:
                    t.copy_(value, False)
