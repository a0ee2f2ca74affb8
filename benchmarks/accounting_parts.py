"""The random-state accounting's parts, timed inside one patched load (no
profiler): the init-pass phase and each of its passes, the replays, the
build's draws (`Ledger.take`), the owed draws taken in batches, and the
once-per-process probes the accounting runs outside the init pass.

Each part is timed twice: wall clock, and the building thread's CPU time
(`time.thread_time`). The load reads its checkpoint in other threads
meanwhile, so a part's wall time includes waits for the GIL that the same
load would spend elsewhere without the accounting; its CPU time does not.
A probe run in a thread of its own (deferred_writes') counts by wall time.

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
    """owner.name timed into totals[key] as [wall, CPU] seconds (`where()`:
    a suffix naming where the call is). Nested calls count once."""
    original = getattr(owner, name, None)
    if original is None:  # a checkout without it
        return
    depth = [0]

    def timed(*args, **kwargs):
        depth[0] += 1
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                full = key + (where() if where else "")
                spent = totals.setdefault(full, [0.0, 0.0])
                spent[0] += time.perf_counter() - start
                spent[1] += time.thread_time() - cpu

    setattr(owner, name, timed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="moe")
    args = parser.parse_args(argv)
    path = checkpoint_path(args.case)

    import ms_loadpatch
    from ms_loadpatch.strategy.building import deferred_writes, draws, init_pass

    try:
        from ms_loadpatch.strategy.building import batched_draws
    except ImportError:  # a checkout from before batched_draws.py
        from ms_loadpatch.strategy.building import draws as batched_draws

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
    _timed(
        draws.Ledger, "take", totals, "draws (Ledger.take)", lambda: " in the init pass" if in_pass else " of the build"
    )
    _timed(
        draws.Ledger,
        "take_owed_draws",
        totals,
        "owed draws",
        lambda: " in the init pass" if in_pass else " of the build",
    )
    _timed(getattr(replays, "Replays", None) or init_pass._Replays, "_replay", totals, "replays")
    where = lambda: " in the init pass" if in_pass else " outside the init pass"  # noqa: E731
    _timed(deferred_writes, "verified", totals, "deferred-writes probe", where)
    _timed(batched_draws, "problem", totals, "batched-draws probe", where)
    _timed(draws, "verified_classes", totals, "draw classes probe", where)
    run = init_pass.run

    def timed_run(*a, **k):
        start, cpu = time.perf_counter(), time.thread_time()
        in_pass.append(True)
        try:
            return run(*a, **k)
        finally:
            in_pass.pop()
            passes.append((time.perf_counter() - start, time.thread_time() - cpu))

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
        f"(passes {', '.join(f'{wall:.3f}' for wall, _ in passes)} s wall, "
        f"{', '.join(f'{cpu:.3f}' for _, cpu in passes)} s CPU)"
    )
    for key, (wall, cpu) in totals.items():
        print(f"  {key}: {wall:.3f} s wall, {cpu:.3f} s CPU")
    build = ("draws (Ledger.take) of the build", "owed draws of the build")
    probes = [key for key in totals if key.endswith(" outside the init pass")]
    wall = report.phases.get("init-pass", 0.0) + sum(totals[key][0] for key in build + tuple(probes) if key in totals)
    cpu = (
        sum(p[1] for p in passes)
        + sum(totals[key][1] for key in build if key in totals)
        + sum(totals[key][0] for key in probes)  # a probe's thread may be another: its wall time
        + totals.get("deferred-writes probe in the init pass", [0.0])[0]  # run in a thread of its own
    )
    print(
        f"  init pass + the build's draws + probes outside the pass: {wall:.3f} s wall, {wall / seconds:.1%} "
        f"of the load; {cpu:.3f} s CPU, {cpu / seconds:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
