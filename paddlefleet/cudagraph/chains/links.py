"""What a thread's graphed calls tell about chains (NOTE [ Chains of graphed calls ] in
chains/chain.py): the latest call and its output, the links seen between keys, and the open run.
"""

import threading
import weakref

__all__ = ["CONFIRM", "VERSION", "confirmed", "current_run", "flags", "forget_link", "observe", "remember", "set_run"]

#: Times a link is seen in a row before a chain uses it.
CONFIRM = 2

_local = threading.local()
_links = weakref.WeakKeyDictionary()  # entry -> _Link to the entry of the call it feeds
#: Bumped whenever a link is made, confirmed or forgotten: chains built before are built again.
VERSION = [0]


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
    return getattr(_local, "run", None)


def set_run(run):
    _local.run = run


def flags(graphs):
    """The training flags of the Layers a key's graphs use (its key was made with them)."""
    return tuple(layer.training for layer in graphs.layers)


def remember(entry, output, extras):
    """Records a call whose single output ``output`` a later call may be given (see observe);
    ``extras``: the call's tensors after its first."""
    _local.last = _Seen(entry, output, extras)


def forget_link(entry):
    """The link from ``entry`` is seen again before a chain uses it (a chain broke there)."""
    link = _links.get(entry)
    if link is not None:
        link.count = 0
        VERSION[0] += 1


def confirmed(entry):
    """``(body, entry, flags)`` of the key a confirmed link from ``entry`` leads to, or None."""
    link = _links.get(entry)
    if link is None or link.count < CONFIRM:
        return None
    body, nxt = link.body(), link.entry()
    return None if body is None or nxt is None else (body, nxt, link.flags)


def observe(body, entry, call):
    """Called before a block replay through the bridge: records a link when this call is given
    the output of the latest one, unchanged, with the same other tensors (other arguments are
    compared by value, through the key, when a chain serves the call: ChainRun.hand_out)."""
    seen = getattr(_local, "last", None)
    _local.last = None
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
    link = _links.get(before)
    if link is not None and link.entry() is entry and link.body() is body:
        link.count += 1
        if link.count == CONFIRM:
            VERSION[0] += 1
        return
    _links[before] = _Link(body, entry, flags(entry.graphs.current))
    VERSION[0] += 1
