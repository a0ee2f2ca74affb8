"""Benchmark: the patched load of this tree against the patched load of
another checkout of ms_loadpatch (a baseline), in the same run: what a change
to the loading path costs or saves. Fresh processes, the two sides taking
turns, medians; every weight touched before the clock stops.

    git worktree add /tmp/baseline <commit>
    python benchmarks/bench_ab.py --baseline /tmp/baseline --repeats 5
    python benchmarks/bench_ab.py --baseline /tmp/baseline --cases bench,moe --memory as-is

Cases: `bench` (the built-in default checkpoint, `ms-loadpatch bench`'s),
`moe` (the Mixtral-style MoE of bench_transformers.py, 48 layers x 128
experts, 18.8k tensors), `qwen2` (Qwen2-0.5B's shape, fp32, 2 GB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ms_loadpatch.tools import bench  # noqa: E402

from bench_transformers import SIZES  # noqa: E402


def checkpoint(case: str) -> str:
    if case == "bench":
        return bench.builtin_checkpoint()
    config = SIZES["full"]
    if case == "moe":
        return bench.cached_checkpoint("tf-full-moe", "MixtralForCausalLM", config["moe"], config["moe_shard"])
    if case == "qwen2":
        return bench.cached_checkpoint("tf-full-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"])
    raise SystemExit(f"unknown case {case}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a checkout of ms_loadpatch (the directory holding it)")
    parser.add_argument("--cases", default="bench,moe")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    args = parser.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    if not os.path.isfile(os.path.join(baseline, "ms_loadpatch", "__init__.py")):
        raise SystemExit(f"{baseline} holds no ms_loadpatch package")
    sides = {"baseline": {"PYTHONPATH": baseline}, "this tree": {}}
    for case in args.cases.split(","):
        spec = bench.LoadSpec.resolve(checkpoint(case))
        prime = bench.prime_bytes(spec, args.memory)
        seconds = {side: [] for side in sides}
        reports = {}
        for _ in range(args.repeats):
            for side, env in sides.items():
                result = bench.measure_load(spec, "patched", prime=prime, env_extra=env)
                if not result.get("report"):
                    raise SystemExit(f"{case} ({side}): the load was not accelerated")
                seconds[side].append(result["seconds"])
                reports[side] = result["report"]
        base, this = (statistics.median(seconds[side]) for side in sides)
        print(f"{case} ({args.memory}, {args.repeats} runs each, medians): baseline {base:.3f} s, "
              f"this tree {this:.3f} s, difference {this - base:+.3f} s ({(this - base) / base:+.1%})")
        for side in sides:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in reports[side].get("phases", {}).items())
            print(f"  {side}: runs {', '.join(f'{s:.3f}' for s in seconds[side])}; last report: {phases}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
