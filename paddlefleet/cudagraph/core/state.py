"""Global state saved and restored around warmup and capture, and the parts of it that key a
call: AMP autocast, RNG (default generator and Fleet's model-parallel tracker), Layer buffers.

Everything here flips global state only inside try/finally (context managers).
"""

import contextlib

import paddle

from ..backends.paddle_patches import Patches

__all__ = ["amp_state", "rng_snapshot", "restore_rng", "preserved_rng", "written_in_place", "BufferSnapshot", "SlotWatch",
           "RngRewindGuard", "RecordingRngGuard", "generator_state_indices"]


_dygraph_tracer = paddle.base.framework._dygraph_tracer  # read on every call's key: looked up once


def amp_state():
    """The autocast state that changes what a call computes: ``(level, dtype)``, or None when
    Paddle exposes no tracer state. On a CPU build auto_cast is a no-op and this stays O0."""
    tracer = _dygraph_tracer()
    if tracer is None:
        return None
    # Raw (hashable) values: str() of the level enum costs ~15 us per call; the enum itself hashes
    # and compares slowly (NOTE [ Cheap key parts ] in core/keys.py), so the level is its int.
    return (_enum_int(getattr(tracer, "_amp_level", None)), getattr(tracer, "_amp_dtype", None))


def _enum_int(value):
    """A pybind enum value as its int (injective within its enum), anything else as itself."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _tracker():
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
    except ImportError:  # pragma: no cover - Paddle without fleet
        return None
    try:
        return get_rng_state_tracker()
    except Exception:  # pragma: no cover - tracker not initialised in this process
        return None


def rng_snapshot():
    """Snapshot of the default generator and of every state in Fleet's RNG tracker."""
    tracker = _tracker()
    tracked = None
    if tracker is not None and getattr(tracker, "states_", None):
        tracked = tracker.get_states_tracker()
    return paddle.get_rng_state(), tracked


def restore_rng(snapshot):
    """Puts back a snapshot taken by rng_snapshot(); the snapshot stays valid, so it can be
    restored again (NOTE [ Restoring the tracker ])."""
    default, tracked = snapshot
    paddle.set_rng_state(default)
    if tracked is not None:
        # NOTE [ Restoring the tracker ]
        # Paddle 2.6's RNGStatesTracker keeps GeneratorState values in a dict, and
        # set_states_tracker(states) makes ``states`` that dict: every later rng_state(name)
        # block writes its advanced state into it. Handing it our snapshot's dict would let
        # the next tracker use overwrite the snapshot, and a second restore (verify_replays
        # restores the state before a call twice on a mismatch) would put back the advanced
        # states: silently different dropout masks than eager. Paddle 3.x keeps states by
        # index and copies them out of the dict. A fresh dict each time is right for both.
        # The GeneratorState objects themselves are values: get_state() returns a copy and
        # set_state() copies in (phi::Generator, both versions), so sharing them is safe.
        _tracker().set_states_tracker(dict(tracked))


@contextlib.contextmanager
def preserved_rng():
    """Runs the block and then restores every RNG state it consumed."""
    snapshot = rng_snapshot()
    try:
        yield
    finally:
        restore_rng(snapshot)


def written_in_place(layer):
    """``[(name, tensor)]`` of what a forward may write in place: the initialised buffers and the
    non-trainable parameters (BatchNorm keeps its running statistics in stop_gradient parameters,
    not in buffers) of ``layer`` and its sublayers."""
    frozen = [(n, p) for n, p in layer.named_parameters() if p.stop_gradient]
    return [(n, t) for n, t in list(layer.named_buffers()) + frozen if t._is_initialized()]


class BufferSnapshot:
    """Copies of what a forward may write in place - the buffers and the non-trainable
    parameters of some Layers (BatchNorm keeps its running statistics in parameters with
    stop_gradient=True, not in buffers) - put back by restore(), so that capture runs leave no
    trace.

    Args:
        enabled: False makes add() and restore() no-ops. A backend whose capture only records
            kernels (cuda) changes nothing during capture, and a copy taken inside the capture
            would be recorded, not made: restore() would then write garbage.
    """

    def __init__(self, enabled=True):
        self._saved = {}
        self._enabled = enabled

    def add(self, layer):
        if not self._enabled:
            return
        with paddle.no_grad():
            for _, buf in written_in_place(layer):
                if id(buf) not in self._saved:
                    self._saved[id(buf)] = (buf, buf.clone())

    def restore(self):
        # copy_ keeps the inplace version: a paddle.assign(output=) bump made the caller's
        # backward through the same BatchNorm (used before, or twice) fail with "modified by an
        # inplace operation".
        with paddle.no_grad():
            for buf, copy in self._saved.values():
                buf.copy_(copy, False)
        self._saved = {}


class SlotWatch:
    """Which tensor each buffer and parameter slot of some Layers holds, to refuse a capture
    whose function rebinds one (``self.steps = self.steps + 1``): a graph keeps reading and
    writing the tensor it captured, so the Layer would never see the new one."""

    def __init__(self):
        self._slots = {}

    def add(self, layer):
        for kind in ("_buffers", "_parameters"):
            for name, t in getattr(layer, kind, {}).items():
                self._slots.setdefault((id(layer), kind, name), (layer, kind, name, t))

    def check(self):
        """Raises CaptureError naming the first slot that holds another tensor than before, after
        putting the original tensors back (the capture run's rebinding leaves no trace)."""
        changed = [(layer, kind, name, t) for layer, kind, name, t in self._slots.values()
                   if getattr(layer, kind).get(name) is not t]
        for layer, kind, name, t in changed:
            getattr(layer, kind)[name] = t
        if changed:
            from ..errors import CaptureError

            layer, kind, name, _ = changed[0]
            what = "buffer" if kind == "_buffers" else "parameter"
            raise CaptureError(
                f"autocudagraph: the function rebinds {what} '{name}' of {type(layer).__name__} to a new "
                "tensor (e.g. self.x = self.x + 1). A graph keeps using the tensor it captured, so the "
                f"Layer would never see the update. Update it in place instead (paddle.assign(new, "
                f"output=self.{name}) or self.{name}.set_value(new))."
            )


# Random kernels whose seed and offset a CUDA graph bakes at capture (Paddle's _C_ops names).
_RANDOM_OPS = ("dropout", "dropout_", "uniform", "uniform_inplace", "uniform_inplace_", "gaussian",
               "gaussian_inplace", "gaussian_inplace_", "bernoulli", "randint", "randperm", "multinomial",
               "truncated_gaussian_random", "exponential_", "fused_dropout_add", "rrelu")


class RngRewindGuard:
    """Refuses a backward capture that rewinds the RNG and then draws random numbers.

    NOTE [ Recompute under CUDA graphs ]
    Reentrant recompute restores the forward's RNG state in its backward and re-runs the block,
    so its dropout draws the forward's masks again. A CUDA graph bakes each random kernel's seed
    and offset at capture, and on every later replay Paddle advances the generator once per
    captured random kernel: the recomputed dropout would no longer see the forward's masks,
    and the grads would be silently wrong. So on a backend whose capture only records (cuda),
    a backward capture that sets the RNG state and then launches a random kernel fails
    (CaptureError; the key runs eagerly). Recompute without random ops is unaffected.
    """

    def __init__(self):
        self.rewound = False
        self.random_after_rewind = None
        self._patches = Patches()  # NOTE [ Paddle patches ] in backends/paddle_patches.py

    def __enter__(self):
        guard = self
        tracker = _tracker()

        def flag_rewind(owner, name):
            original = getattr(owner, name)

            def rewinding(*args, **kwargs):
                guard.rewound = True
                return original(*args, **kwargs)

            self._patches.set(owner, name, rewinding)

        def flag_random(name):
            original = getattr(paddle._C_ops, name)

            def drawing(*args, **kwargs):
                if guard.rewound and guard.random_after_rewind is None:
                    guard.random_after_rewind = name
                return original(*args, **kwargs)

            self._patches.set(paddle._C_ops, name, drawing)

        try:
            for name in ("set_rng_state", "set_cuda_rng_state"):
                if hasattr(paddle, name):
                    flag_rewind(paddle, name)
            if tracker is not None and hasattr(tracker, "set_states_tracker"):
                flag_rewind(tracker, "set_states_tracker")
            for name in _RANDOM_OPS:
                if hasattr(paddle._C_ops, name):
                    flag_random(name)
        except BaseException:
            self._patches.restore()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self._patches.restore()
        return False

    def check(self):
        """Raises CaptureError when the guarded block rewound the RNG and then drew from it."""
        if self.random_after_rewind is not None:
            from ..errors import CaptureError

            raise CaptureError(
                f"autocudagraph: the backward rewinds the RNG state and then runs the random kernel "
                f"'{self.random_after_rewind}' (reentrant recompute with dropout). A CUDA graph would "
                "replay that kernel with a new offset instead of the forward's, giving wrong grads. "
                "Graph the blocks inside the recompute instead of around it, or disable dropout there."
            )


def _patch_random_ops(patches, note):
    """Replaces every random ``_C_ops`` kernel through ``patches`` so that ``note(name)`` runs before
    each call (all restored, none left, when one replacement fails)."""

    def patch(name):
        original = getattr(paddle._C_ops, name)

        def drawing(*args, **kwargs):
            note(name)
            return original(*args, **kwargs)

        patches.set(paddle._C_ops, name, drawing)

    try:
        for name in _RANDOM_OPS:
            if hasattr(paddle._C_ops, name):
                patch(name)
    except BaseException:
        patches.restore()
        raise


# The random kernels whose seed and offset Paddle patches before every replay but the first
# (phi's CUDAGraphNodeLauncher parameter setters: dropout's forward and fused_dropout_add; the
# same three kernels in Paddle 2.6.2's GPU build and in 3.x's sources).
_RESEEDED_OPS = ("dropout", "dropout_", "fused_dropout_add")


def generator_state_indices():
    """True where Paddle's generators keep several states and switch between them by index
    (``Generator.get_state_index``, Paddle 3.x); Paddle 2.6 has one state per generator."""
    try:
        from paddle.base import core
    except ImportError:  # pragma: no cover - Paddle without paddle.base
        return False
    return hasattr(core.default_cpu_generator(), "get_state_index")


def _current_seeds():
    """The seed of the current state of each generator of the current place."""
    return tuple(s.current_seed() for s in paddle.get_rng_state())


class RecordingRngGuard:
    """Refuses a recording capture (cuda) whose random kernels a replay would not redraw as
    eager does.

    NOTE [ Random kernels under a recording capture ]
    A CUDA graph bakes each kernel's arguments at capture. Paddle re-seeds only dropout and
    fused_dropout_add on replay: before every replay but the first, a host hook calls the
    generator's IncrementOffset and patches the kernel's seed and offset. Two cases are then
    silently wrong, and the capture fails (CaptureError; the key runs eagerly):

    * any other random kernel (uniform, gaussian, bernoulli, randint, ...) replays the capture's
      numbers on every call, where eager draws new ones (every Paddle);
    * a re-seeded kernel drawn under another generator state than the one current when the
      capture began - inside a Fleet tracker ``rng_state(name)`` block in the function - on a
      Paddle without generator state indices (2.6). 2.6's tracker swaps state *values* in and
      out of the one CUDA generator, and the hook advances whatever state is current at replay,
      i.e. the caller's: the replayed mask comes from the default stream and the tracker's
      state never advances. Paddle 3.x keeps tracker states by index and the hook switches to
      the captured index first (the cuda backend then puts the caller's index back, NOTE
      [ Generator state index after replay ] in backends/cuda.py). A call made inside a
      tracker block captures and replays under the tracker's state on both: not refused.

    Args:
        enabled: False makes the guard a no-op (a capture that executes, simulate).
        state_indices: whether the generators keep states by index; None detects it.
    """

    def __init__(self, enabled=True, state_indices=None):
        self.enabled = enabled
        self.state_indices = generator_state_indices() if state_indices is None else state_indices
        self.problem = None
        self._start = None
        self._patches = Patches()  # NOTE [ Paddle patches ] in backends/paddle_patches.py

    def __enter__(self):
        if not self.enabled:
            return self
        self._start = None if self.state_indices else _current_seeds()
        _patch_random_ops(self._patches, self._note)
        return self

    def _note(self, name):
        if self.problem is None:
            if name not in _RESEEDED_OPS:
                self.problem = (name, "frozen")
            elif self._start is not None and _current_seeds() != self._start:
                self.problem = (name, "foreign state")

    def __exit__(self, exc_type, exc, tb):
        self._patches.restore()
        return False

    def check(self):
        """Raises CaptureError naming the first random kernel a replay would get wrong."""
        if self.problem is None:
            return
        from ..errors import CaptureError

        name, kind = self.problem
        if kind == "frozen":
            raise CaptureError(
                f"autocudagraph: the function runs the random kernel '{name}', which Paddle does not "
                "re-seed when a CUDA graph replays (only dropout and fused_dropout_add are): every replay "
                "would repeat the capture's random numbers. Draw them outside the graphed function and "
                "pass them in, or use dropout."
            )
        raise CaptureError(
            f"autocudagraph: the function runs the random kernel '{name}' under another RNG state than "
            "the caller's (a Fleet tracker rng_state(name) block inside it), and this Paddle has no "
            "generator state indices (Generator.get_state_index): a replay would draw from the caller's "
            "state instead, giving other masks than eager. Graph the code inside the rng_state block, "
            "call the graphed function inside the block, or use a Paddle with generator state indices (3.x)."
        )
