"""The process's global random generators kept as they were around work that
an unpatched load does not do (the probes).

A probe builds and fills small models: mindspore's random initializers take
their seeds from numpy's global RandomState, and a model may draw from
Python's `random`. A seeded script must draw the same numbers after a load
whether or not the probes ran in it. mindspore's default generator is not
touched by the probes (tests/loading/test_random_state.py compares it too), and is
not read here: `get_rng_state()` launches an op, and two threads reading it
at once (two first loads) hung mindspore 2.10.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np


@contextlib.contextmanager
def kept():
    """numpy's global RandomState and Python's `random` put back on exit
    (also on error). Their state is per process: a draw another thread
    makes meanwhile is undone too, so this wraps only the once-per-process
    probes, never a load's own work."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
