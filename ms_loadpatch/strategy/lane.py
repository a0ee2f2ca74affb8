"""The package's one per-thread lane: what runs in this thread. The wrappers
of a load's calls find their load here; the mindspore-side replacements,
called with mindspore's arguments only, find this thread's build session
here (building/session.py)."""

from __future__ import annotations

import contextlib
import threading


class ThreadLane(threading.local):
    def __init__(self):
        self.load = None  # the innermost accelerated load (load.Load)
        self.build_then_fill = None  # the innermost build-then-fill call (glue/build_then_fill.py)
        self.build = None  # this thread's build session, made on first use (building/session.py)
        self.probing_cell_passes = False  # cellpasses.probe() running here: mindspore's own passes


lane = ThreadLane()


@contextlib.contextmanager
def entered(field: str, value):
    """`lane.<field>` is `value` for the block, then what it was."""
    outer = getattr(lane, field)
    setattr(lane, field, value)
    try:
        yield value
    finally:
        setattr(lane, field, outer)
