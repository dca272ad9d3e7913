"""Outputs a call hands back as they are: the call's own inputs, and one tensor at several places of the result.

NOTE [ Outputs handed back as they are ]
Eagerly, a function that returns its argument returns the caller's tensor itself, and one that returns a
tensor twice returns one object twice: ``out is x`` holds, an in-place write through one name shows through
the others, and autograd sees one tensor (its grad goes straight to the caller's tensor). A capture sees
the argument's static buffer, or the repeated tensor, as static outputs, and a replay would hand out a new
tensor at each place. So a capture keeps each output tensor once, and none that is one of its inputs
(``output_aliases``: ``kept``, what the graphs hand out and differentiate), and a replay rebuilds the result
from those with the caller's own tensor where the function returned its argument and one object where it
returned one tensor several times (``OutputAliases.expand``). A result with neither has no OutputAliases,
and its calls pay nothing. A simulated replay whose re-run returns another pattern than the capture's is
refused (a GPU would hand out the capture's).
"""

from ..errors import ReplayTraceError

__all__ = ["OutputAliases", "describe_aliases", "output_aliases", "run_aliases"]


class OutputAliases:
    """How a result is rebuilt from the outputs a capture kept.

    Attributes:
        index: per result tensor, the kept output's index (>= 0) or ``-1 - k`` for the call's input ``k``.
        first: per kept output, the first result position holding it.
    """

    __slots__ = ("index", "first")

    def __init__(self, index):
        self.index = tuple(index)
        first = {}
        for i, j in enumerate(self.index):
            if j >= 0:
                first.setdefault(j, i)
        self.first = tuple(first[j] for j in range(len(first)))

    def __eq__(self, other):
        return isinstance(other, OutputAliases) and other.index == self.index

    def __hash__(self):
        return hash(self.index)

    def expand(self, outputs, inputs):
        """The result's tensors: ``outputs`` (one per kept output) and the call's ``inputs`` where they go."""
        return [outputs[j] if j >= 0 else inputs[-1 - j] for j in self.index]

    def describe(self):
        """Words for messages: which result tensors are inputs or repeat another."""
        said = []
        for i, j in enumerate(self.index):
            if j < 0:
                said.append(f"result tensor {i} is input {-1 - j}")
            elif self.first[j] != i:
                said.append(f"result tensor {i} is result tensor {self.first[j]}")
        return ", ".join(said)


def output_aliases(out_tensors, inputs):
    """``(kept, aliases)``: the output tensors a capture keeps, each once and none of ``inputs`` (the call's
    tensors as the function saw them), and the OutputAliases rebuilding ``out_tensors`` from them; where
    nothing is an input or repeated, ``(out_tensors, None)``."""
    where = {id(t): -1 - k for k, t in enumerate(inputs)}
    kept, index = [], []
    for t in out_tensors:
        j = where.get(id(t))
        if j is None:
            j = where[id(t)] = len(kept)
            kept.append(t)
        index.append(j)
    if len(kept) == len(out_tensors) and all(j >= 0 for j in index):
        return out_tensors, None
    return kept, OutputAliases(index)


def describe_aliases(aliases):
    """Words for messages of an OutputAliases or None."""
    return aliases.describe() if aliases is not None else "no input and no repeated tensor"


def run_aliases(out_tensors, inputs, record):
    """output_aliases() of one run of a captured function; ``record``: its capture's CaptureRecord, whose
    ``aliases`` a simulated replay's run must match (before anything is copied into the static outputs).

    Raises:
        ReplayTraceError: a replay's run holds its inputs or repeats its outputs otherwise than the capture's.
    """
    kept, aliases = output_aliases(out_tensors, inputs)
    if record.captured and aliases != record["aliases"]:
        raise ReplayTraceError(
            f"a replay returned its inputs or repeated outputs otherwise than the capture "
            f"({describe_aliases(aliases)} against {describe_aliases(record['aliases'])}). On a GPU this replay "
            "would hand out the capture's; this call runs eagerly instead")
    record["aliases"] = aliases
    return kept
