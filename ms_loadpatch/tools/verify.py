"""`ms-loadpatch verify PATH`: load a checkpoint unpatched and patched, each in
a fresh process, and compare every parameter and buffer bit for bit.

Each child writes testing.snapshot() of its model to a temporary .npz; the
parent (no mindspore import) compares them with testing.compare.

Exit codes: 0 identical; 1 different (or the patched load failed where the
unpatched one worked); 2 usage error; 3 the unpatched load itself failed, so
there is nothing to compare against.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

from ..testing import TensorRecord, compare
from .children import FALLBACK_NOTE, ChildError, measure_load
from .spec import LoadSpec, UsageError
from .steps import Progress

SHOWN_DIFFERENCES = 20
EXIT_EQUAL, EXIT_DIFFERENT, EXIT_USAGE, EXIT_NO_REFERENCE = 0, 1, 2, 3
_META = "__meta__"


def write_snapshot(snap: dict, path) -> None:
    """testing.snapshot() result -> one .npz: the bits of tensor i as "t{i}",
    everything else as JSON in "__meta__"."""
    arrays, tensors = {}, []
    for i, (name, record) in enumerate(snap["tensors"].items()):
        arrays[f"t{i}"] = record.bits
        tensors.append(
            {
                "name": name,
                "kind": record.kind,
                "shape": list(record.shape),
                "dtype": record.dtype,
                "requires_grad": record.requires_grad,
                "param_name": record.param_name,
                "copy_has_values": record.copy_has_values,
                "keeps_initializer": record.keeps_initializer,
            }
        )
    meta = {"tensors": tensors, "ties": snap["ties"], "training": snap["training"]}
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def read_snapshot(path) -> dict:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(data[_META].tobytes().decode())
        tensors = {}
        for i, t in enumerate(meta["tensors"]):
            tensors[t["name"]] = TensorRecord(
                t["kind"],
                tuple(t["shape"]),
                t["dtype"],
                data[f"t{i}"],
                t["requires_grad"],
                t["param_name"],
                t.get("copy_has_values"),
                t.get("keeps_initializer"),
            )
    return {"tensors": tensors, "ties": meta["ties"], "training": meta["training"]}


def run_verify(spec: LoadSpec, progress: Progress | None = None, timeout=None) -> dict:
    """Both loads and the comparison. Returns a dict with "exit_code", the two
    children's results (or "errors"), "problems" and the snapshot sizes."""
    progress = progress or Progress(enabled=False)
    outcome = {"spec": spec, "runs": {}, "errors": {}, "problems": [], "counts": {}}
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-verify-") as tmp:
        snaps = {}
        for mode in ("unpatched", "patched"):
            path = os.path.join(tmp, f"{mode}.npz")
            try:
                with progress.step(f"{mode} load (fresh process)"):
                    outcome["runs"][mode] = measure_load(spec, mode, snapshot=path, timeout=timeout)
            except ChildError as exc:
                outcome["errors"][mode] = exc
                if mode == "unpatched":
                    outcome["exit_code"] = EXIT_NO_REFERENCE
                    return outcome
                continue
            snaps[mode] = read_snapshot(path)
    if "patched" in outcome["errors"]:
        outcome["exit_code"] = EXIT_DIFFERENT
        return outcome
    patched = outcome["runs"]["patched"]
    if not patched.get("plugin_enabled"):
        outcome["errors"]["patched"] = ChildError(f"ms_loadpatch could not be enabled: {patched.get('plugin_refusal')}")
        outcome["exit_code"] = EXIT_DIFFERENT
        return outcome
    reference = snaps["unpatched"]
    kinds = [r.kind for r in reference["tensors"].values()]
    outcome["counts"] = {
        "params": kinds.count("param"),
        "buffers": kinds.count("buffer"),
        "tied": sum(len(v) for v in reference["ties"].values()),
    }
    outcome["problems"] = compare(reference, snaps["patched"])
    outcome["exit_code"] = EXIT_DIFFERENT if outcome["problems"] else EXIT_EQUAL
    return outcome


def format_outcome(outcome: dict) -> str:
    spec = outcome["spec"]
    runs, errors = outcome["runs"], outcome["errors"]
    lines = []
    where = spec.path + (f" (subfolder {spec.subfolder})" if spec.subfolder else "")
    first = runs.get("unpatched") or {}
    library = first.get("library", spec.library)
    lines.append(f"ms-loadpatch verify: {where}")
    lines.append(
        f"  class {first.get('class_name', spec.class_name)} (mindone.{library}), "
        f"dtype {spec.dtype or 'as from_pretrained defaults'}"
    )
    if first:
        fallback = FALLBACK_NOTE if first.get("cpu_kernel_fallbacks") else ""
        lines.append(f"  device {first['device']}{fallback}")
    for mode, label in (("unpatched", "MS_LOADPATCH=0"), ("patched", "ms_loadpatch enabled")):
        if mode in runs:
            run = runs[mode]
            lines.append(
                f"  {mode + ' load':15} {run['seconds']:8.3f} s  peak RSS {run['peak_rss_bytes'] / 2**20:,.0f} MB"
                f"  (fresh process, {label})"
            )
        elif mode in errors:
            lines.append(f"  {mode + ' load':15}   FAILED  {errors[mode]}")
    patched = runs.get("patched")
    if patched is not None and patched.get("plugin_enabled"):
        report = patched.get("report")
        if report:
            lines.append(f"  patched technique: {report['technique']}")
        else:
            lines.append(
                "  note: the patched load ran mindone's own path (no load report): "
                "nothing was accelerated, so equality is expected"
            )
    code = outcome["exit_code"]
    if code == EXIT_NO_REFERENCE:
        lines.append("CANNOT VERIFY: the unpatched load failed, so there is no reference to compare with")
        tail = _error_detail(errors["unpatched"])
        if tail:
            lines.append(tail)
        return "\n".join(lines)
    if "patched" in errors:
        lines.append("DIFFERENT: the patched load failed where the unpatched load worked")
        tail = _error_detail(errors["patched"])
        if tail:
            lines.append(tail)
        return "\n".join(lines)
    counts = outcome["counts"]
    lines.append(
        f"  compared {counts['params']} parameters and {counts['buffers']} buffers "
        f"({counts['tied']} tied names): names, shapes, dtypes, requires_grad, parameter names, "
        "ties, training mode, values bit for bit"
    )
    problems = outcome["problems"]
    if not problems:
        lines.append("IDENTICAL: the patched load gives the same model")
        return "\n".join(lines)
    lines.append(f"DIFFERENT: {len(problems)} difference(s)")
    for problem in problems[:SHOWN_DIFFERENCES]:
        lines.append(f"  {problem}")
    if len(problems) > SHOWN_DIFFERENCES:
        lines.append(f"  ... and {len(problems) - SHOWN_DIFFERENCES} more")
    return "\n".join(lines)


def _error_detail(exc) -> str:
    detail = getattr(exc, "result", {}).get("traceback") or getattr(exc, "stderr", "")
    if not detail:
        return ""
    tail = detail.strip().splitlines()[-12:]
    return "\n".join("    " + line for line in tail)


def main(args) -> int:
    """`ms-loadpatch verify` (args from cli.build_parser)."""
    try:
        spec = LoadSpec.resolve(args.path, args.class_name, args.subfolder, args.dtype)
        outcome = run_verify(spec, progress=Progress())
    except UsageError as exc:
        print(f"ms-loadpatch verify: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_outcome(outcome))
    return outcome["exit_code"]
