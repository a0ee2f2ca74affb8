"""Benchmark: jobs of several "nodes" on this machine loading one checkpoint
from one shared storage, each node reading alone (MS_LOADPATCH_COOPERATIVE
=off, as before) against the nodes splitting the reading (on, auto).

Storage `fuse` (default): tools/slow_storage.py serves the checkpoint with
one mount per node (its own page cache) under one aggregate cap and a delay
per request, and counts the bytes it serves for the whole job. Storage
`local`: every node reads the local disk (warm, or `--cold`: the files'
pages evicted first), to see what `auto` chooses there.

Each job: one msrun launch per node (tools/nodes.py), every rank ready
before the timed part (benchmarks/_multinode_rank.py: from_pretrained and a
touch of every weight); the slowest rank is the job's time.

    python benchmarks/bench_multinode.py                       # 1, 2, 3 nodes x off, on through FUSE
    python benchmarks/bench_multinode.py --nodes 2 --ranks-per-node 2 --modes off on
    python benchmarks/bench_multinode.py --storage local --nodes 2 --modes off auto [--cold]

The checkpoint: Qwen2-0.5B's shape, fp32, 2 GB in 4 shards (generated once,
cached). Figures in docs/benchmarks.md#multi-node-jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_transformers import SIZES  # noqa: E402

from ms_loadpatch.tools import bench, cold  # noqa: E402
from ms_loadpatch.tools.nodes import NodesJob  # noqa: E402
from ms_loadpatch.tools.slow_storage import SlowStorage, StorageSettings  # noqa: E402

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multinode_rank.py")


def checkpoint() -> str:
    config = SIZES["full"]
    return bench.cached_checkpoint("tf-full-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"])


def files_of(path) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


def run_job(model, nodes, ranks_per_node, mode, storage_settings, timeout, chunk_mb) -> dict:
    with tempfile.TemporaryDirectory(prefix="ms_loadpatch-multinode-") as directory:
        with contextlib.ExitStack() as stack:
            if storage_settings is not None:
                storage = stack.enter_context(SlowStorage(model, storage_settings, mounts=nodes))
                sources = storage.mountpoints
            else:
                storage, sources = None, [model] * nodes
            for node, source in enumerate(sources):
                os.symlink(source, os.path.join(directory, f"node{node}"))
            env = {k: v for k, v in os.environ.items() if k != "MS_LOADPATCH"}
            env["MS_LOADPATCH_COOPERATIVE"] = mode
            if chunk_mb:
                env["MS_LOADPATCH_COOPERATIVE_CHUNK_MB"] = str(chunk_mb)
            out = os.path.join(directory, "out")
            job = NodesJob(
                directory,
                RANK_SCRIPT,
                ["--model", os.path.join(directory, "{node}"), "--out", out],
                nodes,
                ranks_per_node,
                env,
            )
            try:
                job.wait(timeout)
            finally:
                job.kill()
            served = storage.served()[0] if storage is not None else None
            ranks = []
            for rank in range(nodes * ranks_per_node):
                path = os.path.join(out, f"rank{rank}.json")
                if not os.path.exists(path):
                    raise SystemExit(f"rank {rank} reported nothing:\n{job.logs()}")
                with open(path) as f:
                    ranks.append(json.load(f))
    size = sum(os.path.getsize(p) for p in files_of(model))
    reports = [r["report"] for r in ranks]
    return {
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "mode": mode,
        "slowest_s": max(r["seconds"] for r in ranks),
        "served_x": None if served is None else served / size,
        "decision": reports[0]["cooperative"] if reports[0] else None,
        "staging_mb": (reports[0]["staging_bytes"] or 0) / 1e6 if reports[0] else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        # per rank: MB it read from storage (None: it read alone, as without a job)
        "from_storage_mb": [
            None
            if not r["report"] or r["report"]["bytes_from_storage"] is None
            else r["report"]["bytes_from_storage"] / 1e6
            for r in ranks
        ],
    }


def _per_rank(megabytes) -> str:
    return " / ".join("alone" if mb is None else f"{mb:.0f}" for mb in megabytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("fuse", "local"), default="fuse")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=("off", "on", "auto"))
    parser.add_argument("--total-mb-s", type=float, default=100.0, help="the storage's aggregate cap (fuse)")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="delay per read request (fuse)")
    parser.add_argument("--cold", action="store_true", help="local: evict the files' pages before each job")
    parser.add_argument("--chunk-mb", type=int, default=None, help="MS_LOADPATCH_COOPERATIVE_CHUNK_MB")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    model = checkpoint()
    settings = (
        StorageSettings(latency_ms=args.latency_ms, total_mb_s=args.total_mb_s) if args.storage == "fuse" else None
    )
    rows = []
    for nodes in args.nodes:
        modes = [mode for mode in args.modes if nodes > 1 or mode == "off"]  # one node reads alone whatever the mode
        runs = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:  # the modes take turns, so that the VM's drift falls on each alike
                if args.storage == "local" and args.cold:
                    cold.evict(files_of(model))
                runs[mode].append(
                    run_job(model, nodes, args.ranks_per_node, mode, settings, args.timeout, args.chunk_mb)
                )
                print(json.dumps(runs[mode][-1]), flush=True)
        for mode in modes:
            row = dict(runs[mode][-1])
            row["slowest_s"] = statistics.median(r["slowest_s"] for r in runs[mode])
            row["runs_s"] = [round(r["slowest_s"], 2) for r in runs[mode]]
            rows.append(row)
    print(f"\nstorage {args.storage}" + (f" {args.total_mb_s:.0f} MB/s, {args.latency_ms} ms" if settings else ""))
    print(
        "| nodes x ranks | mode | slowest rank (s) | served (x ckpt) | peak RSS (MB) | MB from storage per rank | decision |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        served = "" if r["served_x"] is None else f"{r['served_x']:.3f}"
        print(
            f"| {r['nodes']} x {r['ranks_per_node']} | {r['mode']} | {r['slowest_s']:.1f} {r['runs_s']} | "
            f"{served} | {r['peak_rss_mb']:.0f} | {_per_rank(r['from_storage_mb'])} | {r['decision']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
