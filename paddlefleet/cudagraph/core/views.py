"""Read-only views of a wrapper's insides for tools and tests: ``wrapper.entries()``,
``wrapper.entry(key)`` and ``wrapper.body()`` (core/lifecycle.py) hand these out instead of the
Lifecycle's own ``_entries`` and ``_body``, so that what reads a key's graphs or counts cannot
rebind them."""

import types

__all__ = ["ReadOnly", "Views"]


class ReadOnly:
    """Every attribute of ``target`` readable (methods included), none assignable or deletable."""

    __slots__ = ("_target",)

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_target"), name)

    def _refuse(self, name):
        target = object.__getattribute__(self, "_target")
        raise AttributeError(f"a read-only view of {type(target).__name__}: {name!r} cannot be set or deleted "
                             "through it (the wrapper owns it; reset() or the wrapper's options change it)")

    def __setattr__(self, name, value):
        self._refuse(name)

    def __delattr__(self, name):
        self._refuse(name)

    def __eq__(self, other):
        if isinstance(other, ReadOnly):
            other = object.__getattribute__(other, "_target")
        return object.__getattribute__(self, "_target") is other

    def __hash__(self):
        return id(object.__getattribute__(self, "_target"))

    def __repr__(self):
        return f"<read-only {object.__getattribute__(self, '_target')!r}>"


class Views:
    """The Lifecycle's mixin that hands out read-only views; it reads ``_entries``, ``_body`` and
    ``__name__``."""

    def entries(self):
        """``{key: entry}``, read-only, least recently used first: each entry a read-only view (its phase,
        counts, ``graphs``, ``host_cost``), for tools and tests."""
        return types.MappingProxyType({key: ReadOnly(entry) for key, entry in self._entries.items()})

    def entry(self, key=None):
        """A read-only view of ``key``'s entry; without ``key``, of the only key's."""
        if key is not None:
            return ReadOnly(self._entries[key])
        if not self._entries:
            raise LookupError(f"{self.__name__}.entry(): no key yet (or reset() dropped them); call the wrapper first")
        if len(self._entries) > 1:
            raise LookupError(f"{self.__name__}.entry(): {len(self._entries)} keys; pass one of them as key= (the "
                              f"keys of {self.__name__}.entries())")
        return ReadOnly(next(iter(self._entries.values())))

    def body(self):
        """A read-only view of what each phase runs for this kind of call (core/body.py), for tools and tests."""
        return ReadOnly(self._body)
