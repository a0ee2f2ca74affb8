"""Benchmark: the patched load of this tree against the patched load of
another checkout of ms_loadpatch (a baseline), in the same run: what a change
to the loading path costs or saves. Fresh processes, the two sides taking
turns, medians; every weight touched before the clock stops.

    git worktree add /tmp/baseline <commit>
    python benchmarks/bench_ab.py --baseline /tmp/baseline --repeats 5
    python benchmarks/bench_ab.py --baseline /tmp/baseline --cases bench,moe --memory as-is

    python benchmarks/bench_ab.py --baseline /tmp/baseline --cases qwen3_moe,nllb_moe --unpatched --floors

Cases: `bench` (the built-in default checkpoint, `ms-loadpatch bench`'s),
`moe` (the Mixtral-style MoE of bench_transformers.py, 48 layers x 128
experts, 18.8k tensors), `qwen2` (Qwen2-0.5B's shape, fp32, 2 GB), `unet`
(bench_diffusers.py's full UNet2DConditionModel, fp32, sharded: a diffusers
load), and any MoE family of moe_families.py (24 layers x 128 experts, fp32).
`--unpatched` adds an unpatched load to each round (each side's speed-up
over it); `--floors` measures mindspore's `no_init_parameters` build of the
model once per case and prints each side's construct phase against it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_diffusers import SIZES as DIFFUSERS_SIZES  # noqa: E402
from bench_transformers import SIZES, generate  # noqa: E402
from moe_families import families  # noqa: E402

from ms_loadpatch.tools import bench  # noqa: E402


def checkpoint(case: str) -> str:
    if case == "bench":
        return bench.builtin_checkpoint()
    config = SIZES["full"]
    if case == "moe":
        return bench.cached_checkpoint("tf-full-moe", "MixtralForCausalLM", config["moe"], config["moe_shard"])
    if case == "qwen2":
        return bench.cached_checkpoint("tf-full-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"])
    if case == "unet":
        config = DIFFUSERS_SIZES["full"]
        return bench.cached_checkpoint(
            "df-full-unet-sharded", "UNet2DConditionModel", config["unet"], config["shard"], library="diffusers"
        )
    if case in families():
        return generate("full", None)[case]
    raise SystemExit(f"unknown case {case}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a checkout of ms_loadpatch (the directory holding it)")
    parser.add_argument("--cases", default="bench,moe")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--unpatched", action="store_true", help="also time an unpatched load each round")
    parser.add_argument("--floors", action="store_true", help="construct phases against no_init_parameters' build")
    args = parser.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    if not os.path.isfile(os.path.join(baseline, "ms_loadpatch", "__init__.py")):
        raise SystemExit(f"{baseline} holds no ms_loadpatch package")
    # side -> (load mode, environment)
    sides = {"baseline": ("patched", {"PYTHONPATH": baseline}), "this tree": ("patched", {})}
    if args.unpatched:
        sides["unpatched"] = ("unpatched", {})
    for case in args.cases.split(","):
        spec = bench.LoadSpec.resolve(checkpoint(case))
        prime = bench.prime_bytes(spec, args.memory)
        floor = bench.measure_floors(spec, prime=prime)["construct_seconds"] if args.floors else None
        seconds = {side: [] for side in sides}
        construct = {side: [] for side in sides}
        reports = {}
        for _ in range(args.repeats):
            for side, (mode, env) in sides.items():
                result = bench.measure_load(spec, mode, prime=prime, env_extra=env)
                if mode == "patched" and not result.get("report"):
                    raise SystemExit(f"{case} ({side}): the load was not accelerated")
                seconds[side].append(result["seconds"])
                reports[side] = result.get("report") or {}
                construct[side].append(reports[side].get("phases", {}).get("construct"))
        base, this = (statistics.median(seconds[side]) for side in ("baseline", "this tree"))
        print(
            f"{case} ({args.memory}, {args.repeats} runs each, medians): baseline {base:.3f} s, "
            f"this tree {this:.3f} s, difference {this - base:+.3f} s ({(this - base) / base:+.1%})"
        )
        if args.unpatched:
            plain = statistics.median(seconds["unpatched"])
            print(f"  unpatched {plain:.3f} s: baseline {plain / base:.2f}x, this tree {plain / this:.2f}x")
        for side in sides:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in reports[side].get("phases", {}).items())
            line = f"  {side}: runs {', '.join(f'{s:.3f}' for s in seconds[side])}"
            if phases:
                line += f"; last report: {phases}"
            if floor and None not in construct[side]:
                median = statistics.median(construct[side])
                line += f"; construct {median:.3f} s = {median / floor:.2f}x the floor ({floor:.3f} s)"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
