"""The process's global random generators kept as they were around work that
an unpatched load does not do (the probes).

A probe builds and fills small models: mindspore's random initializers take
their seeds from numpy's global RandomState, and a model may draw from
Python's `random` or mindspore's default generator. A seeded script must
draw the same numbers after a load whether or not the probes ran in it.
"""

from __future__ import annotations

import contextlib
import random
import sys

import numpy as np


def _mindspore_generator():
    """(get_rng_state, set_rng_state) of mindspore's default generator, or
    None where mindspore is not imported or has no such functions."""
    ms = sys.modules.get("mindspore")
    get, put = getattr(ms, "get_rng_state", None), getattr(ms, "set_rng_state", None)
    return (get, put) if callable(get) and callable(put) else None


def snapshot() -> tuple:
    """The state of every global generator: numpy's, Python's, mindspore's default (or None)."""
    generator = _mindspore_generator()
    return np.random.get_state(), random.getstate(), generator[0]() if generator else None


def restore(state: tuple) -> None:
    numpy_state, python_state, mindspore_state = state
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    generator = _mindspore_generator()
    if mindspore_state is not None and generator is not None:
        generator[1](mindspore_state)


@contextlib.contextmanager
def kept():
    """Global generators put back on exit (also on error). Their state is
    per process: a draw another thread makes meanwhile is undone too, so
    this wraps only the once-per-process probes, never a load's own work."""
    state = snapshot()
    try:
        yield
    finally:
        restore(state)
