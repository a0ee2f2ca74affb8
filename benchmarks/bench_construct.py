"""Benchmark: building a model, mindspore's no_init_parameters (the floor)
against ms_loadpatch's construction window, with every fast-construction
technique and with each one switched off (its contribution).

Each measurement is a fresh process, the variants taking turns (imports first, then the clock runs
around the model's constructor only: `cls(config)` with mindone's init pass
off, as bench's construct floor does); median over --repeats. The patched
clock includes what a load's construct phase pays: the probes, run when the
build reaches the cell where the techniques engage
(MS_LOADPATCH_FAST_CONSTRUCTION_FROM, default 1000; a model with fewer cells
is built plainly). Memory is
primed before the clock starts (bench's `--memory primed`: this VM charges
about 2 s/GB on first touch of fresh memory, which would swamp the build).

    python benchmarks/bench_construct.py --repeats 3
    python benchmarks/bench_construct.py --models moe --repeats 1
    python benchmarks/bench_construct.py --models families,qwen2,dense80 --repeats 3
    python benchmarks/bench_construct.py --models granitemoe,dbrx --only floor,patched,probed-patched

probed-patched runs the probes before the clock: the build's share without
them (what a second load in the same process pays).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_transformers import SIZES  # noqa: E402
from moe_families import families  # noqa: E402

MODELS = {
    "moe": ("MixtralForCausalLM", SIZES["full"]["moe"]),  # the built-in bench's MoE, 48 layers x 128 experts
    "qwen2": ("Qwen2ForCausalLM", SIZES["full"]["qwen2"]),
    # a big dense model: 80 decoder layers (~1.2k cells)
    "dense80": (
        "Qwen2ForCausalLM",
        dict(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=80,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        ),
    ),
    **{family: (class_name, config) for family, (class_name, config) in families().items()},
}
FAMILIES = list(families())

_CHILD = r"""
import gc, json, os, sys, time
variant, class_name, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if sys.argv[4] == "lazy":
    import ms_loadpatch  # first: mindone.transformers is imported lazily, as in a patched user's process
import mindone.transformers as transformers
import mindone.transformers.modeling_utils as modeling_utils
from mindspore.nn.utils import no_init_parameters
import ms_loadpatch
from ms_loadpatch import techniques
from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.building import window
from ms_loadpatch.strategy.building.construction import lazy_construction
from ms_loadpatch.testing import cpu_kernel_fallbacks
from ms_loadpatch.tools._child import prime_memory

cls = getattr(transformers, class_name)
config = cls.config_class(**config)
modeling_utils._init_weights = False  # the init pass is not construction
if sys.argv[5] == "probed":  # the probes (once per process) before the clock: the build's own share
    building.active_techniques(early=True), building.active_techniques()
gc.collect()
prime_memory(1536 * 2**20)  # more than the build allocates
with cpu_kernel_fallbacks():  # this backend lacks some kernels mindone's constructors call
    start = time.perf_counter()
    if variant == "floor":
        with no_init_parameters():
            model = cls(config)
    else:
        with lazy_construction():
            model = cls(config)
    seconds = time.perf_counter() - start
cells = sum(1 for _ in model.cells_and_names())
params = len(model.parameters_dict())
active = [t.name for t in building.active_techniques()]
build = techniques.last_build() if variant != "floor" else None
print("RESULT " + json.dumps({"seconds": seconds, "cells": cells, "parameters": params, "active": active,
                              "engaged_at": window.state.engaged_at if variant != "floor" else None,
                              "copied": build["cells_copied"] if build else 0,
                              "not_copied": build["not_copied"] if build else {}}))
"""


def _variants():
    from ms_loadpatch.strategy.building import TECHNIQUES

    yield "floor", "construct (mindspore no_init_parameters)", None
    yield "patched", "patched construct (all techniques)", ""
    # opt-in (--only): both again with ms_loadpatch imported before mindone, so mindone.transformers is
    # lazy (fewer nn.Cell subclasses loaded: each instance-count update and collection costs less)
    yield "lazy-floor", "construct (no_init_parameters), lazy mindone import", None
    yield "lazy-patched", "patched construct, lazy mindone import", ""
    # opt-in (--only): the probes run before the clock (what a second load in the process pays; they also
    # warm mindspore's first ops, which the build then does not pay for)
    yield "probed-patched", "patched construct, probes run before the clock", ""
    yield "none", "patched construct, every technique off", "all"
    for technique in TECHNIQUES:
        yield f"no-{technique.name}", f"patched construct without {technique.name}", technique.name


FAMILY_VARIANTS = ("floor", "patched", "no-sibling-clone")  # per family: floor, patched, sibling-clone's share


def _wanted(variant, model, only) -> bool:
    if only:
        return variant in only
    return not variant.startswith(("lazy-", "probed-")) and (model not in FAMILIES or variant in FAMILY_VARIANTS)


def run_once(variant, off, class_name, config) -> dict:
    env = dict(os.environ)
    env.pop("MS_LOADPATCH", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    if off is not None:
        env["MS_LOADPATCH_TECHNIQUES_OFF"] = off
    else:
        env.pop("MS_LOADPATCH_TECHNIQUES_OFF", None)
    imports = "lazy" if variant.startswith("lazy-") else "eager"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            "floor" if off is None else "patched",
            class_name,
            json.dumps(config),
            imports,
            "probed" if variant.startswith("probed-") else "-",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{variant}: the child failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        default="moe,qwen2",
        help=f"comma-separated subset of {', '.join(MODELS)}; `families`: every MoE family",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--only",
        help="comma-separated variants (floor, patched, none, no-<technique>, lazy-floor, "
        "lazy-patched, probed-patched)",
    )
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    results = {}
    models = [m for name in args.models.split(",") for m in (FAMILIES if name == "families" else [name])]
    for model in models:
        class_name, config = MODELS[model]
        rows = []
        chosen = [v for v in _variants() if _wanted(v[0], model, only)]
        # round-robin over the variants, so the machine's drift between runs falls on every variant alike
        runs_of = {variant: [] for variant, _, _ in chosen}
        for _ in range(args.repeats):
            for variant, _, off in chosen:
                runs_of[variant].append(run_once(variant, off, class_name, config))
        for variant, label, _off in chosen:
            runs = runs_of[variant]
            seconds = [r["seconds"] for r in runs]
            rows.append(
                {
                    "variant": variant,
                    "label": label,
                    "runs": seconds,
                    "median_seconds": statistics.median(seconds),
                    "cells": runs[0]["cells"],
                    "parameters": runs[0]["parameters"],
                    "active": runs[0]["active"],
                    "engaged_at": runs[0]["engaged_at"],
                    "copied": runs[0]["copied"],
                    "not_copied": runs[0]["not_copied"],
                }
            )
            print(
                f"{model:6} {label:58} {statistics.median(seconds):8.3f} s   runs "
                + "/".join(f"{s:.3f}" for s in seconds)
                + f"   {runs[0]['copied']} cells copied",
                flush=True,
            )
        results[model] = rows
        floor = next((r for r in rows if r["variant"] == "floor"), None)
        if floor:
            engaged = next((r["engaged_at"] for r in rows if r["variant"] == "patched"), None)
            print(
                f"{model}: {rows[0]['cells']} cells, {rows[0]['parameters']} parameters; techniques engaged "
                + (f"at cell {engaged}" if engaged is not None else "never (fewer cells than the start)")
            )
            lazy_floor = next((r for r in rows if r["variant"] == "lazy-floor"), floor)
            for r in rows:
                base = lazy_floor if r["variant"].startswith("lazy-") else floor  # each against its own import
                ratio = r["median_seconds"] / base["median_seconds"]
                print(
                    f"  {r['label']:58} {r['median_seconds']:8.3f} s  {ratio:5.2f}x floor"
                    + ("" if r["variant"].endswith("floor") else f"  {r['copied']} cells copied")
                )
            patched = next((r for r in rows if r["variant"] == "patched"), None)
            for name, reason in (patched["not_copied"] if patched else {}).items():
                print(f"  built plainly: {name}: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
