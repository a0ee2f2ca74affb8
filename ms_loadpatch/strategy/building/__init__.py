"""Building cells and parameters with less Python work, producing the same objects.

Entered inside the lazy-construction window (construction.lazy_construction and
the from_config wrappers), under CONSTRUCTION_LOCK, for the building thread
only: each technique (technique.Technique) swaps one mindspore function for
a dispatcher that runs the fast version in the building thread and the
original everywhere else; the originals are put back in `finally` when the
outermost window closes (window.py). Each technique has a probe
(probe.py) that runs once per process; a failed probe skips it and
`technique_status()` says why. MS_LOADPATCH_TECHNIQUES_OFF (switch.py)
turns techniques off by name.
"""

from __future__ import annotations

import contextlib

from .. import randomstate, switch, verdict
from ..probe_cache import ProbeCache
from . import deferred_writes, draws, gc_pause, init_pass, lazy_writes, window
from .cell_init_template import CellInitTemplate
from .flat_name_walk import FlatNameWalk
from .gc_pause import GcPause
from .host_factories import HostFactories
from .lazy import CONSTRUCTION_LOCK
from .primitive_defaults import PrimitiveDefaults
from .probe import run_probes
from .sibling_clone import SiblingClone
from .signature_cache import SignatureCache

_FLAT_NAME_WALK = FlatNameWalk()
_SIBLING_CLONE = SiblingClone()
TECHNIQUES = (
    CellInitTemplate(),
    SignatureCache(),
    PrimitiveDefaults(),
    _FLAT_NAME_WALK,
    _SIBLING_CLONE,
    GcPause(),
    HostFactories(),
)

_probe_results = ProbeCache()  # technique name -> its probe's reason, None when it passed


def engaged_at() -> int | None:
    """The cell of the last build at which its techniques engaged (None: built plainly)."""
    return window.state.engaged_at


def named_parameters(root, cells: list | None = None) -> list | None:
    """root.parameters_and_names() as a list through flat-name-walk's walk
    when it is installed for the calling thread's window, else None; `cells`
    (a list) then gets root.cells_and_names()'s cells from the same walk."""
    return _FLAT_NAME_WALK.named_parameters(root, cells)


def copied_from_by_id():
    """A lookup of id(cell) -> the sibling-clone recipe the cell was copied
    from, for calls from this thread while its window stays open (outside the
    builder, one that finds none)."""
    return _SIBLING_CLONE.copied_from_by_id() if window.in_builder() else {}.get


def probe_result(technique) -> str | None:
    """The probe's verdict for `technique` on this process's mindspore (run once)."""
    if window.state.depth:  # inside a window the probe would compare the fast path with itself
        raise RuntimeError("ms_loadpatch: fast-construction probes cannot run inside a construction window")
    if technique.name in _probe_results:
        return _probe_results[technique.name]

    def probe():
        with gc_pause.collection_paused(), randomstate.kept():
            _probe_groups(technique)
        return _probe_results[technique.name]

    with CONSTRUCTION_LOCK:  # first, always: a build reaching its start cell holds it when it asks
        return _probe_results.get(technique.name, probe)


def _probe_groups(technique):
    """The early techniques alone (a small build need not pay the others'), then the rest if `technique` is one."""
    _probe_group(early=True)
    if not technique.engages_early:  # probed with the early ones a real build installs beside them
        _probe_group(
            early=False,
            alongside=[
                t
                for t in TECHNIQUES
                if t.engages_early and not switch.is_off(t.name) and _probe_results[t.name] is None
            ],
        )


def _probe_group(early: bool, alongside=()):
    group = [t for t in TECHNIQUES if t.engages_early == early]
    if any(t.name not in _probe_results for t in group):
        _probe_results.update(run_probes(group, alongside))


def switched_off() -> set[str]:
    """The construction techniques MS_LOADPATCH_TECHNIQUES_OFF turns off."""
    return {t.name for t in TECHNIQUES if switch.is_off(t.name)}


def technique_status() -> list[verdict.TechniqueRow]:
    """One verdict.row per technique (its libraries left to the technique table,
    which knows them). Runs the probes (once per process); needs mindspore."""
    rows = []
    for technique in TECHNIQUES:
        if switch.is_off(technique.name):
            rows.append(verdict.row_off(technique.name, None, technique.description))
        else:
            rows.append(
                verdict.row(
                    technique.name,
                    None,
                    technique.description,
                    probe_result(technique),
                    passed="probe passed: the probe model is identical with and without it",
                )
            )
    rows.append(deferred_writes.status_row())
    rows.append(init_pass.batched_draws_row())
    return rows


def active_techniques(early: bool = False) -> list:
    """The techniques switched on whose probe passed: those installed once a
    build reaches its start cell, or (`early`) those installed when it begins."""
    return [t for t in TECHNIQUES if t.engages_early == early and not switch.is_off(t.name) and probe_result(t) is None]


def leftovers() -> list[str]:
    """What a closed window would have left behind (for tests): empty when
    nothing of fast construction is installed."""
    found = []
    if window.state.depth or window.state.builder is not None:
        found.append(f"a construction window is open (depth {window.state.depth})")
    for technique in TECHNIQUES:
        found += technique.leftovers()
    if window.counter_left_installed():
        found.append("nn.Cell.__init__ still counts cells")
    return found + gc_pause.leftovers() + draws.leftovers() + init_pass.leftovers() + lazy_writes.leftovers()


@contextlib.contextmanager
def fast_construction(lazy_parameters: bool = True, checkpoint_tensors: int | None = None):
    """Construction in this thread takes every active technique's fast path
    once it has made window.start_after_cells(checkpoint_tensors) cells
    (`checkpoint_tensors`: what the checkpoint being loaded holds, if known).
    Call with CONSTRUCTION_LOCK held. Without `lazy_parameters` (from_config:
    parameters get their random values while the model is built) cells are
    never copied: a copy would skip its draws from the random generator."""
    if window.state.depth and window.in_builder():
        with window.open_window(list):
            yield
        return

    def choose():
        techniques = active_techniques()
        return techniques if lazy_parameters else [t for t in techniques if not isinstance(t, SiblingClone)]

    with window.open_window(
        choose, window.start_after_cells(checkpoint_tensors), early=lambda: active_techniques(early=True)
    ):
        yield
