"""Whether a capture drew random numbers a replay would get wrong, decided from the generators' state.

NOTE [ Random draws seen from generator state ]
A CUDA graph bakes each kernel's arguments at capture, a random kernel's seed and offset
included. Whether a capture drew random numbers is read from Paddle's generators, never from a
list of op names: Paddle's default CPU generator and each CUDA generator are read before and
after every Paddle op of the capture (``paddle._C_ops`` and ``_legacy_C_ops``) - the seed and
offset of the state current on each (the state index's, where generators keep several), and
for the CPU generator, whose kernels advance an engine the state's fields do not show, the
engine's next number (read from a copy; the generator is put back). An op across which any of
them changed drew random numbers; so did any change between two ops that no RNG setter made
(``paddle.seed`` inside the function, a draw outside Python's reach). Every draw is refused
(``CaptureError``: the key runs eagerly), unless it is one Paddle re-seeds on replay:

* ``dropout``, ``dropout_`` and ``fused_dropout_add`` (phi's CUDAGraphNodeLauncher parameter
  setters; the same three in Paddle 2.6.2's GPU build and in 3.x): before every replay but the
  first, a host hook advances the generator's offset and patches the kernel's seed and offset;
* provided it is drawn under the state that was current when the capture began, or the
  generators keep states by index (``Generator.get_state_index``, Paddle 3.x). Paddle 2.6's
  Fleet tracker swaps state *values* in and out of the one generator, and the hook advances
  whatever state is current at replay, i.e. the caller's: a dropout inside a tracker
  ``rng_state(name)`` block in the function would replay from the default stream. 3.x keeps
  tracker states by index and the hook switches to the captured index first (the cuda backend
  then puts the caller's index back, NOTE [ Generator state index after replay ] in
  backends/cuda.py).

Everything else (``paddle.rand``, ``F.gumbel_softmax``, ``paddle.poisson``, ``Tensor.random_``,
binomial, standard_gamma, dirichlet, a kernel added by a later Paddle) would replay the
capture's numbers forever. The check runs during every capture on every backend, and every
refusal here applies on every backend: the simulated backend, whose replays re-run the function,
would draw eager's numbers, but a CPU run must refuse what a GPU refuses. The reading costs a
few microseconds per op, at capture only.

A forward that sets the RNG state back to one it drew from and draws again (R-Drop:
``get_rng_state(); dropout; set_rng_state(); dropout``; a hand-written recompute) is refused alike,
whatever the kernel: a replay re-seeds the second dropout with a new offset instead of the state
set, so the two masks would differ where eager's are equal. Each draw's starting reading is kept;
a draw after an RNG setter that starts from one of them is that case (a Fleet tracker's
``rng_state(name)`` block, which sets its own state and then the caller's back, draws from new
states only).

NOTE [ Recompute under CUDA graphs ]
Reentrant recompute restores the forward's RNG state in its backward and re-runs the block, so
its dropout draws the forward's masks again. A captured random kernel advances the generator
on replay instead of rewinding it: the recomputed dropout would not see the forward's masks and
the grads would be silently wrong. So a backward capture that sets the RNG state
(``paddle.set_rng_state``, ``set_cuda_rng_state``, the tracker's ``set_states_tracker``) and
then draws is refused, whatever the kernel, on every backend (the simulated backend, which
re-runs the recompute at every replay and would get it right, refuses it as a GPU must).
"""

import paddle

from .location import user_call_site
from .paddle_patches import Patches
from .refusals import RANDOM_KERNEL, RECOMPUTE_DROPOUT, RNG_REWOUND, TRACKER_DROPOUT

__all__ = ["DrawGuard", "generator_state_indices", "RESEEDED_OPS"]

# The random kernels whose seed and offset Paddle patches before every replay but the first.
RESEEDED_OPS = frozenset(("dropout", "dropout_", "fused_dropout_add"))

_OP_MODULES = []  # [(module, [names of its public callables])], listed once (dir() is slow)


def _op_modules():
    if not _OP_MODULES:
        for module in (paddle._C_ops, getattr(paddle, "_legacy_C_ops", None)):
            if module is not None:
                names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
                _OP_MODULES.append((module, names))
    return _OP_MODULES


def _core():
    from paddle.base import core

    return core


def generator_state_indices():
    """True where Paddle's generators keep several states and switch between them by index
    (``Generator.get_state_index``, Paddle 3.x); Paddle 2.6 has one state per generator."""
    try:
        core = _core()
    except ImportError:  # pragma: no cover - Paddle without paddle.base
        return False
    return hasattr(core.default_cpu_generator(), "get_state_index")


def generators():
    """``[(label, generator, is_cpu)]``: Paddle's default CPU generator and each CUDA generator."""
    core = _core()
    found = [("the CPU generator", core.default_cpu_generator(), True)]
    if paddle.is_compiled_with_cuda():
        for i in range(core.get_cuda_device_count()):
            found.append((f"the generator of gpu:{i}", core.default_cuda_generator(i), False))
    return found


def _fields(state):
    """``(device, seed, offset)`` of a GeneratorState where Paddle exposes them, else the seed."""
    getter = getattr(state, "__getstate__", None)
    if getter is not None:
        try:
            return tuple(getter())
        except TypeError:  # pragma: no cover - a state without pickling support
            pass
    return (state.current_seed(),)


def _reading(generator, is_cpu):
    """What one generator's current state shows: its index (or None), its fields and, for a
    CPU generator, the engine's next number (drawn from the state and then put back)."""
    index = generator.get_state_index() if hasattr(generator, "get_state_index") else None
    state = generator.get_state()
    if not is_cpu:
        return index, _fields(state), None
    try:
        probe = generator.random()
    finally:
        generator.set_state(state)
    return index, _fields(state), probe


def _current_seeds():
    """The seed of the current state of each generator of the current place."""
    return tuple(s.current_seed() for s in paddle.get_rng_state())


class DrawGuard:
    """Watches a capture (on every backend) for random draws a replay would get wrong (NOTE [ Random draws
    seen from generator state ]); ``check()`` raises CaptureError naming the first.

    Args:
        enabled: False makes the guard a no-op.
        backward: refuse a draw after an RNG setter whatever the kernel (NOTE [ Recompute under
            CUDA graphs ]): a backward, or a whole step.
        state_indices: whether the generators keep states by index; None detects it.
    """

    def __init__(self, enabled=True, backward=False, state_indices=None):
        self.enabled = enabled
        self.backward = backward
        self.state_indices = generator_state_indices() if state_indices is None else state_indices
        self.problem = None  # (kind, what, where)
        self.rewound = False
        self._patches = Patches()  # NOTE [ Paddle patches ] in guards/paddle_patches.py
        self._gens = None
        self._last = None
        self._start_seeds = None
        self._depth = 0
        self._drawn_from = []  # the readings each draw started from

    # ----------------------------------------------------------------- readings
    def _read(self):
        return tuple(_reading(g, cpu) for _, g, cpu in self._gens)

    def _changed(self, before, after):
        """The label of the first generator whose state changed between two readings of one
        state index each, or None (a switch of state index alone is no draw)."""
        for (label, _, _), b, a in zip(self._gens, before, after):
            if b[0] == a[0] and b != a:
                return label
        return None

    def _note(self, kind, what):
        if self.problem is None:
            self.problem = (kind, what, user_call_site())

    # ----------------------------------------------------------------- patches
    def _wrap_op(self, name, original):
        guard = self

        def watched(*args, **kwargs):
            if guard._depth:
                return original(*args, **kwargs)
            before = guard._read()
            gap = guard._changed(guard._last, before)
            if gap is not None:
                guard._note("outside", gap)
            guard._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                guard._depth -= 1
                after = guard._read()
                guard._last = after
                if guard._changed(before, after) is not None:
                    guard._drew(name, before)

        return watched

    def _drew(self, name, before):
        again = self.rewound and before in self._drawn_from  # a state drawn from before, set again
        self._drawn_from.append(before)
        if (self.backward and self.rewound) or again:
            self._note("after rewind", name)
        elif name not in RESEEDED_OPS:
            self._note("frozen", name)
        elif not self.state_indices and _current_seeds() != self._start_seeds:
            self._note("foreign state", name)

    def _wrap_setter(self, original, by_index_arg=None):
        guard = self

        def setting(*args, **kwargs):
            # Switching the state index (the 3.x tracker) is no rewind; setting a state is.
            by_index = by_index_arg is not None and kwargs.get("use_index", args[by_index_arg] if len(
                args) > by_index_arg else False)
            guard.rewound = guard.rewound or not by_index
            try:
                return original(*args, **kwargs)
            finally:
                guard._last = guard._read()

        return setting

    def __enter__(self):
        if not self.enabled:
            return self
        self._gens = generators()
        self._start_seeds = _current_seeds()
        try:
            for module, names in _op_modules():
                own = module.__dict__
                for name in names:
                    original = own.get(name)
                    if original is None:
                        original = getattr(module, name)
                    self._patches.set(module, name, self._wrap_op(name, original))
            setters = [(paddle, "set_rng_state", None), (paddle, "set_cuda_rng_state", None)]
            incubate = getattr(paddle, "incubate", None)
            if incubate is not None:
                setters.append((incubate, "set_rng_state", 2))  # (state_list, device, use_index)
            tracker = _tracker()
            if tracker is not None:
                setters.append((tracker, "set_states_tracker", None))
            for owner, name, by_index in setters:
                if hasattr(owner, name):
                    self._patches.set(owner, name, self._wrap_setter(getattr(owner, name), by_index))
            self._last = self._read()
        except BaseException:
            self._patches.restore()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        try:
            if self._last is not None:
                gap = self._changed(self._last, self._read())
                if gap is not None:
                    self._note("outside", gap)
        finally:
            self._patches.restore()
        return False

    # ----------------------------------------------------------------- verdict
    def check(self):
        """Raises CaptureError naming the first random draw a replay would get wrong."""
        if self.problem is None:
            return
        from ..errors import CaptureError

        kind, what, where = self.problem
        if kind == "after rewind" and not self.backward:
            raise RNG_REWOUND.error(
                f"autocudagraph: the function sets the RNG state and then runs the random kernel '{what}' (at "
                f"{where}; R-Drop or a hand-written recompute: paddle.set_rng_state after get_rng_state). A CUDA "
                "graph replays that kernel with a new offset instead of the state set, so its masks would differ "
                "from eager's. Run the rewind and the draws outside the graphed function."
            )
        if kind == "after rewind":
            raise RECOMPUTE_DROPOUT.error(
                f"autocudagraph: the backward rewinds the RNG state and then runs the random kernel '{what}' "
                f"(at {where}; reentrant recompute with dropout). A CUDA graph would replay that kernel with a new "
                "offset instead of the forward's, giving wrong grads. Graph the blocks inside the recompute "
                "instead of around it, or disable dropout there."
            )
        if kind == "frozen":
            raise RANDOM_KERNEL.error(
                f"autocudagraph: the function runs the random kernel '{what}' (at {where}), which Paddle does not "
                "re-seed when a CUDA graph replays (only dropout and fused_dropout_add are): every replay would "
                "repeat the capture's random numbers. Draw them outside the graphed function and pass them in, "
                "or use dropout."
            )
        if kind == "outside":
            raise CaptureError(
                f"autocudagraph: the state of {what} changed during the capture outside any Paddle op "
                f"(seen at {where}; paddle.seed or Generator.set_state inside the function, or a draw Python "
                "does not see). A CUDA graph would replay the capture's random numbers. Seed and draw outside "
                "the graphed function."
            )
        raise TRACKER_DROPOUT.error(
            f"autocudagraph: the function runs the random kernel '{what}' (at {where}) under another RNG state "
            "than the caller's (a Fleet tracker rng_state(name) block inside it), and this Paddle has no "
            "generator state indices (Generator.get_state_index): a replay would draw from the caller's state "
            "instead, giving other masks than eager. Graph the code inside the rng_state block, call the "
            "graphed function inside the block, or use a Paddle with generator state indices (3.x)."
        )


def _tracker():
    """Fleet's RNG state tracker, or None (Paddle without Fleet, or no tracker in this process)."""
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
    except ImportError:  # pragma: no cover - Paddle without fleet
        return None
    try:
        return get_rng_state_tracker()
    except Exception:  # pragma: no cover - tracker not initialised in this process
        return None
