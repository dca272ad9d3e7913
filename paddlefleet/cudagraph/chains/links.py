"""What a thread's graphed calls tell about chains (NOTE [ Chains of graphed calls ] in
chains/chain.py): the latest call and its output, the links seen between keys, and the open run.
"""

import weakref

from .table import TABLE

__all__ = ["CONFIRM", "confirmed", "current_run", "flags", "forget_link", "observe", "remember", "set_run"]

#: Times a link is seen in a row before a chain uses it.
CONFIRM = 2



class _Seen:
    """The latest replay of a block in this thread through the bridge, or handed out by a chain."""

    __slots__ = ("entry", "output", "version", "extras")

    def __init__(self, entry, output, extras):
        self.entry = weakref.ref(entry)
        self.output = weakref.ref(output)
        self.version = output._inplace_version()
        self.extras = extras


class _Link:
    __slots__ = ("body", "entry", "count", "flags")

    def __init__(self, body, entry, flags):
        self.body = weakref.ref(body)
        self.entry = weakref.ref(entry)
        self.count = 1
        self.flags = flags


def current_run():
    """The open ChainRun of this thread (its next member not handed out yet), or None."""
    return TABLE.thread.run


def set_run(run):
    TABLE.thread.run = run


def flags(graphs):
    """The training flags of the Layers a key's graphs use (its key was made with them)."""
    return tuple(layer.training for layer in graphs.layers)


def remember(entry, output, extras):
    """Records a call whose single output ``output`` a later call may be given (see observe);
    ``extras``: the call's tensors after its first."""
    TABLE.thread.last = _Seen(entry, output, extras)


def forget_link(entry):
    """The link from ``entry`` is seen again before a chain uses it (a chain broke there)."""
    link = TABLE.links.get(entry)
    if link is not None:
        link.count = 0
        TABLE.version += 1


def confirmed(entry):
    """``(body, entry, flags)`` of the key a confirmed link from ``entry`` leads to, or None."""
    link = TABLE.links.get(entry)
    if link is None or link.count < CONFIRM:
        return None
    body, nxt = link.body(), link.entry()
    return None if body is None or nxt is None else (body, nxt, link.flags)


def observe(body, entry, call):
    """Called before a block replay through the bridge: records a link when this call is given
    the output of the latest one, unchanged, with the same other tensors (other arguments are
    compared by value, through the key, when a chain serves the call: ChainRun.hand_out)."""
    thread = TABLE.thread
    seen, thread.last = thread.last, None
    if seen is None or not call.args:
        return
    out = seen.output()
    if out is None or call.args[0] is not out or out._inplace_version() != seen.version:
        return
    extras = call.tensors[1:]
    if len(extras) != len(seen.extras) or any(a is not b for a, b in zip(extras, seen.extras)):
        return
    before = seen.entry()
    if before is None:
        return
    link = TABLE.links.get(before)
    if link is not None and link.entry() is entry and link.body() is body:
        link.count += 1
        if link.count == CONFIRM:
            TABLE.version += 1
        return
    TABLE.links[before] = _Link(body, entry, flags(entry.graphs.current))
    TABLE.version += 1
