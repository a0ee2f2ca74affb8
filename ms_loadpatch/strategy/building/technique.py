"""What a construction technique is: the interface every one implements."""

from __future__ import annotations

import threading

from .. import verdict
from . import window
from .swaps import Swap


class ProbeFailed(Exception):
    """The fast path cannot be shown to match mindspore's on this install."""


class Technique:
    """One construction technique. `prepare()` finds what it patches on the
    installed mindspore (raises ProbeFailed when it cannot), `install()`
    patches it for the open window (False: someone else's patch is there,
    nothing done), `uninstall()` puts the originals back, `leftovers()` says
    what an uninstalled technique still holds. The probe builds its model
    with the technique and compares the whole state with a plain build;
    `probe_started()` / `probe_finished(token)` add the technique's own
    check (a reason when it did not do its work)."""

    name = ""
    description = ""
    # the probe build leaves cyclic collection to the technique (gc-pause)
    pauses_collection = False
    # installed when the window opens, not once the build reaches its start cell
    engages_early = False
    # a model of its own to probe on (with `probe_values(model)`), instead of the shared one
    probe_model = None

    def prepare(self) -> None:
        raise NotImplementedError

    def install(self) -> bool:
        raise NotImplementedError

    def uninstall(self) -> None:
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        return []

    def probe_started(self):
        return None

    def probe_finished(self, token) -> str | None:
        return None


def cell_method(name: str, known_names: frozenset):
    """(nn.Cell, its own method `name`) for a technique that reproduces the
    method: it must be a Python function referring to no global name outside
    `known_names` (any other is a side effect the technique would miss)."""
    from mindspore import nn

    original = vars(nn.Cell).get(name)
    unknown = verdict.unknown_globals(original, known_names)
    if unknown is None:
        raise ProbeFailed(f"nn.Cell.{name} is not a Python function")
    if unknown:
        raise ProbeFailed(
            f"nn.Cell.{name} refers to {', '.join(unknown)}: side effects this technique does not reproduce"
        )
    return nn.Cell, original


def cell_registration():
    """What nn.Cell.__init__ calls to register a cell (Cell_, cells_compile_cache,
    init_pipeline), from its module, for techniques that make cells themselves."""
    from mindspore import nn

    module = getattr(vars(nn.Cell).get("__init__"), "__globals__", {})
    for needed in ("Cell_", "cells_compile_cache", "init_pipeline"):
        if needed not in module:
            raise ProbeFailed(f"nn.Cell.__init__'s module has no {needed}")
    return module["Cell_"], module["cells_compile_cache"], module["init_pipeline"]


class InitHooks:
    """Per-class `__init__` wrappers for one window: a dispatcher on a base
    class's own `__init__` notices each class the building thread builds
    (`notice(cls, base_init)`, once per class), which may `wrap` that class's
    `__init__` or `leave` it; `restore()` puts every one back."""

    def __init__(self):
        self.hooked: dict = {}  # class -> its Swap of __init__, or None (left alone)
        self.base = self.base_init = self.dispatcher = None
        self.base_swap = None

    def install(self, base, notice) -> bool:
        current = vars(base).get("__init__")
        if current is None:
            return False
        hooked = self.hooked

        def __init__(obj, *args, **kwargs):
            if window.state.builder == threading.get_ident():
                cls = type(obj)
                if cls not in hooked:
                    notice(cls, current)
            return current(obj, *args, **kwargs)

        __init__.__wrapped__ = current
        __init__.__doc__ = current.__doc__
        self.base, self.base_init, self.dispatcher = base, current, __init__
        self.base_swap = Swap(base, "__init__", __init__)
        self.base_swap.install()
        return True

    def leave(self, cls) -> None:
        self.hooked[cls] = None

    def wrap(self, cls, fast) -> None:
        """`cls.__init__` calls `fast(cls, init, obj, args, kwargs)` for an
        instance of exactly `cls` in the building thread, `init` otherwise."""
        init = cls.__init__

        def wrapper(obj, *args, **kwargs):
            if window.state.builder != threading.get_ident() or type(obj) is not cls:
                return init(obj, *args, **kwargs)
            return fast(cls, init, obj, args, kwargs)

        wrapper.__wrapped__ = init
        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(wrapper, attribute, getattr(init, attribute, None))
        swap = self.hooked[cls] = Swap(cls, "__init__", wrapper)
        swap.install()

    def restore(self) -> None:
        for swap in self.hooked.values():
            if swap is not None:
                swap.uninstall()
        self.hooked.clear()
        if self.base_swap is not None:
            self.base_swap.uninstall()

    def leftovers(self) -> list[str]:
        found = [f"{cls.__qualname__}.__init__ still wrapped" for cls in self.hooked]
        if self.base_swap is not None and self.base_swap.owns():
            found.append(f"{self.base.__qualname__}.__init__ still notices classes")
        return found
