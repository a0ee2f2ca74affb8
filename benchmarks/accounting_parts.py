"""The random-state accounting's parts, timed inside one patched load (no
profiler): the init-pass phase and each of its passes, the replays, the
build's draws (`Ledger.take`), the owed draws taken in batches, and the
once-per-process probes the accounting runs outside the init pass.

Each part is timed twice: wall clock, and the building thread's CPU time
(`time.thread_time`). The load reads its checkpoint in other threads
meanwhile, so a part's wall time includes waits for the GIL that the same
load would spend elsewhere without the accounting; its CPU time does not.
A probe run in a thread of its own (deferred_writes') counts by wall time.
Timing a call costs about a microsecond, which across the MoE's 50k timed
calls would be counted as accounting: that cost, measured in the same
process on a method doing nothing, is taken off each part (its own timer,
and those of the timed calls inside it) and off the passes.

    python benchmarks/accounting_parts.py --case moe
    PYTHONPATH=<another checkout> python benchmarks/accounting_parts.py --case moe
    python benchmarks/accounting_parts.py --case moe --floor

With --floor, each init pass is preceded by the least an exact pass must
read (`least_pass`: every cell as `Cell.apply` visits it, its init flag
looked up and, where unset, each lazy parameter's initializer read; nothing
written), timed the same way: a floor under any exact pass in Python. That
walk warms what the pass then touches, so the passes of a --floor run are
not compared with those of a plain one.

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


_open: list = []  # per timed call in progress: the timed calls made inside it so far


def _timed(owner, name, totals, key, where=None):
    """owner.name timed into totals[key] as [wall, CPU seconds, calls, timed
    calls inside them] (`where()`: a suffix naming where the call is). A
    call inside a call to the same method counts once."""
    original = getattr(owner, name, None)
    if original is None:  # a checkout without it
        return
    depth = [0]

    def timed(*args, **kwargs):
        if depth[0]:
            return original(*args, **kwargs)
        depth[0] += 1
        _open.append(0)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            depth[0] -= 1
            inner = _open.pop()
            if _open:
                _open[-1] += 1 + inner
            full = key + (where() if where else "")
            spent = totals.setdefault(full, [0.0, 0.0, 0, 0])
            spent[0] += wall
            spent[1] += cpu
            spent[2] += 1
            spent[3] += inner

    setattr(owner, name, timed)


def timer_cost(calls=20000) -> tuple[float, float]:
    """What timing one call adds, in CPU seconds: (inside the call's own
    measured interval, to a timer around it), from a method that does
    nothing, timed as the parts are (the least of three runs)."""

    class Nothing:
        def call(self):
            return None

    totals, raw = {}, Nothing.call
    _timed(Nothing, "call", totals, "nothing")
    thing, inside, around = Nothing(), [], []
    for _ in range(3):
        totals.clear()
        start = time.thread_time()
        for _ in range(calls):
            raw(thing)
        plain = time.thread_time() - start
        start = time.thread_time()
        for _ in range(calls):
            thing.call()
        wrapped = time.thread_time() - start
        inside.append((totals["nothing"][1] - plain) / calls)
        around.append((wrapped - plain) / calls)
    return max(0.0, min(inside)), max(0.0, min(around))


def least_pass(root, flag="_is_hf_initialized") -> tuple[int, int]:
    """Reads what any exact init pass over `root` reads, and writes nothing:
    each cell once per parent (as Cell.apply), its flag looked up in its
    instance dict and, where it is unset, each lazy parameter's initializer.
    (cells, parameters)."""
    cells = params = 0
    stack = [root]
    while stack:
        cell = stack.pop()
        own = cell.__dict__
        cells += 1
        for param in () if own.get(flag) else (own.get("_params") or {}).values():
            tensor = getattr(param, "init_mode", None) if param is not None else None
            if tensor is not None:
                tensor.init  # noqa: B018 - the read a pass makes of each initializer
                params += 1
        children = own.get("_cells")
        if children:
            stack.extend(dict.fromkeys(child for child in children.values() if child is not None))
    return cells, params


def _nested_calls(totals) -> int:
    """The timed calls made so far inside init passes."""
    return sum(spent[2] for key, spent in totals.items() if key == "replays" or key.endswith(" in the init pass"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="moe")
    parser.add_argument("--floor", action="store_true", help="time least_pass before each init pass")
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
    passes, in_pass, floors = [], [], []
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
        if args.floor:
            cpu = time.thread_time()
            cells, params = least_pass(a[0] if a else k["root"])
            floors.append((time.thread_time() - cpu, cells, params))
        start, cpu, calls = time.perf_counter(), time.thread_time(), _nested_calls(totals)
        in_pass.append(True)
        try:
            return run(*a, **k)
        finally:
            in_pass.pop()
            passes.append((time.perf_counter() - start, time.thread_time() - cpu, _nested_calls(totals) - calls))

    init_pass.run = timed_run
    with _fallbacks(_on_cpu()):
        start = time.perf_counter()
        model = cls.from_pretrained(spec.model_dir)
        touch_all(model)
        seconds = time.perf_counter() - start
    report = ms_loadpatch.last_report()
    inside, around = timer_cost()
    # each timed call's own cost, taken off its part; the calls timed inside a pass, off the pass
    for spent in totals.values():
        spent[0] -= spent[2] * inside + spent[3] * around
        spent[1] -= spent[2] * inside + spent[3] * around
    nested = _nested_calls(totals)
    passes = [(wall - calls * around, cpu - calls * around) for wall, cpu, calls in passes]
    # the phase holds the least passes a --floor run adds: taken off (by their CPU time, their wall time alike)
    phase = report.phases.get("init-pass", 0.0) - nested * around - sum(cpu for cpu, _, _ in floors)
    print(f"{args.case}: ms_loadpatch from {os.path.dirname(ms_loadpatch.__file__)}")
    print(
        f"  load {seconds:.3f} s; init-pass phase {phase:.3f} s "
        f"(passes {', '.join(f'{wall:.3f}' for wall, _ in passes)} s wall, "
        f"{', '.join(f'{cpu:.3f}' for _, cpu in passes)} s CPU)"
    )
    print(
        f"  (timing a call costs {inside * 1e6:.2f} us inside it and {around * 1e6:.2f} us around it: "
        f"taken off each part, and off the passes and parts for the timed calls inside them)"
    )
    for key, (wall, cpu, calls, _) in totals.items():
        print(f"  {key}: {wall:.3f} s wall, {cpu:.3f} s CPU, {calls} calls")
    build = ("draws (Ledger.take) of the build", "owed draws of the build")
    probes = [key for key in totals if key.endswith(" outside the init pass")]
    wall = phase + sum(totals[key][0] for key in build + tuple(probes) if key in totals)
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
    if floors:
        least = sum(cpu for cpu, _, _ in floors)
        each = ", ".join(f"{cpu * 1e3:.1f} ms CPU over {c} cells, {p} parameters" for cpu, c, p in floors)
        print(f"  least passes (read only): {each}; {least * 1e3:.1f} ms, {least / seconds:.1%} of the load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
