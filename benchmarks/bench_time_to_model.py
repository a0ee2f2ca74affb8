"""Benchmark: time to model, the wait of a user's script.

Each run is a fresh process; times are medians over --repeats, the sides
alternating. Unpatched: MS_LOADPATCH=0 and no `import ms_loadpatch` (eager
mindone.transformers); patched: the script starts with `import ms_loadpatch`
(plugin on, lazy mindone.transformers). Cases:

  imports       `import mindspore`, then `from mindone.transformers import
                AutoModelForCausalLM` (the mindone part timed on its own)
  touch-all     `import mindone.transformers` and getattr of every public name
                (the worst case of lazy import: everything ends up imported)
  transformers  time to model of a Qwen2ForCausalLM (the built-in bench checkpoint)
  diffusers     time to model of an SD-sized AutoencoderKL (mindone.diffusers)

    python benchmarks/bench_time_to_model.py --repeats 5
    python benchmarks/bench_time_to_model.py --cases imports,touch-all --repeats 5

Checkpoints are generated locally (random weights, cached in
$MS_LOADPATCH_CACHE or ~/.cache/ms_loadpatch). Run one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ms_loadpatch.tools import bench  # noqa: E402

CASES = ("imports", "touch-all", "transformers", "diffusers")
# SD 1.x VAE shape (84M parameters, 335 MB in fp32)
VAE = dict(
    block_out_channels=[128, 256, 512, 512],
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2,
    sample_size=512,
)

# argv: spawn time; prints one JSON line of seconds since spawn per step
_IMPORTS = """
import sys, time
spawned, out = float(sys.argv[1]), {}
out["started"] = time.time() - spawned
if sys.argv[2] == "patched":
    import ms_loadpatch
import mindspore
out["mindspore"] = time.time() - spawned
if sys.argv[3] == "mindone":
    from mindone.transformers import AutoModelForCausalLM
    out["mindone"] = time.time() - spawned
out["lazy"] = type(sys.modules.get("mindone.transformers")).__name__ == "LazyPackage"
print("RESULT", __import__("json").dumps(out))
"""

_TOUCH_ALL = """
import sys, time
spawned, out = float(sys.argv[1]), {}
if sys.argv[2] == "patched":
    import ms_loadpatch
import mindone.transformers as mt
out["imported"] = time.time() - spawned
names = [n for n in dir(mt) if not n.startswith("_")]
for name in names:
    getattr(mt, name)
out["touched"] = time.time() - spawned
out["names"] = len(names)
out["modules"] = len(sys.modules)
out["lazy"] = type(mt).__name__ == "LazyPackage"
print("RESULT", __import__("json").dumps(out))
"""


def _env(mode):
    env = bench.child_env(mode)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _run(code, mode, *args):
    proc = subprocess.run(
        [sys.executable, "-c", code, repr(time.time()), mode, *args],
        env=_env(mode),
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _median(runs, key):
    return statistics.median(r[key] for r in runs)


def case_imports(repeats):
    runs = {"mindspore only": [], "unpatched": [], "patched": []}
    for _ in range(repeats):
        runs["mindspore only"].append(_run(_IMPORTS, "unpatched", "none"))
        for mode in ("unpatched", "patched"):
            runs[mode].append(_run(_IMPORTS, mode, "mindone"))
    base = _median(runs["mindspore only"], "mindspore")
    rows = {"mindspore only": {"import mindspore": base, "runs": [r["mindspore"] for r in runs["mindspore only"]]}}
    for mode in ("unpatched", "patched"):
        parts = [r["mindone"] - r["mindspore"] for r in runs[mode]]
        rows[mode] = {
            "import mindspore": _median(runs[mode], "mindspore"),
            "mindone part": statistics.median(parts),
            "total": _median(runs[mode], "mindone"),
            "mindone part runs": parts,
            "lazy": all(r["lazy"] for r in runs[mode]),
        }
    rows["mindone part ratio"] = rows["unpatched"]["mindone part"] / rows["patched"]["mindone part"]
    print(
        "\nimports (seconds since process spawn; mindone part = from mindone.transformers import "
        "AutoModelForCausalLM after import mindspore)"
    )
    print(f"  python -c 'import mindspore'                     {base:.3f} s")
    for mode in ("unpatched", "patched"):
        row = rows[mode]
        print(
            f"  {mode:10} import mindspore {row['import mindspore']:.3f} s, mindone part {row['mindone part']:.3f} s "
            f"(runs {' '.join(f'{x:.2f}' for x in row['mindone part runs'])}), total {row['total']:.3f} s, "
            f"lazy {row['lazy']}"
        )
    print(f"  mindone part: {rows['mindone part ratio']:.2f}x faster patched")
    return rows


def case_touch_all(repeats):
    runs = {"unpatched": [], "patched": []}
    for _ in range(repeats):
        for mode in ("unpatched", "patched"):
            runs[mode].append(_run(_TOUCH_ALL, mode))
    rows = {
        mode: {
            "imported": _median(r, "imported"),
            "touched": _median(r, "touched"),
            "runs": [x["touched"] for x in r],
            "names": r[0]["names"],
            "modules": r[0]["modules"],
            "lazy": all(x["lazy"] for x in r),
        }
        for mode, r in runs.items()
    }
    rows["slowdown"] = rows["patched"]["touched"] / rows["unpatched"]["touched"] - 1
    print("\ntouch-all (import mindone.transformers, getattr of every public name; seconds since spawn)")
    for mode in ("unpatched", "patched"):
        row = rows[mode]
        print(
            f"  {mode:10} imported {row['imported']:.3f} s, all touched {row['touched']:.3f} s "
            f"(runs {' '.join(f'{x:.2f}' for x in row['runs'])}), {row['names']} names, "
            f"{row['modules']} modules, lazy {row['lazy']}"
        )
    print(f"  patched vs unpatched: {rows['slowdown']:+.1%}")
    return rows


def case_time_to_model(name, spec, repeats, memory):
    prime = bench.prime_bytes(spec, memory)
    runs = {"unpatched": [], "patched": []}
    for _ in range(repeats):
        for mode in ("unpatched", "patched"):
            runs[mode].append(bench.measure_time_to_model(spec, mode, prime=prime))
    result = bench.summarize_time_to_model(runs)
    print(f"\ntime to model, {name}: {spec.class_name}, {bench._mb(spec.checkpoint_bytes())}")
    labels = (
        ("interpreter start", "interpreter_seconds"),
        ("import mindspore", "import_mindspore_seconds"),
        ("import the model class", "import_mindone_seconds"),
        ("from_pretrained + touch", "load_seconds"),
        ("total", "seconds"),
    )
    print(f"  {'':26}{'unpatched':>11}{'patched':>11}")
    for label, key in labels:
        print(f"  {label:26}{result['unpatched'][key]:>10.3f}s{result['patched'][key]:>10.3f}s")
    print(
        f"  runs (total): unpatched {' '.join(f'{x:.2f}' for x in result['unpatched']['all_seconds'])}; "
        f"patched {' '.join(f'{x:.2f}' for x in result['patched']['all_seconds'])}"
    )
    print(f"  {result['ratio']:.2f}x faster patched (lazy import: {result['patched']['lazy_import']})")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per side and case (median)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    args = parser.parse_args(argv)
    selected = [c for c in args.cases.split(",") if c]
    if set(selected) - set(CASES):
        parser.error(f"unknown case(s): {', '.join(sorted(set(selected) - set(CASES)))}")
    progress = bench.Progress()
    results = {}
    for case in selected:
        if case == "imports":
            results[case] = case_imports(args.repeats)
        elif case == "touch-all":
            results[case] = case_touch_all(args.repeats)
        elif case == "transformers":
            spec = bench.LoadSpec.resolve(bench.builtin_checkpoint("default", progress=progress))
            results[case] = case_time_to_model(case, spec, args.repeats, args.memory)
        else:
            path = bench.cached_checkpoint("ttm-vae", "AutoencoderKL", VAE, library="diffusers", progress=progress)
            results[case] = case_time_to_model(case, bench.LoadSpec.resolve(path), args.repeats, args.memory)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
