"""The `ms-loadpatch` command (also `python -m ms_loadpatch`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys

from . import activation

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def _cmd_run(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("ms-loadpatch run: no command given (usage: ms-loadpatch run -- python train.py)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env[activation.ENV_VAR] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, env.get("PYTHONPATH")) if p)
    executable = shutil.which(command[0], path=env.get("PATH"))
    if executable is None:
        print(f"ms-loadpatch run: command not found: {command[0]}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, command, env)  # the child's exit code becomes ours
    return 0  # not reached


def _import_targets() -> dict:
    """Import mindspore and every module holding targets, as a user's load
    would: targets are applied and probes run on import. Returns what
    happened, with how long it took."""
    import importlib
    import time

    from .targets import TARGETS

    start = time.perf_counter()
    errors = {}
    # mindone prints notices on stdout while importing: keep stdout for the report (--json)
    with contextlib.redirect_stdout(sys.stderr):
        for name in ["mindspore"] + list(dict.fromkeys(t.module for t in TARGETS)):
            top = ".".join(name.split(".")[:2])
            if any(failed == top or name.startswith(failed + ".") for failed in errors):
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:  # a missing or broken mindone is what status is asked about
                errors[top if name != "mindspore" else name] = f"{type(exc).__name__}: {exc}"
    return {"imported": True, "seconds": round(time.perf_counter() - start, 3), "errors": errors}


def _installed_pth() -> bool:
    import site

    paths = site.getsitepackages() + [site.getusersitepackages()]
    return any(os.path.exists(os.path.join(d, "ms_loadpatch_autoload.pth")) for d in paths)


def _print_status(report: dict) -> None:
    imported = report["import"]
    if imported["imported"]:
        print(f"(imported mindspore and mindone's target modules in {imported['seconds']:.1f} s)")
    else:
        print("(--no-import: mindspore and mindone not imported, probes not run)")
    for library, verdict in report["libraries"].items():
        names = ", ".join(
            row["name"] for row in report["techniques"] if row["state"] == "active" and library in row["libraries"]
        )
        error = next((e for m, e in imported["errors"].items() if m == f"mindone.{library}" or m == "mindspore"), None)
        if verdict["accelerated"]:
            line = "accelerated" + (f" (techniques: {names})" if names else "")
        elif verdict["accelerated"] is None:
            line = f"not known yet: {verdict['reason']}"
        else:
            line = f"not accelerated: {verdict['reason']}"
        print(f"mindone.{library}: {line}")
        if error:
            print(f"  importing it failed: {error}")
        if verdict["advice"]:
            print(f"  what to do: {verdict['advice']}")
    for untested in report["untested"]:
        print(f"warning: {untested}; accepted because {report['activation']['allow_untested_var']} is set")
    for development in report["development"]:
        print(f"note: {development}")
    activation = report["activation"]
    hook = "installed" if activation["pth_installed"] else "not installed: use ms-loadpatch run"
    print(
        f"\nturned on by: import ms_loadpatch, or {activation['env_var']}=1 (currently "
        f"{activation['env_value']!r}; .pth hook {hook})"
    )
    _print_lazy_import(report["lazy_import"])
    _print_multi_node(report.get("multi_node"))
    print("\nversions:")
    for name, version in report["versions"].items():
        tested = ", ".join(report["tested"][name])
        print(f"  {name} {version or 'not installed'} (supported {report['supported'][name]}; tested {tested})")
    python = report["python"]  # the running one
    untested = "" if python["tested_here"] else f", not {python['version'].rsplit('.', 1)[0]}"
    print(
        f"  python {python['version']} (supported {python['supported']}; tested {', '.join(python['tested'])}"
        f"{untested})"
    )
    if report["refusal"]:
        print(f"  refused: {report['refusal']}")
    for library in report["libraries"]:
        rows = [row for row in report["targets"] if row["library"] == library]
        print(f"\nmindone.{library} entry points:")
        for row in (r for r in rows if r["public"]):
            reason = f"  ({row['reason']})" if row["reason"] else ""
            print(f"  {row['state']:10} {row['target'].split(':', 1)[1]}{reason}")
        internal = [r for r in rows if not r["public"]]
        counts = {}
        for row in internal:
            counts[row["state"]] = counts.get(row["state"], 0) + 1
        print(f"  internals of its loading path: {', '.join(f'{n} {state}' for state, n in counts.items())}")
        for row in internal:
            if row["state"] != "patched" and row["reason"] and not row["refused"]:  # the refusal is printed once
                print(f"    {row['state']:10} {row['target'].split(':', 1)[1]}  ({row['reason']})")
    if report["techniques"]:
        print(f"\ntechniques (probed on mindspore {report['versions']['mindspore']}):")
        for row in report["techniques"]:
            reason = f"  ({row['reason']})" if row["reason"] else ""
            print(f"  {row['state']:8} {row['name']}: {row['description']}{reason}")
    build = report.get("last_build")
    if build is not None:
        start = build["engaged_at"]
        print(
            "\nlast build in this process: "
            + (
                "built plainly (fewer cells than the start cell)"
                if start is None
                else f"fast construction from cell {start}, {build['cells_copied']} cells copied from recipes"
            )
            + f", {build.get('host_tensors', 0)} factory tensors made on the host"
        )
        for name, reason in build["not_copied"].items():
            print(f"  built plainly: {name}: {reason}")


def _print_multi_node(multi_node: dict | None) -> None:
    if multi_node is None:
        return
    ranks = multi_node["job_ranks"]
    job = f"in a job of {ranks} ranks (node {multi_node['node']!r})" if ranks else "not in a multi-rank job"
    print(f"multi-node reading ({multi_node['env_var']}): {multi_node['mode']}, {job}")
    store = multi_node["store"]
    if store is not None:
        serving = ", served by this process" if store["serves"] else ""
        print(
            f"  the job's store at {store['address']}{serving}" + (f": {store['problem']}" if store["problem"] else "")
        )
    for channel in multi_node["leader_channels"]:
        leaders = ", ".join(map(str, channel["leaders"]))
        found = channel["problem"] or f"{channel['bytes_per_s'] / 1e6:.0f} MB/s to each leader"
        print(f"  the leaders' channel (ranks {leaders}): {found}")


def _print_lazy_import(lazy: dict) -> None:
    if not lazy["on"]:
        print(f"lazy import of mindone.transformers: off ({lazy['reason']})")
    else:
        print(f"lazy import of mindone.transformers: on ({lazy['env_var']}=0 turns it off)")
    for name, row in lazy["packages"].items():
        if row["state"] == "lazy":
            print(f"  {name}: lazy, {row['deferred']} modules deferred ({row['imported_since']} imported since)")
        elif row["state"] == "eager" and (lazy["on"] or row["reason"]):
            print(f"  {name}: imported eagerly: {row['reason']}")
        elif lazy["on"]:
            print(f"  {name}: {row['state']}")
    for module, error in lazy["side_effect_errors"].items():
        print(f"  importing {module} (as the eager import would) failed: {error}")


def _cmd_status(args) -> int:
    import ms_loadpatch

    if args.enable and not activation.switched_off():
        ms_loadpatch.enable()
    imported = {"imported": False, "seconds": 0.0, "errors": {}}
    if not args.no_import:
        imported = _import_targets()
    from . import versions

    report = ms_loadpatch.status()
    report["import"] = imported
    report["activation"] = {
        "env_var": activation.ENV_VAR,
        "env_value": activation.env_value(),
        "pth_installed": _installed_pth(),
        "allow_untested_var": versions.ALLOW_UNTESTED_ENV_VAR,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report)
    return 0


def _cmd_verify(args) -> int:
    from .tools import verify

    return verify.main(args)


def _cmd_bench(args) -> int:
    from .tools import bench

    return bench.main(args)


def _add_load_options(parser, dtypes) -> None:
    parser.add_argument(
        "--class",
        dest="class_name",
        metavar="NAME",
        help="model class: a mindone.transformers / mindone.diffusers name, or module:Class "
        "(default: from config.json, `architectures[0]` or `_class_name`)",
    )
    parser.add_argument("--dtype", choices=dtypes, help="dtype passed to from_pretrained")
    parser.add_argument("--subfolder", default="", metavar="S", help="model inside PATH, e.g. a pipeline's unet")


def build_parser() -> argparse.ArgumentParser:
    from .tools.bench import MEMORY_MODES  # standard library only: cheap at start-up

    parser = argparse.ArgumentParser(prog="ms-loadpatch", description="Fast, bit-identical mindone model loading.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a command with the plugin enabled: ms-loadpatch run -- python train.py")
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser(
        "status",
        help="will loads be accelerated here: a verdict per library, then entry points, techniques, versions",
        description="Imports mindspore and mindone (as a load would), applies the targets and runs every probe.",
    )
    status.add_argument("--json", action="store_true", help="print everything as JSON (README: status --json)")
    status.add_argument(
        "--no-import",
        action="store_true",
        help="do not import mindspore or mindone (fast; targets then show as pending, probes not run)",
    )
    status.add_argument("--import-mindone", action="store_true", help=argparse.SUPPRESS)  # the default since 0.2
    status.set_defaults(func=_cmd_status, enable=True)

    dtypes = ("float16", "bfloat16", "float32")  # bench.DTYPES; not imported here to keep start-up light
    verify = sub.add_parser(
        "verify",
        help="load PATH unpatched and patched (fresh processes) and compare every tensor bit for bit",
        description="Exit codes: 0 identical, 1 different (or the patched load failed), 2 usage error, "
        "3 the unpatched load failed (nothing to compare).",
    )
    verify.add_argument("path", metavar="PATH", help="local checkpoint directory")
    _add_load_options(verify, dtypes)
    verify.set_defaults(func=_cmd_verify)

    bench = sub.add_parser(
        "bench",
        help="time unpatched vs patched from_pretrained (default: a built-in generated checkpoint)",
        description="Each load runs in a fresh process; the timed region ends after every weight was touched.",
    )
    bench.add_argument(
        "path",
        metavar="PATH",
        nargs="?",
        help="checkpoint directory (default: a built-in one, "
        "generated once into $MS_LOADPATCH_CACHE or ~/.cache/ms_loadpatch)",
    )
    _add_load_options(bench, dtypes)
    bench.add_argument(
        "--single-file",
        metavar="FILE",
        help="load FILE (in the model's directory) with "
        "from_single_file instead of from_pretrained (mindone.diffusers models)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    # 1 by default: each load is a fresh process paying mindone's imports, and
    # the no-argument bench must stay well under a minute on 2 cores
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="loads per side, each in a fresh process; the median is shown (default 1)",
    )
    bench.add_argument(
        "--size", choices=("tiny", "default"), default="default", help="size of the built-in checkpoint (when no PATH)"
    )
    bench.add_argument(
        "--cold",
        action="store_true",
        help="give the checkpoint's pages back to the OS (posix_fadvise, no root) before each timed "
        "part, and time cold sequential and parallel reads of its files beside the loads",
    )
    bench.add_argument(
        "--memory",
        choices=MEMORY_MODES,
        default="primed",
        help="primed (default): every process faults in and frees memory before each timed part; "
        "as-is: count the machine's first-touch cost of fresh memory (large on some VMs)",
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
