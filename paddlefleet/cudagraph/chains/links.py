"""What a thread's graphed calls tell about chains (NOTE [ Chains of graphed calls ] in
chains/chain.py): the latest call and its output, the links seen between keys, the links barred
for good (NOTE [ Outputs with consumers outside the chain ]), and the open run. The state lives in
chains/table.py.

NOTE [ Outputs with consumers outside the chain ]
Eagerly, the grad of a layer's output is the sum of what each of its consumers gives it, added in
the order Paddle's backward engine runs those consumers: an order that comes from the caller's whole
graph. A chain computes the next member's part inside its one grad node, after Paddle has summed the
parts of every other consumer: with one other consumer the two terms commute exactly, with two or
more the sum can differ from eager's in the last bit. No order can be proven from inside the chain, so
a link whose output has a consumer outside the chain is **barred**: no chain goes through it again
(the calls replay alone, each with its own grad node), and explain() says so. It is seen two ways:
- before a chain uses the link, while the calls replay alone: the next call's backward records the
  grad it gives the output, and the producer's backward gets another tensor when a grad from another
  consumer reached the output first (Paddle adds later ones into the first, so a consumer whose grad
  arrives after the next call's is not seen here). Both are seen by a ``_Watch`` the bridge's backward
  runs (block/bridge.py's ``Token.watch``);
- in a chain's backward: a grad from outside reached an intermediate output.
The second way sees every such consumer, at the first chained backward that has one; that backward
itself sums in the chain's order (exact with one outside consumer).
"""

import dataclasses
import weakref
from typing import Any, Optional

from .eligible import flags, given_output, gone
from .record import record
from .table import TABLE

__all__ = ["CONFIRM", "OUTSIDE", "bar", "confirmed", "current_run", "forget_link", "observe", "remember",
           "set_run", "watch"]

#: Times a link is seen in a row before a chain uses it.
CONFIRM = 2

#: Why a barred link is not used (explain()).
OUTSIDE = ("its output has consumers outside the chain, whose grads eager sums with the next call's in an order a "
           "chain cannot prove (NOTE [ Outputs with consumers outside the chain ])")


class _Seen:
    """The latest replay of a block in this thread through the bridge, or handed out by a chain;
    ``token``: a weak reference to the bridge's Token of a replay alone (None for a chain's)."""

    __slots__ = ("entry", "output", "version", "extras", "token")

    def __init__(self, entry, output, extras, token):
        self.entry = weakref.ref(entry)
        self.output = weakref.ref(output)
        self.version = output._inplace_version()
        self.extras = extras
        self.token = token


class _Link:
    __slots__ = ("body", "entry", "count", "flags", "barred")

    def __init__(self, body, entry, flags, barred=""):
        self.body = weakref.ref(body)
        self.entry = weakref.ref(entry)
        self.count = 1
        self.flags = flags
        self.barred = barred


def current_run():
    """The open ChainRun of this thread (its next member not handed out yet), or None."""
    return TABLE.thread.run


def set_run(run):
    TABLE.thread.run = run


def remember(entry, output, extras, token=None):
    """Records a call whose single output ``output`` a later call may be given (see observe);
    ``extras``: the call's tensors after its first; ``token``: its bridge Token's weak reference."""
    TABLE.thread.last = _Seen(entry, output, extras, token)


def forget_link(entry):
    """The link from ``entry`` is seen again before a chain uses it (a chain broke there)."""
    link = TABLE.links.get(entry)
    if link is not None:
        link.count = 0
        TABLE.version += 1


def bar(entry, reason):
    """The link from ``entry`` is never used again (NOTE [ Outputs with consumers outside the chain ])."""
    link = TABLE.links.get(entry)
    if link is None or link.barred:
        return
    link.barred = reason
    link.count = 0
    TABLE.version += 1
    record(entry).note = f"calls after it are not chained to it: {reason}"


def confirmed(entry):
    """``(body, entry, flags)`` of the key a confirmed link from ``entry`` leads to, or None; None too where
    that key runs eagerly for good (``gone``): a chain could never reach it, and the head's calls would
    otherwise build a chain of one at every call to find out."""
    link = TABLE.links.get(entry)
    if link is None or link.barred or link.count < CONFIRM:
        return None
    body, nxt = link.body(), link.entry()
    return None if body is None or nxt is None or gone(nxt) else (body, nxt, link.flags)


def observe(body, entry, call):
    """Called before a block replay through the bridge: records a link when this call is given
    the output of the latest one, unchanged, with the same other tensors (other arguments are
    compared by value, through the key, when a chain claims the call: ChainRun.claim)."""
    thread = TABLE.thread
    seen, thread.last, thread.feeding = thread.last, None, None
    if not given_output(seen, call):
        return
    before = seen.entry()
    if before is None:
        return
    link = TABLE.links.get(before)
    if link is not None and link.entry() is entry and link.body() is body:
        link.count += 1
        if link.count == CONFIRM and not link.barred:
            TABLE.version += 1
    else:
        TABLE.links[before] = link = _Link(body, entry, flags(entry.graphs.current), link.barred if link else "")
        TABLE.version += 1
    if not link.barred and seen.token is not None:
        thread.feeding = (weakref.ref(entry), seen.token, weakref.ref(before))


def watch(entry, token):
    """After a replay alone of ``entry`` (its bridge Token ``token``): when it was given the output
    of the replay observe() saw, the two backwards tell whether another consumer gave that output a
    grad first (NOTE [ Outputs with consumers outside the chain ])."""
    thread = TABLE.thread
    feeding, thread.feeding = thread.feeding, None
    if feeding is None or feeding[0]() is not entry or token is None:
        return
    producer = feeding[1]()
    if producer is not None:
        if producer.watch is None:
            producer.watch = _Watch()
        producer.watch.outside = feeding[2]
        if token.watch is None:
            token.watch = _Watch()
        token.watch.feeds = weakref.ref(producer.watch)


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)
class _Watch:
    """What a replay's backward tells the links (block/bridge.py's ``Token.watch``): as the consumer of
    its producer's output (``feeds``: the producer's _Watch, weakly), the address of the grad it gave
    that output (``fed`` on the producer); as a producer whose consumer was watched (``outside``: a weak
    reference to its entry), whether the grad Paddle passed its output is another tensor."""

    feeds: Any = None
    fed: Optional[int] = None
    outside: Any = None

    def __call__(self, grad, given):
        if self.fed is not None and grad is not None and grad.data_ptr() != self.fed:
            entry = self.outside()
            if entry is not None:
                bar(entry, OUTSIDE)
        if self.feeds is not None and given is not None:
            producer = self.feeds()
            if producer is not None:
                producer.fed = given.data_ptr()
