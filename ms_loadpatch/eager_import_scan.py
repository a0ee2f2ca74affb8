"""What the eager import of a lazy package binds beyond its `__init__`'s own
statements, predicted from the installed sources (lazy_import.LazyPackage's
dir(), and its getattr of such a name).

The eager import of mindone.transformers runs hundreds of modules; each
import of a submodule binds it in its parent package, and a star import of
a package without `__all__` exports the submodules bound by then. A lazy
package lists those names too, so that dir() before any access is the
eager one (tests/plugin/test_lazy_import.py compares both in fresh processes).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from . import versions

_eager_bound: dict[str, dict[str, frozenset] | None] = {}  # top-level package -> lazy package -> names
_eager_bound_lock = threading.RLock()
_eager_bound_errors: dict[str, str] = {}  # top-level package -> why the prediction failed (dir() then
# lists what the __init__ binds)


def bound_by_eager_import(name, lazy):
    """Names the eager import binds in the lazy package `name` beyond what its
    `__init__`'s own statements bind: every submodule that a module it runs
    imports (the import system binds it in its parent), and the submodules a
    star import of a package without `__all__` exports. Predicted once, on the
    first dir() of a lazy package or access to such a name (not at import),
    by _EagerImportScan. None while it is predicted (a nested call) or when
    the prediction failed. `lazy` is lazy_import's view of its packages
    (lazy_import.LazyPackagesView: roots, executed imports, literal `__all__`)."""
    top = name.split(".")[0]
    with _eager_bound_lock:
        if top not in _eager_bound:
            _eager_bound[top] = None
            try:
                _eager_bound[top] = _EagerImportScan(top, lazy).run()
            except Exception as exc:  # dir() must not fail: it lists the __init__'s names then
                _eager_bound_errors[top] = f"{type(exc).__name__}: {exc}"
        bound = _eager_bound[top]
        return None if bound is None else bound.get(name, frozenset())


class _EagerImportScan:
    """Follows, from source, the imports the eager import of the lazy packages
    executes, in its order: each module's import statements of modules of the
    same top-level package (`mindone`) that run at import (not in a function,
    an `except` or an `if` whose test is false: a test is evaluated when it
    can be, `TYPE_CHECKING` is false), depth first, a module imported once, as
    Python does. A lazy package's own relative imports are the ones its plan
    went through. Import lines are found by text search (a parse of every
    module would take seconds).
    tests/plugin/test_lazy_import.py compares the result with a real eager import."""

    _LINE = None  # compiled on first use
    _HEADER = None

    def __init__(self, top, lazy):
        import re

        if _EagerImportScan._LINE is None:
            _EagerImportScan._LINE = re.compile(
                r"([ \t]*)(?:from[ \t]+(\.*)([\w.]*)[ \t]+import\b[ \t]*(\([^)]*\)|[^\n;#]*)|import[ \t]+([^\n;#]*))"
            )
            _EagerImportScan._HEADER = re.compile(
                r"(async[ \t]+def|def|class|if|elif|else|try|except|finally|with"
                r"|for|while)\b[ \t]*(.*?)[ \t]*:?[ \t]*$"
            )
        self.top, self.lazy = top, lazy
        self.roots = self.lazy.roots(top)
        self.top_dir = os.path.dirname(sys.modules[self.top].__file__)
        self.imported: set[str] = set()
        self.stars: dict[str, set[str]] = {n: set() for n in self.roots}  # lazy package -> submodules its
        # star imports export
        self.conditions: dict[str, bool | None] = {}
        self._files: dict[str, str | None] = {self.top: os.path.join(self.top_dir, "__init__.py")}
        self._listings: dict[str, dict] = {}

    def run(self):
        for name in versions.LAZY_IMPORT_PACKAGES:  # a lazy package not imported yet: its plan (cheap)
            if name.rpartition(".")[0] in self.roots and name not in sys.modules:
                self.lazy.import_quietly(name)
        self.roots = self.lazy.roots(self.top)
        for root in self.roots:
            self.import_(root)
        bound = {}
        for root in self.roots:
            prefix = root + "."
            names = {m[len(prefix) :].split(".")[0] for m in self.imported if m.startswith(prefix)}
            bound[root] = frozenset(names | self.stars.get(root, set()))
        return bound

    # -- the import system, on names

    def import_(self, module):
        """`import module`: its parents first, each once."""
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            self._load(".".join(parts[:i]))

    def _from(self, module, names, importer):
        self.import_(module)
        if not self._is_package(module):
            return  # a module's names are attributes
        for name in names:
            if name == "*":
                listed = self._literal_all(module)
                if listed is None and importer in self.stars:  # exports the submodules bound by then
                    prefix = module + "."
                    self.stars[importer].update(
                        m[len(prefix) :]
                        for m in self.imported
                        if m.startswith(prefix) and "." not in m[len(prefix) :] and not m[len(prefix) :].startswith("_")
                    )
                for child in listed or ():  # those __all__ names are imported
                    if self._file(f"{module}.{child}") is not None:
                        self.import_(f"{module}.{child}")
            elif self._file(f"{module}.{name}") is not None:  # a submodule: imported (it is not an attribute)
                self.import_(f"{module}.{name}")

    def _load(self, module):
        if module in self.imported or not (module == self.top or module.startswith(self.top + ".")):
            return
        self.imported.add(module)  # before it runs, as in sys.modules (circular imports)
        executed = self.lazy.executed(module) if module in self.roots else None
        if executed is not None:
            statements = executed
        else:
            path = self._file(module)
            if path is None or path == "":
                return
            statements = self._statements(module, path)
        for target, names in statements:
            if names is None:
                self.import_(target)
            else:
                self._from(target, names, module)

    def _file(self, module):
        """Source file of a module of the top package; "" for a directory
        without `__init__` or a compiled module; None when there is none."""
        path = self._files.get(module, 0)
        if path == 0:
            parent, _, name = module.rpartition(".")
            path = self._children(parent).get(name) if parent else None
            if path is not None and path.endswith(os.sep):  # a directory: a package, or a namespace package
                init = path + "__init__.py"
                path = init if os.path.isfile(init) else "" if os.path.isdir(path) else None
            self._files[module] = path
        return path

    def _is_package(self, module):
        path = self._file(module)
        return path is not None and path.endswith("__init__.py")

    def _children(self, package):
        """A package's submodules (one directory listing): name -> file, or
        directory ending with a separator, or "" for a compiled module."""
        children = self._listings.get(package)
        if children is None:
            children = self._listings[package] = {}
            if self._is_package(package):
                directory = os.path.dirname(self._files[package])
                for entry in os.listdir(directory):
                    stem, dot, extension = entry.partition(".")
                    if not dot:  # a package comes before a module of the same name
                        children[stem] = os.path.join(directory, entry, "")
                    elif extension == "py":
                        children.setdefault(stem, os.path.join(directory, entry))
                    elif extension.endswith(("so", "pyd")):
                        children.setdefault(stem, "")
        return children

    def _literal_all(self, module):
        path = self._file(module)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return self.lazy.literal_all(f.read())

    # -- a module's import statements that run at import

    def _statements(self, module, path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        top, found, seen = self.top, [], set()
        position = text.find("import")
        while position >= 0:
            start = text.rfind("\n", 0, position) + 1
            position = text.find("import", position + 6)
            if start in seen:
                continue
            seen.add(start)
            match = self._LINE.match(text, start)
            if match is None:
                continue
            indent, dots, name, fromlist, plain = match.groups()
            if plain is not None:
                targets = [(p.split()[0], None) for p in plain.split(",") if p.split()]
                targets = [t for t in targets if t[0] == top or t[0].startswith(top + ".")]
            elif dots:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - len(dots) + 1])
                targets = [(f"{base}.{name}" if name else base, None)]
            elif name == top or name.startswith(top + "."):
                targets = [(name, None)]
            else:
                continue
            if not targets or (indent and not self._runs_at_import(module, text, start, len(indent))):
                continue
            if fromlist is not None:
                if fromlist.startswith("("):
                    fromlist = "\n".join(line.split("#")[0] for line in fromlist[1:-1].splitlines())
                names = [n.split()[0] for n in fromlist.replace("\\", " ").split(",") if n.split()]
                targets = [(targets[0][0], names)]
            found.extend(targets)
        return found

    def _runs_at_import(self, module, text, position, indent):
        """Whether the statement starting at `position`, indented by `indent`,
        runs when the module is imported: each enclosing block's header, from
        the innermost out, is looked up by indentation."""
        while indent:
            header = self._header_before(text, position, indent)
            if header is None:
                return True
            kind, test, position, indent = header
            if kind in ("def", "except") or kind.startswith("async"):
                return False
            if kind in ("if", "elif") and self._condition(module, test) is False:
                return False
            if kind == "elif" and not self._else_runs(module, text, position, indent):
                return False
            if kind == "else" and not self._else_runs(module, text, position, indent):
                return False
        return True

    def _header_before(self, text, position, indent, sibling=False):
        """The nearest line before `position` that opens a block indented
        less than `indent` (lines that open none, e.g. continuations, are
        passed over); with sibling, the block just before at `indent` itself
        (None when another line comes first): (keyword, rest, position, indent)."""
        end = position - 1
        while end >= 0:
            start = text.rfind("\n", 0, end) + 1
            line = text[start:end]
            end = start - 1
            stripped = line.lstrip()
            if not stripped or stripped[0] == "#":
                continue
            width = len(line) - len(stripped)
            if width < indent or (sibling and width == indent):
                match = self._HEADER.match(stripped)
                if match is not None and (not sibling or width == indent):
                    return match.group(1), match.group(2), start, width
                if sibling:
                    return None
        return None

    def _else_runs(self, module, text, position, indent):
        """An `else` (or `elif`) at `position` can run: it closes a try, for
        or while, or an if/elif chain whose tests before it are all false."""
        while True:
            header = self._header_before(text, position, indent, sibling=True)
            if header is None:
                return True
            kind, test, position, _ = header
            if kind not in ("if", "elif"):
                return True
            if self._condition(module, test) is not False:
                return False
            if kind == "if":
                return True

    def _condition(self, module, test):
        """An `if` test's value (`is_vision_available()`, `TYPE_CHECKING`,
        `__name__ == "__main__"`, a version comparison), None when it cannot
        be told or would call anything else."""
        key = (module, test)
        if key not in self.conditions:
            import re

            test = test.split("#")[0].strip().rstrip(":")
            calls = re.findall(r"([\w.]+)[ \t]*\(", test)
            value = None
            if ":=" not in test and all(re.fullmatch(r"is_\w+_available|(version\.)?parse", c) for c in calls):
                try:
                    value = bool(eval(test, {}, _ConditionNames(module, self.roots[0])))
                except Exception:
                    pass
            self.conditions[key] = value
        return self.conditions[key]


class _ConditionNames(dict):
    """Names an `if` test reads: the module's own when it is imported, else
    the package's utils (the `is_..._available` checks), as eagerly."""

    def __init__(self, module, root):
        super().__init__(TYPE_CHECKING=False, __name__=module)
        self.module, self.root = module, root

    def __missing__(self, key):
        for source in (self.module, f"{self.root}.utils"):
            namespace = sys.modules.get(source)
            if namespace is None and source != self.module:
                namespace = importlib.import_module(source)
            if namespace is not None and key in vars(namespace):
                return vars(namespace)[key]
        raise KeyError(key)
