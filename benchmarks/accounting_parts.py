"""The random-state accounting's parts, timed inside one patched load (no
profiler): the init-pass phase and each of its passes, the replays, the
build's draws (`Ledger.take`) and the owed draws taken in batches.

    python benchmarks/accounting_parts.py --case moe
    PYTHONPATH=<another checkout> python benchmarks/accounting_parts.py --case moe

The checkpoint is found (generated once) by a child process with this
tree's helpers; the load itself imports ms_loadpatch as PYTHONPATH gives it,
so two checkouts can take turns. One load per process: run it several
times, sides alternating, and compare medians.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def checkpoint_path(case: str) -> str:
    code = f"import sys; sys.path.insert(0, {HERE!r}); from bench_ab import checkpoint; print(checkpoint({case!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return proc.stdout.strip().splitlines()[-1]


def _timed(owner, name, totals, key, where=None):
    """owner.name timed into totals[key] (`where()`: a suffix naming where the call is)."""
    original = getattr(owner, name, None)
    if original is None:  # a checkout without it
        return

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            full = key + (where() if where else "")
            totals[full] = totals.get(full, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="moe")
    args = parser.parse_args(argv)
    path = checkpoint_path(args.case)

    import ms_loadpatch
    from ms_loadpatch.strategy.building import draws, init_pass

    try:
        from ms_loadpatch.strategy.building import replays
    except ImportError:  # a checkout from before replays.py
        replays = None
    from ms_loadpatch.tools import bench
    from ms_loadpatch.tools._child import _fallbacks, _on_cpu, import_model_class, touch_all

    spec = bench.LoadSpec.resolve(path)
    cls, _ = import_model_class(spec)
    totals: dict[str, float] = {}
    passes, in_pass = [], []
    _timed(draws.Ledger, "take", totals, "build draws (Ledger.take)")
    _timed(
        draws.Ledger,
        "take_owed_draws",
        totals,
        "owed draws",
        lambda: " in the init pass" if in_pass else " of the build",
    )
    _timed(getattr(replays, "Replays", None) or init_pass._Replays, "_replay", totals, "replays")
    run = init_pass.run

    def timed_run(*a, **k):
        start = time.perf_counter()
        in_pass.append(True)
        try:
            return run(*a, **k)
        finally:
            in_pass.pop()
            passes.append(time.perf_counter() - start)

    init_pass.run = timed_run
    with _fallbacks(_on_cpu()):
        start = time.perf_counter()
        model = cls.from_pretrained(spec.model_dir)
        touch_all(model)
        seconds = time.perf_counter() - start
    report = ms_loadpatch.last_report()
    print(f"{args.case}: ms_loadpatch from {os.path.dirname(ms_loadpatch.__file__)}")
    print(
        f"  load {seconds:.3f} s; init-pass phase {report.phases.get('init-pass', 0.0):.3f} s "
        f"(passes {', '.join(f'{p:.3f}' for p in passes)} s)"
    )
    for key, value in totals.items():
        print(f"  {key}: {value:.3f} s")
    accounting = (
        report.phases.get("init-pass", 0.0)
        + totals.get("build draws (Ledger.take)", 0.0)
        + totals.get("owed draws of the build", 0.0)
    )
    print(f"  init pass + the build's draws: {accounting:.3f} s, {accounting / seconds:.1%} of the load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
