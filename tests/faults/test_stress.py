"""The short form of benchmarks/stress_loads.py: 3 threads x 3 rounds of mixed
loads (transformers and diffusers, dense and many-cell, sharded with progress
bars, truncated checkpoints that must fail), in a fresh process. It must end
with every model bit-identical to its unpatched load, no stall, nothing left
behind.

Without the disable() / enable() in the middle: while the plugin is off,
loads are mindone's own, which crash when run concurrently (mindspore 2.10,
mindone 0.5.0), and the script keeps them apart only by timing. The long
form, run by hand, toggles:
    python benchmarks/stress_loads.py --threads 4 --rounds 125
"""

import os
import re
import subprocess
import sys

from _helpers import REPO

KINDS = ["qwen2", "qwen2-sharded", "mixtral", "vae", "unet", "bad", "bad-vae"]
BAD = {"bad", "bad-vae"}


def summary_of(proc) -> dict:
    """The SUMMARY line's fields; `loads` as {kind: count}."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, (
        f"no SUMMARY line; exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    fields = dict(re.findall(r"(\w+)=(\S+)", lines[-1]))
    loads = (
        {}
        if fields["loads"] == "none"
        else {k: int(n) for k, n in (item.split(":") for item in fields.pop("loads").split(","))}
    )
    out = {k: float(v) if k == "seconds" else int(v) for k, v in fields.items() if k != "loads"}
    out["loads"] = loads
    return out


def test_stress_short():
    threads, rounds = 3, 3
    env = dict(os.environ)
    env.pop("MS_LOADPATCH", None)  # the plugin on, as a user's `import ms_loadpatch` has it
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/stress_loads.py",
            "--threads",
            str(threads),
            "--rounds",
            str(rounds),
            "--seed",
            "2",
            "--watchdog",
            "120",
            "--loads",
            ",".join(KINDS),
            "--no-toggle",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    summary = summary_of(proc)
    assert proc.returncode == 0, detail
    assert summary["stalls"] == 0 and summary["mismatches"] == 0, detail
    assert summary["unexpected_errors"] == 0 and summary["leftovers"] == 0, detail
    assert summary["threads"] == threads and summary["rounds"] == threads * rounds, detail
    assert sum(summary["loads"].values()) == threads * rounds
    # seed 2 picks every kind in these 9 rounds (each thread's picks depend on the seed only)
    assert set(summary["loads"]) == set(KINDS), summary["loads"]
    bad_loads = sum(n for kind, n in summary["loads"].items() if kind in BAD)
    assert summary["expected_failures"] == bad_loads > 0, detail
    assert summary["toggles"] == 0, detail
    assert summary["accelerated"] > 0, "no load took the plugin's path: the run proves nothing"
