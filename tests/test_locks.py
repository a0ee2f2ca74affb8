"""The order locks are taken in (docs/architecture.md#locks), checked where
it once could invert: each case in a fresh process (the probes not run yet),
a thread holding CONSTRUCTION_LOCK as a build does while another thread
takes the path that used to take a lock the other way round. A deadlock
shows as the child timing out; the case passes only if both threads finish."""

import os
import subprocess
import sys

import pytest

_PRELUDE = """
import sys, threading, time
import ms_loadpatch
import mindspore
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK

def finishes(target, seconds=120):
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread

CONSTRUCTION_LOCK.acquire()  # as a build in this thread holds it
"""

CASES = {
    # a build reaching its start cell asks for the construction probes while
    # another thread's status() is probing them
    "probe-lock-after-construction-lock": """
from ms_loadpatch.strategy import building
other = finishes(lambda: building.probe_result(building.TECHNIQUES[0]))
time.sleep(1.0)
building.probe_result(building.TECHNIQUES[0])
CONSTRUCTION_LOCK.release()
other.join(120)
print("DONE" if not other.is_alive() else "STUCK")
""",
    # status() in another thread runs the probes, which wait for the build;
    # the build then starts a nested load, which takes the patcher's lock
    "status-probes-outside-patcher-lock": """
import mindone.transformers.modeling_utils
from ms_loadpatch import core
other = finishes(ms_loadpatch.status)
time.sleep(1.0)
with core.accelerated_load():
    pass
CONSTRUCTION_LOCK.release()
other.join(120)
print("DONE" if not other.is_alive() else "STUCK")
""",
    # another thread imports a patched module first: its import hook runs the
    # API probes under that module's import lock, and must not wait for the build
    "import-hook-takes-no-construction-lock": """
other = finishes(lambda: __import__("mindone.transformers.modeling_utils"))
other.join(120)
finished_while_building = not other.is_alive()
CONSTRUCTION_LOCK.release()
other.join(120)
status = ms_loadpatch.status()["libraries"]["transformers"]
print("DONE" if finished_while_building and status["accelerated"] else f"STUCK {status}")
""",
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_lock_order_inversion(case):
    env = {k: v for k, v in os.environ.items() if k != "MS_LOADPATCH"}
    env.update(GLOG_v="3")
    try:
        proc = subprocess.run([sys.executable, "-c", _PRELUDE + CASES[case]], env=env, capture_output=True, text=True,
                              timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the two threads deadlocked")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), (proc.stdout[-2000:], proc.stderr[-3000:])
