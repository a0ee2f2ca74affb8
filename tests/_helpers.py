"""What several test modules share: running a fresh Python process and
reading the report it prints.

A plain module (conftest.py keeps the fixtures and the environment set at
import): test modules import it by name, as pytest puts tests/ on sys.path,
and so can the child scripts beside it, which run from tests/.
"""

import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


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

