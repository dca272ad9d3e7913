"""The backward of a fused run that is not regular (NOTE [ Fused chains ] in block/chain_fused.py).

NOTE [ Recomputing a fused run ]
A fused run replayed every member's forward at its first call, inside the fused graphs; a backward
that is not regular needs each called member's own forward state. Two ways, both eager's bits:

* with the members' own graphs, while each still replays the graphs its key has and none waits
  for another backward: their forwards replayed from the first call's input (the fused graph's
  static input still holds it), then their backwards as an unfused chain's;
* eagerly, where a member's graphs are busy or gone (the member was called again alone before
  this backward, or its key was reset or evicted): each member's function runs again on a leaf
  copy of its input, under the head call's autocast state and the training flags its key was
  made with, and ``paddle.grad`` of its output gives the grads of its input and parameters, fed
  and hooked as the graphs' backward would be. Members of a fused chain are pure (no random
  numbers drawn, no buffers), so the second forward reads and writes nothing eager's did not.
  A ``paddle.grad`` inside another one breaks Paddle's partial-grad engine (NOTE [ paddle.grad
  through a graphed call ] in block/partial_grad.py), so a caller's paddle.grad is refused,
  before Paddle starts it and naming ``chain_calls=False``, while a fused run that would be
  recomputed this way waits for its backward (ChainRun.needs_eager_recompute).
"""

import contextlib

import paddle

from ..backends import own_grad
from ..core.state import amp_restored
from ..errors import CudaGraphError
from . import partial_grad
from .chain_bridge import member_backwards, replay_forward

__all__ = ["recompute"]


def recompute(run, grads, fused):
    """The grads of a fused run's tensors, in the fused bridge's order, for a backward that is
    not regular."""
    if all(m.current() for m in run.members[:run.handed]):
        head, params = _replayed(run, grads, fused)
    else:
        head, params = _eager(run, grads, fused)
    tail = fused.bridge_tail
    where = {id(p): i for i, p in enumerate(tail)}
    out = [None] * len(tail) + head
    for member, grads_of in zip(run.members, params):
        for p, g in zip(member.params, grads_of):
            out[where[id(p)]] = g
    return out


def _replayed(run, grads, fused):
    first = fused.static_inputs.buffers[0]
    for j in range(run.handed):
        member = run.members[j]
        member.in_buf.copy_(first, False)
        replay_forward(run, j)
        first = member.out_buf
    return member_backwards(run, grads)


def _eager(run, grads, fused):
    if partial_grad.inside_paddle_grad():  # refused before Paddle started it (block/chain_outputs.py)
        raise CudaGraphError("autocudagraph: a fused chain's eager recompute inside a paddle.grad")
    members = run.members[:run.handed]
    inputs, outputs = [], []
    h = fused.static_inputs.buffers[0]
    with _forward_state(run, members), paddle.enable_grad():
        for member in members:
            x = h.detach()
            x.stop_gradient = False
            h = member.body.run((x,), {}, count=False)
            inputs.append(x)
            outputs.append(h)

    def backward_of(j, grad):
        with own_grad():
            got = paddle.grad([outputs[j]], [inputs[j]] + list(members[j].params), [grad], allow_unused=True)
        return [got[0]], list(got[1:])

    return member_backwards(run, grads, backward_of)


@contextlib.contextmanager
def _forward_state(run, members):
    """The head call's autocast state and the training flags the members' keys were made with."""
    saved = [(layer, layer.training) for m in members for layer in m.layers]
    try:
        for m in members:
            for layer, flag in zip(m.layers, m.flags):
                layer.training = flag
        with amp_restored(run.amp_snapshot):
            yield
    finally:
        for layer, flag in saved:
            layer.training = flag
