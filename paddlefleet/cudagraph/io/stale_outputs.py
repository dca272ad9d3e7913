"""Outputs a later replay overwrote (``check_stale_outputs``).

NOTE [ Stale outputs ]
With ``clone_outputs=False`` a call returns aliases of the graph's static output buffers, and
the next replay of the same key rewrites them. With ``check_stale_outputs=True`` every alias
handed out is remembered (weakly); the next replay of its key marks the aliases still alive as
stale and releases their storage handle (the static buffer itself is untouched). Afterwards:

* passing a stale tensor to any graphed call raises StaleOutputError naming the replay that
  overwrote it (checked before anything else reads the tensor);
* any Paddle op or backward that reads it fails loudly ("Tensor holds no memory") instead of
  reading the new values: this also covers autograd, e.g. ``loss = (y * w).sum()`` whose
  backward would otherwise use the overwritten ``y``;
* not detected: ``y.numpy()`` returns an empty array and ``print(y)`` shows "Not
  initialized" (Paddle's behaviour for a tensor without storage); ``y.shape`` still reads;
  views taken from ``y`` before the overwrite (``y[0]``, ``y.reshape(...)``, ``y.T``) share the
  static buffer's storage through their own handle and silently read the new values, in
  autograd too. Clone an output before taking views you keep across calls.
"""

import weakref

from ..errors import StaleOutputError

__all__ = ["StaleOutputs", "any_stale", "check_fresh"]

# id -> (weakref, message) of outputs a later replay overwrote (NOTE [ Stale outputs ]).
_stale = {}


def _forget(key):
    _stale.pop(key, None)


def any_stale():
    """True while some output a later replay overwrote is alive (check_fresh may raise)."""
    return bool(_stale)


def check_fresh(tensors):
    """Raises StaleOutputError when one of ``tensors`` is an output a later replay overwrote."""
    if not _stale:
        return
    for t in tensors:
        rec = _stale.get(id(t))
        if rec is not None and rec[0]() is t:
            raise StaleOutputError(rec[1])


class StaleOutputs:
    """The aliases one key handed out at its latest replay, to mark stale at the next one."""

    def __init__(self):
        self._handed = []
        self._replay = 0

    def overwrite(self, name, label, call_site):
        """Called right before a replay rewrites the static outputs: marks the previous
        replay's aliases that are still alive as stale and releases their storage handle."""
        self._replay += 1
        handed, self._handed = self._handed, []
        for index, ref in handed:
            t = ref()
            if t is None or not t._is_initialized():
                continue
            message = (
                f"autocudagraph: this tensor is output {index} of {name} from run #{self._replay - 1} of the "
                f"graph of key {label}, and run #{self._replay} of that graph, called at {call_site}, "
                "overwrote it: with clone_outputs=False outputs are the graph's static buffers. Clone an "
                f"output you keep across calls (y = {name}(...).clone()), or use clone_outputs=True."
            )
            key = id(t)
            _stale[key] = (weakref.ref(t, lambda _, key=key: _forget(key)), message)
            t._clear_data()

    def hand_out(self, outputs, copies=()):
        """Remembers (weakly) the aliases given to the caller by this replay; ``copies``: indices
        of outputs handed out as copies (host outputs), which no replay overwrites."""
        self._handed = [(i, weakref.ref(o)) for i, o in enumerate(outputs) if i not in copies]
