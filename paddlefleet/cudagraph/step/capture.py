"""One capture of a whole step (``StepCapture``): the static inputs it adopts or copies, the
capture run under the step scope, its checks against the last warmup step, and what a failed capture
takes back.

NOTE [ Adopted inputs of a step ]
A batch tensor passed in the last warmup call and again in the capture call (a loader that refills
one device buffer in place, a benchmark's fixed batch) is adopted as blocks adopt it (NOTE
[ Adopted inputs ] in io/static_inputs.py): its own storage is the graph's input, so a replay that
is passed it again copies nothing - on a GPU that is one device copy, and its launch, less per
tensor per call. Its in-place updates are what the graph reads, as eager reads them, and a step that
writes its input in place writes the caller's tensor, as eager does. A call that passes another
tensor there cannot be served by copying into it (that would overwrite the caller's tensor): the
key is captured again (ReplayChecks, Action.RECAPTURE), and that capture adopts nothing the call
does not pass again, so a loader that hands out a new tensor per step pays one extra capture, then
copies as before. The adopted tensor's storage is kept alive while the key holds its graph.

NOTE [ The capture call of a step ]
On the simulated backend a capture executes the step: that run *is* this call's step (it
consumed the RNG and updated the parameters as eager would), so its results are handed out and
the graph is not replayed for this call. A CUDA capture only records: the graph is replayed
once for this call, and Paddle's random kernels start from the offsets the capture recorded,
which the generator already moved past (NOTE [ RNG across capture ] in block/capture.py). A failed
capture on the simulated backend is taken back (step_state.Rollback) before the call runs
eagerly.
"""

import contextlib

import paddle

from ..core import state
from ..guards.paddle_patches import Patches
from ..backends import function_errors
from ..errors import CaptureError
from .grad_scaler import live_scalers
from .grad_slots import CLOSED
from .graphs import StepGraphs
from ..io.host_tensors import host_mask
from ..guards.host_reads import describe_trace_difference
from ..guards.refusals import ARGUMENT_GRAD, CHANGING_HOST_VALUE, INPUT_WRITTEN, PADDLE_SCALER
from ..guards.session import CaptureSession
from ..guards.traced_ops import held_for as traced_ops_held
from .optimizer_state import SchedulerWatch, inner_optimizer, move_beta_pows_to_device, optimizer_params, watch_steps
from ..io.nested import flatten, holds_tensor, unflatten
from ..io.output_aliases import run_aliases
from ..io.static_inputs import StaticInputs, contiguous_outputs
from .replay_checks import ReplayChecks
from .returned_values import ReturnedValues, tag_learning_rates
from .rollback import NO_WATCH, GradValues, LayerWatch, Rollback, describe_changes, fingerprint, step_params

__all__ = ["StepCapture"]


@contextlib.contextmanager
def _refuse_paddle_scaler():
    """paddle.amp.GradScaler decides on the host; refuse it by name inside a capture.

    NOTE [ Paddle's GradScaler in a whole step ]
    An enabled paddle.amp.GradScaler reads found_inf on the host in step()/minimize() and keeps
    its counters in Python: a graph would freeze its decisions. Paddle turns the scaler off
    where the place is not a GPU (a CPU run, the simulated backend), and a disabled scaler looks
    like one made with enable=False. So the scaler object is refused whether or not it is
    enabled: a run on a CPU refuses what the same script refuses on a GPU, where the scaler is
    on. A scaler made with enable=False on a GPU is refused too (it only forwards to the
    optimizer: call optimizer.step() there, or use GraphGradScaler).
    """
    classes = [c for c in (getattr(paddle.amp, "GradScaler", None), getattr(paddle.amp, "AmpScaler", None)) if c]
    with Patches() as patches:  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        for cls in classes:
            for name in ("step", "minimize", "update"):
                if cls.__dict__.get(name) is not None:
                    patches.set(cls, name, _refusing_scaler(name))
        yield


def _refusing_scaler(name):
    def refusing(self, *args, **kwargs):
        state = "enabled" if getattr(self, "_enable", False) else (
            "disabled here: Paddle turns it off off-GPU, and on a GPU it is on")
        raise PADDLE_SCALER.error(
            f"autocudagraph_step: paddle.amp.GradScaler.{name}() was called during capture ({state}). It reads "
            "found_inf on the host to skip the update and keeps its counters in Python, so a graph "
            "would freeze its decisions. Use paddlefleet.cudagraph.GraphGradScaler (same API, decisions "
            "on the device) in a graphed step."
        )

    return refusing


class ArgumentGrads:
    """Which arguments' buffers the capture's backward gave a grad (a hook on each buffer requiring grad,
    for the capture only; ``paddle.grad`` of an argument hands its grad out as a value and is not
    counted). Such a grad eagerly reaches the caller's tensor (its ``.grad``, or through a tensor
    computed before the step, what it came from); a replay would leave it with the buffer."""

    def __init__(self, static):
        self._static = static
        self.reached = []
        self._hooks = [b.register_hook(self._noting(i)) for i, b in enumerate(static.buffers) if not b.stop_gradient]

    def _noting(self, i):
        def noting(grad):
            if i not in self.reached:
                self.reached.append(i)

        return noting

    def remove(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def refuse(self):
        """Raises CaptureError naming the arguments the backward reached. Checked before the trace
        comparison: the trace of such a step differs too (a parameter passed as an argument is read as
        an argument eagerly and from outside at the capture), and says less."""
        if not self.reached:
            return
        names = ", ".join(repr(self._static.name(i)) for i in sorted(self.reached))
        raise ARGUMENT_GRAD.error(
            f"autocudagraph_step: the step's backward computes a grad for its argument(s) {names} "
            "(stop_gradient=False). Eagerly it reaches the tensor the caller passed (its .grad, or what it was "
            "computed from); the capture reads each argument through a buffer of its own, so every replay would "
            "leave the caller's tensor without it. Pass such a tensor with stop_gradient=True (x.detach()) where "
            "its grad is not needed, read a parameter from its Layer inside the step instead of passing it, "
            "return paddle.grad(...) of an input from the step, or graph the model with autocudagraph, whose "
            "calls hand grads to their arguments.")


def _refuse_written_copies(static, versionless):
    """Raises CaptureError where the step wrote an input it copies (an adopted input is the caller's
    tensor: written as eagerly), in place or through ``copy_``/``set_value`` (``versionless``)."""
    written = static.written(skip=static.adopted)
    written += [static.name(i) for i, b in enumerate(static.buffers)
                if i not in static.adopted and versionless.wrote(b) and static.name(i) not in written]
    if written:
        raise INPUT_WRITTEN.error(
            f"autocudagraph_step: the step writes its input(s) {', '.join(map(repr, written))} in place. The "
            "graph writes into its own copy of such an input, so the caller's tensor would not change on replays. "
            "Return the new value instead, write it after the step, or pass the very same tensor on every call "
            "(then the graph reads and writes it in place: NOTE [ Adopted inputs of a step ]).")


def _unlisted_optimizers(body):
    """``[(name, optimizer)]`` the step function reads (its globals and closure) that optimizers=
    lacks: their learning rate (and Adam's beta powers) reach the step as host values that change
    every step, which is what a changing op argument at an optimizer op usually is."""
    listed = {id(inner_optimizer(opt)) for opt in body.optimizers}
    found = {}
    for name, value in body._bindings.snapshot().items():
        inner = inner_optimizer(value)
        if inner is not None and id(inner) not in listed:
            found.setdefault(id(inner), (name, inner))
    return list(found.values())


def _unlisted_optimizers_hint(body):
    """A sentence naming the optimizers of _unlisted_optimizers, or ""."""
    missing = _unlisted_optimizers(body)
    if not missing:
        return ""
    return (f" The step uses {', '.join(f'{n} ({type(o).__name__})' for n, o in missing)}, which optimizers= does "
            "not list: autocudagraph_step feeds the learning rate of the listed optimizers only. Pass every "
            f"optimizer the step steps: add {', '.join(n for n, _ in missing)} to optimizers=[...].")


class StepCapture:
    """One capture of a step (NOTE [ The capture call of a step ])."""

    def __init__(self, body, backend, call, names, warm, last_inputs=None):
        self.body = body
        self.last_inputs = last_inputs or []  # weak references to the last warmup call's tensors
        self.backend = backend
        self.call = call
        self.names = names
        self.warm = warm
        self.on_gpu = backend.cpu_is_host
        self.schedulers = SchedulerWatch(body.optimizers)  # their state before the capture

    def run(self):
        body, backend = self.body, self.backend
        graphs = StepGraphs(backend=backend, pool=backend.new_pool(), grad_mode=body.slots.mode)
        place = _device_place(body.optimizers) if self.on_gpu else None
        graphs.moved_beta_pows = sum(move_beta_pows_to_device(o, place, self.on_gpu) for o in body.optimizers)
        # Unlisted optimizers the step steps are rolled back too: the capture is refused (their
        # learning rate changes), and the eager call that replaces it must not update twice.
        rolled_back = list(body.optimizers) + [opt for _, opt in _unlisted_optimizers(body)]
        rollback = Rollback(rolled_back, live_scalers(), roots=[body.fn]) if backend.replays_python else None
        # NOTE [ What a failed recording capture leaves ] in step/rollback.py
        grads = GradValues(step_params(rolled_back, roots=[body.fn]), recording=True) if rollback is None else None
        rng = state.rng_snapshot()
        # A recording capture changes no tensor, but its Python ran: the scalers' stages advanced.
        stages = [(scaler, scaler.python_state()) for scaler in live_scalers()]
        try:
            with traced_ops_held(backend):  # NOTE [ Traced entry points ] in guards/traced_ops.py: before any patch
                self._capture(graphs, rollback)
        except BaseException:
            if rollback is not None:
                rollback.restore()
                for feed in body._feeds:  # the rollback put the previous step's rate back
                    feed.forget()
            else:
                grads.restore()
                state.restore_rng(rng)
                self.schedulers.restore()
                for scaler, stage in stages:
                    scaler.set_python_state(stage)
            graphs.release()
            raise
        return graphs

    def _capture(self, graphs, rollback):
        body, call = self.body, self.call
        host = host_mask(call.tensors, on_gpu=self.on_gpu)
        static = StaticInputs(call.tensors, self.names, adopt=_adoptable(call.tensors, self.last_inputs, host),
                              host=host)
        watch = LayerWatch(values=rollback.buffers if rollback is not None else None)
        before = fingerprint(body.optimizers, with_grads=graphs.grad_mode != CLOSED)

        def on_step(opt):
            if not any(o is opt for o in body.optimizers):
                raise body.unlisted_error([opt])

        # NOTE [ One capture session ] in guards/session.py: the step's ops are traced on both backends
        # (its capture is checked against its last warmup step), and it draws in its own backward.
        writes = rollback.writes if rollback is not None else contextlib.nullcontext()
        session = CaptureSession(self.backend, watch, NO_WATCH, backward=True,
                                 trace={"on_gpu": self.on_gpu, "always": True, "inputs": static.buffers},
                                 guards=(_refuse_paddle_scaler(), watch_steps(on_step), tag_learning_rates(), writes))
        graphs.live = live = session.record
        body._feed(self.warm.stepped)
        graphs.graph = self.backend.new_graph(graphs.pool)
        reached = ArgumentGrads(static)
        try:
            outputs = session.capture(graphs.graph, self._step_body(session, static.buffers, watch,
                                                                      call.rebuild(static.buffers)),
                                      body.options.capture_hooks)
        finally:
            reached.remove()
        reached.refuse()
        self._check(live, before, watch, graphs)
        _refuse_written_copies(static, session.versionless)
        graphs.static_inputs = static
        graphs.in_place = len(static.adopted) + len(static.host) == len(static.buffers)
        graphs.static_outputs = list(outputs)
        graphs.detached = [o.detach() for o in graphs.static_outputs]
        graphs.stepped = self.warm.stepped
        graphs.feeds = tuple(feed for feed in body._feeds if id(feed.opt) in graphs.stepped)
        graphs.out_spec = live["spec"][0]
        graphs.out_aliases = live["aliases"]  # NOTE [ Outputs handed back as they are ] in io/output_aliases.py
        graphs.returned = ReturnedValues(graphs.out_spec, live["spec"][1], self.warm.consts, self.call)
        graphs.out_consts = graphs.returned.consts
        graphs.layers = _unique(watch.layers)
        graphs.trace = live["trace"] if self.backend.replays_python else None
        graphs.read_leaves = live["trace"].requiring_grad()  # NOTE [ Step replay checks ] in step/replay_checks.py
        graphs.bindings = body._bindings.snapshot()
        graphs.params = [(p, p.data_ptr()) for opt in body.optimizers for p in optimizer_params(opt)]
        body._after_host_run(live["record"])
        graphs.watched = list(body._between)
        graphs.checks = ReplayChecks(graphs, body._bindings)
        if self.backend.replays_python:  # NOTE [ The capture call of a step ]
            graphs.pending = unflatten(graphs.out_spec, graphs.handed_result(self.call.tensors), graphs.out_consts)

    def _step_body(self, session, buffers, watch, static_call):
        """The step the graph captures (and a simulated replay re-runs), each run recorded in the
        session's record; the optimizers whose rate Paddle would fill are the record's ``stepped``."""
        (args, kwargs), body, live = static_call, self.body, session.record
        stepped = live["stepped"] = set()

        def step_body():
            with body._scope(lambda opt: stepped.add(id(opt))) as record, session.function_run(), function_errors():
                out = body.fn(*args, **kwargs)
            tensors, consts, spec = flatten(out)
            kept = run_aliases(tensors, buffers, live, lambda: watch.layers)  # NOTE [ Outputs handed back as they are ]
            live.update(record=record, spec=(spec, consts))
            return contiguous_outputs(kept)  # NOTE [ Strided static outputs ] in io/static_inputs.py

        return step_body

    def _check(self, live, before, watch, graphs):
        body = self.body
        stepped = self.schedulers.stepped()
        if stepped:
            raise CaptureError(SchedulerWatch.message(stepped))
        new = [k for k, opt in enumerate(body.optimizers) if id(opt) in live["stepped"] - self.warm.stepped]
        if new:  # its rate was not fed before the capture
            raise CaptureError(
                f"autocudagraph_step: the capture step updates optimizers[{new[0]}] "
                f"({type(body.optimizers[new[0]]).__name__}), which the last warmup step of this key did not. A key "
                "must update the same optimizers on every call; give other phases their own key (e.g. a Python bool "
                "argument)."
            )
        trace = live["trace"]
        host = trace.host_inputs()
        if host:
            i, op, line = host[0]
            raise CaptureError(
                f"autocudagraph_step: op #{i} {op}{f' at {line}' if line else ''} reads a host (CPU) tensor inside the "
                "step. A graph reads host memory once, at capture. Keep the step's tensors on the device."
            )
        after = fingerprint(body.optimizers, with_grads=graphs.grad_mode != CLOSED)
        changes = describe_changes({**before, **watch.before}, {**after, **watch.after()})
        if changes:
            raise CaptureError(
                f"autocudagraph_step: the capture step created or replaced state: {changes}. A graph keeps using the "
                "tensors that existed at capture, so later steps would silently train stale ones. Create "
                "parameters and optimizer state before training, and update tensors in place."
            )
        diff = describe_trace_difference(self.warm.trace, trace, "last warmup step", "capture")
        if diff is not None:
            raise CHANGING_HOST_VALUE.error(
                f"autocudagraph_step: the step reads a host value that changes between steps: {diff}. A graph replays "
                "every op with its capture-time arguments, so later steps would silently reuse them. Pass such "
                "values as tensors (updated in place) or as arguments of the step (they become part of the key)."
                + _unlisted_optimizers_hint(body)
            )
        if live["record"].leaves_grads and graphs.grad_mode == CLOSED:
            raise CaptureError(
                "autocudagraph_step: the capture step left grads for the next call, but its warmup steps cleared them. "
                "A step must clear grads on every call or on none of a key's calls; give accumulation phases "
                "their own key (e.g. a Python bool argument)."
            )
        for value in live["spec"][1]:
            if holds_tensor(value):
                raise CaptureError(
                    f"autocudagraph_step: the step returns a {type(value).__name__} object holding tensors; it would be "
                    "returned as captured, with frozen values. Return tensors in a tuple, list or dict."
                )


def _adoptable(tensors, last_inputs, host):
    """Per tensor: was it the very same tensor in the last warmup call (NOTE [ Adopted inputs of a
    step ])? Host inputs are keyed by value and never adopted, nor is a non-contiguous tensor."""
    if len(last_inputs) != len(tensors):
        return None
    return [last_inputs[i]() is t and t.is_contiguous() and not (host and host[i]) for i, t in enumerate(tensors)]


def _device_place(optimizers):
    for opt in optimizers:
        for p in optimizer_params(opt):
            if p.place.is_gpu_place():
                return paddle.CUDAPlace(p.place.gpu_device_id())
    return None


def _unique(layers):
    seen, out = set(), []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out
