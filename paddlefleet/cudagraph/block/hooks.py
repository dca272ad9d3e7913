"""What a graphed block lets the room above it do around its calls (``BlockBody.hooks``). The API
fills it (chains/entry.py: consecutive graphed calls served as one chain); block/ imports nothing
of what fills it, and a block without hooks replays each call alone.
"""

__all__ = ["CallHooks", "NO_HOOKS"]


class CallHooks:
    """The hooks of a BlockBody; this base does nothing (every call replays alone)."""

    __slots__ = ()

    def claim(self, body, args, kwargs, keys):
        """``(entry, plan)`` for a call the hooks serve before the wrapper looks up its entries, or
        None; decides only (no device code). ``keys``: the wrapper's KeyMaker."""
        return None

    def serve(self, plan, args):
        """The Replayed of the call ``claim`` gave ``plan`` for, or None: the call runs alone."""
        return None

    def idle(self):
        """True when ``claim`` would answer None for any call now, acting on nothing."""
        return True

    def idle_holder(self):
        """What idle() reads, for a compiled check (NOTE [ The front door ] in core/front.py): None where idle()
        is always true, an object whose ``run`` is None exactly when idle() is true, or False (ask idle())."""
        return None

    def head(self, body, entry, call):
        """The Replayed of a replay of ``entry`` that the hooks ran themselves (the first call of a
        chain), or None: the block replays the call alone. Called for replays through the bridge."""
        return None

    def replayed(self, body, entry, call, result):
        """After a replay of ``entry`` through the bridge that returned the tensor ``result``."""
        return None


#: The hooks of a block nothing else serves.
NO_HOOKS = CallHooks()
