"""Rules of the package's structure that docs/architecture.md states and a
reading of the source can check: no timings in comments or docstrings (they
go stale; figures live in docs/benchmarks.md), no decision taken on the text
of a reason, per-thread state only in the lane, status rows typed."""

import ast
import io
import os
import re
import tokenize

from _helpers import REPO

PACKAGE = os.path.join(REPO, "ms_loadpatch")

# a duration, a rate or a cost per size: "0.2 s", "36 us", "~5 ms", "2 s/GB", "100 MB/s"
TIMING = re.compile(r"(~?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:s|ms|us|µs)\b(?!\w))|(\d\s?[MG]B/s)|(s/GB)")


def _sources():
    for root, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


def _comments_and_docstrings(source: str):
    """(line, text) of every comment and docstring."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring and node.body:
                yield node.body[0].lineno, docstring


def test_timing_pattern_sees_timings():
    found = [bool(TIMING.search(text)) for text in ("~0.2 s per load", "36 us a cell", "2 s/GB", "at 100 MB/s")]
    assert found == [True] * 4
    assert not TIMING.search("a 16 MB message, 4 threads, 2 ranks, mindspore 2.10")


def test_no_timings_in_comments_or_docstrings():
    offenders = [
        f"{path}:{line}: {TIMING.search(text).group(0)!r}"
        for path, source in _sources()
        for line, text in _comments_and_docstrings(source)
        if TIMING.search(text)
    ]
    assert offenders == []


def test_no_decision_on_the_text_of_a_reason():
    """A reason is for people; code decides on typed fields."""
    pattern = re.compile(
        r"""(\[["']reason["']\]|\.reason|_reason|refusal)\)?\.(startswith|endswith)\(|in\s+\w*reason\b"""
    )
    offenders = [
        f"{path}:{number}"
        for path, source in _sources()
        for number, line in enumerate(source.splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_status_rows_are_typed_until_status_shows_them():
    """Rows are built as objects (verdict.TechniqueRow, core.TargetState,
    lazy_import.PackageState) and made dicts once each, where status() shows them."""
    makers = {
        path for path, source in _sources() for line in source.splitlines() if re.search(r"[\"']state[\"']\s*:", line)
    }
    assert makers == {"strategy/verdict.py", "core.py", "lazy_import.py"}


def test_one_lane_holds_per_thread_state():
    """strategy/lane.py is the package's only per-thread state (docs/architecture.md,
    "Where state lives"): the load, the build-then-fill call, the build session."""
    holders = {path for path, source in _sources() if re.search(r"threading\.local\b|\blocal\(\)", source)}
    assert holders == {"strategy/lane.py"}


def _patches_outside_swap(source: str):
    """Lines that set or delete an attribute of a module or class imported
    from outside the package (`Parameter.init_param = ...`,
    `setattr(ms.Tensor, ...)`), or a name in a module's globals
    (`fn.__globals__[...] = ...`)."""
    tree = ast.parse(source)
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level)
        for alias in node.names
    }
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        targets = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, (ast.Name, ast.Attribute)):
                root = target.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    yield node.lineno
            if isinstance(target, ast.Subscript) and "__globals__" in ast.unparse(target.value):
                yield node.lineno


def test_patch_finder_sees_patches():
    found = list(
        _patches_outside_swap(
            "from mindspore import Parameter\nimport mindspore as ms\n"
            "Parameter.init_param = False\nsetattr(ms.Tensor, 'fill_', f)\ndel ms.nn.Cell.x\n"
            "fn.__globals__['inspect'] = shim\ncell = object()\nsetattr(cell, 'a', 1)\ncell.b = 2\n"
            "old, ms.x = ms.x, 1\n"
        )
    )
    assert sorted(found) == [3, 4, 5, 6, 10]


def test_every_patch_goes_through_swap():
    """Attributes of mindspore's (or mindone's) modules and classes are
    replaced with building/swaps.py's Swap, or wrapt for the targets: what
    was there is put back exactly, and only while it is still the
    replacement."""
    offenders = [
        f"{path}:{line}"
        for path, source in _sources()
        if not path.endswith("swaps.py")
        for line in _patches_outside_swap(source)
    ]
    assert offenders == []
