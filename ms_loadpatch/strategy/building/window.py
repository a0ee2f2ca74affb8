"""The construction window: which thread builds with the techniques, from
which cell of its build, and putting everything back when it closes.

Opened by the outermost caller only, under CONSTRUCTION_LOCK; nested windows
of the same thread join it. The probes open windows of their own (`record`
False), so a status call never reads as a fast build.
"""

from __future__ import annotations

import contextlib
import threading

from ...activation import env_int
from .swaps import Swap

# A build's first cells are plain; the probes run and the techniques engage at
# this cell (0: from the first). Below it the probes cost more than the
# techniques save: a dense model of a few hundred cells
# (docs/architecture.md, "Where it engages").
START_ENV_VAR = "MS_LOADPATCH_FAST_CONSTRUCTION_FROM"
DEFAULT_START = 1000
# A load whose checkpoint holds at least this many tensors engages at once: it
# pays the probes anyway, as its model passes DEFAULT_START cells (mindone's
# transformers build more than one cell a tensor, the MoE families the most),
# and from the first cell it saves on each of those first cells.
EARLY_START_TENSORS = 600


class WindowState:
    """The open window, one object for the process (`state`): written here
    only, under CONSTRUCTION_LOCK; read by the techniques and the load report."""

    def __init__(self):
        # The thread whose construction takes the fast paths (None: no window open).
        self.builder: int | None = None
        self.depth = 0
        # Counts outermost windows: a technique installed in one window is not served
        # in the probes' windows opened inside it (the same thread builds both).
        self.generation = 0
        # Cells the last outermost window had built when its techniques engaged (None: never).
        self.engaged_at: int | None = None
        # What techniques noted about the last recorded window (name -> notes), and
        # whether the window open now is recorded (the probes' windows are not).
        self.notes: dict[str, dict] = {}
        self.recording = False


state = WindowState()


def last_build() -> dict | None:
    """The last recorded build: the cell where its techniques engaged, the
    cells sibling-clone copied, each class built more than once but never
    copied with the first reason, and the tensors host-factories made. None
    before any build engaged or noted."""
    if not state.notes and state.engaged_at is None:
        return None
    copies = state.notes.get("sibling-clone", {})
    return {
        "engaged_at": state.engaged_at,
        "cells_copied": copies.get("cells_copied", 0),
        "not_copied": dict(copies.get("not_copied", {})),
        "host_tensors": state.notes.get("host-factories", {}).get("tensors", 0),
    }


def window_open() -> bool:
    return state.depth > 0


def in_builder() -> bool:
    """Whether the calling thread is the one building in the open window."""
    return state.builder == threading.get_ident()


def start_after_cells(checkpoint_tensors: int | None = None) -> int:
    """The cell of a build at which the techniques engage: START_ENV_VAR;
    else the first cell when the build is for a checkpoint of at least
    EARLY_START_TENSORS tensors (`checkpoint_tensors`: None when not known
    before the build); else DEFAULT_START."""
    value = env_int(START_ENV_VAR, minimum=0)
    if value is not None:
        return value
    return 0 if checkpoint_tensors is not None and checkpoint_tensors >= EARLY_START_TENSORS else DEFAULT_START


class DeferredInstanceCount:
    """`Cell.total_instance_count += 1` rewrites a class attribute of nn.Cell,
    and CPython then invalidates the attribute cache of every subclass (some
    5,000 once mindone is imported) for every cell built. The fast paths
    count their cells here and add them to the class attribute once, when
    their technique is uninstalled (the window's `finally`); only its value
    during the build differs (mindspore reads it when compiling a jit
    function, not while building)."""

    def __init__(self):
        self.pending = 0

    def flush(self, cell_class):
        pending, self.pending = self.pending, 0
        if pending:
            cell_class.total_instance_count += pending


class _StartCounter:
    """Counts the cells the building thread makes (a pass-through wrapper of
    nn.Cell.__init__) and, at the `start`-th, takes itself out and calls
    `reached()`, which runs the probes (once per process) and installs the
    techniques for the rest of the build (True when it installed any)."""

    def __init__(self, start, reached):
        from mindspore import nn

        self.cell_class, self.start, self.reached = nn.Cell, start, reached
        self.count = 0
        self.swap = None

    def install(self):
        original = vars(self.cell_class).get("__init__")
        if original is None:
            return False
        counter = self

        def __init__(cell, *args, **kwargs):
            if state.builder == threading.get_ident():
                counter.count += 1
                if counter.count >= counter.start and counter.uninstall() and counter.reached():
                    state.engaged_at = counter.count
            return original(cell, *args, **kwargs)

        __init__.__wrapped__ = original
        __init__.__doc__ = original.__doc__
        self.swap = Swap(self.cell_class, "__init__", __init__)
        self.swap.install()
        return True

    def uninstall(self) -> bool:
        """Puts nn.Cell.__init__ back; False when already done."""
        if self.swap is None:
            return False
        self.swap.uninstall()
        self.swap = None
        return True


def counter_left_installed() -> bool:
    from mindspore import nn

    return "_StartCounter" in getattr(vars(nn.Cell).get("__init__"), "__qualname__", "")


def _install_chosen(choose, installed) -> bool:
    """Runs the probes (outside the open window: they build models of their
    own) and installs the active techniques into it; True when any was."""
    saved = state.builder, state.depth, state.recording, state.generation
    state.builder, state.depth = None, 0
    try:
        techniques = choose()
    finally:
        state.builder, state.depth, state.recording, state.generation = saved
    before = len(installed)
    for technique in techniques:
        if technique.install():
            installed.append(technique)
    return len(installed) > before


@contextlib.contextmanager
def open_window(choose, start: int = 0, record: bool = True, early=None):
    """Open the building thread's window (the caller holds CONSTRUCTION_LOCK):
    `choose()` gives the techniques, installed at once when `start` is 0,
    else once the build has made `start` cells; `early()` gives those
    installed at once whatever `start`. `record`: the window sets
    `engaged_at` (the probes' windows do not)."""
    if state.depth:
        if state.builder != threading.get_ident():  # cannot happen under the lock; never share a window
            raise RuntimeError("ms_loadpatch: fast construction window opened from two threads")
        state.depth += 1
        try:
            yield
        finally:
            state.depth -= 1
        return
    installed, counter = [], None
    try:
        state.builder = threading.get_ident()
        state.depth = 1
        state.generation += 1
        state.recording = record
        if record:
            state.engaged_at = None
            state.notes.clear()
        if early is not None:
            _install_chosen(early, installed)
        if start > 0:
            counter = _StartCounter(start, lambda: _install_chosen(choose, installed))
            counter.install()
        elif _install_chosen(choose, installed) and record:
            state.engaged_at = 0
        yield
    finally:
        state.depth = 0
        state.builder = None
        if counter is not None:
            counter.uninstall()
        for technique in reversed(installed):
            technique.uninstall()
