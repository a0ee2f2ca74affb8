"""The one way building/ patches mindspore for a while: a Swap replaces one
attribute of a class or module and later puts back exactly what was there
(the class's own attribute, or none: the attribute is deleted and the
inherited one shows again). It restores only while the attribute is still
its replacement: a patch laid over it since is someone else's, left in
place and reported by leftover(). Who runs the fast path (the building
thread) is the replacement's own test; Swaps holds a group."""

from __future__ import annotations

import threading

_MISSING = object()
_shared_lock = threading.Lock()


class Swap:
    __slots__ = ("owner", "name", "replacement", "original", "installed")

    def __init__(self, owner, name: str, replacement):
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = _MISSING  # the owner's own attribute before install()
        self.installed = False

    def install(self) -> None:
        self.original = vars(self.owner).get(self.name, _MISSING)
        setattr(self.owner, self.name, self.replacement)
        self.installed = True

    def owns(self) -> bool:
        """The attribute is still this swap's replacement."""
        return vars(self.owner).get(self.name, _MISSING) is self.replacement

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if not self.owns():  # someone patched over it: theirs stays
            return
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)

    def leftover(self) -> str | None:
        if not self.owns():
            return None
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        return f"{owner}.{self.name} still patched"


class Swaps:
    """Swaps installed together (all or none) and put back in reverse order;
    also a context manager."""

    def __init__(self, swaps=()):
        self.swaps = [s if isinstance(s, Swap) else Swap(*s) for s in swaps]

    def add(self, owner, name: str, replacement) -> Swap:
        """One more swap, installed now."""
        swap = Swap(owner, name, replacement)
        swap.install()
        self.swaps.append(swap)
        return swap

    def install(self) -> None:
        done = []
        try:
            for swap in self.swaps:
                swap.install()
                done.append(swap)
        except BaseException:
            for swap in reversed(done):
                swap.uninstall()
            raise

    def uninstall(self) -> None:
        for swap in reversed(self.swaps):
            swap.uninstall()

    def leftovers(self) -> list[str]:
        return [found for found in (swap.leftover() for swap in self.swaps) if found is not None]

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.uninstall()


class SharedSwaps:
    """Swaps held while any thread needs them (users counted under one
    lock): the first user installs the Swaps `make()` returns, the last puts
    them back and calls `ended()`."""

    def __init__(self, make, ended=None):
        self.make, self.ended, self.users, self.swaps = make, ended, 0, None

    def __enter__(self):
        with _shared_lock:
            if self.users == 0:
                swaps = self.make()
                swaps.install()
                self.swaps = swaps
            self.users += 1
        return self

    def __exit__(self, *exc):
        with _shared_lock:
            self.users -= 1
            if self.users == 0:
                self.swaps.uninstall()
                self.swaps = None
                if self.ended is not None:
                    self.ended()
