"""Profile: where a patched load's time goes, by room of the plugin, under
cProfile in a fresh process (this process: run it once per question).

    python benchmarks/profile_load.py --case moe
    python benchmarks/profile_load.py --case qwen3_moe --top 25

Cases as bench_ab.py's (`bench`, `moe`, `qwen2`, an MoE family). The load
report's phases (wall clock, without the profiler) come first; then the
profile's own time per plugin module (tottime summed: the profiler's cost
per call inflates modules with many small calls, so read the shares, not
the seconds), with the random-state accounting (ACCOUNTING's modules)
summed; then the accounting's functions and all
functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

ACCOUNTING = (
    "building/draws.py",
    "building/draw_patches.py",
    "building/batched_draws.py",
    "building/init_pass.py",
    "building/replays.py",
    "building/deferred_writes.py",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="moe")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--save", metavar="FILE", help="also write the profile (pstats) to FILE")
    args = parser.parse_args(argv)

    from bench_ab import checkpoint

    spec_path = checkpoint(args.case)  # generated (once) before anything is imported for the load

    import ms_loadpatch
    from ms_loadpatch.strategy.reports import last_report
    from ms_loadpatch.tools import bench
    from ms_loadpatch.tools._child import _fallbacks, _on_cpu, import_model_class, touch_all

    spec = bench.LoadSpec.resolve(spec_path)
    cls, _ = import_model_class(spec)
    assert ms_loadpatch.is_enabled(), "the plugin is off (MS_LOADPATCH=0?)"
    with _fallbacks(_on_cpu()):
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        model = cls.from_pretrained(spec.model_dir)
        touch_all(model)
        profile.disable()
        seconds = time.perf_counter() - start
    report = last_report()
    print(f"{args.case}: {spec.class_name}, {report.tensors_read} tensors; under the profiler {seconds:.2f} s")
    print("report: " + report.summary())

    stats = pstats.Stats(profile)
    if args.save:
        stats.dump_stats(args.save)
    by_module: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        marker = os.sep + "ms_loadpatch" + os.sep
        if marker in filename:
            name = filename.split(marker, 1)[1]
            by_module[name] = by_module.get(name, 0.0) + tottime
    total = sum(v[2] for v in stats.stats.values())
    print(f"\nown time per plugin module (of {total:.2f} s profiled):")
    for name, own in sorted(by_module.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {own:8.3f} s  {own / total:6.1%}  {name}")
    accounting = sum(own for name, own in by_module.items() if name.replace(os.sep, "/").endswith(ACCOUNTING))
    print(f"random-state accounting ({', '.join(ACCOUNTING)}): {accounting:.3f} s, {accounting / total:.1%}")
    print("\nthe accounting's functions by cumulative time (their calls into mindspore and numpy included):")
    stats.sort_stats("cumulative").print_stats("draws.py|init_pass.py|replays.py|deferred_writes.py", args.top)
    print("every function by cumulative time:")
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
