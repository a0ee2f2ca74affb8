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


@dataclasses.dataclass(frozen=True)
class TechniqueRow:
    """status()'s row of one speed technique, whatever its kind."""

    name: str
    description: str
    state: str  # ACTIVE, SKIPPED or OFF
    reason: str
    libraries: tuple[str, ...] = ()  # empty: the technique table (techniques.py) gives them
    kind: str = ""  # the technique table's kind, set there

    def as_dict(self) -> dict:
        """The row as status() shows it."""
        return {
            "name": self.name,
            "libraries": list(self.libraries),
            "description": self.description,
            "state": self.state,
            "reason": self.reason,
            "kind": self.kind,
        }


def row(name: str, libraries, description: str, problem: str | None, passed: str) -> TechniqueRow:
    """The row of a probed technique switched on: active (reason `passed`)
    when its probe found no `problem`, else skipped with the probe's reason.
    `libraries` None: left to the technique table."""
    if problem is None:
        return TechniqueRow(name, description, ACTIVE, passed, tuple(libraries or ()))
    return TechniqueRow(name, description, SKIPPED, f"probe failed: {problem}", tuple(libraries or ()))


def row_off(name: str, libraries, description: str) -> TechniqueRow:
    """The row of a technique MS_LOADPATCH_TECHNIQUES_OFF names (its probe need not run)."""
    return TechniqueRow(name, description, OFF, switch.reason_off(), tuple(libraries or ()))


def unknown_globals(function, known) -> list[str] | None:
    """The global names `function`'s code refers to outside `known`, sorted
    (for a technique reproducing it, each is a side effect it would miss);
    None when `function` is not a Python function."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return sorted(set(code.co_names) - set(known))
