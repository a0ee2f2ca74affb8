"""What a construction technique is: the interface every one implements."""

from __future__ import annotations


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
    code = getattr(original, "__code__", None)
    if code is None:
        raise ProbeFailed(f"nn.Cell.{name} is not a Python function")
    unknown = sorted(set(code.co_names) - known_names)
    if unknown:
        raise ProbeFailed(f"nn.Cell.{name} refers to {', '.join(unknown)}: side effects this technique does "
                          "not reproduce")
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
