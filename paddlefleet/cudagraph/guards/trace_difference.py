"""How two op traces differ, in words: the first op that differs or reads another tensor, what it
got at both runs and the user's line (NOTE [ The dataflow of a trace ] in guards/host_reads.py)."""

__all__ = ["describe_trace_difference", "InputSlots"]

# Role tags of tensor operands (NOTE [ The dataflow of a trace ] in guards/host_reads.py).
_IN, _OP, _OBJ = "<in>", "<op>", "<obj>"


class InputSlots(frozenset):
    """The input slots that held one tensor operand of a traced call: one, or several where the call was given
    one tensor as several arguments. Two agree when they share a slot: a run given ``x`` as both arguments
    reads it for either, the capture reads the static buffer of one of them (NOTE [ The dataflow of a trace ]
    in guards/host_reads.py). Compared only: sets that agree may differ, so all hash alike."""

    __slots__ = ()

    def __eq__(self, other):
        return isinstance(other, InputSlots) and not self.isdisjoint(other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return 0

    def __str__(self):
        slots = sorted(self)
        if len(slots) == 1:
            return f"input {slots[0]}"
        return "inputs " + ", ".join(str(k) for k in slots[:-1]) + f" and {slots[-1]} (one tensor)"


def _show(value, trace=None):
    """A readable form of a normalised argument (a tensor by its role)."""
    if isinstance(value, tuple) and value and value[0] in (_IN, _OP, _OBJ):
        if value[0] == _IN:
            return str(value[1])
        if value[0] == _OP:
            return f"output {value[2]} of op #{value[1]}"
        return trace.name_of(value[1]) if trace is not None else "a tensor from outside"
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "f":
        text = value[1]
        return repr(float.fromhex(text)) if text.startswith(("0x", "-0x")) else text
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v, trace) for v in value) + ")"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _argument_difference(a, b, before, after):
    """``"argument 2 2.0 at the {0} and 3.0 at the {1}"`` for the first differing argument of one op."""
    args_a, args_b = a[1], b[1]
    if len(args_a) == len(args_b):
        for k, (x, y) in enumerate(zip(args_a, args_b)):
            if x != y:
                return f"argument {k} {_show(x, before)} at the {{0}} and {_show(y, after)} at the {{1}}"
    return f"keyword arguments {_show(a[2], before)} at the {{0}} and {_show(b[2], after)} at the {{1}}"


def _same_object(a, b):
    """The same tensor at the same address; or, where the first is gone, one also gone (each run's
    own temporary, made where no traced op shows it) or one with its lasting name (an optimizer's
    accumulator that the package moved to the device before the capture)."""
    t, u = a[0](), b[0]()
    if t is not None:
        return t is u and a[1] == b[1]
    if u is None:  # both gone once their run ended: temporaries each run made (a hook's grad)
        return True
    return a[2] is not None and a[2] == b[2]


def _reads(ops, n):
    """The index of the first op whose arguments hold outside tensor ``n``."""
    role = (_OBJ, n)

    def holds(value):
        return value == role or (isinstance(value, tuple) and any(holds(v) for v in value))

    return next((i for i, op in enumerate(ops) if holds(op[1]) or holds(op[2])), 0)


def _line(before, after, i, lines):
    where = (after.lines[i] if i < len(after.lines) else None) or (
        before.lines[i] if i < len(before.lines) else None) or (lines[i] if i < len(lines) else None)
    return f" at {where}" if where else ""


def describe_trace_difference(before, after, before_name, after_name, lines=()):
    """None when the two traces record the same ops with the same host values on the same tensors
    (NOTE [ The dataflow of a trace ]), else a sentence naming the first difference (and the user's
    line, when ``lines`` of ``after`` or ``before`` are known)."""
    same_ops = before.ops == after.ops
    first = None if same_ops else next(
        (i for i, (a, b) in enumerate(zip(before.ops, after.ops)) if a != b), min(len(before.ops), len(after.ops)))
    moved = [(_reads(after.ops, n), n) for n, (a, b) in enumerate(zip(before.objects, after.objects))
             if not _same_object(a, b)]
    if moved and (first is None or min(moved)[0] <= first):
        i, n = min(moved)
        return (f"op #{i} {after.ops[i][0]}{_line(before, after, i, lines)} read {before.name_of(n)} at the "
                f"{before_name} and another tensor, {after.name_of(n)}, at the {after_name}")
    if first is None:
        return None
    if first < min(len(before.ops), len(after.ops)):
        a, b = before.ops[first], after.ops[first]
        at = _line(before, after, first, lines)
        if a[0] != b[0]:
            return (f"op #{first} was {a[0]} at the {before_name} and {b[0]} at the {after_name}{at} (the code "
                    "takes another branch)")
        return f"op #{first} {a[0]}{at} got " + _argument_difference(a, b, before, after).format(
            before_name, after_name)
    longer, name = (before, before_name) if len(before.ops) > len(after.ops) else (after, after_name)
    return (f"the {before_name} ran {len(before.ops)} ops and the {after_name} {len(after.ops)}; the first extra op "
            f"at the {name} is {longer.ops[first][0]}")
