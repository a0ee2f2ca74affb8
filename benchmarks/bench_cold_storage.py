"""Benchmark: cold loads against what the storage can deliver. The
checkpoint's pages are evicted before every timed part; the patched load of
this tree (and of a baseline checkout, for a before/after in one run) is set
beside the best parallel read of the same files, from a cold start.

Storage: `--storage fuse` serves the checkpoint through tools/slow_storage.py
(network storage: a delay per read request, a cap per reading thread and an
aggregate cap; its byte count shows what each load asked of the storage);
`--storage local` reads the local disk.

    git worktree add /tmp/baseline <commit>
    python benchmarks/bench_cold_storage.py --storage fuse --baseline /tmp/baseline --repeats 3
    python benchmarks/bench_cold_storage.py --storage local --baseline /tmp/baseline --case qwen2-bf16
    python benchmarks/bench_cold_storage.py --storage fuse --ranks 2

`--ranks N`: each load is a job of N ranks on this node starting at the same
moment (the launcher's variables msrun sets); the slowest rank is timed, the
bytes served are the job's, and one rank alone is timed beside it.

Cases: `qwen2` (Qwen2-0.5B's shape, fp32, 2 GB in 4 shards), `qwen2-bf16`
(the same in bf16), `unet-single-file` (bench_build_then_fill.py's UNet,
1.26 GB in one file, through `from_single_file`), `bench` (the built-in
default checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_build_then_fill import UNET  # noqa: E402
from bench_transformers import SIZES, bf16_copy  # noqa: E402

from ms_loadpatch.tools import bench, cold  # noqa: E402
from ms_loadpatch.tools.slow_storage import SlowStorage, StorageSettings  # noqa: E402

PARALLEL_THREADS = (8, 16, 32)


def checkpoint(case: str) -> tuple:
    """(directory, the file from_single_file loads or None)."""
    if case == "bench":
        return bench.builtin_checkpoint(), None
    if case == "unet-single-file":
        return (
            bench.cached_checkpoint("sd-unet-0.6x", "UNet2DConditionModel", UNET, library="diffusers"),
            "diffusion_pytorch_model.safetensors",
        )
    config = SIZES["full"]
    path = bench.cached_checkpoint("tf-full-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"])
    if case == "qwen2":
        return path, None
    if case == "qwen2-bf16":
        return bf16_copy(path), None
    raise SystemExit(f"unknown case {case}")


def load_job(spec, mode, prime, env, ranks):
    """One load, or a job of `ranks` loads at once; (slowest seconds, first rank's result)."""
    if ranks == 1:
        result = bench.measure_load(spec, mode, prime=prime, env_extra=env)
        return result["seconds"], result
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-ranks-") as start_line:
        barrier = {"directory": start_line, "parties": ranks}
        with ThreadPoolExecutor(max_workers=ranks) as pool:
            futures = [
                pool.submit(
                    bench.measure_load,
                    spec,
                    mode,
                    None,
                    None,
                    prime,
                    barrier,
                    {
                        "MS_ROLE": "MS_WORKER",
                        "MS_WORKER_NUM": str(ranks),
                        "RANK_ID": str(rank),
                        "MS_LOADPATCH_LOCAL_RANKS": str(ranks),
                        **env,
                    },
                )
                for rank in range(ranks)
            ]
            results = [f.result() for f in futures]
    return max(r["seconds"] for r in results), results[0]


def _served(storage):
    return storage.served()[0] if storage is not None else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("fuse", "local"), default="fuse")
    parser.add_argument("--case", default="qwen2")
    parser.add_argument("--baseline", help="a checkout of ms_loadpatch to load with as well (before / after)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--stream-mb-s", type=float, default=50.0)
    parser.add_argument("--total-mb-s", type=float, default=200.0)
    parser.add_argument("--unpatched", action="store_true", help="also time an unpatched load each round")
    parser.add_argument("--ranks", type=int, default=1, help="ranks loading at once on this node")
    parser.add_argument(
        "--drop",
        action="store_true",
        help="also this tree with MS_LOADPATCH_PAGE_CACHE=drop (and, where the filesystem allows it, O_DIRECT)",
    )
    parser.add_argument(
        "--cold-threads",
        default="",
        help="also this tree with MS_LOADPATCH_COLD_READ_THREADS at each of these counts (comma-separated)",
    )
    args = parser.parse_args(argv)
    source, single_file = checkpoint(args.case)
    sides = {"this tree": ("patched", {})}
    if args.baseline:
        baseline = os.path.abspath(args.baseline)
        if not os.path.isfile(os.path.join(baseline, "ms_loadpatch", "__init__.py")):
            raise SystemExit(f"{baseline} holds no ms_loadpatch package")
        sides = {"baseline": ("patched", {"PYTHONPATH": baseline}), **sides}
    if args.unpatched:
        sides["unpatched"] = ("unpatched", {})
    for count in filter(None, args.cold_threads.split(",")):
        sides[f"this tree, {count} cold threads"] = ("patched", {"MS_LOADPATCH_COLD_READ_THREADS": count})
    if args.drop:
        sides["this tree, drop"] = ("patched", {"MS_LOADPATCH_PAGE_CACHE": "drop"})
    if args.ranks > 1:
        sides["this tree, 1 rank alone"] = ("patched", {})
    settings = StorageSettings(args.latency_ms, args.stream_mb_s, args.total_mb_s)
    with contextlib.ExitStack() as stack:
        storage = stack.enter_context(SlowStorage(source, settings)) if args.storage == "fuse" else None
        where = storage.mountpoint if storage else source
        spec = bench.LoadSpec.resolve(where, single_file=single_file)
        files = spec.weight_files()
        size = spec.checkpoint_bytes()
        prime = bench.prime_bytes(spec, args.memory, cold=True)
        described = (
            f"FUSE, {args.latency_ms:g} ms per request, {args.stream_mb_s:g} MB/s per stream, "
            f"{args.total_mb_s:g} MB/s in all"
            if storage
            else "local disk"
        )
        ranks = f"; jobs of {args.ranks} ranks, the slowest timed" if args.ranks > 1 else ""
        print(
            f"{args.case}: {size / 1e9:.2f} GB in {len(files)} file(s); storage: {described}; "
            f"{args.repeats} rounds, sides taking turns, medians{ranks}"
        )
        floors = {threads: [] for threads in PARALLEL_THREADS}
        seconds = {side: [] for side in sides}
        served = {side: [] for side in sides}
        reports = {}
        for _ in range(args.repeats):
            for threads in PARALLEL_THREADS:
                cold.evict(files)
                floors[threads].append(cold.parallel_read(files, threads=threads))
            for side, (mode, env) in sides.items():
                left = cold.evict(files)
                before = _served(storage)
                slowest, result = load_job(spec, mode, prime, env, 1 if "alone" in side else args.ranks)
                served[side].append(_served(storage) - before)
                seconds[side].append(slowest)
                reports[side] = result.get("report") or {}
                if left:
                    print(f"  note: {left:.1%} of the files stayed cached after the eviction")
        best = min(statistics.median(runs) for runs in floors.values())
        floor_text = ", ".join(f"{threads} threads {statistics.median(runs):.2f} s" for threads, runs in floors.items())
        print(f"  parallel read, cold: {floor_text}; best {best:.2f} s ({size / best / 1e6:.0f} MB/s)")
        for side in sides:
            median = statistics.median(seconds[side])
            line = (
                f"  {side}: {median:.2f} s = {median / best:.2f}x the best read "
                f"(runs {', '.join(f'{s:.2f}' for s in seconds[side])})"
            )
            if storage:
                line += f"; served {statistics.median(served[side]) / size:.2f}x the checkpoint's bytes"
            report = reports[side]
            if report.get("files_read"):
                threads = sorted({r.get("threads", "?") for r in report["files_read"]}, key=str)
                cold_files = sum(1 for r in report["files_read"] if r.get("cold"))
                line += f"; {cold_files} of {len(report['files_read'])} files cold, threads {threads}"
            if report.get("phases"):
                line += "; " + ", ".join(f"{k} {v:.2f}" for k, v in report["phases"].items())
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
