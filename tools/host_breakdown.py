"""Where the host time of a graphed training step goes: each piece timed alone.

On a GPU host with a GPU build of Paddle (README.md, "Install on a GPU")::

    python tools/host_breakdown.py --out docs/reports/host_breakdown.md

CPU smoke test (simulated backend, small model, the report only under the temp dir)::

    python tools/host_breakdown.py --smoke

Each row is the median host time of one operation over ``--reps`` repetitions (no device sync
inside the timed region; one sync after each repetition so the queue stays short), for a
``--layers`` x ``--width`` matmul MLP at ``--batch`` rows (default: 16 x 512, batch 16, the
first config of tools/bench.py). The rows split a graphed step into the wrapper's own pieces (key,
checks, copies), Paddle's (PyLayer, autograd engine, Tensor.backward, copies), and the whole step
with default options and with each speed option this version has. ``layer_call_us`` (layer_call_us()):
one graphed Layer called alone, forward + backward, for ``--layers`` matmuls (16 parameters by
default) and for a realistic layer (6 matmuls x 1024), with every piece's share, ours and Paddle's. The forward
call of a chain's later member (the same MLP with each layer graphed on its own) is timed stage by stage too;
written as tables in the report and as JSON to ``--json`` (by default the report's path with
``.json``: docs/reports/host_breakdown.json). ``--profile PATH`` also writes
a cProfile of the graphed step's host side, and of the start-up (first 3 steps: warmup, capture,
first replay) of a model graphed layer by layer, to PATH.startup.

NOTE [ Host breakdown internals ]
Timing the wrapper's pieces one by one needs its private names. Every such use is in
``Internals`` below and nowhere else: ``GraphedCallable.entry()`` (a read-only view of the key's entry),
``_entries`` (the chain hooks keep an entry weakly), ``GraphedCallable._keys.key(args, kwargs, tensors, spec)``,
``GraphedCallable.body().blocker`` and ``.hooks`` (``head``, ``replayed``), ``entry.graphs`` (BlockGraphs:
``params.moved``, ``bridge.args``, ``grad_feeds``, ``static_inputs.copy_in``, ``backward.grad_plan.adopted`` /
``hand_out`` and ``forget_views``, ``static_outputs``, ``diff_at``, ``inflight``, ``fwd_graph`` / ``backward.graph``), ``call.Call``,
``bridge.hand_out_outputs`` and ``grads.handles.route_hooks`` / ``copy``; for the whole step, in ``StepInternals``:
``dispatch.nested_reason``, ``entries()`` (a copy of its keys: the lookup's cost), ``_keys``, ``body()`` (a read-only
view of the StepBody: ``blocker``, ``_between``,
``_remember_between``), ``entry.graphs`` (StepGraphs: ``checks`` (``_bindings_unchanged``, ``_moved``),
``feeds``, ``returned``, ``in_place``, ``static_inputs``, ``hand_out``, ``out_spec``, ``graph``),
``step.replay_checks._grads_between`` and ``io.stale_outputs.check_fresh``; for the stages of one call, in
``CallStages`` (NOTE [ Call stages ]): ``core.lifecycle.Lifecycle.__call__`` and ``_dispatched`` (a front door's call)
and the module's ``dispatch``,
``block.graphed.BlockBody.replay``, ``block.replay.GraphedFunction`` (its ``apply``),
``block.bridge.GraphedFunction.forward`` / ``backward`` and ``block.bridge.replay_backward``; for the stages of a
chained call, in ``ChainStages``: the same two of ``Lifecycle``, ``chains.run.ChainRun.claim`` / ``hand_out`` and the
``replay_forward`` that ``chains.run`` calls. A piece whose name moved
reads "n/a (...)" in the report, with what was missing, and the other rows still run: update
``Internals`` / ``StepInternals`` after a refactor.
"""

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402
from paddle.autograd import PyLayer  # noqa: E402

from paddlefleet.cudagraph import autocudagraph  # noqa: E402
from paddlefleet.cudagraph.options import ENV_BACKEND  # noqa: E402
from testkit.cli import BACKEND_HELP, require_gpu, sized, sized_help  # noqa: E402
from testkit.common import (  # noqa: E402
    SPEED_OPTIONS,
    MatMLP,
    build,
    check_smoke_path,
    host_tensor,
    info_lines,
    normal,
    option_unsupported,
    run_info,
    short,
    write_generated,
)
from testkit.step_gpu import MatmulStep  # noqa: E402

TOOL = "tools/host_breakdown.py"
#: (full size on a GPU, smoke size with --backend simulate)
SIZES = {"layers": (16, 4), "width": (512, 32), "batch": (16, 4), "reps": (300, 20)}


class Passthrough(PyLayer):
    """A PyLayer with the bridge's shape: one output, grads for the input and every parameter."""

    grads = ()

    @staticmethod
    def forward(ctx, x, *params):
        return _C_ops.assign(x)

    @staticmethod
    def backward(ctx, dy):
        return (None,) + tuple(Passthrough.grads)  # x needs no grad, as in the benchmark


class BridgeShape(PyLayer):
    """Paddle's share of the bridge alone: a PyLayer taking what the bridge takes (the bridged parameters
    and the call's tensors that need grad, in BridgeArgs' convention: NOTE [ Bridge inputs ] in
    block/bridge.py), whose forward hands out a view of the input (no copy: the output copy is a row of
    ours) and whose backward hands autograd one grad per parameter (as the bridge does).
    ``apply(held, args, *args.args)``: ``held()`` returns the input (no PyLayer input itself)."""

    grads = ()

    @staticmethod
    def forward(ctx, held, args, *tensors):
        ctx.args = args
        x = held()
        return _C_ops.view_shape(x, x.shape)

    @staticmethod
    def backward(ctx, dy):
        return ctx.args.grads(list(BridgeShape.grads))


class Internals:
    """The wrapper's private pieces, resolved in one place (NOTE [ Host breakdown internals ]).

    Each method returns the callable to time, resolving the private names it needs when called,
    so a name that moved costs its own row only."""

    def __init__(self, wrapper, x):
        self.wrapper, self.x = wrapper, x

    def _entry(self):
        return self.wrapper.entry()

    def _call(self):
        from paddlefleet.cudagraph.core.call import Call

        return Call, Call((self.x,), {})

    def flatten(self):
        make, _ = self._call()
        return lambda: make((self.x,), {})

    def key(self):
        _, call = self._call()
        return lambda: self.wrapper._keys.key(call.args, call.kwargs, call.tensors, call.spec)

    def params_moved(self):
        return self._entry().graphs.current.params.moved

    def blocker(self):
        _, call = self._call()
        entry, body = self._entry(), self.wrapper.body()
        return lambda: body.blocker(entry, call)

    def copy_in(self):
        _, call = self._call()
        return lambda: self._entry().graphs.current.static_inputs.copy_in(call.tensors)

    def adopted(self):
        return self._entry().graphs.current.backward.grad_plan.adopted

    def hand_out_grads(self):
        """The grad hand-out as a backward after freed grads pays it: the views the hand-out before the last gave
        re-pointed (NOTE [ Freed aliases re-pointed ] in grads/hand_out_plan.py); after each call, untimed, the views
        handed out are freed as a free of the grads autograd adopted frees them."""
        plan = self._entry().graphs.current.backward.grad_plan
        handed = []

        def hand_out():
            handed[:] = plan.hand_out()

        def free():  # untimed (timed() runs a piece's ``after``): the loop's free of the grads autograd adopted
            for grad in handed:
                if grad is not None:
                    grad._clear_data()
        hand_out.after = free
        return hand_out

    def hand_out_made(self):
        """The grad hand-out with every view made anew (NOTE [ Reused aliases ] in grads/hand_out_plan.py; the kept
        views forgotten)."""
        plan = self._entry().graphs.current.backward.grad_plan

        def hand_out():
            plan.forget_views()
            return plan.hand_out()
        return hand_out

    def hand_out_reused(self):
        """The grad hand-out with the last backward's views reused (grads zeroed or accumulated, not freed)."""
        return self._entry().graphs.current.backward.grad_plan.hand_out

    def hand_out_outputs(self):
        from paddlefleet.cudagraph.block.bridge import hand_out_outputs

        graphs = self._entry().graphs.current
        return lambda: hand_out_outputs(graphs)

    def hook_route(self):
        from paddlefleet.cudagraph.grads.handles import copy, route_hooks

        graphs = self._entry().graphs.current
        outputs = [copy(t) for t in graphs.static_outputs]  # stand-ins for what a call hands out
        return lambda: route_hooks(outputs, graphs.diff_at, graphs.inflight)

    def bridge_args(self):
        """The BridgeArgs a replay of this call hands to PyLayer.apply (NOTE [ Bridge inputs ])."""
        _, call = self._call()
        return self._entry().graphs.current.bridge.args(call.tensors)

    def bridge_inputs(self):
        _, call = self._call()
        plan = self._entry().graphs.current.bridge
        return lambda: plan.args(call.tensors)

    def chain_hooks(self):
        from paddlefleet.cudagraph.grads.handles import copy

        _, call = self._call()
        body = self.wrapper.body()
        entry = next(e for e in self.wrapper._entries.values() if e.graphs is not None)  # the hooks keep it weakly
        hooks, output = body.hooks, copy(entry.graphs.current.static_outputs[0])  # a stand-in for the call's output

        def around():
            hooks.head(body, entry, call)
            hooks.replayed(body, entry, call, output)

        return around

    def grad_output_copy(self):
        from paddlefleet.cudagraph.grads.handles import copy

        graphs = self._entry().graphs.current
        feeds = [(buf, copy(buf)) for _, buf in graphs.grad_feeds]  # stand-ins for the grads Paddle passes
        return lambda: [buf.copy_(grad, False) for buf, grad in feeds]

    def forward_replay(self):
        return self._entry().graphs.current.fwd_graph.replay

    def backward_replay(self):
        return self._entry().graphs.current.backward.graph.replay

    def pieces(self):
        """(row name, whose, resolver) for each private piece; resolver() returns what to time."""
        return [
            ("flatten the arguments (Call)", "ours", self.flatten),
            ("key of the call", "ours", self.key),
            ("replay preconditions (parameters, adopted inputs, pending backward)", "ours", self.blocker),
            ("  of which the parameter-address check", "ours", self.params_moved),
            ("input copy into the static buffer (copy_)", "ours (1 device copy)", self.copy_in),
            ("output hand-out (clone_outputs: one copy per output)", "ours (1 device copy)", self.hand_out_outputs),
            ("hook route of the differentiable outputs (a weak reference each)", "ours", self.hook_route),
            ("bridge inputs of the call (BridgePlan.args)", "ours", self.bridge_inputs),
            ("chain hooks of a replay alone (links observed and remembered, no chain)", "ours", self.chain_hooks),
            ("grad-output copy into its static buffer (one copy per output)", "ours (1 device copy)",
             self.grad_output_copy),
            ("adopted-grad check before a backward replay (GradPlan.adopted)", "ours", self.adopted),
            ("grad hand-out (GradPlan.hand_out: aliases of the static grads; grads freed every backward: the freed "
             "views of the hand-out before the last re-pointed)", "ours", self.hand_out_grads),
            ("  the same, every view made anew (one unbind per stack, one view per single grad)", "ours",
             self.hand_out_made),
            ("  the same, the last backward's views reused (grads zeroed or accumulated, not freed)", "ours",
             self.hand_out_reused),
            ("forward graph replay()", "Paddle", self.forward_replay),
            ("backward graph replay()", "Paddle", self.backward_replay),
        ]


class StepInternals:
    """The pieces of one replayed call of a whole-step graph (``autocudagraph_step``), in the order
    the call runs them (NOTE [ Host breakdown internals ]). ``step`` must be replaying its key with
    ``args``; each resolver returns a callable that runs one piece alone, as the call would."""

    def __init__(self, step, args, kwargs=None):
        self.step, self.args, self.kwargs = step, tuple(args), dict(kwargs or {})

    def _entry(self):
        return next(e for e in self.step.entries().values() if e.graphs is not None)

    def _call(self):
        from paddlefleet.cudagraph.core.call import Call

        return Call, Call(self.args, self.kwargs)

    def nested(self):
        from paddlefleet.cudagraph.core.dispatch import nested_reason

        return lambda: nested_reason(self.step)

    def flatten(self):
        make, _ = self._call()
        return lambda: make(self.args, self.kwargs)

    def stale(self):
        from paddlefleet.cudagraph.io.stale_outputs import check_fresh

        _, call = self._call()
        return lambda: check_fresh(call.tensors)

    def key(self):
        _, call = self._call()
        return lambda: self.step._keys.key(call.args, call.kwargs, call.tensors, call.spec)

    def entry(self):
        _, call = self._call()
        step = self.step
        # The lifecycle's lookup on a copy of its ordered entries (the wrapper's own are not handed out).
        entries = collections.OrderedDict(step.entries())
        key, latest = step._keys.key(call.args, call.kwargs, call.tensors, call.spec), next(reversed(entries.values()))

        def lookup():
            if entries.get(key) is not latest:
                entries.move_to_end(key)

        return lookup

    def blocker(self):
        _, call = self._call()
        entry, body = self._entry(), self.step.body()
        return lambda: body.blocker(entry, call)

    def bindings(self):
        checks = self._entry().graphs.checks
        return checks._bindings_unchanged or (lambda: True)  # None: the capture saw nothing bound

    def params(self):
        checks = self._entry().graphs.checks
        return lambda: checks._moved(None, None)

    def between(self):
        from paddlefleet.cudagraph.step.replay_checks import _grads_between

        body = self.step.body()
        return lambda: _grads_between(body._between)

    def lr_feed(self):
        feeds = self._entry().graphs.feeds
        return lambda: [feed.feed() for feed in feeds]

    def returned(self):
        return self._entry().graphs.returned.for_replay

    def copy_in(self):
        _, call = self._call()
        graphs = self._entry().graphs
        if graphs.in_place:  # every input adopted: the replay copies nothing
            return lambda: None
        return lambda: graphs.static_inputs.copy_in(call.tensors)

    def replay(self):
        return self._entry().graphs.graph.replay

    def hand_out(self):
        from paddlefleet.cudagraph.io.nested import unflatten

        graphs = self._entry().graphs
        consts = graphs.returned.for_replay()
        return lambda: unflatten(graphs.out_spec, graphs.hand_out(), consts)

    def grad_slots(self):
        return self.step.body()._remember_between

    def pieces(self):
        """(row name, resolver, part of the whole call) for each piece: the parts add up to the call
        less the lifecycle's own bookkeeping; the others are shares of a part."""
        return [
            ("nested-call checks (capture open, whole step running, saved-tensors hooks)", self.nested, True),
            ("flatten the arguments (Call)", self.flatten, True),
            ("stale-output check of the arguments", self.stale, True),
            ("key of the call", self.key, True),
            ("entry lookup (LRU order)", self.entry, True),
            ("replay preconditions (StepBody.blocker)", self.blocker, True),
            ("  of which globals/closure bindings", self.bindings, False),
            ("  of which parameter addresses", self.params, False),
            ("  of which grads between calls", self.between, False),
            ("learning-rate feed (unchanged rates)", self.lr_feed, True),
            ("Python values of the result (get_lr recomputed)", self.returned, True),
            ("input copy into the static buffers (none where every input is adopted)", self.copy_in, True),
            ("graph replay()", self.replay, True),
            ("output hand-out (a detached copy per output) and result rebuilt", self.hand_out, True),
            ("grads remembered for the next call's check (simulated replays only)", self.grad_slots, False),
        ]


# NOTE [ Call stages ]
# The pieces of layer_call_us are each timed alone, in a loop of their own: warm caches, no neighbours.
# What a call pays between and around them (Paddle's Layer.__call__, the runner, the PyLayer machinery,
# the autograd engine, and the pieces themselves slowed by the call's other work) is "the rest" there.
# CallStages times whole calls, forward and backward, cut at the boundaries of the replay path: a
# timestamp (time.perf_counter_ns) where the wrapper's call, the dispatcher, the block's replay, the
# bridge's PyLayer.apply, its forward and backward, and the backward replay start and end. The stages
# add up to the instrumented call; each boundary costs one Python frame (a wrapper, about 0.1-0.2 us
# on a CPU), which lands in the stage it opens or closes. The probes wrap private names (listed in
# NOTE [ Host breakdown internals ]) for the measurement only and put them back after it.

_ns = time.perf_counter_ns

#: (stage, whose, from boundary, to boundary): the table's rows, in the order a call runs them.
STAGES = (
    ("Paddle's Layer.__call__ into the wrapper", "Paddle", "start", "call<"),
    ("dispatch: flatten, key, entry lookup, replay preconditions", "ours", "call<", "dispatch>"),
    ("runner: from the Decision to the block's replay", "ours", "dispatch>", "replay<"),
    ("block replay before the bridge: chain hooks (head), input copy, bridge inputs", "ours", "replay<", "apply<"),
    ("PyLayer.apply into the bridge's forward (per input)", "Paddle", "apply<", "forward<"),
    ("bridge forward: graph replay, token, output hand-out (copies)", "ours", "forward<", "forward>"),
    ("PyLayer.apply out of the bridge's forward (grad node, outputs)", "Paddle", "forward>", "apply>"),
    ("block replay after the bridge: hook route, chain hooks (replayed), result", "ours", "apply>", "replay>"),
    ("runner and Layer.__call__ back to the caller", "ours and Paddle", "replay>", "forward done"),
    ("Tensor.backward into the bridge's backward (engine start)", "Paddle", "forward done", "backward<"),
    ("bridge backward until its replay ran: grad-output copy, adopted check, graph replay", "ours",
     "backward<", "replayed>"),
    ("bridge backward after its replay: grad hand-out, grads in the bridge's order", "ours", "replayed>",
     "backward>"),
    ("autograd engine after the bridge: grads accumulated into p.grad, hooks", "Paddle", "backward>",
     "backward done"),
    ("the output dropped (its grad node, the bridge's context and token freed)", "Paddle", "backward done", "end"),
)


class CallStages:
    """The stages of one graphed layer call, timed inside the call (NOTE [ Call stages ]):
    ``with CallStages() as stages: rows, total = stages.time(forward, backward, reps, after)``."""

    def __init__(self):
        self.marks = {}
        self._saved = []

    def _wrap(self, owner, name, before, after, static=False):
        original = owner.__dict__[name] if static else getattr(owner, name)
        function = original.__func__ if static else original
        marks = self.marks

        def probe(*args, **kwargs):
            marks[before] = _ns()
            result = function(*args, **kwargs)
            marks[after] = _ns()
            return result

        self._saved.append((owner, name, original))
        setattr(owner, name, staticmethod(probe) if static else probe)

    def __enter__(self):
        from paddlefleet.cudagraph.block import bridge, graphed, replay
        from paddlefleet.cudagraph.core import lifecycle

        try:
            self._wrap(lifecycle.Lifecycle, "__call__", "call<", "call>")
            self._wrap(lifecycle.Lifecycle, "_dispatched", "call<", "call>")  # the front door's calls
            self._wrap(lifecycle, "dispatch", "dispatch<", "dispatch>")
            self._wrap(graphed.BlockBody, "replay", "replay<", "replay>")
            self._wrap(bridge.GraphedFunction, "forward", "forward<", "forward>", static=True)
            self._wrap(bridge.GraphedFunction, "backward", "backward<", "backward>", static=True)
            self._wrap(bridge, "replay_backward", "replayed<", "replayed>")
            marks, function = self.marks, replay.GraphedFunction

            def apply(*args):
                marks["apply<"] = _ns()
                result = function.apply(*args)
                marks["apply>"] = _ns()
                return result

            self._saved.append((replay, "GraphedFunction", function))
            replay.GraphedFunction = type("TimedBridge", (), {"apply": staticmethod(apply)})
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        return False

    def time(self, forward, backward, reps, after):
        """``[(stage, whose, median us)]`` plus the instrumented total: ``y = forward()``, ``backward(y)``,
        ``y`` dropped, then ``after()`` untimed; ``reps`` times."""
        samples = {stage: [] for stage, _, _, _ in STAGES}
        totals = []
        marks = self.marks
        for _ in range(reps):
            marks.clear()
            marks["start"] = _ns()
            y = forward()
            marks["forward done"] = _ns()
            backward(y)
            marks["backward done"] = _ns()
            del y
            marks["end"] = _ns()
            after()
            for stage, _, start, end in STAGES:
                samples[stage].append(marks[end] - marks[start])
            totals.append(marks["end"] - marks["start"])
        rows = [(stage, whose, statistics.median(samples[stage]) / 1e3) for stage, whose, _, _ in STAGES]
        return rows, statistics.median(totals) / 1e3


#: The stages of a chained call's forward (NOTE [ Call stages ]; a later member of a chain: NOTE [ Chains of graphed
#: calls ] in chains/chain.py): (stage, whose, from boundary, to boundary), in the order the call runs them.
CHAIN_STAGES = (
    ("Paddle's Layer.__call__ into the wrapper", "Paddle", "start", "call<"),
    ("dispatch until the chain's claim", "ours", "call<", "claim<"),
    ("the chain's claim: key, replay preconditions (ChainRun.claim)", "ours", "claim<", "claim>"),
    ("from the claim to the hand-out", "ours", "claim>", "hand<"),
    ("input copy into the static input (copy_)", "ours (1 device copy)", "hand<", "fwd<"),
    ("forward graph replay() and its token", "ours and Paddle", "fwd<", "fwd>"),
    ("output copy into the tensor the head made (copy_), hand-out", "ours (1 device copy)", "fwd>", "hand>"),
    ("runner back to the wrapper's return (Replayed, counters)", "ours", "hand>", "call>"),
    ("Layer.__call__ back to the caller", "Paddle", "call>", "end"),
)


class ChainStages(CallStages):
    """The stages of a chained call's forward, timed inside the call (NOTE [ Call stages ])."""

    def __enter__(self):
        from paddlefleet.cudagraph.chains import run
        from paddlefleet.cudagraph.core import lifecycle

        try:
            self._wrap(lifecycle.Lifecycle, "__call__", "call<", "call>")
            self._wrap(lifecycle.Lifecycle, "_dispatched", "call<", "call>")  # the front door's calls
            self._wrap(run.ChainRun, "claim", "claim<", "claim>")
            self._wrap(run.ChainRun, "hand_out", "hand<", "hand>")
            self._wrap(run, "replay_forward", "fwd<", "fwd>")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def time_chain(self, layers, x, backward, reps, after):
        """``([(stage, whose, median us)], instrumented median us of a later member's forward call, median us of
        the head's)`` over ``reps`` forward passes through ``layers`` (every call after the first a chain's), each
        followed by ``backward(h)`` and ``after()``, untimed."""
        samples = {stage: [] for stage, _, _, _ in CHAIN_STAGES}
        totals, heads = [], []
        marks = self.marks
        for _ in range(reps):
            h = x
            for j, layer in enumerate(layers):
                marks.clear()
                marks["start"] = _ns()
                h = layer(h)
                marks["end"] = _ns()
                if j == 0:
                    heads.append(marks["end"] - marks["start"])
                    continue
                if any(mark not in marks for _, _, a, b in CHAIN_STAGES for mark in (a, b)):
                    raise RuntimeError(f"call {j} was not served by a chain (marks {sorted(marks)})")
                for stage, _, start, end in CHAIN_STAGES:
                    samples[stage].append(marks[end] - marks[start])
                totals.append(marks["end"] - marks["start"])
            backward(h)
            del h
            after()
        rows = [(stage, whose, statistics.median(samples[stage]) / 1e3) for stage, whose, _, _ in CHAIN_STAGES]
        return rows, statistics.median(totals) / 1e3, statistics.median(heads) / 1e3


def timed(fn, reps, sync, after=None):
    """Median host us of ``fn()`` alone; ``after()`` (where given, else ``fn.after`` where ``fn`` has one) and a
    device sync run untimed after each call."""
    after = after or getattr(fn, "after", None)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        if after is not None:
            after()
        sync()
    return statistics.median(samples) * 1e6


def layer_call_us(args, sync, matmuls, width, label):
    """``layer_call_us`` of one graphed Layer of ``matmuls`` matmuls x ``width`` (batch ``args.batch``):
    the host time of one call alone (not chained), forward and backward (``model(x).backward(dy)``;
    the grads are released untimed), and each piece's share: ours (the wrapper's pieces, each timed
    alone), Paddle's (the graph replays; its PyLayer bridge, BridgeShape: apply with every parameter,
    and its backward node handing one grad per parameter) and the rest (Python between the pieces,
    the autograd engine's walk)."""
    draw = normal(3)
    x, dy = host_tensor(draw(args.batch, width)), host_tensor(draw(args.batch, width))
    model = graphed_model(args, width=width, layers=matmuls)
    params = model.parameters()
    release = lambda: [p.clear_gradient(False) for p in params]  # noqa: E731
    call = lambda: model(x).backward(dy)  # noqa: E731
    for _ in range(24):  # warmup, capture, and past the replays core/host_cost.py times
        call()
        release()
    sync()
    total = timed(call, args.reps, sync, release)
    reads = compiled_against_python(call, args.reps, sync, release)
    forward, backward = forward_backward_us(model, x, dy, release, args.reps, sync)
    pieces = []
    for name, who, resolve in Internals(model.forward, x).pieces():
        if name.startswith("  "):  # a share of the row above it, not a piece of its own
            continue
        try:
            us = timed(resolve(), args.reps, sync)
        except Exception as err:  # noqa: BLE001 - a private name a refactor moved (NOTE [ Host breakdown internals ])
            pieces.append({"piece": name, "whose": who, "us": None, "why": short(err, 160)})
            continue
        pieces.append({"piece": name, "whose": "Paddle" if who == "Paddle" else "ours", "us": round(us, 2)})
    bridge_args = Internals(model.forward, x).bridge_args()
    taken = len(bridge_args.args[0]) if isinstance(bridge_args.args[0], list) else len(bridge_args.args)
    BridgeShape.grads = [host_tensor(draw(width, width)) for _ in params]
    held = lambda: x  # noqa: E731
    bridge = timed(lambda: BridgeShape.apply(held, bridge_args, *bridge_args.args).backward(dy), args.reps, sync,
                   release)
    pieces.append({"piece": f"PyLayer bridge: apply with {taken} inputs and its backward node handing "
                            f"{len(params)} grads to autograd (accumulated into p.grad)", "whose": "Paddle",
                   "us": round(bridge, 2)})
    known = sum(p["us"] for p in pieces if p["us"] is not None)
    pieces.append({"piece": "the rest: Python between the pieces (lifecycle, bridge bodies), the autograd engine",
                   "whose": "ours and Paddle", "us": round(total - known, 2)})
    for piece in pieces:
        piece["share"] = None if piece["us"] is None else round(piece["us"] / total, 3)
    stages, staged = call_stages(model, x, dy, release, args.reps, sync)
    by = lambda whose: round(sum(p["us"] for p in pieces if p["whose"] == whose and p["us"] is not None), 2)  # noqa: E731
    return {"layer": label, "parameters": len(params), "matmuls": matmuls, "width": width, "batch": args.batch,
            "layer_call_us": round(total, 2), "forward_us": round(forward, 2), "backward_us": round(backward, 2),
            "ours_us": by("ours"), "paddle_us": by("Paddle"),
            "rest_us": round(total - known, 2), "pieces": pieces, "stages": stages, "stages_total_us": staged,
            "tensor_reads": reads,
            "counters": {k: model.forward.stats()[k] for k in ("captures", "replays", "eager_calls", "chained_calls")}}


def compiled_against_python(call, reps, sync, release, rounds=6):
    """``{"compiled_us", "python_us", "compiled"}``: ``call`` timed with the compiled tensor reads and with every
    read in Python (NOTE [ Compiled tensor reads ] in native/__init__.py), in alternating rounds of ``reps // rounds``
    calls, the median of each side's rounds; both None where the compiled reads are not in use (``compiled``: why)."""
    from paddlefleet.cudagraph import native

    active, why = native.status()
    if not active:
        return {"compiled_us": None, "python_us": None, "compiled": why}
    compiled, python = [], []
    for _ in range(rounds):
        compiled.append(timed(call, max(reps // rounds, 10), sync, release))
        with native.disabled():
            python.append(timed(call, max(reps // rounds, 10), sync, release))
    return {"compiled_us": round(statistics.median(compiled), 2), "python_us": round(statistics.median(python), 2),
            "compiled": "in use"}


def call_stages(model, x, dy, release, reps, sync):
    """``([{"stage", "whose", "us"}], instrumented total us)`` of ``model(x).backward(dy)`` (NOTE [ Call
    stages ]); one row "n/a" with why, and None, where a probe's private name moved."""
    try:
        with CallStages() as probes:
            rows, total = probes.time(lambda: model(x), lambda y: y.backward(dy), reps, lambda: (release(), sync()))
    except Exception as err:  # noqa: BLE001 - a private name a refactor moved (NOTE [ Host breakdown internals ])
        return [{"stage": "n/a", "whose": "", "us": None, "why": short(err, 160)}], None
    return [{"stage": stage, "whose": whose, "us": round(us, 2)} for stage, whose, us in rows], round(total, 2)


def forward_backward_us(model, x, dy, release, reps, sync):
    """Median host us of ``y = model(x)`` and of ``y.backward(dy)``, each timed within one call."""
    forward, backward = [], []
    for _ in range(reps):
        start = time.perf_counter()
        y = model(x)
        middle = time.perf_counter()
        y.backward(dy)
        backward.append(time.perf_counter() - middle)
        forward.append(middle - start)
        del y
        release()
        sync()
    return statistics.median(forward) * 1e6, statistics.median(backward) * 1e6


def graphed_model(args, options=None, width=None, layers=None):
    """A graphed MatMLP, captured and replaying (warmup 1, then capture, then a replay)."""
    model = build(lambda: MatMLP([width or args.width] * ((layers or args.layers) + 1)), seed=0)
    # The graphed path is what is timed: never run eagerly as slower (eager_if_slower).
    autocudagraph(model, backend=args.backend, warmup_steps=1, **{"eager_if_slower": False, **(options or {})})
    return model


class Breakdown:
    """Times the pieces of one graphed step; each row is (piece, whose, host us or "n/a (why)")."""

    def __init__(self, args):
        self.args = args
        self.sync = paddle.device.cuda.synchronize if args.backend == "cuda" else (lambda: None)
        draw = normal(0)
        self.x = host_tensor(draw(args.batch, args.width))
        self.dy = host_tensor(draw(args.batch, args.width))
        self.rows = []

    def row(self, name, who, make):
        """``make()`` returns the callable to time; an error in it or in timing makes the row n/a
        (for a private piece: a name that a refactor moved, see NOTE [ Host breakdown internals ])."""
        try:
            us = f"{timed(make(), self.args.reps, self.sync):.1f}"
        except Exception as err:  # noqa: BLE001 - the other rows still run
            us = f"n/a ({short(err, 160)})"
        self.rows.append((name, who, us))

    def step_of(self, model, release=True):
        params = model.parameters()  # made once: Layer.parameters() walks the sublayers

        def step():
            model(self.x).backward(self.dy)
            if release:
                for p in params:
                    p.clear_gradient(False)

        for _ in range(3):  # warmup, capture, first replay
            step()
        self.sync()
        return step

    def wrapper_rows(self):
        model = graphed_model(self.args)
        step = self.step_of(model)
        self.row("graphed step: forward call + backward + release grads", "total", lambda: step)
        params = model.parameters()
        self.row(f"release {len(params)} grads (clear_gradient(False))", "benchmark loop",
                 lambda: lambda: [p.clear_gradient(False) for p in params])
        self.row("graphed step, grads kept (accumulating; host time only, values not checked here)", "total",
                 lambda: self.step_of(graphed_model(self.args), release=False))
        self.row("forward call alone (then drop the output)", "total", lambda: lambda: model(self.x))
        for name, who, resolve in Internals(model.forward, self.x).pieces():
            self.row(name, who, resolve)
        return model, step

    def per_layer_rows(self):
        """The same MLP with each layer graphed on its own (as users graph each decoder layer), and
        as one whole-step graph (autocudagraph_step), where the package has it."""
        args = self.args
        per_layer_step, layers = self.per_layer_model()
        start = time.perf_counter()
        for _ in range(3):  # warmup, capture, first replay
            per_layer_step()
        self.sync()
        startup = (time.perf_counter() - start) * 1e3
        captures = sum(sum(layer.forward.stats().get("capture_ms", {}).values()) for layer in layers)
        self.rows.append((f"start-up of {args.layers} graphed layers: first 3 steps, ms (of which captures, ms)", "total",
                          f"{startup:.1f} ms ({captures:.1f} ms)"))
        name = f"per-layer step: {args.layers} graphed layers (one Layer each), forward + backward + release"
        self.per_layer_row(name, per_layer_step)
        variants = (("each call alone (chain_calls=False)", {"chain_calls": False}), ("eagerly", None))
        for what, options in variants:
            step, _ = self.per_layer_model(options)
            for _ in range(3):
                step()
            self.per_layer_row(f"per-layer step, {what}", step)
        self.whole_step_row()

    def chain_stage_lines(self):
        """Markdown of a chained call's forward stage by stage (NOTE [ Call stages ]), the per-layer model's
        calls after the first (each served by the chain), and the same forward calls timed without probes."""
        args = self.args
        step, layers = self.per_layer_model({})
        for _ in range(3 + 2):  # warmup, capture, replays until the links are confirmed and the chain runs
            step()
        self.sync()
        params = layers.parameters()
        after = lambda: ([p.clear_gradient(False) for p in params], self.sync())  # noqa: E731
        plain = []
        for _ in range(args.reps):
            h, times = self.x, []
            for layer in layers:
                start = time.perf_counter()
                h = layer(h)
                times.append(time.perf_counter() - start)
            h.backward(self.dy)
            del h
            after()
            plain.append(times)
        later = statistics.median(t for times in plain for t in times[1:]) * 1e6
        head = statistics.median(times[0] for times in plain) * 1e6
        head_lines = ["", f"## A chained call's forward, stage by stage ({args.layers} graphed layers of one matmul x "
                          f"{args.width}, batch {args.batch})", ""]
        try:
            with ChainStages() as probes:
                rows, total, head_probed = probes.time_chain(list(layers), self.x, lambda h: h.backward(self.dy),
                                                             args.reps, after)
        except Exception as err:  # noqa: BLE001 - a private name a refactor moved (NOTE [ Host breakdown internals ])
            return head_lines + [f"n/a ({short(err, 160)})"]
        chained = sum(layer.forward.stats()["chained_calls"] for layer in layers)
        lines = head_lines + [
            f"The forward calls of the per-layer step after the first, each served by the chain ({chained} chained "
            f"calls in all), timed inside the call (median of {args.reps} passes x {args.layers - 1} calls per stage; "
            f"the instrumented call {total:.1f} us; uninstrumented, the same calls {later:.1f} us and the head's "
            f"{head:.1f} us, {head_probed:.1f} instrumented: it applies the one bridge of every member; NOTE [ Call "
            "stages ] in tools/host_breakdown.py). The backward and the grads' release run untimed between passes.",
            "", "| stage | whose | host us |", "|---|---|---|"]
        lines += [f"| {stage} | {whose} | {us:.1f} |" for stage, whose, us in rows]
        return lines

    def per_layer_row(self, name, step):
        self.row(name, "total", lambda: step)
        us = self.rows[-1][2]
        per_call = f"{float(us) / self.args.layers:.1f}" if not us.startswith("n/a") else us
        self.rows.append(("  per layer call (forward + backward)", "total", per_call))

    def per_layer_model(self, options=()):
        """``(step, layers)``: the MLP with each layer its own graphed Layer (``options`` None:
        eager), nothing run yet."""
        args = self.args
        layers = build(lambda: paddle.nn.LayerList([MatMLP([args.width] * 2) for _ in range(args.layers)]), seed=0)
        if options is not None:
            for layer in layers:
                autocudagraph(layer, backend=args.backend, warmup_steps=1, **{"eager_if_slower": False, **dict(options)})
        params = layers.parameters()

        def per_layer_step():
            h = self.x
            for layer in layers:
                h = layer(h)
            h.backward(self.dy)
            for p in params:
                p.clear_gradient(False)

        return per_layer_step, layers

    def whole_step_row(self):
        from paddlefleet import cudagraph as package

        make = getattr(package, "autocudagraph_step", None)
        name = "whole-step graph (autocudagraph_step): one call, forward + backward + release inside"
        if make is None:
            self.rows.append((name, "total", "n/a (no autocudagraph_step in this version)"))
            return
        args = self.args
        train = MatmulStep(build(lambda: MatMLP([args.width] * (args.layers + 1)), seed=0))
        graphed = make(train, optimizers=[], warmup_steps=2, backend=args.backend)

        def step():
            graphed(self.x, self.dy)

        for _ in range(4):  # 2 warmup steps, capture, first replay
            step()
        self.sync()
        self.row(name, "total", lambda: step)
        for piece, resolve, _ in StepInternals(graphed, (self.x, self.dy)).pieces():
            who = "Paddle" if "replay()" in piece else "ours (whole step)"
            self.row(f"  whole step: {piece.strip()}", who, resolve)

    def option_rows(self):
        for option in SPEED_OPTIONS:
            name = f"graphed step with {option.options}"
            why = option_unsupported(option.options)
            if why:
                self.rows.append((name, "total", f"n/a ({why})"))
                continue
            if option.keeps_grads:
                # Accumulators are kept, not released: the step's host time is what this row
                # measures; its values are checked by tools/bench.py and the suite, not here (on a
                # GPU without Paddle's add kernel they are wrong, the host work is the same).
                name += " (grads kept; host time only, values not checked here)"
            self.row(name, "total", lambda option=option: self.step_of(
                graphed_model(self.args, option.options), release=not option.keeps_grads))

    def paddle_rows(self, params):
        args, x, dy = self.args, self.x, self.dy
        stack = host_tensor(normal(1)(args.layers, args.width, args.width))
        Passthrough.grads = [host_tensor(normal(2)(args.width, args.width)) for _ in params]
        self.row(f"one device copy (_C_ops.assign of the {args.batch} x {args.width} output)", "Paddle",
                 lambda: lambda: _C_ops.assign(x))
        self.row(f"one device copy of a {args.layers} x {args.width} x {args.width} grad stack", "Paddle",
                 lambda: lambda: _C_ops.assign(stack))
        self.row(f"unbind of the grad stack into {args.layers} views", "Paddle", lambda: lambda: _C_ops.unbind(stack, 0))
        self.row(f"PyLayer.apply with {len(params) + 1} tensor inputs (forward: 1 copy)", "Paddle",
                 lambda: lambda: Passthrough.apply(x, *params))

        def pylayer_step():
            Passthrough.apply(x, *params).backward(dy)
            for p in params:
                p.clear_gradient(False)

        self.row(f"PyLayer forward + Tensor.backward handing {len(params)} grads to autograd + release", "Paddle",
                 lambda: pylayer_step)
        leaf = x.detach()
        leaf.stop_gradient = False

        def tiny_backward():
            paddle.matmul(leaf, params[0]).backward(dy)
            params[0].clear_gradient(False)
            leaf.clear_gradient(False)

        self.row("eager matmul + Tensor.backward (1 layer) + release, for scale", "Paddle", lambda: tiny_backward)


def profile(step, steps, path, what="graphed steps"):
    """cProfile of ``steps`` calls of ``step`` (host side), top functions to ``path``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    buf = io.StringIO()
    buf.write(f"# {steps} {what} (host time; each line's times are totals over all steps)\n")
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    with open(path, "w") as fh:
        fh.write(buf.getvalue())


def parse():
    parser = argparse.ArgumentParser(description="host time of the pieces of a graphed step")
    parser.add_argument("--backend", choices=("cuda", "simulate"), default="cuda", help=BACKEND_HELP)
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: simulate, 4 x 32, 20 reps, output under the temp dir")
    for name, text in (("layers", "matmul layers"), ("width", "layer width"), ("batch", "batch size"),
                       ("reps", "timed repetitions per piece")):
        parser.add_argument(f"--{name}", type=int, help=sized_help(text, *SIZES[name]))
    parser.add_argument("--out", help="write the report here (markdown; text above its generated-text mark is kept)")
    parser.add_argument("--json", help="write layer_call_us here (default: --out with .json for .md)")
    parser.add_argument("--profile", help="also write a cProfile of 100 graphed steps here")
    args = parser.parse_args()
    if args.smoke:
        args.backend = "simulate"
        args.out = args.out or os.path.join(tempfile.gettempdir(), "host_breakdown_smoke.md")
    if args.out and not args.json:
        args.json = os.path.splitext(args.out)[0] + ".json"
    require_gpu(TOOL, args.backend)
    for name, (full, smoke) in SIZES.items():
        setattr(args, name, sized(getattr(args, name), args.backend, full, smoke))
    try:
        for path in (args.out, args.json, args.profile) if args.backend != "cuda" else ():
            if path:
                check_smoke_path(path, TOOL)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return args


def main():
    args = parse()
    os.environ.pop(ENV_BACKEND, None)
    cuda = args.backend == "cuda"
    paddle.set_device("gpu" if cuda else "cpu")
    bd = Breakdown(args)
    calls = [layer_call_us(args, bd.sync, matmuls, width, label) for matmuls, width, label in (
        (args.layers, args.width, f"{args.layers} parameters ({args.layers} matmuls x {args.width})"),
        (6, 1024 if cuda else args.width, f"realistic: 6 matmuls x {1024 if cuda else args.width}"))]
    model, step = bd.wrapper_rows()
    bd.per_layer_rows()
    chain_lines = bd.chain_stage_lines()
    bd.option_rows()
    bd.paddle_rows(model.parameters())
    if args.profile:
        profile(step, 100, args.profile)
        startup, _ = bd.per_layer_model()
        profile(startup, 3, args.profile + ".startup", f"first steps of {args.layers} graphed layers (warmup, capture, replay)")
    title = "Host time of the pieces of a graphed step" + ("" if cuda else " (SMOKE RUN on the CPU: not a GPU result)")
    lines = [f"# {title}", ""] + info_lines(run_info(cuda, REPO)) + [
        f"- backend {args.backend}; model: {args.layers} matmul layers x {args.width}, batch {args.batch}; median of "
        f"{args.reps} repetitions, host time without a device sync inside the timed region; counters after the "
        f"run: {model.forward.stats().get('replays')} replays, {model.forward.stats().get('captures')} capture",
        "", "| piece | whose | host us |", "|---|---|---|"]
    lines += [f"| {name} | {who} | {us} |" for name, who, us in bd.rows]
    lines += chain_lines
    lines += layer_call_lines(calls, args.reps)
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out:
        write_generated(args.out, lines, TOOL, smoke=not cuda)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tool": TOOL, "smoke": not cuda, "backend": args.backend, "run": run_info(cuda, REPO),
                       "layer_call_us": calls}, fh, indent=1)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def layer_call_lines(calls, reps):
    """Markdown of the layer_call_us results: one table per layer, every piece with its share."""
    lines = []
    for c in calls:
        lines += ["", f"## layer_call_us, {c['layer']}: {c['layer_call_us']:.1f} us", "",
                  f"One graphed Layer ({c['parameters']} parameters, batch {c['batch']}) called alone, forward + "
                  f"backward (grads released untimed), median of {reps} (forward {c['forward_us']:.1f} us, backward "
                  f"{c['backward_us']:.1f} us, each timed within one call): ours {c['ours_us']:.1f} us, Paddle's "
                  f"{c['paddle_us']:.1f} us, the rest {c['rest_us']:.1f} us (each piece timed alone; counters "
                  f"{c['counters']}).", "", "| piece | whose | host us | share |", "|---|---|---|---|"]
        for p in c["pieces"]:
            us = "n/a (" + p["why"] + ")" if p["us"] is None else f"{p['us']:.1f}"
            share = "" if p["share"] is None else f"{100 * p['share']:.0f}%"
            lines.append(f"| {p['piece']} | {p['whose']} | {us} | {share} |")
        reads = c.get("tensor_reads") or {}
        if reads.get("compiled_us") is not None:
            lines += ["", f"Tensor reads (NOTE [ Compiled tensor reads ] in native/__init__.py), the same call in "
                          f"alternating rounds: compiled {reads['compiled_us']:.1f} us, in Python "
                          f"{reads['python_us']:.1f} us ({reads['compiled_us'] - reads['python_us']:+.1f})."]
        elif reads:
            lines += ["", f"Tensor reads: all in Python ({reads['compiled']})."]
        lines += stage_lines(c, reps)
    return lines


def stage_lines(c, reps):
    """Markdown of one layer_call_us result's stages (NOTE [ Call stages ])."""
    total = c.get("stages_total_us")
    lines = ["", f"The same call stage by stage, timed inside the call (median of {reps} per stage; the instrumented "
                 f"call {'n/a' if total is None else f'{total:.1f}'} us, uninstrumented {c['layer_call_us']:.1f} us: "
                 "each probe adds a Python frame; NOTE [ Call stages ] in tools/host_breakdown.py):", "",
             "| stage | whose | host us |", "|---|---|---|"]
    for st in c.get("stages", ()):
        us = "n/a (" + st["why"] + ")" if st["us"] is None else f"{st['us']:.1f}"
        lines.append(f"| {st['stage']} | {st['whose']} | {us} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
