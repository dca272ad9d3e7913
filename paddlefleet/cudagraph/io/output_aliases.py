"""Outputs a call hands back as they are: the call's own inputs, the state of its Layers, and one tensor at
several places of the result.

NOTE [ Outputs handed back as they are ]
Eagerly, a function that returns its argument returns the caller's tensor itself; one that returns a
parameter or a buffer of its Layers (``self.weight``, a BatchNorm mean) returns that tensor, which later
updates change; and one that returns a tensor twice returns one object twice: ``out is x`` holds, an
in-place write through one name shows through the others, a reference kept by the caller follows the
parameter's updates (so does one to ``self.weight.detach()``, which shares its storage), and autograd sees one
tensor (its grad goes straight to the caller's tensor or the
parameter). A capture sees the argument's static buffer, the parameter, or the repeated tensor as static
outputs, and a replay would hand out a new tensor holding a copy at each place. So a capture keeps each
output tensor once, and none that is one of its inputs or its Layers' state (``output_aliases``: ``kept``,
what the graphs hand out and differentiate), and a replay rebuilds the result from those with the caller's
own tensor, the state tensor (a new ``detach()`` of it where the function returned one), and one object where
the function returned one tensor several times (``OutputAliases.expand``). Other views of a Layer tensor (a slice,
a reshape) are handed out as copies, as any output. A result with none of these has no OutputAliases, and its calls pay nothing.
A simulated replay whose re-run returns another pattern than the capture's is refused (a GPU would hand
out the capture's).
"""

from ..errors import ReplayTraceError

__all__ = ["OutputAliases", "describe_aliases", "layer_state", "output_aliases", "run_aliases"]

_OUT, _IN, _STATE, _DETACHED = 0, 1, 2, 3


class OutputAliases:
    """How a result is rebuilt from the outputs a capture kept.

    Attributes:
        index: per result tensor, ``(_OUT, j)`` (kept output ``j``), ``(_IN, k)`` (the call's input ``k``),
            ``(_STATE, m)`` (``state[m]``) or ``(_DETACHED, m)`` (a new ``state[m].detach()``).
        state: the Layers' tensors the result holds, by reference.
        first: per kept output, the first result position holding it.
    """

    __slots__ = ("index", "state", "first", "detached")

    def __init__(self, index, state=()):
        self.index = tuple(index)
        self.state = tuple(state)
        self.detached = any(kind == _DETACHED for kind, _ in self.index)
        first = {}
        for i, (kind, j) in enumerate(self.index):
            if kind == _OUT:
                first.setdefault(j, i)
        self.first = tuple(first[j] for j in range(len(first)))

    def __eq__(self, other):
        return (isinstance(other, OutputAliases) and other.index == self.index and len(other.state) == len(self.state)
                and all(a is b for a, b in zip(other.state, self.state)))

    def __hash__(self):
        return hash(self.index)

    def expand(self, outputs, inputs):
        """The result's tensors: ``outputs`` (one per kept output), the call's ``inputs`` and the state where
        they go."""
        sources = (outputs, inputs, self.state, self.state)
        if not self.detached:
            return [sources[kind][j] for kind, j in self.index]
        return [sources[kind][j] if kind != _DETACHED else self.state[j].detach() for kind, j in self.index]

    def describe(self):
        """Words for messages: which result tensors are inputs, state, or repeat another."""
        said = []
        for i, (kind, j) in enumerate(self.index):
            if kind == _IN:
                said.append(f"result tensor {i} is input {j}")
            elif kind == _STATE:
                said.append(f"result tensor {i} is the Layer tensor {self.state[j].name}")
            elif kind == _DETACHED:
                said.append(f"result tensor {i} is a detach() of the Layer tensor {self.state[j].name}")
            elif self.first[j] != i:
                said.append(f"result tensor {i} is result tensor {self.first[j]}")
        return ", ".join(said)


def describe_aliases(aliases):
    """Words for messages of an OutputAliases or None."""
    return aliases.describe() if aliases is not None else "no input, no Layer tensor and no repeated tensor"


def layer_state(layers):
    """``{id: tensor}`` of every parameter and buffer of ``layers`` and their sublayers."""
    found = {}
    for layer in layers:
        for _, sub in layer.named_sublayers(include_self=True):
            for tensors in (sub._parameters, sub._buffers):
                for t in tensors.values():
                    if t is not None:
                        found[id(t)] = t
    return found


def _storage(t):
    """What a detach() shares with its tensor: the address, shape, dtype and contiguity."""
    return t.data_ptr(), tuple(t.shape), int(t.dtype), t.is_contiguous()


def output_aliases(out_tensors, inputs, layers=None):
    """``(kept, aliases)``: the output tensors a capture keeps, each once, none of ``inputs`` (the call's tensors
    as the function saw them) and none of the parameters and buffers of ``layers()`` (asked only where an
    output is persistable, as those are), and the OutputAliases rebuilding ``out_tensors`` from them; where
    there is nothing to rebuild, ``(out_tensors, None)``."""
    where = {id(t): (_IN, k) for k, t in enumerate(inputs)}
    state_of = detached_of = None
    if layers is not None and any(t.persistable for t in out_tensors):
        state_of = layer_state(layers())
    kept, index, state = [], [], []
    for t in out_tensors:
        at = where.get(id(t))
        if at is None:
            if state_of is not None and id(t) in state_of:
                at = (_STATE, len(state))
                state.append(t)
            elif state_of is not None and t.persistable and t.stop_gradient:
                if detached_of is None:  # a detach() shares the tensor's storage, shape and dtype, and is persistable
                    detached_of = {_storage(s): s for s in state_of.values()}
                source = detached_of.get(_storage(t))
                if source is not None:
                    at = (_DETACHED, len(state))
                    state.append(source)
            if at is None:
                at = (_OUT, len(kept))
                kept.append(t)
            where[id(t)] = at
        index.append(at)
    if len(kept) == len(out_tensors):
        return out_tensors, None
    return kept, OutputAliases(index, state)


def run_aliases(out_tensors, inputs, record, layers=None):
    """output_aliases() of one run of a captured function; ``record``: its capture's CaptureRecord, whose
    ``aliases`` a simulated replay's run must match (before anything is copied into the static outputs).

    Raises:
        ReplayTraceError: a replay's run holds its inputs, its Layers' tensors or repeats its outputs otherwise
            than the capture's.
    """
    kept, aliases = output_aliases(out_tensors, inputs, layers)
    if record.captured and aliases != record["aliases"]:
        raise ReplayTraceError(
            f"a replay returned its inputs, its Layers' tensors or repeated outputs otherwise than the capture "
            f"({describe_aliases(aliases)} against {describe_aliases(record['aliases'])}). On a GPU this replay "
            "would hand out the capture's; this call runs eagerly instead")
    record["aliases"] = aliases
    return kept
