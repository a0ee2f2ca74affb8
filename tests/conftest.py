import json
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Test models have tens of cells: fast construction engages from their first
# cell (in this process and the ones tests start), so every suite exercises it;
# test_building checks the default start on its own.
os.environ.setdefault("MS_LOADPATCH_FAST_CONSTRUCTION_FROM", "0")

# Enabled before any test module imports mindone, as a user's `import
# ms_loadpatch` at the top of a script: the whole suite runs with lazy
# mindone.transformers (unless MS_LOADPATCH or MS_LOADPATCH_LAZY_IMPORT is off).
import ms_loadpatch  # noqa: E402,F401


def run_python(code_or_args, env_extra=None, env_drop=(), timeout=600, cwd=None):
    """Run a fresh Python process (real import order, real environment)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.pop("MS_LOADPATCH", None)
    env.update(env_extra or {})
    args = [sys.executable] + (["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or TESTS_DIR)


def report_of(proc):
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT ") :])
    raise AssertionError(f"no REPORT line; exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")


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
