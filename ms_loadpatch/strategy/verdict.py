"""One shape for every speed technique's status row, whatever its kind
(API, cast-on-read, cell passes, construction), and the check techniques
that reproduce a mindspore function make of its code."""

from __future__ import annotations

import dataclasses

from . import switch

ACTIVE, SKIPPED, OFF = "active", "skipped", "off"


@dataclasses.dataclass(frozen=True)
class Problem:
    """A probe's finding: which technique cannot be used here, the libraries
    whose fast path it gates, and why (what status, the gate and the log show)."""

    technique: str
    libraries: tuple[str, ...]
    reason: str


def row(name: str, libraries, description: str, problem: str | None, passed: str) -> dict:
    """status()'s row of a probed technique switched on: active (reason
    `passed`) when its probe found no `problem`, else skipped with the
    probe's reason. `libraries` None: left to the caller (the technique table)."""
    if problem is None:
        return _row(name, libraries, description, ACTIVE, passed)
    return _row(name, libraries, description, SKIPPED, f"probe failed: {problem}")


def row_off(name: str, libraries, description: str) -> dict:
    """The row of a technique MS_LOADPATCH_TECHNIQUES_OFF names (its probe need not run)."""
    return _row(name, libraries, description, OFF, switch.reason_off())


def _row(name, libraries, description, state, reason) -> dict:
    row = {"name": name} if libraries is None else {"name": name, "libraries": list(libraries)}
    return {**row, "description": description, "state": state, "reason": reason}


def unknown_globals(function, known) -> list[str] | None:
    """The global names `function`'s code refers to outside `known`, sorted
    (for a technique reproducing it, each is a side effect it would miss);
    None when `function` is not a Python function."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return sorted(set(code.co_names) - set(known))
