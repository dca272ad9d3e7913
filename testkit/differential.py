"""The differential checker: an eager twin and a graphed twin trained side by side, every piece of
state reachable from their models, optimizers, scalers and schedulers compared bit for bit after
every step, the first difference named.

A test builds the same training set-up twice (same seed), graphs one of them, and lets
``differential_run`` drive both::

    def build():
        paddle.seed(0)
        model = Net()
        opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=sched)
        def step(x):
            loss = model(x).mean(); loss.backward(); opt.step(); opt.clear_grad()
            return loss
        return Trainee(step, {"model": model, "opt": opt, "sched": sched})

    differential_run(build, batches, graph=lambda t: autocudagraph_step(t.step, optimizers=[t.objects["opt"]]))

What is compared (``state_of``):
- a Layer: every parameter (value, grad or None, ``main_grad`` where set, stop_gradient), every
  buffer, each sublayer's ``training`` flag;
- an optimizer (Fleet's wrappers unwrapped): every accumulator (moments, beta powers, ...) and
  master weight, keyed by the parameter's position (the twins' parameter names differ), the learning
  rate it would use now (``get_lr()``) and its scheduler's state;
- an object with ``state_dict()`` (a grad scaler, an LR scheduler): its state dict, plus the tensors
  held directly in its attributes (a scaler's found-inf flag);
- a tensor, or a callable returning a nest of tensors and Python values: that value.
"""

import dataclasses
from typing import Any, Callable, Dict, Optional

import numpy as np
import paddle

from paddlefleet.cudagraph import autocudagraph_step

from .common import RECORD, bitwise_failures

__all__ = ["StateMismatch", "Trainee", "assert_same_state", "differential_run", "state_of", "step_grapher"]


class StateMismatch(AssertionError):
    """The graphed twin's state differs from the eager twin's; the message names the first
    difference and counts the rest."""


@dataclasses.dataclass
class Trainee:
    """One twin: ``step(*batch)`` runs one training step and returns what the step returns;
    ``objects`` names everything whose state is compared (Layers, optimizers, scalers, schedulers,
    tensors, callables returning extra state)."""

    step: Callable[..., Any]
    objects: Dict[str, Any]


# ----------------------------------------------------------------------------- snapshots
def _leaf(value):
    if isinstance(value, paddle.Tensor):
        return np.array(value.numpy(), copy=True) if value._is_initialized() else "<uninitialized>"
    return value


def _layer_state(layer, out, prefix):
    for i, (name, p) in enumerate(layer.named_parameters()):
        where = f"{prefix}.param[{i} {name}]"
        out[where] = _leaf(p)
        out[f"{where}.grad"] = None if p.grad is None else _leaf(p.grad)
        main_grad = getattr(p, "main_grad", None)
        if main_grad is not None:
            out[f"{where}.main_grad"] = _leaf(main_grad)
        out[f"{where}.stop_gradient"] = bool(p.stop_gradient)
    for name, b in layer.named_buffers():
        out[f"{prefix}.buffer[{name}]"] = _leaf(b)
    for name, sub in layer.named_sublayers(include_self=True):
        out[f"{prefix}.training[{name or '.'}]"] = bool(sub.training)


def _inner(opt):
    seen = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        for attr in ("_inner_opt", "_optim", "_optimizer"):
            nested = getattr(opt, attr, None)
            if isinstance(nested, paddle.optimizer.Optimizer) or hasattr(nested, "_accumulators"):
                opt = nested
                break
        else:
            return opt
    return opt


def _optimizer_params(opt):
    groups = getattr(opt, "_param_groups", None) or opt._parameter_list or []
    params = []
    for entry in groups:
        if isinstance(entry, dict):
            params.extend(entry["params"])
        else:
            params.append(entry)
    return params


def _optimizer_state(opt, out, prefix):
    opt = _inner(opt)
    params = _optimizer_params(opt)
    index = {p.name: i for i, p in enumerate(params)}
    for acc_name, by_param in sorted(getattr(opt, "_accumulators", {}).items()):
        for pname, tensor in sorted(by_param.items(), key=lambda kv: index.get(kv[0], -1)):
            out[f"{prefix}.{acc_name}[param {index.get(pname, pname)}]"] = _leaf(tensor)
    for pname, tensor in sorted(getattr(opt, "_master_weights", {}).items(), key=lambda kv: index.get(kv[0], -1)):
        out[f"{prefix}.master_weight[param {index.get(pname, pname)}]"] = _leaf(tensor)
    out[f"{prefix}.lr"] = float(opt.get_lr())
    sched = opt._learning_rate
    if isinstance(sched, paddle.optimizer.lr.LRScheduler):
        _nest(sched.state_dict(), out, f"{prefix}.scheduler")


def _nest(value, out, prefix):
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _nest(value[k], out, f"{prefix}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _nest(v, out, f"{prefix}[{i}]")
    else:
        out[prefix] = _leaf(value)


def _object_state(obj, out, prefix):
    if hasattr(obj, "state_dict"):
        _nest(obj.state_dict(), out, f"{prefix}.state_dict")
    for attr, value in sorted(vars(obj).items()):
        if isinstance(value, paddle.Tensor):
            out[f"{prefix}.{attr}"] = _leaf(value)


def state_of(objects):
    """A flat ``{path: numpy array or Python value}`` of everything ``objects`` (a name -> object
    dict) holds; see the module docstring for what each kind of object contributes."""
    out = {}
    for name, obj in objects.items():
        if isinstance(obj, paddle.nn.Layer):
            _layer_state(obj, out, name)
        elif isinstance(obj, paddle.optimizer.Optimizer) or hasattr(obj, "_accumulators"):
            _optimizer_state(obj, out, name)
        elif isinstance(obj, paddle.Tensor):
            out[name] = _leaf(obj)
        elif callable(obj) and not hasattr(obj, "state_dict"):
            _nest(obj(), out, name)
        else:
            _object_state(obj, out, name)
    return out


# ----------------------------------------------------------------------------- comparison
def assert_same_state(graphed, eager, where="state"):
    """Raises StateMismatch naming the first path whose value differs (bit for bit; None only
    equals None; a path present on one side only counts as a difference)."""
    if set(graphed) != set(eager):
        only_g, only_e = sorted(set(graphed) - set(eager)), sorted(set(eager) - set(graphed))
        raise StateMismatch(f"{where}: graphed-only {only_g[:3]}, eager-only {only_e[:3]}")
    failures = []
    for path in eager:
        g, e = graphed[path], eager[path]
        if isinstance(e, np.ndarray) or isinstance(g, np.ndarray):
            _, f = bitwise_failures(g, e, path)
        elif isinstance(e, float) and isinstance(g, float):
            f = [] if np.float64(g).tobytes() == np.float64(e).tobytes() else [f"{path}: {g!r} != eager {e!r}"]
        else:
            f = [] if g == e and type(g) is type(e) else [f"{path}: {g!r} != eager {e!r}"]
        failures += f
    if failures:
        more = f" ({len(failures) - 1} more differences)" if len(failures) > 1 else ""
        raise StateMismatch(f"{where}: {failures[0]}{more}")
    RECORD.compared += len(eager)


def differential_run(build: Callable[[], Trainee], batches, graph: Callable[[Trainee], Callable[..., Any]],
                     compare_outputs: bool = True, after_step: Optional[Callable[[int, Trainee, Trainee], None]] = None):
    """Builds an eager twin and a graphed twin, runs one step of each per batch (interleaved:
    eager step i, graphed step i; a batch is a tuple of arguments or one argument) and after
    every step compares their outputs and ``state_of`` their
    objects bit for bit, raising StateMismatch at the first difference. ``graph(trainee)`` returns
    the graphed step function; ``after_step(i, eager, graphed)`` runs after each comparison (a
    scheduler step, a test's own checks). Returns ``(eager, graphed)`` for further checks."""
    eager, graphed = build(), build()
    assert_same_state(state_of(graphed.objects), state_of(eager.objects), "before step 0")
    graphed_step = graph(graphed)
    for i, batch in enumerate(batches):
        args = batch if isinstance(batch, tuple) else (batch,)
        out_e = eager.step(*args)
        out_g = graphed_step(*args)
        if compare_outputs:
            compared, failures = bitwise_failures(out_g, out_e, f"step {i} output")
            if failures:
                raise StateMismatch(failures[0] + (f" ({len(failures) - 1} more)" if len(failures) > 1 else ""))
            RECORD.compared += compared
        assert_same_state(state_of(graphed.objects), state_of(eager.objects), f"after step {i}")
        if after_step is not None:
            after_step(i, eager, graphed)
    return eager, graphed


def step_grapher(wrappers, **options):
    """A ``graph`` for ``differential_run``: ``autocudagraph_step(trainee.step, **options)`` with the
    trainee's optimizer ``objects["opt"]`` (none if it has none); the wrapper is appended to
    ``wrappers`` for the test's counters."""

    def graph(trainee):
        opt = trainee.objects.get("opt")
        wrappers.append(autocudagraph_step(trainee.step, optimizers=[] if opt is None else [opt], **options))
        return wrappers[-1]

    return graph
