"""Every replacement of a Paddle attribute goes through here (NOTE [ Paddle patches ]).

NOTE [ Paddle patches ]
Some of what a graph must refuse or record happens inside Paddle, where no hook reaches: a
host read during a capture, a random kernel after an RNG rewind, the Layers a call uses, the
backward and grad clears of a whole step. For those, the package replaces Paddle attributes
for a while, always through ``Patches`` (or ``patched``): it remembers what the owner itself
held, and ``restore()``, in a ``finally`` or a context manager's exit, puts each back in
reverse order (deleting again what the owner only inherited), so nested patches of one
attribute unwind in order and an exception never leaves one installed.

A few patches stay for the rest of the process (``install_for_process``). Importing the package
installs none of them: paddlefleet/cudagraph/__init__.py only names their install functions
(``on_first_wrapper``), and the first wrapper (``autocudagraph()``, ``autocudagraph_step()``, any
Lifecycle) runs them, once (``install_process_patches``); the patches only some wrappers need are
named with the option that needs them (``on_first_wrapper_with``: chains' with ``chain_calls``) and
run by the first wrapper whose options set it. A process that imports the package and
graphs nothing runs Paddle's own methods; a wrapper is made before its first call, so every capture
and replay runs with them installed. What each must see from before its install is its own NOTE's
concern (NOTE [ Grad consumers ], NOTE [ Saved-tensors hooks ]). The list, with where each lives, is
in docs/design/architecture.md ("Paddle patches"); this module imports nothing from the package, so
every layer (backends included) may use it.
"""

import contextlib
import threading

__all__ = ["Patches", "patched", "install_for_process", "on_first_wrapper", "on_first_wrapper_with",
           "install_process_patches", "process_patches_installed", "temporarily_patched", "unpatched", "install_beneath",
           "own_beneath", "remove_beneath"]

_MISSING = object()
# The install functions of the process-wide patches, in order, and whether they ran.
_PROCESS = {"installs": [], "installed": False, "by_option": {}, "options_installed": set()}
_PROCESS_LOCK = threading.Lock()
# (id(owner), name) -> the Patches that hold that attribute replaced now, first first.
_HELD = {}


class Patches:
    """Paddle attributes replaced for a while; ``restore()`` (or leaving the ``with``) puts
    every one back, last first."""

    def __init__(self):
        self._saved = []

    def set(self, owner, name, replacement):
        """Replaces ``owner.name`` with ``replacement`` until restore()."""
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)
        _HELD.setdefault((id(owner), name), []).append(self)

    def restore(self):
        saved, self._saved = self._saved, []
        for owner, name, own in reversed(saved):
            key = (id(owner), name)
            holders = _HELD.get(key, [])
            if self in holders:
                holders.remove(self)
            if not holders:
                _HELD.pop(key, None)
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


def temporarily_patched(owner, name):
    """Whether a ``Patches`` holds ``owner.name`` replaced now."""
    return (id(owner), name) in _HELD


def unpatched(owner, name):
    """What ``owner.name`` is beneath every temporary patch in force now (what it is when none is)."""
    own = own_beneath(owner, name)
    return own if own is not _MISSING else owner.__dict__.get(name, getattr(owner, name, None))


def _beneath(owner, name):
    """``(saved, k)``: the outermost temporary patch's saved list for ``owner.name`` and the index of its entry
    (None where it has none), or None where no temporary patch holds ``owner.name`` now."""
    holders = _HELD.get((id(owner), name))
    if not holders:
        return None
    saved = holders[0]._saved
    for k, (own_owner, own_name, _) in enumerate(saved):
        if own_owner is owner and own_name == name:
            return saved, k
    return saved, None


def install_beneath(owner, name, replacement):
    """``install_for_process``, where a temporary patch may be in force: the replacement goes beneath
    it (the patch's restore puts the replacement back, not what it replaced)."""
    slot = _beneath(owner, name)
    if slot is None:
        setattr(owner, name, replacement)
    elif slot[1] is not None:
        slot[0][slot[1]] = (owner, name, replacement)


def own_beneath(owner, name):
    """What ``owner``'s own ``__dict__`` holds for ``name`` beneath every temporary patch in force now (a sentinel
    that remove_beneath understands, where the owner only inherits it)."""
    slot = _beneath(owner, name)
    if slot is not None and slot[1] is not None:
        return slot[0][slot[1]][2]
    return owner.__dict__.get(name, _MISSING)


def remove_beneath(owner, name, replacement, own):
    """Undoes ``install_beneath(owner, name, replacement)``: puts back ``own`` (own_beneath's answer before the
    install; its sentinel: the owner inherits the attribute again), beneath any temporary patch in force now. Returns
    False, changing nothing, where ``replacement`` is no longer what the owner holds there (a patch installed for
    the process after it calls it now)."""
    slot = _beneath(owner, name)
    if slot is not None and slot[1] is not None:
        saved, k = slot
        if saved[k][2] is not replacement:
            return False
        saved[k] = (owner, name, own)
        return True
    if owner.__dict__.get(name, _MISSING) is not replacement:
        return False
    if own is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, own)
    return True


def install_for_process(owner, name, replacement):
    """Replaces ``owner.name`` for the rest of the process (an install function's patch)."""
    setattr(owner, name, replacement)


def on_first_wrapper(*installs):
    """Names install functions that ``install_process_patches()`` runs, in order, at the first wrapper
    (the package's import calls this; it replaces nothing). An install added after the first wrapper
    runs at once."""
    with _PROCESS_LOCK:
        _PROCESS["installs"].extend(installs)
        if not _PROCESS["installed"]:
            return
    for install in installs:
        install()


def on_first_wrapper_with(option, *installs):
    """Names install functions that the first wrapper whose options set ``option`` runs, in order, once
    (patches only such wrappers need; the package's import calls this and replaces nothing)."""
    with _PROCESS_LOCK:
        _PROCESS["by_option"].setdefault(option, []).extend(installs)


def install_process_patches(options=None):
    """Runs the process-wide patches' install functions once (every wrapper calls this when made), and
    those named for an option ``options`` sets (on_first_wrapper_with) once."""
    if not _PROCESS["installed"]:
        with _PROCESS_LOCK:
            if not _PROCESS["installed"]:
                for install in _PROCESS["installs"]:
                    install()
                _PROCESS["installed"] = True
    if options is None:
        return
    wanted = [o for o in _PROCESS["by_option"] if o not in _PROCESS["options_installed"] and getattr(options, o, False)]
    if wanted:
        with _PROCESS_LOCK:
            for option in wanted:
                if option not in _PROCESS["options_installed"]:
                    for install in _PROCESS["by_option"][option]:
                        install()
                    _PROCESS["options_installed"].add(option)


def process_patches_installed():
    """Whether the first wrapper installed the process-wide patches."""
    return _PROCESS["installed"]
