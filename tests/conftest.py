"""Fixtures, and the environment every test process starts from (set here,
at import, before any test module imports mindone). Helpers that test
modules import by name are in _helpers.py."""

import os
import signal

import pytest

# Test models have tens of cells: fast construction engages from their first
# cell (in this process and the ones tests start), so every suite exercises it;
# test_building_window checks the default start on its own.
os.environ.setdefault("MS_LOADPATCH_FAST_CONSTRUCTION_FROM", "0")

# Enabled before any test module imports mindone, as a user's `import
# ms_loadpatch` at the top of a script: the whole suite runs with lazy
# mindone.transformers (unless MS_LOADPATCH or MS_LOADPATCH_LAZY_IMPORT is off).
from _helpers import run_python  # noqa: E402

import ms_loadpatch  # noqa: E402,F401


@pytest.fixture
def python_proc():
    return run_python


@pytest.fixture
def cpu_kernels():
    """Kernels missing from the CPU wheel routed to equivalent ops (both sides of a comparison)."""
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    with cpu_kernel_fallbacks():
        yield


@pytest.fixture
def plugin_enabled():
    """The plugin on for the test, whatever the session's state; restored after."""
    import ms_loadpatch

    with ms_loadpatch.enabled():
        yield


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a
    process started in the background by a non-interactive shell inherits
    SIGINT ignored, and `_thread.interrupt_main` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session", autouse=True)
def cell_passes_probed_on_mindspores_own_cell():
    """The cell-passes probe runs once per process and reads nn.Cell's own
    methods: run before any test records them through monkeypatch (a probe
    that first saw a test's recorder would rightly refuse for the session)."""
    from ms_loadpatch.strategy import cellpasses

    cellpasses.probe()
    yield
