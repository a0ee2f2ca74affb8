"""The order locks are taken in (docs/architecture.md#locks), checked where
it once could invert: each case in a fresh process (the probes not run yet),
a thread holding CONSTRUCTION_LOCK as a build does while another thread
takes the path that used to take a lock the other way round. A deadlock
shows as the child timing out; the case passes only if both threads finish."""

import os
import subprocess
import sys

import pytest
from _helpers import TESTS_DIR

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
        proc = subprocess.run(
            [sys.executable, "-c", _PRELUDE + CASES[case]], env=env, capture_output=True, text=True, timeout=400
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the two threads deadlocked")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), (proc.stdout[-2000:], proc.stderr[-3000:])


# -- every nested acquisition against ms_loadpatch.locks.LOCK_ORDER

_RECORDING = r"""
import importlib, json, sys, threading
import ms_loadpatch
import mindone.diffusers as md
import mindone.transformers as mt
import mindone.diffusers.models.modeling_utils  # noqa: F401 - the glue imported before the locks are swapped
import mindone.transformers.modeling_utils  # noqa: F401
from ms_loadpatch.locks import LOCK_ORDER
from ms_loadpatch.testing import cpu_kernel_fallbacks

sys.path.insert(0, sys.argv[2])
from _helpers import tiny_qwen2_config, tiny_vae

held = threading.local()
pairs = set()


class Tracked:
    def __init__(self, lock, rank, name):
        self._lock, self.rank, self.name = lock, rank, name

    def acquire(self, *args, **kwargs):
        got = self._lock.acquire(*args, **kwargs)
        if got:
            stack = held.__dict__.setdefault("stack", [])
            if self not in stack:  # a re-entrant lock taken again is no new nesting
                pairs.update((outer.name, self.name, outer.rank, self.rank) for outer in stack)
            stack.append(self)
        return got

    def release(self):
        stack = held.stack
        del stack[len(stack) - 1 - stack[::-1].index(self)]
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    def __getattr__(self, name):
        return getattr(self._lock, name)


names = []
for rank, (module_name, path) in enumerate(LOCK_ORDER):
    owner = importlib.import_module("ms_loadpatch." + module_name)
    *parents, attr = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, attr)
    tracked = Tracked(original, rank, f"{module_name}.{path}")
    setattr(owner, attr, tracked)
    for module in list(sys.modules.values()):  # names bound by `from ... import` elsewhere in the package
        if getattr(module, "__name__", "").startswith("ms_loadpatch"):
            for key, value in list(vars(module).items()):
                if value is original:
                    setattr(module, key, tracked)
    names.append(tracked.name)

root = sys.argv[1]
with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
    mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(root + "/qwen2")
    md.AutoencoderKL(**tiny_vae()).save_pretrained(root + "/vae")
with cpu_kernel_fallbacks():
    worker = threading.Thread(target=ms_loadpatch.status)  # probes from another thread, as a job's monitor might
    worker.start()
    mt.Qwen2ForCausalLM.from_pretrained(root + "/qwen2").half()
    md.AutoencoderKL.from_pretrained(root + "/vae").to(mindspore_dtype_placeholder)
    md.AutoencoderKL.from_config(md.AutoencoderKL.load_config(root + "/vae"))
    worker.join()
    ms_loadpatch.status()
print("RESULT " + json.dumps({"names": names, "pairs": sorted(pairs)}), flush=True)
"""


def test_nested_locks_follow_the_lock_order_table(tmp_path):
    """Real loads of both libraries, status() from another thread, the
    probes run for the first time: every lock of LOCK_ORDER (each resolved,
    so a stale row fails) is only taken while holding locks before it."""
    import json

    here = TESTS_DIR
    env = {k: v for k, v in os.environ.items() if k != "MS_LOADPATCH"}
    env.update(GLOG_v="3")
    code = _RECORDING.replace("mindspore_dtype_placeholder", "__import__('mindspore').float16")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), here], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(lines[-1][len("RESULT ") :])
    from ms_loadpatch.locks import LOCK_ORDER

    assert len(result["names"]) == len(LOCK_ORDER)
    pairs = [tuple(pair) for pair in result["pairs"]]
    assert any(outer == "strategy.building.lazy.CONSTRUCTION_LOCK" for outer, *_ in pairs), pairs  # not vacuous
    inverted = [(outer, inner) for outer, inner, outer_rank, inner_rank in pairs if outer_rank >= inner_rank]
    assert inverted == [], f"taken against LOCK_ORDER (held, then taken): {inverted}"
