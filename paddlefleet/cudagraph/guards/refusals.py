"""Every refusal of a capture, one row each: what the user's code does, what each backend does,
the words its message carries and the fix it gives.

NOTE [ One table of refusals ]
A capture is refused (CaptureError; the key runs eagerly with eager's results and one warning
naming the user's line) where a CUDA graph would fail or replay something other than eager. The
simulated backend must refuse exactly what the cuda backend refuses, or CPU CI says "graphed"
where a GPU falls back. ``REFUSALS`` is the one list of those refusals: docs/guides/refusals.md
is rendered from it (``render()``; tests/backends/test_refusals.py checks the page is current).
Each refusal is raised from its row by the guard that owns it (``ROW.error(message)``: the
CaptureError carries its row, and the message the guard writes, with what was called and its
values, carries the row's words and fix); tests/backends/test_refusals.py makes each row's guard
refuse and checks the row it raised, and names the tests that show each row on both backends (on
the simulated backend with the stand-in for a recording capture, ``capture_executes=False``,
where a GPU differs because a capture only records). A new refusal is a new row.
"""

import dataclasses

from ..errors import CaptureError

__all__ = ["Refusal", "REFUSALS", "NOT_REFUSED", "row", "render", "cell", "page_head", "HOST_READ", "RAW_TENSOR_READ", "HOST_TO_DEVICE",
           "DEVICE_SYNC", "STREAM_WAIT", "GRAD_ASSIGNED", "VALUE_SHAPE", "DEVICE_INDEX", "RANDOM_KERNEL",
           "RECOMPUTE_DROPOUT", "RNG_REWOUND", "TRACKER_DROPOUT", "DOUBLE_BACKWARD", "LOST_LEAF", "INPUT_WRITTEN", "ARGUMENT_GRAD",
           "PADDLE_SCALER", "FREED_GRADS", "CHANGING_HOST_VALUE", "ATTR_WRITTEN"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refusal.

    Attributes:
        name: a short id.
        what: what the user's code does (markdown).
        cuda: what the cuda backend does.
        simulate: what the simulated backend does.
        message: words every such message carries.
        fix: words of the fix the message gives.
    """

    name: str
    what: str
    cuda: str
    simulate: str
    message: str
    fix: str

    def error(self, message):
        """The CaptureError of this refusal, raised by the guard that owns the row: ``message`` says
        what was called, with its values, and carries the row's ``message`` and ``fix`` words."""
        err = CaptureError(message)
        err.refusal = self
        return err


_GUARD = ("refused in Python before CUDA sees it (a capturing stream fails it with CUDA error 900/906 and "
          "the capture breaks)")
_SAME = "refused the same way (host marks stand for CPU tensors)"

REFUSALS = (
    Refusal(
        "host read",
        "reads a device tensor on the host: `.numpy()`, `.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)`, "
        "`if t:`, `print(t)`, `.cpu()`, `np.array(t)`",
        _GUARD, _SAME,
        "reads a device tensor on the host", "Keep host reads out of the graphed function"),
    Refusal(
        "raw tensor read",
        "reads a device tensor's raw tensor on the host: `np.array(t.get_tensor())`, "
        "`np.array(t.value().get_tensor())`, `str(t.get_tensor())`, `t.get_tensor()._copy(cpu)`",
        _GUARD, _SAME,
        "Tensor.get_tensor()", "Keep host reads out of the graphed function"),
    Refusal(
        "host-to-device copy",
        "copies host data to the device: `paddle.to_tensor(array)`, `paddle.Tensor(array)`, `paddle.assign(array)`, "
        "`t.set_value(array)`, `t[i] = array` (or a list), a CPU tensor's `.cuda()` / `.to('gpu')`, "
        "`t.get_tensor().set(array, place)`",
        _GUARD + "; a graph could never replay it with new values (`paddle.Tensor(array)`: on Paddle 3.x; Paddle "
        "2.6's constructor cannot be wrapped)", _SAME,
        "copies host data to the device", "Create the tensor outside the graphed function"),
    Refusal(
        "device synchronize",
        "`paddle.device.synchronize()`, `paddle.device.cuda.synchronize()`",
        _GUARD, "refused the same way (the call never reaches the device)",
        "waits for the device", "Keep host reads out of the graphed function"),
    Refusal(
        "stream or event wait",
        "`Stream.synchronize()`, `Stream.query()`, `Event.synchronize()`, `Event.query()`, "
        "`Event.elapsed_time()` (`paddle.device` and `paddle.device.cuda`)",
        _GUARD + "; a replay would not repeat the answer", "refused the same way",
        "asks how far it got", "Keep host reads out of the graphed function"),
    Refusal(
        "grad assigned",
        "`p.grad = t` where `p` has no grad yet, or `t` has another shape or dtype, or is a host tensor "
        "(`p.grad = t` onto a grad of `t`'s shape and dtype is done as Paddle does it, an in-place copy, "
        "and captured: Paddle 2.6's `clip_grad_norm_` included)",
        "refused in Python (Paddle's setter copies on the legacy stream: CUDA error 906)", "refused the same way",
        "p.grad = tensor", "Let backward() write the grads"),
    Refusal(
        "shape from tensor values",
        "`paddle.nonzero`, `paddle.masked_select`, `paddle.unique`, `paddle.unique_consecutive`, `paddle.bincount`, "
        "`paddle.repeat_interleave` with tensor repeats, `x[bool_mask]`",
        "refused in Python (the output's shape must be copied to the host: CUDA error 900)",
        "refused the same way; a replay whose shapes change anyway falls back before copying",
        "Its output's shape depends on tensor values", "fixed-shape form"),
    Refusal(
        "index with a device tensor",
        "`x[t]` with a 0-D integer device tensor, `x[:t]` with a device tensor bound (a host tensor such as "
        "`paddle.shape(x)[0]` is allowed)",
        "refused in Python (Paddle reads the index on the host: CUDA error 900)", "refused the same way",
        "reads that tensor's value on the host", "Index with Python ints or slices"),
    Refusal(
        "random kernel other than dropout",
        "`paddle.rand`, `randn`, `bernoulli`, `randint` and other random kernels in a graphed block",
        "refused: Paddle re-seeds only dropout on replay, every replay would repeat the capture's numbers",
        "refused, as on cuda (its replays, which re-run the function, would draw afresh)",
        "does not re-seed", "Draw them outside the graphed function"),
    Refusal(
        "recompute with dropout",
        "a reentrant `recompute` whose block draws random numbers, inside a graphed call or step",
        "refused: the backward rewinds the RNG and redraws, a replay would draw with a new offset",
        "refused, as on cuda (its replays, which re-run the recompute, would redraw the forward's masks)",
        "rewinds the RNG state and then runs the random kernel", "Graph the blocks inside the recompute"),
    Refusal(
        "RNG rewound in the function",
        "a graphed function sets the RNG state back and draws again: `s = paddle.get_rng_state(); dropout; "
        "paddle.set_rng_state(s); dropout` (R-Drop, a hand-written recompute)",
        "refused: a replay re-seeds each dropout with a new offset, so the two masks would differ from eager's",
        "refused, as on cuda (decided from the generators' state)",
        "sets the RNG state and then runs the random kernel", "Run the rewind and the draws outside the graphed function"),
    Refusal(
        "tracker dropout without state indices",
        "dropout under a Fleet tracker `rng_state(name)` block inside a graphed function, on a Paddle without "
        "generator state indices (2.6)",
        "refused: the replay hook advances the caller's state, not the tracker's",
        "refused, as on cuda (its replays, which re-run the tracker block, would draw from the tracker's state)",
        "generator state indices", "Graph the code inside the rng_state block"),
    Refusal(
        "double backward",
        "`paddle.grad(u, x, create_graph=True)` inside a graphed function, whose grads require grad",
        "refused in Python where paddle.grad returns", "refused the same way",
        "create_graph=True", "outside the graphed function and graph the parts before and after it"),
    Refusal(
        "leaf that would lose its grad",
        "uses a tensor that requires grad and is neither an argument nor a parameter of its Layers "
        "(a closure's, a global's)",
        "refused in Python after the forward capture", "refused the same way",
        "neither arguments nor parameters", "Pass them as arguments"),
    Refusal(
        "input written in place",
        "writes one of its tensor arguments in place (a copied input: the graph writes its own copy)",
        "refused in Python after the capture", "refused the same way (the simulated capture's write is undone)",
        "in place", "Return the new value instead"),
    Refusal(
        "grad into a step's argument",
        "a whole step whose backward computes a grad for one of its tensor arguments (`stop_gradient=False`): a "
        "batch that requires grad (`x.grad` read after the step), a parameter passed as an argument "
        "(`step(x, model.w)`), a tensor computed before the step from parameters",
        "refused in Python after the capture: the capture reads each argument through a buffer of its own, so "
        "the grad would reach that buffer, and neither the caller's tensor nor what it was computed from",
        "refused the same way",
        "computes a grad for its argument", "Pass such a tensor with stop_gradient=True"),
    Refusal(
        "paddle.amp.GradScaler in a whole step",
        "`paddle.amp.GradScaler.step()`, `.minimize()` or `.update()` inside `autocudagraph_step`, enabled or "
        "not (Paddle turns it off on a CPU, on a GPU it is on)",
        "refused in Python: it reads found_inf on the host", "refused the same way, also where Paddle disabled it",
        "paddle.amp.GradScaler", "GraphGradScaler"),
    Refusal(
        "grads freed at the end of an accumulation window",
        "a whole step that accumulates grads and frees them with `clear_grad(set_to_zero=False)` when it steps",
        "refused in Python: every window starts from new grad storage", "refused the same way",
        "clear_grad(set_to_zero=False) at the end of an accumulation window", "Use clear_grad() (set_to_zero=True)"),
    Refusal(
        "host value that changes between steps",
        "a whole step whose ops take a Python value that differs between its last warmup step and its capture "
        "(a counter, a float from the host)",
        "refused in Python: the op traces of warmup and capture differ",
        "refused the same way; a simulated replay that reads other values falls back",
        "reads a host value that changes between steps", "Pass such values as tensors"),
    Refusal(
        "Layer attribute changed by the call",
        "writes an attribute of a Layer to another value than it held before the call, in a graphed function "
        "or a whole step: `self.calls += 1`, `self.last = out` (a new tensor on every call), `self.seen = step`, "
        "a buffer rebound (`self.steps = self.steps + 1`) "
        "(a value written equal, `self._shape = tuple(x.shape)`, and one made once in a warmup call are "
        "captured; one changed between calls, outside the function, captures the key again)",
        "refused in Python after the capture: a replay runs no Python, so the attribute would keep its "
        "capture's value while eager's changes on every call (a key's first such capture only warms it up "
        "again: a value made once, a lazy attribute, is left alone by the next capture)",
        "refused the same way (its replays, which re-run the function, would change it; the capture's writes "
        "are put back before the call runs eagerly)",
        "changes attribute", "Keep such state outside the graphed function"),
)

(HOST_READ, RAW_TENSOR_READ, HOST_TO_DEVICE, DEVICE_SYNC, STREAM_WAIT, GRAD_ASSIGNED, VALUE_SHAPE, DEVICE_INDEX,
 RANDOM_KERNEL, RECOMPUTE_DROPOUT, RNG_REWOUND, TRACKER_DROPOUT, DOUBLE_BACKWARD, LOST_LEAF, INPUT_WRITTEN, ARGUMENT_GRAD,
 PADDLE_SCALER, FREED_GRADS, CHANGING_HOST_VALUE, ATTR_WRITTEN) = REFUSALS

#: What looks like a refusal and is not: captured on both backends, eager's result bit for bit.
NOT_REFUSED = (
    "`int(paddle.shape(x)[0])` and other reads of `paddle.shape` results: on a GPU they are host tensors, "
    "read at capture (every key fixes its shapes); the simulated backend treats them as host tensors too",
    "`p.grad = t` onto a grad of `t`'s shape and dtype: Paddle copies into the grad's storage, and so does "
    "the capture",
    "`x[mask] = v`, `paddle.where(cond, x, y)`, `masked_fill`, gathers with an N-D index tensor: fixed shapes",
    "dropout (Paddle re-seeds it on every replay)",
)


def row(name):
    """The Refusal named ``name``."""
    for refusal in REFUSALS:
        if refusal.name == name:
            return refusal
    raise KeyError(f"no refusal named {name!r}; the rows are {[r.name for r in REFUSALS]}")


def cell(text):
    """``text`` as one cell of a markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def page_head(title, module, test):
    """The first lines of a guide page rendered from ``module`` and checked by ``test``."""
    return [f"# {title}", "", f"<!-- generated from paddlefleet/cudagraph/guards/{module} by render(); {test} checks "
            "it is current -->", ""]



def render():
    """docs/guides/refusals.md, from REFUSALS and NOT_REFUSED."""
    lines = page_head("What a capture refuses", "refusals.py", "tests/backends/test_refusals.py") + [
        "A refused capture is ended cleanly, the call returns eager's result, the key runs eagerly from then on "
        "(`wrapped.reset()` tries again), and one warning gives the reason, the fix and the line of your code. "
        "The simulated backend (`backend=\"simulate\"`) refuses exactly what the cuda backend refuses, so a run "
        "on a CPU tells you what a GPU will do. [limitations.md](limitations.md) explains each case.",
        "",
        "| refused | cuda backend | simulated backend | the message says | the fix it gives |",
        "|---|---|---|---|---|",
    ]
    for r in REFUSALS:
        lines.append(f"| **{cell(r.name)}**: {cell(r.what)} | {cell(r.cuda)} | {cell(r.simulate)} | "
                     f"\"{cell(r.message)}\" | \"{cell(r.fix)}\" |")
    lines += ["", "Not refused (captured, eager's result bit for bit):", ""]
    lines += [f"- {item}" for item in NOT_REFUSED]
    return "\n".join(lines) + "\n"
