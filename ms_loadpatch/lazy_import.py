"""Lazy `mindone.transformers` and `mindone.transformers.models`.

Their `__init__`s import every public class with plain relative imports, so
any use of the library imports ~800 modules. With the plugin enabled before
mindone is imported, a finder placed first on `sys.meta_path` gives those two
packages a loader that reads the installed `__init__` with `ast` and, in
order: defers each relative import (the name resolves on first access, to the
object the eager import binds), and runs every other statement (version
checks, assignments, absolute imports) as it is. Anything the parser does not
understand makes that package import eagerly, with the reason in status.

Exactness rules the module follows (the eager import is the reference):
- a name resolves like `from .x import name` (module attribute, else the
  submodule); a star import resolves as a unit, with its full public names;
- a later statement's binding wins over an earlier one, as eagerly;
- `__all__` when the `__init__` defines none: every name is resolved, then
  AttributeError, so `from ... import *` reads the complete `__dict__`;
- dir() lists, before any access, what the eager import's namespace holds:
  besides what the `__init__` binds, the submodules that the modules it runs
  import (bound in their parent as a side effect) and that its star imports
  export, predicted from the installed sources on the first dir()
  (_EagerImportScan, ~0.2 s, never at import);
- such a submodule, when it is a direct one, is imported on access (the very
  module the eager import binds); one a star import exports, or any
  submodule name when there is no prediction, resolves everything first, so
  `hasattr` answers as eagerly; any other unknown name is an AttributeError
  at once.
Modules whose import writes into another module's registry (the audit in
versions.LAZY_IMPORT_SIDE_EFFECTS) are imported when that registry's reader
is, and modules whose being imported changes how others behave
(versions.LAZY_IMPORT_ALONG) with the package, so what a user gets does not
depend on laziness.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import threading
import types

from . import activation, versions

ENV_VAR = "MS_LOADPATCH_LAZY_IMPORT"

_lock = threading.Lock()
_installed = False
_hooks_registered = False
# package name -> {"state": "lazy" | "eager", "reason": str, "modules": tuple of deferred module names}
_packages: dict[str, dict] = {}
_plans: dict[str, _Plan] = {}  # lazy package name -> its plan (the table behind __getattr__)
_side_effect_errors: dict[str, str] = {}


class Unsupported(Exception):
    """The `__init__` holds something the lazy loader does not handle: import it eagerly."""


# --- switching on and off


def switched_off() -> bool:
    return activation.env_value(ENV_VAR) in activation.OFF_VALUES


def _off_reason() -> str | None:
    if switched_off():
        return f"{ENV_VAR}={os.environ.get(ENV_VAR, '')}"
    version = versions.installed_version("mindone")
    if version is None:
        return "mindone is not installed"
    if not versions.LAZY_IMPORT_MINDONE.contains(version, prereleases=True):
        return f"mindone {version} is outside {versions.LAZY_IMPORT_MINDONE}, the versions it is built for"
    return None


def install() -> None:
    """Called by enable(): put the finder first on sys.meta_path (packages not
    imported yet become lazy when they are)."""
    global _installed, _hooks_registered
    with _lock:
        if _installed or _off_reason() is not None:
            return
        for name in versions.LAZY_IMPORT_PACKAGES:
            if name in sys.modules and name not in _packages:
                _packages[name] = {"state": "eager", "reason": "imported before ms_loadpatch was enabled",
                                   "modules": ()}
        if not _hooks_registered:
            import wrapt

            for reader in versions.LAZY_IMPORT_SIDE_EFFECTS:
                wrapt.register_post_import_hook(_import_writers, reader)
            _hooks_registered = True
        sys.meta_path.insert(0, _FINDER)  # after wrapt's own finder went in: first
        _installed = True


def uninstall() -> None:
    """Called by disable(): packages imported from now on are eager; one
    already lazy stays as it is (it gives the same objects)."""
    global _installed
    with _lock:
        while _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        _installed = False


def status() -> dict:
    """`on`, `reason` when off, and per package its state (lazy / eager /
    not imported), the reason it is eager, and how many modules it deferred
    (`deferred`) of which how many were imported since (`imported_since`)."""
    reason = _off_reason()
    packages = {}
    for name in versions.LAZY_IMPORT_PACKAGES:
        row = _packages.get(name)
        if row is None:
            state = "not imported" if name not in sys.modules else "eager"
            row = {"state": state, "reason": "" if state != "eager" else "imported while ms_loadpatch was not enabled",
                   "modules": ()}
        modules = row["modules"]
        packages[name] = {"state": row["state"], "reason": row["reason"], "deferred": len(modules),
                          "imported_since": sum(m in sys.modules for m in modules)}
    return {"on": _installed and reason is None, "reason": reason or ("" if _installed else "ms_loadpatch not enabled"),
            "env_var": ENV_VAR, "packages": packages, "side_effect_errors": dict(_side_effect_errors)}


def _import_writers(reader) -> None:
    """Post-import hook of a registry's reader: import the modules that write
    into it, as the eager import would have, when a lazy package skipped them."""
    if not any(row["state"] == "lazy" for row in _packages.values()):
        return
    for name in versions.LAZY_IMPORT_SIDE_EFFECTS.get(reader.__name__, ()):
        _import_quietly(name)


def _import_quietly(name) -> None:
    try:
        importlib.import_module(name)
    except Exception as exc:  # the eager import would have failed earlier; keep the importer usable
        _side_effect_errors[name] = f"{type(exc).__name__}: {exc}"


# --- the finder and the loader


class _Finder:
    """First on sys.meta_path: for the two packages only, takes the spec the
    other finders give and swaps in the lazy loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in versions.LAZY_IMPORT_PACKAGES:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        if type(spec.loader) is not importlib.machinery.SourceFileLoader or not spec.submodule_search_locations:
            _packages[fullname] = {"state": "eager", "modules": (),
                                   "reason": f"loaded by {type(spec.loader).__name__}, not from its source file"}
            return spec
        spec.loader = _LazyInitLoader(spec.loader.name, spec.loader.path)
        return spec

    def invalidate_caches(self):
        pass


_FINDER = _Finder()


class _LazyInitLoader(importlib.machinery.SourceFileLoader):
    """The package's own source loader, except that exec_module runs the plan."""

    def exec_module(self, module):
        name = module.__name__
        try:
            plan = _Plan.build(name, self.path, self.get_data(self.path))
        except Exception as exc:  # anything unexpected: the eager import, as without the plugin
            _packages[name] = {"state": "eager", "reason": f"{type(exc).__name__}: {exc}", "modules": ()}
            return super().exec_module(module)
        module.__class__ = LazyPackage
        _plans[name] = plan
        plan.run(module)
        for along in versions.LAZY_IMPORT_ALONG.get(name, ()):
            _import_quietly(along)
        # what __loader__ and __spec__ show is the eager import's (a reload imports eagerly)
        module.__spec__.loader = module.__loader__ = importlib.machinery.SourceFileLoader(name, self.path)
        _packages[name] = {"state": "lazy", "reason": "", "modules": plan.deferred_modules()}


class LazyPackage(types.ModuleType):
    """A package whose deferred names resolve on first access."""

    def __getattr__(self, name):
        plan = _plans.get(self.__dict__.get("__name__"))
        if plan is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return plan.getattr(self, name)

    def __dir__(self):
        plan = _plans.get(self.__dict__.get("__name__"))
        names = set(self.__dict__)
        if plan is not None and not plan.complete:
            names.update(plan.table)
            names.update(_eager_import_scan().bound_by_eager_import(plan.name, LazyPackagesView) or ())
        return sorted(names)


# --- the plan: the __init__'s statements, relative imports deferred


class _Binding:
    __slots__ = ("index", "module", "attr", "star")

    def __init__(self, index, module, attr, star=None):
        self.index = index  # position of the statement that binds it (later ones win)
        self.module = module  # absolute name of the module to import
        self.attr = attr  # attribute of it, or None for the module itself
        self.star = star  # index of the star import it comes from, or None


class _Plan:
    def __init__(self, name, directory):
        self.name = name
        self.directory = directory
        self.steps = []  # ("import", index, [(name, _Binding)]) | ("exec", index, code, needs) | ("if", ...)
        self.table: dict[str, _Binding] = {}  # deferred name -> binding (the latest statement's)
        self.origin: dict[str, int] = {}  # name -> index of the statement that bound it
        self.stars: dict[int, str] = {}  # star import index -> module it imports from
        self.star_children: set[str] = set()  # submodules of star sources (may be star-exported)
        self.complete = False
        self._children = None
        self.executed = []  # (module, names) of the relative imports the run went through, in order

    # -- building (static: nothing is imported or executed)

    @classmethod
    def build(cls, name, path, source):
        import ast

        plan = cls(name, os.path.dirname(path))
        tree = ast.parse(source, path)
        counter = iter(range(1 << 30))
        plan.steps = plan._steps(ast, tree.body, path, counter)
        return plan

    def _steps(self, ast, body, path, counter):
        steps = []
        for node in body:
            index = next(counter)
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                raise Unsupported("a __future__ import")
            if isinstance(node, ast.ImportFrom) and node.level:
                steps.append(self._import_step(ast, node, index))
            elif isinstance(node, ast.If) and self._has_relative_import(ast, node):
                test = compile(ast.Expression(node.test), path, "eval")
                steps.append(("if", index, test, self._needs(ast, node.test),
                              self._steps(ast, node.body, path, counter), self._steps(ast, node.orelse, path, counter)))
            else:  # runs as it is, in order (a nested relative import is then eager, as written)
                code = compile(ast.Module([node], []), path, "exec", dont_inherit=True)
                steps.append(("exec", index, code, self._needs(ast, node)))
        return steps

    @staticmethod
    def _has_relative_import(ast, node):
        return any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(node))

    @staticmethod
    def _needs(ast, node):
        """Names a statement reads (deferred ones are resolved before it runs);
        None when it may read the whole namespace (globals(), vars(), ...)."""
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        return None if names & {"globals", "vars", "locals", "dir", "eval", "exec"} else names

    def _import_step(self, ast, node, index):
        parts = self.name.split(".")
        if node.level > len(parts):
            raise Unsupported(f"line {node.lineno}: relative import beyond the top-level package")
        base = ".".join(parts[:len(parts) - node.level + 1])
        module = f"{base}.{node.module}" if node.module else base
        bindings = []
        child = self._child_of(module)
        if child is not None:  # importing a submodule binds its first component here
            bindings.append((child, _Binding(index, f"{self.name}.{child}", None)))
        for alias in node.names:
            if alias.name == "*":
                self.stars[index] = module
                for star_name in self._star_names(ast, module, node.lineno):
                    bindings.append((star_name, _Binding(index, module, star_name, star=index)))
                continue
            bound = alias.asname or alias.name
            if module == self.name:  # `from . import x`: the submodule x
                if alias.name not in self._child_names():
                    raise Unsupported(f"line {node.lineno}: `from . import {alias.name}`: no such submodule")
                bindings.append((bound, _Binding(index, f"{self.name}.{alias.name}", None)))
            else:
                bindings.append((bound, _Binding(index, module, alias.name)))
        for bound, binding in bindings:
            if bound in self._child_names() and binding.module != f"{self.name}.{bound}":
                # the import system would rebind it to the submodule when that is imported
                raise Unsupported(f"line {node.lineno}: {bound!r} names both a submodule and another object")
        return ("import", index, bindings, module, [alias.name for alias in node.names])

    def _child_of(self, module):
        if not module.startswith(self.name + "."):
            return None
        child = module[len(self.name) + 1:].split(".")[0]
        if child not in self._child_names():
            raise Unsupported(f"{self.name}.{child} not found next to the __init__")
        return child

    def _child_names(self):
        if self._children is None:
            self._children = _module_names(self.directory)
        return self._children

    def _file_of(self, module):
        parts = module[len(self.name) + 1:].split(".")
        path = os.path.join(self.directory, *parts)
        for candidate in (os.path.join(path, "__init__.py"), path + ".py"):
            if os.path.isfile(candidate):
                return candidate
        raise Unsupported(f"{module}: no source file")

    def _star_names(self, ast, module, lineno):
        """The names `from module import *` binds, predicted from source: its
        `__all__`, or the names its own relative imports bind (recursively).
        Its submodules, which a star import binds too, resolve with the unit."""
        if not module.startswith(self.name + "."):
            raise Unsupported(f"line {lineno}: star import from outside the package")
        path = self._file_of(module)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        listed = _literal_all(ast, source)
        if listed is not None:
            return listed
        if not path.endswith("__init__.py"):
            raise Unsupported(f"line {lineno}: {module} has no literal __all__")
        self.star_children.update(_module_names(os.path.dirname(path)))
        names = []
        for node in ast.parse(source, path).body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # docstring
            if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
                raise Unsupported(f"{path}:{node.lineno}: not a relative import (star-imported by line {lineno})")
            for alias in node.names:
                if alias.name == "*":
                    names.extend(self._star_names(ast, f"{module}.{node.module}", lineno))
                elif not (alias.asname or alias.name).startswith("_"):
                    names.append(alias.asname or alias.name)
        return names

    # -- running (at import, in the __init__'s order)

    def run(self, module):
        import builtins

        module.__dict__.setdefault("__builtins__", vars(builtins))  # as exec() sets it, with no statement run
        self._run(module, self.steps)

    def _run(self, module, steps):
        namespace = module.__dict__
        for step in steps:
            kind, index = step[0], step[1]
            if kind == "import":
                self.executed.append((step[3], step[4]))
                for name, binding in step[2]:
                    if binding.module == f"{self.name}.{name}" and binding.attr is None and name in namespace:
                        continue  # a submodule already imported and bound: the same object
                    namespace.pop(name, None)
                    self.table[name] = binding
            elif kind == "exec":
                self._resolve_needs(module, step[3])
                exec(step[2], namespace)
                self._bound_by_statement(namespace, index)
            else:
                self._resolve_needs(module, step[3])
                self._run(module, step[4] if eval(step[2], namespace) else step[5])

    def _resolve_needs(self, module, needs):
        for name in (list(self.table) if needs is None else [n for n in needs if n in self.table]):
            self.resolve(module, name)

    def _bound_by_statement(self, namespace, index):
        for name in [n for n in list(self.table) if n in namespace]:
            self.table.pop(name, None)
            self.origin[name] = index

    def deferred_modules(self):
        return tuple(sorted({b.module for b in list(self.table.values())} - set(sys.modules)))

    # -- resolving

    def getattr(self, module, name):
        if name in self.table:
            self.resolve(module, name)
        elif name == "__all__":
            self.resolve_all(module)
        elif self._may_exist_eagerly(name):
            bound = _eager_import_scan().bound_by_eager_import(self.name, LazyPackagesView)
            if bound is not None and name in bound and name in self._child_names():
                importlib.import_module(f"{self.name}.{name}")  # the very module; the import system binds it
            else:  # a submodule a star import exports, or no prediction: everything, then the eager answer
                self.resolve_all(module)
        try:
            return module.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.name!r} has no attribute {name!r}") from None

    def _may_exist_eagerly(self, name):
        # only a submodule (bound by whatever imports it) can be there beyond the table
        return (not self.complete and not (name.startswith("__") and name.endswith("__"))
                and (name in self._child_names() or name in self.star_children))

    def resolve(self, module, name):
        binding = self.table.get(name)
        if binding is None:
            return
        if binding.star is not None:
            return self._resolve_star(module, binding.star)
        value = _import_from(binding.module, binding.attr)
        if self.origin.get(name, -1) <= binding.index:
            module.__dict__[name] = value
            self.origin[name] = binding.index
        if self.table.get(name) is binding:
            self.table.pop(name, None)

    def _resolve_star(self, module, index):
        source = importlib.import_module(self.stars[index])
        names = getattr(source, "__all__", None)
        if names is None:
            names = [n for n in vars(source) if not n.startswith("_")]
        namespace = module.__dict__
        for name in names:
            later = self.table.get(name)
            if (later is not None and later.index > index) or self.origin.get(name, -1) > index:
                continue  # a later statement binds it
            namespace[name] = getattr(source, name)
            self.origin[name] = index
            self.table.pop(name, None)
        for name in [n for n, b in list(self.table.items()) if b.star == index]:
            self.table.pop(name, None)  # predicted but not exported: absent, as eagerly

    def resolve_all(self, module):
        """Every deferred name, then the lazy packages below (the eager import
        of this one imports them whole)."""
        if self.complete:
            return
        for name, _ in sorted(list(self.table.items()), key=lambda item: item[1].index):
            self.resolve(module, name)
        for other, plan in list(_plans.items()):
            if other.startswith(self.name + ".") and plan is not self:
                plan.resolve_all(sys.modules[other])
        self.complete = True


def _import_from(module, attr):
    """`from module import attr`: the attribute, else the submodule."""
    imported = importlib.import_module(module)
    if attr is None:
        return imported
    try:
        return getattr(imported, attr)
    except AttributeError:
        pass
    try:
        importlib.import_module(f"{module}.{attr}")
        return getattr(imported, attr)
    except (ImportError, AttributeError):
        raise ImportError(f"cannot import name {attr!r} from {module!r}", name=module) from None


def _module_names(directory):
    names = set()
    for entry in os.listdir(directory):
        full = os.path.join(directory, entry)
        if os.path.isdir(full):
            if entry.isidentifier():
                names.add(entry)  # a package, or a namespace package
        elif entry.endswith((".py", ".so", ".pyd")) or ".cpython-" in entry:
            stem = entry.split(".")[0]
            if stem.isidentifier() and stem != "__init__":
                names.add(stem)
    return names


def _literal_all(ast, source):
    """A module's `__all__` when it is one top-level literal list or tuple of
    strings (found without parsing the whole file); None when there is none;
    Unsupported when it is built any other way."""
    import re

    found = list(re.finditer(r"^([ \t]*)__all__\b(.*)$", source, re.M))
    if not found:
        return None
    opening = re.match(r"\s*=\s*([\[(])", found[0].group(2)) if len(found) == 1 and not found[0].group(1) else None
    if opening is None:
        raise Unsupported("__all__ is not one top-level literal")
    start = found[0].start()
    end = source.find("]" if opening.group(1) == "[" else ")", start)
    line_end = source.find("\n", end)
    if end < 0 or source[end + 1:line_end if line_end >= 0 else None].split("#")[0].strip():
        raise Unsupported("__all__ is not one top-level literal")
    names = ast.literal_eval(source[source.index("=", start) + 1:end + 1].strip())
    if not all(isinstance(n, str) for n in names):
        raise Unsupported("__all__ holds a non-string")
    return list(names)


def _eager_import_scan():
    """The module predicting what the eager import binds (imported on first
    dir() or access to such a name: it imports this one)."""
    from . import eager_import_scan

    return eager_import_scan


class LazyPackagesView:
    """What eager_import_scan reads of the lazy packages (it imports nothing of this module)."""

    @staticmethod
    def roots(top) -> list[str]:
        """The lazy packages under the top-level package `top`, sorted."""
        return sorted(n for n, row in list(_packages.items())
                      if row["state"] == "lazy" and n in _plans and (n + ".").startswith(top + "."))

    @staticmethod
    def executed(name):
        """(module, names) of the relative imports the lazy package `name` went through, or None."""
        plan = _plans.get(name)
        return None if plan is None else plan.executed

    import_quietly = staticmethod(_import_quietly)

    @staticmethod
    def literal_all(source):
        """A module's literal `__all__` from its source, None when there is none or it is not literal."""
        import ast

        try:
            return _literal_all(ast, source)
        except Unsupported:
            return None
