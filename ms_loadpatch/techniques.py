"""Every speed technique in one table, whatever its kind: what status(),
`ms-loadpatch status`, the switch (MS_LOADPATCH_TECHNIQUES_OFF) and the
version matrix read.

Kinds: "api" (how tensors are made, assigned and cast: api_verdict.py,
probed per mindspore), "cast-on-read" (strategy/castread.py), "cell-passes"
(strategy/cellpasses.py), "construction" (strategy/building/) and
"repeated-code" (fingerprints.py: mindone code the glue repeats). Above the
strategy and versions.py: it reads both. A new kind is one entry in `_KINDS`:
a function giving its rows (strategy.verdict.TechniqueRow).
"""

from __future__ import annotations

import dataclasses
import sys

from . import versions


def _api_rows() -> list:
    from .api_verdict import api_verdict

    return api_verdict().rows()


def _cast_on_read_rows() -> list[dict]:
    from .strategy import castread

    return [castread.technique_status(list(versions.LIBRARIES))]


def _cell_pass_rows() -> list[dict]:
    from .strategy import cellpasses

    return [cellpasses.technique_status(["transformers"])]  # the passes after a transformers build


def _construction_rows() -> list[dict]:
    from .strategy import building

    start = building.window.start_after_cells()
    when = f"construction from a build's cell {start}" if start else "construction"
    early = building.window.EARLY_START_TENSORS
    if building.window.start_after_cells(checkpoint_tensors=early) != start:
        when += f" (its first for a checkpoint of {early}+ tensors)"
    return [
        dataclasses.replace(row, libraries=versions.LIBRARIES, description=f"{when}: {row.description}")
        for row in building.technique_status()
    ]


def _repeated_code_rows() -> list[dict]:
    from . import fingerprints

    return fingerprints.rows()


# (kind, rows); all but api need lazy construction (an api row) active
_KINDS = (
    ("api", _api_rows),
    ("cast-on-read", _cast_on_read_rows),
    ("cell-passes", _cell_pass_rows),
    ("construction", _construction_rows),
    ("repeated-code", _repeated_code_rows),
)


def status_rows() -> list[dict]:
    """Every technique with its probe result (the probes run here, once per
    process), or nothing before mindspore is imported: probing imports it."""
    if "mindspore" not in sys.modules:
        return []
    rows = []
    for kind, make_rows in _KINDS:
        if kind != "api" and not _lazy_construction_active(rows):
            continue
        rows += [dataclasses.replace(row, kind=kind) for row in make_rows()]
    return [row.as_dict() for row in rows]


def _lazy_construction_active(rows) -> bool:
    from .strategy.verdict import ACTIVE

    return any(r.name == "lazy-construction" and r.state == ACTIVE for r in rows)


def last_build() -> dict | None:
    """The last model this process built with fast construction: the cell
    where it engaged, cells copied from recipes, and each class built more
    than once but never copied with the first reason. None before any build."""
    window = sys.modules.get(f"{__package__}.strategy.building.window")  # not imported: nothing built
    return window.last_build() if window is not None else None
