"""Benchmark: N ranks of a job on this node loading the same checkpoint at once.

Each rank is a fresh process with the environment msrun gives its workers
(MS_ROLE=MS_WORKER, MS_WORKER_NUM, RANK_ID, DEVICE_ID) plus the flag of the
launching msrun (--local_worker_num, set here as MS_LOADPATCH_LOCAL_RANKS: the
plugin reads msrun's from its parent's command line, and these processes'
parent is this script). The ranks start their loads together (after priming
memory, with --memory primed) and every weight is touched before each
rank's clock stops. Per N and side, the median over --repeats jobs of: the
slowest rank's time, the largest per-rank peak RSS, and the node total (the
sum of the ranks' peaks: at most what the node held at once).

A third side, "patched-no-budget", runs the patched load with every rank
told it is alone on the node (MS_LOADPATCH_LOCAL_RANKS=1): what the per-node
thread budget changes.

    python benchmarks/bench_multirank.py                   # Qwen2-0.5B fp32 (2 GB), N = 1 and 2
    python benchmarks/bench_multirank.py --size small --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_transformers import SIZES  # noqa: E402

from ms_loadpatch.strategy.ranks import available_cores  # noqa: E402
from ms_loadpatch.tools import bench  # noqa: E402

SIDES = {  # name -> (mode, extra environment per rank given N)
    "unpatched": ("unpatched", lambda n: {"MS_LOADPATCH_LOCAL_RANKS": str(n)}),
    "patched": ("patched", lambda n: {"MS_LOADPATCH_LOCAL_RANKS": str(n)}),
    "patched-no-budget": ("patched", lambda n: {"MS_LOADPATCH_LOCAL_RANKS": "1"}),
}
TARGETS = (
    "2 ranks: slowest patched rank >= 10x faster than unpatched (--memory primed); 2 ranks patched <= 2.2x "
    "the 1-rank patched time; node total peak RSS patched <= unpatched; per rank patched <= the 1-rank load"
)


def run_job(spec, side, ranks, prime, timeout):
    """One job: `ranks` processes loading at once; their results by rank."""
    mode, extra = SIDES[side]
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-ranks-") as start_line:
        barrier = {"directory": start_line, "parties": ranks}

        def rank_env(rank):
            return {
                "MS_ROLE": "MS_WORKER",
                "MS_WORKER_NUM": str(ranks),
                "RANK_ID": str(rank),
                "DEVICE_ID": str(rank),
                **extra(ranks),
            }

        with ThreadPoolExecutor(max_workers=ranks) as pool:
            futures = [
                pool.submit(bench.measure_load, spec, mode, None, timeout, prime, barrier, rank_env(rank))
                for rank in range(ranks)
            ]
            return [f.result() for f in futures]


def summarise(jobs):
    """Medians over jobs of the slowest rank, the largest rank peak and the node total."""
    slowest = [max(r["seconds"] for r in job) for job in jobs]
    per_rank = [max(r["peak_rss_bytes"] for r in job) for job in jobs]
    node = [sum(r["peak_rss_bytes"] for r in job) for job in jobs]
    report = jobs[0][0].get("report") or {}
    return {
        "slowest_s": statistics.median(slowest),
        "rank_peak_mb": statistics.median(per_rank) / 2**20,
        "node_peak_mb": statistics.median(node) / 2**20,
        "runs_s": slowest,
        "read_threads": report.get("read_threads"),
        "local_ranks": report.get("local_ranks"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=3, help="fresh jobs per side and rank count (median)")
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {', '.join(SIDES)}")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.ranks.split(",") if n]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(sides) - set(SIDES):
        parser.error(f"unknown side(s): {', '.join(sorted(set(sides) - set(SIDES)))}")
    progress = bench.Progress()
    config = SIZES[args.size]
    path = bench.cached_checkpoint(
        f"tf-{args.size}-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"], progress=progress
    )
    spec = bench.LoadSpec.resolve(path, dtype="float32")
    results = {}
    for ranks in counts:
        prime = bench.prime_bytes(spec, args.memory)
        for side in sides:
            if side == "patched-no-budget" and ranks == 1:
                continue  # the same as "patched" alone on the node
            jobs = []
            for i in range(args.repeats):
                with progress.step(f"{ranks} rank(s), {side}, job {i + 1}/{args.repeats}"):
                    jobs.append(run_job(spec, side, ranks, prime, timeout=1800))
            results[f"{ranks}|{side}"] = summarise(jobs)
    print(f"\n{spec.class_name} fp32 as fp32 ({args.size}), {available_cores()} core(s), memory: {args.memory}")
    print(
        "| ranks | side | slowest rank | vs unpatched | per-rank peak RSS | node total peak RSS | read threads/rank |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, row in results.items():
        ranks, side = key.split("|")
        base = results.get(f"{ranks}|unpatched")
        ratio = f"{base['slowest_s'] / row['slowest_s']:.1f}x" if base and side != "unpatched" else ""
        print(
            f"| {ranks} | {side} | {row['slowest_s']:.3f} s | {ratio} | {row['rank_peak_mb']:,.0f} MB | "
            f"{row['node_peak_mb']:,.0f} MB | {row['read_threads'] or ''} |"
        )
    one, two = results.get("1|patched"), results.get("2|patched")
    if one and two:
        print(f"2 ranks patched / 1 rank patched: {two['slowest_s'] / one['slowest_s']:.2f}x (target <= 2.2x)")
    print(
        "runs (slowest rank, s): "
        + " · ".join(f"{k.replace('|', ' ')}: " + "/".join(f"{s:.2f}" for s in v["runs_s"]) for k, v in results.items())
    )
    print(f"targets: {TARGETS}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "memory": args.memory, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
