"""Benchmark: what a plain user's script gets, against the least the machine
must do, with the bench's own load child beside it.

Each round runs, in fresh processes and in an order that turns from round to
round: a plain script (`import ms_loadpatch`, then `from_pretrained`, then
every weight touched: the bench's time-to-model child) of this tree; the
same script with a baseline checkout first on the path (`--baseline`); the
bench's load child; and the floor.

- `--cold`: the checkpoint's pages are given back to the OS before every
  part; the floor is 8 threads reading 16 MB requests from one queue of all
  files into fresh memory (bench's storage child).
- warm: the files are in the page cache; the floor is the bench's: every
  byte read into fresh memory with every core, plus mindspore's
  `no_init_parameters` build of the model, added (no overlap counted).

Checkpoints are written here with random bf16 weights, Qwen2's layout:
`qwen2-1.3b` (hidden 2048, 24 layers, 2.69 GB in 3 files) and `qwen2-4b`
(hidden 3072, 32 layers, 7.64 GB in 2 files); or pass `--path DIR`.

    git worktree add /tmp/baseline <commit>
    python benchmarks/bench_plain_script.py --cases qwen2-1.3b,qwen2-4b --baseline /tmp/baseline --repeats 5
    python benchmarks/bench_plain_script.py --cases qwen2-1.3b --cold --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ms_loadpatch.tools import bench, cold  # noqa: E402

SHAPES = {
    # hidden, layers, intermediate, heads, shard bytes
    "qwen2-1.3b": (2048, 24, 5504, 16, 1_020_000_000),
    "qwen2-4b": (3072, 32, 8192, 24, 4_080_000_000),
}

_WRITE = """
import sys
import mindone.transformers as mt
import transformers as hf
from ms_loadpatch.testing import write_random_checkpoint
hidden, layers, inter, heads, shard = map(int, sys.argv[2:7])
config = hf.Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
    num_attention_heads=heads, num_key_value_heads=heads, vocab_size=32000, tie_word_embeddings=False,
    max_position_embeddings=4096, architectures=["Qwen2ForCausalLM"])
write_random_checkpoint(mt.Qwen2ForCausalLM, config, sys.argv[1], dtype="bfloat16", max_shard_bytes=shard)
"""


def checkpoint(case: str) -> str:
    """The case's checkpoint, written once into the bench cache."""
    directory = os.path.join(bench.cache_dir(), f"plain-{case}-bf16")
    if not os.path.isfile(os.path.join(directory, ".complete")):
        print(f"writing {case} into {directory} (once)", flush=True)
        env = dict(os.environ, MS_LOADPATCH="0")
        subprocess.run([sys.executable, "-c", _WRITE, directory, *map(str, SHAPES[case])], check=True, env=env)
        open(os.path.join(directory, ".complete"), "w").close()
    return directory


def run_case(path: str, args) -> dict:
    spec = bench.LoadSpec.resolve(path, class_name="Qwen2ForCausalLM", dtype="bfloat16")
    files = spec.weight_files()
    prime = bench.prime_bytes(spec, args.memory, args.cold)
    parts = ["script", "bench child", "floor"] + (["baseline script"] if args.baseline else [])
    runs = {part: [] for part in parts}
    for i in range(args.repeats):
        for part in parts[i % len(parts) :] + parts[: i % len(parts)]:
            if args.cold:
                cold.evict(files)
            else:
                cold.sequential_read(files)  # in the page cache, whatever ran before
            if part == "script":
                result = bench.measure_time_to_model(spec, "patched", prime=prime)
                seconds = result["load_seconds"]
            elif part == "baseline script":
                env = {"PYTHONPATH": args.baseline}
                result = bench.measure_time_to_model(spec, "patched", prime=prime, env_extra=env)
                seconds = result["load_seconds"]
            elif part == "bench child":
                result = bench.measure_load(spec, "patched", prime=prime)
                seconds = result["seconds"]
            elif args.cold:
                result = bench.measure_storage(files, prime=prime)
                seconds = result["seconds"]
            else:
                result = bench.measure_floors(spec, prime=prime)
                seconds = result["read_seconds"] + result["construct_seconds"]
            runs[part].append(dict(result, timed_seconds=seconds))
            print(f"  round {i + 1} {part:16} {seconds:7.3f} s", flush=True)
    return {
        "checkpoint": path,
        "bytes": spec.checkpoint_bytes(),
        "files": len(files),
        "runs": runs,
        "agreement": bench.plain_script_agreement(runs["bench child"], runs["script"]),
    }


def table(case: str, result: dict, args) -> str:
    median = {part: statistics.median(r["timed_seconds"] for r in rs) for part, rs in result["runs"].items()}
    floor = median["floor"]
    what = "8 threads x 16 MB into fresh memory" if args.cold else "read into fresh memory + build"
    lines = [
        f"{case}: {result['bytes'] / 1e9:.2f} GB in {result['files']} files, "
        f"{'cold' if args.cold else 'warm'}, memory {args.memory}, median of {args.repeats}"
    ]
    for part, seconds in median.items():
        spread = " ".join(f"{r['timed_seconds']:.2f}" for r in result["runs"][part])
        ratio = "" if part == "floor" else f"  {seconds / floor:5.2f}x of the floor"
        lines.append(f"  {part:16}{seconds:8.3f} s{ratio}   runs {spread}")
    lines.append(f"  (floor: {what})")
    agreement = result["agreement"]
    lines.append(
        "  plain script and bench child: "
        + ("agree" if agreement["agree"] else "DISAGREE: " + "; ".join(agreement["problems"]))
        + f" (cold files {agreement['script_cold_files']} / {agreement['bench_cold_files']})"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="qwen2-1.3b", help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--path", help="a Qwen2ForCausalLM bf16 checkpoint directory instead of the cases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--baseline", help="a checkout of ms_loadpatch whose plain script runs beside")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    cases = {"path": args.path} if args.path else {case: checkpoint(case) for case in args.cases.split(",")}
    results = {}
    for case, path in cases.items():
        print(f"{case}: {path}", flush=True)
        results[case] = run_case(path, args)
    print()
    for case, result in results.items():
        print(table(case, result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
