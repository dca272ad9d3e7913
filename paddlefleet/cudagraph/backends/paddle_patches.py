"""Every replacement of a Paddle attribute goes through here (NOTE [ Paddle patches ]).

NOTE [ Paddle patches ]
Some of what a graph must refuse or record happens inside Paddle, where no hook reaches: a
host read during a capture, a random kernel after an RNG rewind, the Layers a call uses, the
backward and grad clears of a whole step. For those, the package replaces Paddle attributes
for a while, always through ``Patches`` (or ``patched``): it remembers what the owner itself
held, and ``restore()``, in a ``finally`` or a context manager's exit, puts each back in
reverse order (deleting again what the owner only inherited), so nested patches of one
attribute unwind in order and an exception never leaves one installed. A few patches are
installed for the whole process, once, when the package is imported (``install_for_process``;
paddlefleet/cudagraph/__init__.py calls their install functions). The list, with where each
lives, is in docs/design/architecture.md ("Paddle patches"); this module imports nothing from the
package, so every layer (backends included) may use it.
"""

import contextlib

__all__ = ["Patches", "patched", "install_for_process"]

_MISSING = object()


class Patches:
    """Paddle attributes replaced for a while; ``restore()`` (or leaving the ``with``) puts
    every one back, last first."""

    def __init__(self):
        self._saved = []

    def set(self, owner, name, replacement):
        """Replaces ``owner.name`` with ``replacement`` until restore()."""
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)

    def restore(self):
        saved, self._saved = self._saved, []
        for owner, name, own in reversed(saved):
            if own is _MISSING:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, own)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


@contextlib.contextmanager
def patched(*replacements):
    """``with patched((owner, name, replacement), ...):`` the replacements in force for the block."""
    patches = Patches()
    try:
        for owner, name, replacement in replacements:
            patches.set(owner, name, replacement)
        yield patches
    finally:
        patches.restore()


def install_for_process(owner, name, replacement):
    """Replaces ``owner.name`` for the rest of the process (an install function's patch)."""
    setattr(owner, name, replacement)
