"""Python values a graphed step returns: recomputed on every replay, or refused.

NOTE [ Python values in a step's result ]
A graph produces tensors; the Python values in a step's result (``{"loss": loss, "lr":
opt.get_lr()}``) come from the step's Python, which a replay does not run. Returning the
capture-time value on every replay would be silently stale, so each one is, at capture:

* recomputed when the wrapper knows how: a float returned by an optimizer's ``get_lr()`` (the
  capture tags what ``get_lr()`` returns; arithmetic on it gives a plain float, refused below).
  Before each replay the value is ``opt.get_lr()`` again - what the step's own call returns,
  since the rate is fed from the host before the step runs (NOTE [ Learning rate under a step
  graph ] in step/optimizer_state.py);
* kept when it cannot change without changing the key or being seen: None, a string or bytes
  equal at the last warmup step and the capture; a number or bool that *is* one of the call's
  non-tensor arguments (they are part of the key); an object that is the very object the last
  warmup step returned (a long-lived object, returned by reference);
* refused otherwise - a number computed from host state (a step counter, ``float(sched())``,
  ``opt.get_lr() * 2``), a new object per call - naming where it is in the result and the fix.

The simulated backend re-runs the step's Python on every replay and sends the key to eager when
a kept value differs from the capture's (a GPU would have returned the capture's).
"""

import paddle

from ..guards.paddle_patches import Patches
from ..errors import CaptureError
from ..io.nested import const_names, flatten

__all__ = ["tag_learning_rates", "ReturnedValues"]

_IMMUTABLE = (type(None), str, bytes)
_NUMBERS = (bool, int, float, complex)


class _LearningRate(float):
    """A float returned by ``opt.get_lr()`` during a capture, remembering the optimizer. Copied
    or pickled (the step may keep it in a history list), it is a plain float."""

    optimizer = None

    def __reduce__(self):
        return float, (float(self),)


class tag_learning_rates:
    """While active, ``Optimizer.get_lr()`` returns a _LearningRate naming its optimizer."""

    def __enter__(self):
        cls = paddle.optimizer.Optimizer
        original = cls.__dict__["get_lr"]

        def get_lr(opt):
            value = _LearningRate(original(opt))
            value.optimizer = opt
            return value

        self._patches = Patches()
        self._patches.set(cls, "get_lr", get_lr)
        return self

    def __exit__(self, *exc):
        self._patches.restore()
        return False


class ReturnedValues:
    """The Python values of a captured step's result (NOTE [ Python values in a step's result ]).

    Args:
        spec, consts: the capture's result structure and its Python values (flatten()).
        warm_consts: the last warmup step's Python values, or None when unknown.
        call: the capture's Call (its non-tensor arguments are part of the key).
    Raises:
        CaptureError: for a value that a replay would return stale.
    """

    def __init__(self, spec, consts, warm_consts, call):
        names = const_names(spec, "output")
        arguments = {id(v) for v in flatten((call.args, call.kwargs))[1]}
        same_shape = warm_consts is not None and len(warm_consts) == len(consts)
        self.recompute = []  # [(index, optimizer)]
        self.consts = []
        for i, value in enumerate(consts):
            warm = warm_consts[i] if same_shape else None
            if isinstance(value, _LearningRate):
                self.recompute.append((i, value.optimizer))
                self.consts.append(float(value))
                continue
            why = _refusal(value, warm, same_shape, id(value) in arguments)
            if why is not None:
                raise CaptureError(
                    f"autocudagraph_step: the step returns {why} at {names[i] if i < len(names) else f'value {i}'}. A "
                    "graph produces tensors only: every replay would return the capture's value. Return it as a "
                    "tensor, compute it outside the step, or pass it as an argument (it becomes part of the key); "
                    "opt.get_lr() itself is recomputed on every replay."
                )
            self.consts.append(value)

    def for_replay(self):
        """The values for the next replay (recomputed ones read now, before it runs)."""
        if not self.recompute:
            return self.consts
        consts = list(self.consts)
        for i, opt in self.recompute:
            consts[i] = float(opt.get_lr())
        return consts

    def differs(self, consts):
        """A sentence naming the first kept value that ``consts`` (a simulated replay's) changes."""
        recomputed = {i for i, _ in self.recompute}
        for i, (a, b) in enumerate(zip(self.consts, consts)):
            if i not in recomputed and not _same(a, b):
                return f"the step returned {b!r} where the capture returned {a!r}"
        return None


def _same(a, b):
    if isinstance(a, _IMMUTABLE + _NUMBERS):
        return type(a) is type(b) and a == b
    return a is b


def _refusal(value, warm, same_shape, is_argument):
    """Why ``value`` cannot be returned by a replay, or None."""
    kind = type(value).__name__
    if isinstance(value, _IMMUTABLE):
        if same_shape and not _same(warm, value):
            return f"the {kind} {value!r}, which was {warm!r} at the last warmup step,"
        return None
    if isinstance(value, _NUMBERS) or type(value).__module__ == "numpy":
        if is_argument:
            return None
        return f"the Python {kind} {value!r} (computed on the host, not one of its arguments)"
    if same_shape and warm is value:
        return None
    return f"a {kind} object that is not the one its last warmup step returned"
