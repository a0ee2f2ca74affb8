"""Benchmark harness: unpatched vs patched `from_pretrained`, each load in a
fresh process; also the engine under `ms-loadpatch verify`.

Reusable from scripts (benchmarks/*.py)::

    from ms_loadpatch.tools import bench

    path = bench.cached_checkpoint("my-moe", "MixtralForCausalLM", {...config...})
    spec = bench.LoadSpec.resolve(path)              # class inferred from config.json
    results = bench.run_bench(spec, repeats=3)
    print(bench.format_table(results))

This module imports no mindspore: every mindspore / mindone import happens in
the child processes (`tools/children.py`, `tools/_child.py`), so each load
starts cold and the parent's memory does not count in the children's peak
RSS. What to load is `tools/spec.py`; the status line `tools/steps.py`.
"""

from __future__ import annotations

import json
import statistics
import sys

from .children import (  # noqa: F401 - the harness's API for scripts: bench.X
    CACHE_ENV_VAR,
    FALLBACK_NOTE,
    MEMORY_MODES,
    SIZES,
    ChildError,
    builtin_checkpoint,
    cache_dir,
    cached_checkpoint,
    child_env,
    load_task,
    measure_floors,
    measure_load,
    measure_storage,
    measure_time_to_model,
    prime_bytes,
    run_child,
    summarize_time_to_model,
)
from .spec import DTYPES, LoadSpec, UsageError, distribution_version  # noqa: F401
from .steps import Progress, step_of  # noqa: F401

# -- the benchmark


def _median_run(runs: list[dict]) -> dict:
    """The run whose time is the (low) median: its phases are shown."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2]


def run_bench(
    spec: LoadSpec,
    repeats: int = 3,
    floors: bool = True,
    progress: Progress | None = None,
    timeout=None,
    memory: str = "primed",
    time_to_model: bool = True,
    cold: bool = False,
) -> dict:
    """Time unpatched vs patched from_pretrained (alternating, one fresh process
    per load), plus the floors, plus (time_to_model) a user's whole script in
    a fresh process per side; `cold`: the checkpoint's pages evicted before
    each timed part, and the storage's cold floors measured. Returns a
    JSON-ready dict (see format_table)."""
    if repeats < 1:
        raise UsageError("--repeats must be at least 1")
    from . import cold as cold_runs  # numpy, mincore: only for a run

    prime = prime_bytes(spec, memory, cold)
    runs = {"unpatched": [], "patched": []}
    files = spec.weight_files()
    left_cached = []

    def evicted():
        if cold:
            left_cached.append(cold_runs.evict(files))

    floor = sequential = None
    if floors:  # first: it also brings the files into the page cache for every load after it
        with step_of(progress, "floors: read every checkpoint byte, construct without init"):
            floor = measure_floors(spec, timeout=timeout, prime=prime)
    if cold:
        with step_of(progress, "storage floor: read the files cold, sequentially"):
            sequential = cold_runs.sequential_floor(files)
        left_cached.append(sequential["resident_after_evict"])
    ttm_runs = {"unpatched": [], "patched": []}
    parallel_runs = []
    parts = [("load", "unpatched"), ("load", "patched")]
    if time_to_model:
        parts += [("script", "unpatched"), ("script", "patched")]
    if cold:
        parts.append(("storage", None))
    for i in range(repeats):
        # each round in another order: the first read after an eviction may
        # find the files in a cache below the OS's (a VM host's), later ones do
        for kind, mode in parts[i % len(parts) :] + parts[: i % len(parts)]:
            evicted()
            if kind == "storage":
                with step_of(progress, f"storage floor: parallel read into fresh memory {i + 1}/{repeats}"):
                    parallel_runs.append(measure_storage(files, timeout=timeout, prime=prime)["seconds"])
            elif kind == "load":
                with step_of(progress, f"{mode} load {i + 1}/{repeats}"):
                    runs[mode].append(measure_load(spec, mode, timeout=timeout, prime=prime, warm=not cold))
            else:
                with step_of(progress, f"{mode} time to model {i + 1}/{repeats}"):
                    ttm_runs[mode].append(measure_time_to_model(spec, mode, timeout=timeout, prime=prime))
    sides = {}
    for mode, mode_runs in runs.items():
        median_run = _median_run(mode_runs)
        sides[mode] = {
            "seconds": [r["seconds"] for r in mode_runs],
            "median_seconds": statistics.median(r["seconds"] for r in mode_runs),
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in mode_runs],
            "rss_before_bytes": [r["rss_before_bytes"] for r in mode_runs],
            "median_run": median_run,
        }
    if not sides["patched"]["median_run"].get("plugin_enabled"):
        raise ChildError(
            "the patched child could not enable ms_loadpatch: "
            + str(sides["patched"]["median_run"].get("plugin_refusal"))
        )
    first = runs["patched"][0]
    patched_median = sides["patched"]["median_seconds"]
    return {
        "checkpoint": {
            "path": spec.path,
            "subfolder": spec.subfolder,
            "single_file": spec.single_file,
            "class_name": first["class_name"],
            "library": first["library"],
            "dtype": spec.dtype,
            "files": len(spec.weight_files()),
            "bytes": spec.checkpoint_bytes(),
            "tensors": first["tensors"],
        },
        "device": first["device"],
        "cpu_kernel_fallbacks": first["cpu_kernel_fallbacks"],
        "versions": first["versions"],
        "repeats": repeats,
        "memory": memory,
        "unpatched": sides["unpatched"],
        "patched": dict(sides["patched"], report=sides["patched"]["median_run"].get("report")),
        "ratio": sides["unpatched"]["median_seconds"] / patched_median if patched_median > 0 else None,
        "floors": floor,
        "time_to_model": summarize_time_to_model(ttm_runs) if time_to_model else None,
        "plain_script": plain_script_agreement(runs["patched"], ttm_runs["patched"]) if time_to_model else None,
        "cold": None
        if not cold
        else {
            "storage_floors": dict(
                sequential,
                parallel_seconds=statistics.median(parallel_runs),
                parallel_runs=parallel_runs,
                parallel_threads=cold_runs.PARALLEL_THREADS,
                request_bytes=cold_runs.REQUEST_BYTES,
            ),
            # the most of the checkpoint any eviction left cached (None: not measurable here)
            "resident_after_evict": max((x for x in left_cached if x is not None), default=None),
        },
    }


# Two sets of runs agree when their ranges, each widened by this factor, overlap.
AGREEMENT_MARGIN = 1.25


def _read_figures(run: dict) -> tuple[float | None, int, int]:
    """(read MB/s, cold files, files) of one patched run's report."""
    report = run.get("report") or {}
    reads = report.get("files_read") or []
    seconds = report.get("read_seconds") or 0.0
    rate = report.get("bytes_read", 0) / 2**20 / seconds if seconds > 0 else None
    return rate, sum(1 for read in reads if read.get("cold")), len(reads)


def plain_script_agreement(bench_runs: list[dict], script_runs: list[dict]) -> dict:
    """Whether the bench's load child and a plain user's script (the time to
    model child), both patched, read the checkpoint alike: the same count
    of files read cold in every run, and read rates whose ranges, widened
    by AGREEMENT_MARGIN, overlap."""
    bench_figures = [_read_figures(run) for run in bench_runs]
    script_figures = [_read_figures(run) for run in script_runs]
    out = {
        "bench_read_mb_s": [f[0] for f in bench_figures],
        "script_read_mb_s": [f[0] for f in script_figures],
        "bench_cold_files": [f[1] for f in bench_figures],
        "script_cold_files": [f[1] for f in script_figures],
        "files": max((f[2] for f in bench_figures + script_figures), default=0),
    }
    problems = []
    if set(out["bench_cold_files"]) != set(out["script_cold_files"]) or len(set(out["bench_cold_files"])) > 1:
        problems.append(f"files read cold: bench {out['bench_cold_files']}, plain script {out['script_cold_files']}")
    bench_rates = [r for r in out["bench_read_mb_s"] if r]
    script_rates = [r for r in out["script_read_mb_s"] if r]
    if bench_rates and script_rates:
        low = max(min(bench_rates), min(script_rates)) / AGREEMENT_MARGIN
        high = min(max(bench_rates), max(script_rates)) * AGREEMENT_MARGIN
        if low > high:
            problems.append(
                f"read rate: bench {', '.join(f'{r:,.0f}' for r in bench_rates)} MB/s, "
                f"plain script {', '.join(f'{r:,.0f}' for r in script_rates)} MB/s"
            )
    out["agree"] = not problems
    out["problems"] = problems
    return out


def _mb(n) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.0f} KB"
    return f"{n / 2**20:,.0f} MB"


def _while_reading(report: dict) -> str:
    from ..strategy.reports import cast_detail

    return cast_detail(report.get("tensors_cast_while_reading") or 0, report.get("tensors_read_again") or 0)


def _s(x) -> str:
    return f"{x:.3f} s"


def format_table(results: dict, title: str | None = None) -> str:
    ckpt = results["checkpoint"]
    unp, pat, floors = results["unpatched"], results["patched"], results.get("floors") or {}
    report = pat.get("report") or {}
    lines = []
    where = ckpt["path"] + (f" (subfolder {ckpt['subfolder']})" if ckpt["subfolder"] else "")
    if ckpt.get("single_file"):
        where += f", from_single_file of {ckpt['single_file']}"
    lines.append(title or f"ms-loadpatch bench: {ckpt['class_name']} (mindone.{ckpt['library']})")
    lines.append(f"  checkpoint  {where}")
    lines.append(
        f"              {_mb(ckpt['bytes'])} in {ckpt['files']} file(s), {ckpt['tensors']} tensors, "
        f"dtype {ckpt['dtype'] or 'as from_pretrained defaults'}"
    )
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    fallback = FALLBACK_NOTE if results["cpu_kernel_fallbacks"] else ""
    lines.append(f"  device      {results['device']}{fallback}")
    lines.append(f"  versions    {versions}")
    call = "from_single_file" if ckpt.get("single_file") else "from_pretrained"
    lines.append(
        f"  method      each load in a fresh process, median of {results['repeats']}; timed: "
        f"{call} + touching every weight"
    )
    memory = results.get("memory", "as-is")
    lines.append(
        f"  memory      {memory}"
        + (
            ": each process faults in and frees memory before every timed part, "
            "so first-touch costs of the VM do not count"
            if memory == "primed"
            else ": fresh memory as the machine gives it (first-touch costs count)"
        )
    )
    cold = results.get("cold")
    if cold:
        left = cold["resident_after_evict"]
        lines.append(
            "  cache       cold: the checkpoint's pages given back to the OS before each timed part"
            + (
                f" ({left:.0%} of its bytes stayed cached)"
                if left
                else " (none stayed cached)"
                if left == 0
                else " (not measurable here: no mincore)"
            )
        )
    lines.append("")
    lines.append(f"  {'':24}{'unpatched':>12}{'patched':>12}")
    ratio = results["ratio"]
    ratio_text = ""
    if ratio:
        ratio_text = f"   {ratio:.1f}x faster" if ratio >= 1 else f"   {1 / ratio:.1f}x slower"
    lines.append(f"  {call:24}{_s(unp['median_seconds']):>12}{_s(pat['median_seconds']):>12}{ratio_text}")
    lines.append(f"  {'peak RSS':24}{_mb(max(unp['peak_rss_bytes'])):>12}{_mb(max(pat['peak_rss_bytes'])):>12}")
    lines.append(
        f"  {'  of which before load':24}{_mb(min(unp['rss_before_bytes'])):>12}"
        f"{_mb(min(pat['rss_before_bytes'])):>12}   (interpreter + imports)"
    )
    if results["repeats"] > 1:
        lines.append(
            f"  all runs (s): unpatched {' '.join(f'{x:.2f}' for x in unp['seconds'])}; "
            f"patched {' '.join(f'{x:.2f}' for x in pat['seconds'])}"
        )
    storage = (cold or {}).get("storage_floors")
    if storage:
        size = ckpt["bytes"]
        parallel = storage["parallel_seconds"]
        lines.append(
            f"  storage, cold: sequential read {_s(storage['sequential_seconds'])} "
            f"({size / 2**20 / storage['sequential_seconds']:,.0f} MB/s); "
            f"{storage['parallel_threads']} threads x {_mb(storage['request_bytes'])} requests into fresh memory "
            f"{_s(parallel)} ({size / 2**20 / parallel:,.0f} MB/s, median; runs "
            f"{' '.join(f'{x:.2f}' for x in storage['parallel_runs'])}); "
            f"patched load = {pat['median_seconds'] / parallel:.2f}x of the parallel read"
        )
    plain = results.get("plain_script")
    if plain:
        rates = {side: [r for r in plain[f"{side}_read_mb_s"] if r] for side in ("bench", "script")}
        text = {
            side: (f"{statistics.median(v):,.0f} MB/s ({min(v):,.0f}-{max(v):,.0f})" if v else "-")
            for side, v in rates.items()
        }
        lines.append(
            f"  plain script: read {text['script']}, {'/'.join(map(str, plain['script_cold_files']))} of "
            f"{plain['files']} files cold; the bench's child {text['bench']}, "
            f"{'/'.join(map(str, plain['bench_cold_files']))} cold: "
            + ("agree" if plain["agree"] else "DISAGREE (" + "; ".join(plain["problems"]) + ")")
        )
    ttm = results.get("time_to_model")
    if ttm:
        lines.append("")
        lines.append("  time to model: a fresh process from interpreter start to the loaded, touched model")
        lazy = "lazy import" if ttm["patched"]["lazy_import"] else "eager import"
        rows = (
            ("interpreter start", "interpreter_seconds", "   patched: with the .pth hook, if installed"),
            ("import mindspore", "import_mindspore_seconds", "   patched: after `import ms_loadpatch`"),
            ("import the model class", "import_mindone_seconds", f"   from mindone (patched: {lazy})"),
            (f"{call} + touch", "load_seconds", ""),
        )
        for label, key, note in rows:
            lines.append(f"    {label:22}{_s(ttm['unpatched'][key]):>12}{_s(ttm['patched'][key]):>12}{note}")
        ratio = ttm["ratio"]
        ratio_text = f"   {ratio:.1f}x faster" if ratio >= 1 else f"   {1 / ratio:.1f}x slower"
        lines.append(
            f"    {'total':22}{_s(ttm['unpatched']['seconds']):>12}{_s(ttm['patched']['seconds']):>12}" + ratio_text
        )
    lines.append("")
    phases = dict(report.get("phases") or {})
    if phases:
        lines.append("  patched load, by phase (median run):")
        floor_of = {
            "construct": ("construct (mindspore no_init_parameters)", floors.get("construct_seconds")),
            "read": ("read every checkpoint byte", floors.get("read_seconds")),
            "assign": ("one cast pass", floors.get("cast_seconds")),
        }
        for name, seconds in phases.items():
            label = "cast/assign" if name == "assign" else name
            floor_label, floor_value = floor_of.get(name, (None, None))
            note = f"   floor: {floor_label} {_s(floor_value)}" if floor_value is not None else ""
            if name == "construct" and floor_value:
                note += f" (patched = {seconds / floor_value:.2f}x of it)"
            if name == "read" and report.get("tensors_cast_while_reading"):
                note += " (the cast is done while reading)"
            lines.append(f"    {label:20}{_s(seconds):>10}{note}")
        other = pat["median_run"]["seconds"] - sum(phases.values())
        lines.append(f"    {'other':20}{_s(max(other, 0.0)):>10}   mindone's own bookkeeping, touching the weights")
        lines.append(
            f"  tensors: {report.get('tensors_read')} read from {report.get('shards')} file(s) with "
            f"{report.get('read_workers')} worker(s) of up to {report.get('read_threads')} thread(s), "
            f"{report.get('tensors_assigned')} assigned, "
            f"{report.get('tensors_cast')} cast{_while_reading(report)}, "
            f"{report.get('missing_initialised')} parameters initialised "
            "for missing weights"
        )
        start = report.get("fast_construction_from")
        lines.append(
            f"  technique: {report.get('technique')}"
            + (f", fast construction from cell {start}" if start is not None else " (cells built plainly)")
            + (f", {report['host_tensors']} factory tensors made on the host" if report.get("host_tensors") else "")
            + (", gc paused" if report.get("gc_paused") else "")
        )
    else:
        lines.append("  patched load: no load report (mindone's own path ran, e.g. a class that overrides its loading)")
        for key, label in (("construct_seconds", "construct floor"), ("read_seconds", "read floor")):
            if floors.get(key) is not None:
                lines.append(f"    {label:20}{_s(floors[key]):>10}")
    return "\n".join(lines)


# -- the command


def main(args) -> int:
    """`ms-loadpatch bench` (args from cli.build_parser)."""
    progress = Progress()
    try:
        if args.path:
            spec = LoadSpec.resolve(
                args.path, args.class_name, args.subfolder, args.dtype, getattr(args, "single_file", None)
            )
            title = None
        else:
            if args.class_name or args.subfolder or getattr(args, "single_file", None):
                raise UsageError("--class, --subfolder and --single-file need a PATH")
            path = builtin_checkpoint(args.size, progress=progress)
            spec = LoadSpec.resolve(path, dtype=args.dtype)
            title = f"ms-loadpatch bench: built-in {args.size} checkpoint, {spec.class_name} (mindone.{spec.library})"
        results = run_bench(
            spec, repeats=args.repeats, progress=progress, memory=args.memory, cold=getattr(args, "cold", False)
        )
    except UsageError as exc:
        print(f"ms-loadpatch bench: {exc}", file=sys.stderr)
        return 2
    except ChildError as exc:
        print(f"ms-loadpatch bench: {exc}", file=sys.stderr)
        if exc.result.get("traceback") or exc.stderr:
            print(exc.result.get("traceback") or exc.stderr[-3000:], file=sys.stderr)
        return 1
    if not args.path:
        results["checkpoint"]["builtin_size"] = args.size
    print(format_table(results, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nresults written to {args.json}")
    return 0
