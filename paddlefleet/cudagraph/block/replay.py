"""Replay of a block: what must hold before a key's graphs can serve a call, the copy of the
call's tensors into the static inputs, the bridge call and the hand-out of the outputs.

NOTE [ Replay preconditions ]
A graph reads fixed addresses. Before a replay: the parameters the capture saw must still be
the same tensors at the same addresses with the same stop_gradient, and an adopted input must
be passed again (NOTE [ Adopted inputs ] in io/static_inputs.py) — otherwise the key is captured
again. A call gets a slot whose previous forward's backward has run (NOTE [ Slots ] in
block/slots.py; NOTE [ One forward in flight ] in block/bridge.py), and whose forward, where it shares
a pool with other keys' forwards, overwrites nothing they still hold (NOTE [ Keys sharing a forward
pool ] in backends/shared_pool.py; otherwise the key is captured again into a pool of its own). With
dispatch_key_fn the key no longer proves that the call fits the static buffers, so shapes, dtypes,
stop_gradient and the argument structure are checked (InputMismatchError).

NOTE [ Replay work decided at capture ]
A replayed call pays the host time of everything it does, so what is the same for every replay
of a key is decided once when it is captured (BlockGraphs.settle): the tensors the bridge takes
and the order of the grads it returns (NOTE [ Bridge inputs ] in block/bridge.py), which outputs
carry a grad (their hooks are routed to the backward, NOTE [ Hooks on graphed outputs ] in
grads/handles.py) and which do not; likewise the parameter-address check
(NOTE [ The parameter-address check ] in core/layers.py) and the grad hand-out
(NOTE [ A precomputed hand-out ] in grads/hand_out_plan.py).
A call still gets new output tensors and new grad tensors every time (but for an output the function
returned as it is: NOTE [ Outputs handed back as they are ] in io/output_aliases.py).
"""

import paddle

from .bridge import GraphedFunction, hand_out_outputs
from ..errors import InputMismatchError
from ..grads.handles import route_hooks
from ..core.body import Action, Blocked, Replayed
from ..guards.layer_attrs import attr_message
from ..guards.location import user_call_site
from ..io.nested import unflatten

__all__ = ["replay_blocker", "run_graphs"]

_new = tuple.__new__  # a Replayed made positionally: half the cost of Replayed(...)


def replay_blocker(graphs, call, check_inputs):
    """None when ``call`` can replay ``graphs``, else a Blocked (NOTE [ Replay preconditions ]);
    ``graphs``: a slot without a pending backward (Slots.select(), NOTE [ Slots ] in block/slots.py).

    Raises:
        InputMismatchError: with ``check_inputs`` (dispatch_key_fn), for a call that does not fit.
    """
    if check_inputs:
        if call.spec != graphs.in_spec:
            raise InputMismatchError(
                "autocudagraph: the call's argument structure differs from the one its key was "
                "captured with. Include the structure in the key that dispatch_key_fn returns."
            )
        graphs.static_inputs.check(call.tensors)
    moved = graphs.params.moved()
    if moved is None and graphs.static_inputs.adopted:
        name = graphs.static_inputs.moved(call.tensors)
        if name is not None:
            moved = f"input '{name}' is another tensor than the one the graph reads in place"
    if moved is not None:
        return Blocked(Action.RECAPTURE, moved)
    changed = graphs.attrs.changed() if graphs.attrs is not None else None
    if changed is not None:  # NOTE [ Layer attributes a replay freezes ] in guards/layer_attrs.py
        return Blocked(Action.RECAPTURE, *attr_message(changed), changed)
    backward = graphs.backward
    accumulators = backward.accumulators if backward is not None else None
    if accumulators is not None:
        shared = accumulators.shared_now()
        if shared is not None:  # NOTE [ Shared parameters leave the graph ] in grads/accumulate.py
            return Blocked(Action.RECAPTURE, f"{shared}: its grad goes through autograd from now on")
        moved = accumulators.moved()
        if moved is not None:  # NOTE [ Accumulation inside the graph ] in grads/accumulate.py
            return Blocked(Action.RECAPTURE_ONCE, moved, (
                f"accumulate_in_graph=True: {moved}, so the key is captured again with a new accumulator (if it "
                "happens again, the key runs eagerly). Zero grads in place (optimizer.clear_grad()) or free them "
                "(clear_grad(set_to_zero=False)) instead of rebinding them."))
    shared = graphs.shared_pool
    if shared is not None:
        conflict = shared.blocked(graphs.fwd_graph)
        if conflict is not None:  # NOTE [ Keys sharing a forward pool ] in backends/shared_pool.py
            return Blocked(Action.RECAPTURE, f"{conflict}: the key is captured again into a pool of its own")
    return None  # a pending backward: BlockBody.blocker's Slots.select() took a slot without one


def run_graphs(graphs, call, copy, name, label, grad):
    """Runs the graphs for ``call`` and returns its Replayed: what the call returns and how many
    input copies were made and skipped (none when ``copy`` is False: the
    capture call's tensors are already in the static inputs); ``grad``: paddle.is_grad_enabled()."""
    tensors = call.tensors
    copied, skipped = graphs.static_inputs.copy_in(tensors) if copy else (0, 0)
    backward = graphs.backward
    if grad and backward is not None and backward.graph is not None:
        # NOTE [ Replay work decided at capture ]: diff_at; NOTE [ Bridge inputs ] in block/bridge.py.
        args = graphs.bridge.args(tensors)
        outputs = GraphedFunction.apply(graphs, args, *args.args)
        outputs = [outputs] if isinstance(outputs, paddle.Tensor) else list(outputs)
        route_hooks(outputs, graphs.diff_at, graphs.inflight)  # NOTE [ Hooks on graphed outputs ] in grads/handles.py
    else:
        graphs.fwd_graph.replay()
        outputs = hand_out_outputs(graphs)
        for o in outputs:
            o.stop_gradient = True
    if graphs.handed_out is not None:  # NOTE [ Stale outputs ] in io/stale_outputs.py
        # After the replay: this call's inputs may be the previous outputs (y = f(f(x))).
        graphs.handed_out.overwrite(name, label, user_call_site())
        graphs.handed_out.hand_out(outputs, graphs.host_outputs)
    if graphs.out_aliases is not None:  # NOTE [ Outputs handed back as they are ] in io/output_aliases.py
        outputs = graphs.out_aliases.expand(outputs, tensors)
    return _new(Replayed, (unflatten(graphs.out_spec, outputs, graphs.out_consts), copied, skipped, None))
