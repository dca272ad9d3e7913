"""Options, validated once, when the wrapper is made: OptionsCore (what every wrapper has: the
phase machine's options) and GraphOptions (autocudagraph's); StepOptions (step/graphed_step.py)
extends the same core."""

import dataclasses
import difflib
import inspect
from typing import Any, Callable, Optional, Sequence, Tuple

from .backends import BACKEND_NAMES, ENV_BACKEND

__all__ = ["OptionsCore", "GraphOptions", "BACKEND_NAMES", "ENV_BACKEND", "check_option_names", "check_key_fn",
           "call_key_fn"]


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name, value, minimum, hint, api="autocudagraph"):
    if not _is_int(value):
        raise TypeError(
            f"{api}: {name} must be an int, got {value!r} ({type(value).__name__}). "
            f"{hint}"
        )
    if value < minimum:
        raise ValueError(
            f"{api}: {name} must be >= {minimum}, got {value}. {hint}"
        )


def _check_bool(name, value, hint):
    if not isinstance(value, bool):
        raise TypeError(
            f"autocudagraph: {name} must be True or False, got {value!r} "
            f"({type(value).__name__}). {hint}"
        )


def check_option_names(who, given, valid):
    """Raises a TypeError naming the valid options and the nearest one for every name in
    ``given`` that is not in ``valid`` (a typo such as ``warmup=`` for ``warmup_steps=``)."""
    unknown = [name for name in given if name not in valid]
    if not unknown:
        return
    hints = []
    for name in unknown:
        near = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
        hints.append(f"'{name}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    raise TypeError(
        f"{who}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}. "
        f"Valid options: {', '.join(valid)}."
    )


_KEY_FN_HINT = (
    "It receives ONE argument, the call's inspect.BoundArguments (bound.arguments['x'] is the argument x, "
    "defaults applied), and returns a hashable key or None (run that call eagerly), e.g. "
    "dispatch_key_fn=lambda bound: bound.arguments['x'].shape[0]."
)


def check_key_fn(who, fn):
    """Checks a dispatch_key_fn at decoration: callable, and callable with one positional
    argument where its signature can be read (a builtin's may not: call_key_fn checks it then)."""
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"{who}: dispatch_key_fn must be callable or None, got {fn!r}. {_KEY_FN_HINT}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(
            f"{who}: dispatch_key_fn {getattr(fn, '__name__', type(fn).__name__)}{signature} cannot be called with one "
            f"argument. {_KEY_FN_HINT}"
        ) from None


def call_key_fn(who, fn, bound):
    """``fn(bound)``; a TypeError raised by the call itself (not inside ``fn``: a signature
    check_key_fn could not read) says what dispatch_key_fn receives."""
    try:
        return fn(bound)
    except TypeError as err:
        if err.__traceback__ is not None and err.__traceback__.tb_next is not None:
            raise  # raised inside the user's function: its own error
        raise TypeError(f"{who}: calling dispatch_key_fn {fn!r} failed: {err}. {_KEY_FN_HINT}") from err


@dataclasses.dataclass(frozen=True)
class OptionsCore:
    """The options of the phase machine (core/lifecycle.py), shared by every kind of wrapper.

    Attributes:
        warmup_steps: eager calls per key before the capture call (at least ``MIN_WARMUP``).
        max_graphs: keys that may be warming up or hold graphs at once; further keys run eagerly.
        dispatch_key_fn: ``fn(bound_arguments) -> hashable | None`` replacing the default key;
            None from it runs that call eagerly.
        backend: "cuda", "simulate", "eager" or None (cuda when the call's tensors are on a GPU
            of a CUDA build of Paddle, otherwise eager). The environment variable
            PADDLEFLEET_CUDAGRAPH_BACKEND overrides it.
        capture_hooks: context-manager factories entered around every capture.

    Class attributes (not options): ``API``, the name messages start with; ``MIN_WARMUP`` and
    ``WARMUP_HINT``; ``verify_replays``, ``max_bytes`` and ``eager_if_slower``, which the phase
    machine reads and a kind of wrapper without such options leaves off (GraphOptions makes them
    options).
    """

    warmup_steps: int = 1
    max_graphs: int = 8
    dispatch_key_fn: Optional[Callable[[Any], Any]] = None
    backend: Optional[str] = None
    capture_hooks: Tuple[Callable[[], Any], ...] = ()

    API = "autocudagraph"
    MIN_WARMUP = 0
    WARMUP_HINT = "Pass the number of eager calls before capture, e.g. warmup_steps=1."
    verify_replays = 0
    max_bytes = None
    eager_if_slower = False

    def __post_init__(self):
        api = self.API
        _check_int("warmup_steps", self.warmup_steps, self.MIN_WARMUP, self.WARMUP_HINT, api)
        _check_int("max_graphs", self.max_graphs, 0,
                   "Pass how many keys may hold graphs, e.g. max_graphs=8 (0 runs every call eagerly).", api)
        check_key_fn(api, self.dispatch_key_fn)
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(
                f"{api}: backend must be one of {BACKEND_NAMES} or None, got {self.backend!r}. "
                "Use backend=None to pick cuda on a GPU and eager elsewhere."
            )
        hooks = self.capture_hooks
        if hooks is None:
            hooks = ()
        if callable(hooks) or not isinstance(hooks, Sequence):
            raise TypeError(
                f"{api}: capture_hooks must be a list of context-manager factories, got {hooks!r}. "
                "Wrap a single factory in a list: capture_hooks=[my_capture_context]."
            )
        for hook in hooks:
            if not callable(hook):
                raise TypeError(
                    f"{api}: every capture_hooks entry must be callable and return a context manager, "
                    f"got {hook!r}. Pass the factory (e.g. allreduce.capture), not its result."
                )
        object.__setattr__(self, "capture_hooks", tuple(hooks))


@dataclasses.dataclass(frozen=True)
class GraphOptions(OptionsCore):
    """Options of one autocudagraph wrapper: OptionsCore's (warmup_steps, 0 allowed; max_graphs,
    dispatch_key_fn, backend, capture_hooks) and:

    Attributes:
        clone_outputs: return copies of the static output buffers (True) or the buffers themselves.
        clone_param_grads: "auto" (default): hand parameter grads back as aliases of the static
            grad buffers, copying only where a later replay could overwrite a tensor someone
            still holds (a grad autograd adopted as ``p.grad``, a parameter whose gradient hooks
            may keep the grad: NOTE [ Grad hand-out ] in grads/hand_out_plan.py); True: always copies;
            False: always aliases (a hook that keeps a grad sees the next replay's values).
            Grads of inputs are always copies.
        accumulate_in_graph: the backward graph adds each parameter's grad into a persistent
            accumulator (``p.main_grad`` where Fleet keeps one, else ``p.grad``) and parameters
            leave the autograd bridge: the fastest path; their gradient hooks no longer run
            (NOTE [ Accumulation inside the graph ] in grads/accumulate.py says what to keep).
        verify_replays: compare the first N replays of each key with an eager re-run.
        max_bytes: optional budget for the static buffers of all keys; least recently used keys
            are evicted beyond it.
        max_inflight: forwards of one key whose backward may be pending at once (pipeline
            parallel: micro-batches in flight); each has its own static buffers and graphs, a
            *slot*, captured when first needed (NOTE [ Slots ] in block/slots.py). Further
            forwards of the key run eagerly until a backward has run. 1: one forward in flight.
        check_stale_outputs: with clone_outputs=False, raise when an output is used after a later
            replay overwrote it.
        chain_calls: let consecutive graphed calls that each take the previous one's output
            (``h = layer(h)`` per graphed layer) be replayed as one chain through one autograd
            bridge (NOTE [ Chains of graphed calls ] in chains/chain.py); False: every call alone.
        eager_if_slower: a key whose graphed calls cost more host time than its eager calls
            (lower quartiles of 8 timed eager forward calls before its capture and of its replays,
            NOTE [ Graphed calls that cannot pay ] in core/host_cost.py) runs eagerly from then on;
            False keeps it graphed (the numbers are still in explain(), and a slower key still warns
            once). Where calls are timed (a GPU), a key warms up for at least 8 calls (eager
            samples, then ``warmup_steps`` warmup calls) before its capture.
    """

    clone_outputs: bool = True
    clone_param_grads: Any = "auto"
    accumulate_in_graph: bool = False
    verify_replays: int = 0
    max_bytes: Optional[int] = None
    check_stale_outputs: bool = False
    max_inflight: int = 4
    chain_calls: bool = True
    eager_if_slower: bool = True

    def __post_init__(self):
        super().__post_init__()
        _check_bool("clone_outputs", self.clone_outputs,
                    "clone_outputs=False returns static buffers that the next replay overwrites.")
        if not (self.clone_param_grads is True or self.clone_param_grads is False or self.clone_param_grads == "auto"):
            raise TypeError(
                f"autocudagraph: clone_param_grads must be True, False or 'auto', got {self.clone_param_grads!r} "
                f"({type(self.clone_param_grads).__name__}). 'auto' (the default) copies a parameter grad only "
                "where a later replay could overwrite a tensor someone still holds; False is safe only when "
                "grads are consumed before the next backward replay."
            )
        _check_bool("accumulate_in_graph", self.accumulate_in_graph,
                    "accumulate_in_graph=True adds grads into p.main_grad / p.grad inside the graph.")
        _check_bool("check_stale_outputs", self.check_stale_outputs,
                    "Pass check_stale_outputs=True to detect reads of overwritten outputs.")
        _check_bool("eager_if_slower", self.eager_if_slower,
                    "eager_if_slower=False keeps a key graphed even where its graphed calls were measured slower.")
        _check_bool("chain_calls", self.chain_calls,
                    "chain_calls=False replays every graphed call through a bridge of its own.")
        _check_int("verify_replays", self.verify_replays, 0,
                   "Pass how many replays per key to compare with eager, e.g. verify_replays=2.")
        if self.max_bytes is not None:
            _check_int("max_bytes", self.max_bytes, 1,
                       "Pass a byte budget for static buffers, e.g. max_bytes=2**30, or None for no budget.")
        _check_int("max_inflight", self.max_inflight, 1,
                   "Pass how many forwards of one key may wait for their backward at once, e.g. max_inflight=4 "
                   "(the micro-batches a pipeline stage has in flight; 1 keeps one forward in flight).")
        if self.check_stale_outputs and self.clone_outputs:
            raise ValueError(
                "autocudagraph: check_stale_outputs=True needs clone_outputs=False (cloned outputs are never "
                "overwritten). Pass clone_outputs=False, or drop check_stale_outputs."
            )
