"""Pieces shared by the benchmark scripts: bf16 copies of generated
checkpoints, a script run in a fresh process, and the one-line-per-case
summary table."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

from ms_loadpatch.tools import bench


def script_result(code: str, args, mode: str, what: str) -> dict:
    """Run `code` in a fresh interpreter (`mode`: "patched" or "unpatched",
    bench.child_env) with `args`; the JSON of its "RESULT " line."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], env=bench.child_env(mode), capture_output=True, text=True
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise bench.ChildError(f"{what} ({mode}) failed, exit {proc.returncode}", stderr=proc.stderr)


def to_bf16_file(src, dst):
    """Rewrite a safetensors file with every F32 tensor rounded to BF16
    (round to nearest even, as a cast does); pure numpy, no mindspore here."""
    with open(src, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    metadata = header.pop("__metadata__", None)
    out_header, chunks, offset = {}, [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        dtype = info["dtype"]
        if dtype == "F32":
            bits = raw.view(np.uint32).astype(np.uint64)
            raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
            dtype = "BF16"
        out_header[name] = {"dtype": dtype, "shape": info["shape"], "data_offsets": [offset, offset + raw.size]}
        chunks.append(raw)
        offset += raw.size
    if metadata is not None:
        out_header["__metadata__"] = metadata
    encoded = json.dumps(out_header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for chunk in chunks:
            f.write(chunk.tobytes())


def bf16_copy(src_dir):
    """A copy of a generated fp32 checkpoint directory with bf16 weights (cached)."""
    dst_dir = src_dir.rstrip("/") + "-bf16"
    if os.path.isfile(os.path.join(dst_dir, ".complete")):
        return dst_dir
    os.makedirs(dst_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
        if name.endswith(".safetensors"):
            to_bf16_file(src, dst)
        elif name.endswith(".index.json"):
            with open(src) as f:
                index = json.load(f)
            index.setdefault("metadata", {})["total_size"] = index.get("metadata", {}).get("total_size", 0) // 2
            with open(dst, "w") as f:
                json.dump(index, f, indent=2)
        elif name.endswith(".json"):
            with open(src) as f, open(dst, "w") as g:
                g.write(f.read())
    open(os.path.join(dst_dir, ".complete"), "w").close()
    return dst_dir


def summary_row(name, result):
    unp, pat, floors = result["unpatched"], result["patched"], result.get("floors") or {}
    unp_rss, pat_rss = max(unp["peak_rss_bytes"]), max(pat["peak_rss_bytes"])
    base = min(unp["rss_before_bytes"] + pat["rss_before_bytes"])  # interpreter + imports
    floor = floors.get("read_seconds", 0.0) + floors.get("construct_seconds", 0.0) + floors.get("cast_seconds", 0.0)
    return {
        "case": name,
        "unpatched_s": unp["median_seconds"],
        "patched_s": pat["median_seconds"],
        "ratio": unp["median_seconds"] / pat["median_seconds"],
        "unpatched_peak_mb": unp_rss / 2**20,
        "patched_peak_mb": pat_rss / 2**20,
        "rss_saving": 1 - (pat_rss - base) / max(unp_rss - base, 1),
        "floor_read_s": floors.get("read_seconds"),
        "floor_construct_s": floors.get("construct_seconds"),
        "floor_cast_s": floors.get("cast_seconds", 0.0),
        "vs_floor": pat["median_seconds"] / floor if floor else None,
    }


def format_summary(rows, targets: str = "") -> str:
    head = (
        f"{'case':28}{'unpatched':>11}{'patched':>10}{'ratio':>8}{'peak RSS unp':>14}{'peak RSS pat':>14}"
        f"{'load RSS saved':>16}{'floor read':>12}{'floor build':>13}{'floor cast':>12}{'pat/floor':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:28}{r['unpatched_s']:>10.3f}s{r['patched_s']:>9.3f}s{r['ratio']:>7.2f}x"
            f"{r['unpatched_peak_mb']:>11,.0f} MB{r['patched_peak_mb']:>11,.0f} MB{r['rss_saving']:>15.0%}"
            f"{r['floor_read_s']:>11.3f}s{r['floor_construct_s']:>12.3f}s{r['floor_cast_s']:>11.3f}s{r['vs_floor']:>10.2f}x"
        )
    lines.append("")
    lines.append("load RSS saved: 1 - (patched peak - base) / (unpatched peak - base), base = RSS after imports")
    lines.append(
        "pat/floor: patched time / (read + construct + one cast pass floors); reading overlaps construction, "
        "so < 1 is possible"
    )
    if targets:
        lines.append(f"targets: {targets}")
    return "\n".join(lines)


def run_single(case, path, dtype, args, progress):
    """One model checkpoint through the shared harness; prints its table."""
    spec = bench.LoadSpec.resolve(path, dtype=dtype)
    result = bench.run_bench(spec, repeats=args.repeats, progress=progress, memory=args.memory)
    print()
    print(bench.format_table(result, f"{case}: {spec.class_name} ({args.size})"))
    return result


def bench_main(argv, doc, sizes, cases, generate, run_case, targets, default_cases=None) -> int:
    """The command line of a benchmark script: pick size, repeats and cases,
    generate the checkpoints, run `run_case(case, paths, args, progress)` for
    each, print the summary (and JSON)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sizes, default="full")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side and case (median)")
    parser.add_argument(
        "--cases", default=",".join(default_cases or cases), help=f"comma-separated subset of {', '.join(cases)}"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    parser.add_argument(
        "--memory",
        choices=bench.MEMORY_MODES,
        default="primed",
        help="primed (default): fault in and free memory before each timed part, in every process; "
        "as-is: count this VM's first-touch cost of fresh memory (about 2 s/GB)",
    )
    args = parser.parse_args(argv)
    selected = [c for c in args.cases.split(",") if c]
    unknown = set(selected) - set(cases)
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    progress = bench.Progress()
    paths = generate(args.size, progress)
    rows, results, not_measured = [], {}, {}
    for case in selected:
        try:
            results[case] = run_case(case, paths, args, progress)
        except bench.ChildError as exc:  # e.g. unpatched mindone cannot build the model on this backend
            not_measured[case] = str(exc)
            print(f"\n{case}: not measured: {exc}", flush=True)
            continue
        rows.append(summary_row(case, results[case]))
    print()
    print(format_summary(rows, targets))
    for case, reason in not_measured.items():
        print(f"not measured: {case}: {reason}")
    print(f"memory: {args.memory} (--memory; primed = every timed part starts on memory the host backs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "size": args.size,
                    "memory": args.memory,
                    "results": results,
                    "summary": rows,
                    "not_measured": not_measured,
                },
                f,
                indent=2,
            )
    return 1 if not_measured else 0
