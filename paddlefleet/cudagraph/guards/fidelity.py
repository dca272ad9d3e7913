"""What a replay freezes, and who sees it: the simulated backend, a guard that runs on a GPU, or neither.

NOTE [ One fidelity table ]
A GPU replay runs no Python: it launches the capture's kernels, on the capture's buffers, with the
capture's scalar arguments. Whatever the Python of a graphed call would decide differently on a later
call is frozen. Some of it is guarded on every backend (cheap checks before a replay: the key, Layer
attribute and structure stamps, a whole step's bindings and stop_gradient flags); the rest only the
simulated backend can see, because it re-runs the Python at every replay and compares what ran with
what the capture ran (the dataflow trace, guards/host_reads.py). ``ROWS`` is that division, one row
per kind of frozen value; docs/guides/fidelity.md is rendered from it (``render()``;
tests/guards/test_fidelity.py checks the page is current and that every row has tests). A new
guard or trace is a new row or a changed cell.
"""

import dataclasses

from .refusals import cell as _cell, page_head

__all__ = ["Fidelity", "ROWS", "ADVICE", "render"]


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """One kind of value a replay freezes.

    Attributes:
        name: a short id.
        what: what the user's code does (markdown).
        simulate: what the simulated backend does when it changes after capture.
        cuda: what a GPU run guards (and what that costs), or what it replays when nothing guards it.
    """

    name: str
    what: str
    simulate: str
    cuda: str


_EAGER = "that call's result is eager's, the key runs eagerly from then on, one warning names the op and the line"
_NOT = "not guarded: the replay repeats the capture's value"

ROWS = (
    Fidelity(
        "scalar arguments",
        "a Python value reaches an op: `x * self.cfg['scale']`, a global or closure number, "
        "`random.random()`, `t[i] = k`",
        "the op trace compares every op's scalar arguments with the capture's: " + _EAGER,
        "Layer attributes of the graphed Layers and their sublayers are stamped (a change captures the key "
        "again); a whole step's global and closure bindings are compared; a dict or module global read by "
        "a plain function: " + _NOT,
    ),
    Fidelity(
        "which tensor an op reads",
        "`x * (z if flag else y)`, `paddle.split(x, 3)[k]`, `unbind(x)[k]`, a module-global tensor rebound, "
        "two parameters swapped",
        "the trace records the role of every tensor operand (a static input, a named parameter or buffer, "
        "output k of an earlier op, an outside tensor by identity): " + _EAGER,
        "parameters' addresses and the Layer tree's structure are checked; a choice made by plain Python "
        "between tensors: " + _NOT,
    ),
    Fidelity(
        "indexing",
        "`x[k]`, `self.table[self.cfg['t']]` (C++-bound Tensor methods, no `_C_ops` call)",
        "every C++-bound Tensor method is traced with its index arguments: " + _EAGER,
        "an index read from a Layer attribute is stamped; a Python int from elsewhere: " + _NOT,
    ),
    Fidelity(
        "the backward's Python",
        "a hook on an activation reading a schedule, a PyLayer backward with a coefficient or a branch",
        "the backward graph's body is traced at capture and compared at every simulated replay (ops and "
        "scalar arguments): that call's grads are eager's, the key's next call runs eagerly, one warning",
        _NOT,
    ),
    Fidelity(
        "Python values returned",
        "a block returns a number or a string computed by Python",
        "compared with the capture's at every replay: " + _EAGER,
        "the capture's value is returned: " + _NOT,
    ),
    Fidelity(
        "Layer structure",
        "a sublayer replaced (`_sub_layers[...]`, `LayerDict`, `LayerList.append`), parameters or buffers "
        "added, a forward pre/post hook added or removed",
        "the same stamps as on a GPU, and the trace sees the new path",
        "stamped on every path, chained calls included: the key is captured again (forward and backward "
        "eager's on that call)",
    ),
    Fidelity(
        "stop_gradient",
        "`p.stop_gradient = True` after capture (parameters, or a closure tensor a whole step reads)",
        "checked as on a GPU",
        "part of a block's key; a whole step checks every parameter and every outside tensor it read that "
        "required grad",
    ),
    Fidelity(
        "the default dtype",
        "`paddle.set_default_dtype(...)` after capture (`paddle.to_tensor(0.1)`, `paddle.full`)",
        "watched like a Layer attribute: the key is captured again",
        "watched like a Layer attribute: the key is captured again",
    ),
    Fidelity(
        "random draws",
        "`paddle.rand`, `gumbel_softmax`, an RNG rewound and drawn again (R-Drop, hand-written recompute)",
        "refused at capture from the generators' state (dropout alone is re-seeded and allowed)",
        "refused the same way",
    ),
    Fidelity(
        "host reads and copies",
        "`.numpy()`, `.item()`, `print(t)`, `paddle.to_tensor(array)`, syncs",
        "refused at capture",
        "refused before CUDA sees them",
    ),
    Fidelity(
        "host side effects",
        "`print(...)` or logging of Python values inside a graphed function; a Layer attribute the function "
        "changes on every call (`self.calls += 1`, `self.last = out`)",
        "print and logging run at every replay (a GPU runs them once, at capture): one warning; a changed "
        "Layer attribute is refused at capture, as on a GPU",
        "print and logging run once, at capture; a Layer attribute the capture changes is refused at capture "
        "(the write put back, the key eager, one warning)",
    ),
)

ADVICE = (
    "Run your training script once with `PADDLEFLEET_CUDAGRAPH_BACKEND=simulate` in CI (a few steps on a CPU "
    "are enough): what a GPU would replay silently wrong then runs eagerly with a warning naming the op and "
    "your line. On a GPU, keep values that change between calls out of plain Python: pass them as arguments "
    "(they become part of the key) or as tensors updated in place."
)


def render():
    """docs/guides/fidelity.md, from ROWS and ADVICE."""
    lines = page_head("What a replay freezes, and who sees it", "fidelity.py", "tests/guards/test_fidelity.py") + [
        "A GPU replay runs no Python: it launches the capture's kernels on the capture's buffers with the "
        "capture's scalar arguments. The simulated backend re-runs your Python at every replay and compares "
        "what ran with what the capture ran, op by op and operand by operand, so it sees what a GPU freezes; "
        "on a GPU only the cheap guards below run. What neither sees is marked \"not guarded\".",
        "",
        "| what your code does | simulated backend | cuda backend |",
        "|---|---|---|",
    ]
    for r in ROWS:
        lines.append(f"| **{_cell(r.name)}**: {_cell(r.what)} | {_cell(r.simulate)} | {_cell(r.cuda)} |")
    lines += ["", ADVICE, "", "What a capture refuses outright is in [refusals.md](refusals.md)."]
    return "\n".join(lines) + "\n"
