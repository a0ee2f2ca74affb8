"""The `ms-loadpatch` command (also `python -m ms_loadpatch`)."""

from __future__ import annotations

import argparse
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


def _cmd_status(args) -> int:
    import ms_loadpatch

    if args.enable and not activation.switched_off():
        ms_loadpatch.enable()
    report = ms_loadpatch.status()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"enabled: {report['enabled']}")
    for name, version in report["versions"].items():
        print(f"{name}: {version or 'not installed'} (supported {report['supported'][name]})")
    if report["refusal"]:
        print(f"refused: {report['refusal']}")
    for row in report["targets"]:
        reason = f"  ({row['reason']})" if row["reason"] else ""
        print(f"  {row['state']:8} {row['target']}{reason}")
    return 0


def _cmd_verify(args) -> int:
    from . import verify

    return verify.main(args)


def _cmd_bench(args) -> int:
    from . import bench

    return bench.main(args)


def _add_load_options(parser, dtypes) -> None:
    parser.add_argument("--class", dest="class_name", metavar="NAME",
                        help="model class: a mindone.transformers / mindone.diffusers name, or module:Class "
                        "(default: from config.json, `architectures[0]` or `_class_name`)")
    parser.add_argument("--dtype", choices=dtypes, help="dtype passed to from_pretrained")
    parser.add_argument("--subfolder", default="", metavar="S", help="model inside PATH, e.g. a pipeline's unet")


def build_parser() -> argparse.ArgumentParser:
    from .bench import MEMORY_MODES  # standard library only: cheap at start-up

    parser = argparse.ArgumentParser(prog="ms-loadpatch", description="Fast, bit-identical mindone model loading.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a command with the plugin enabled: ms-loadpatch run -- python train.py")
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser("status", help="print versions and what is patched")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--import-mindone",
        dest="import_mindone",
        action="store_true",
        help="import every target module first, so pending targets show as applied",
    )
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
    bench.add_argument("path", metavar="PATH", nargs="?", help="checkpoint directory (default: a built-in one, "
                       "generated once into $MS_LOADPATCH_CACHE or ~/.cache/ms_loadpatch)")
    _add_load_options(bench, dtypes)
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    # 1 by default: each load is a fresh process paying ~7 s of imports, and
    # the no-argument bench must stay well under a minute on 2 cores
    bench.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="loads per side, each in a fresh process; the median is shown (default 1)")
    bench.add_argument("--size", choices=("tiny", "default"), default="default",
                       help="size of the built-in checkpoint (when no PATH)")
    bench.add_argument("--memory", choices=MEMORY_MODES, default="primed",
                       help="primed (default): every process faults in and frees memory before each timed part; "
                            "as-is: count the machine's first-touch cost of fresh memory (large on some VMs)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "import_mindone", False):
        import importlib

        import ms_loadpatch  # noqa: F401  (enables before mindone is imported)
        from ms_loadpatch.targets import TARGETS

        for module_name in dict.fromkeys(t.module for t in TARGETS):
            importlib.import_module(module_name)
    return args.func(args)
