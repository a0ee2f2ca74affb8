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
  (_EagerImportScan, never at import);
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
import typing

from . import activation, versions
from .lazy_plan import Plan as _Plan
from .lazy_plan import Unsupported, eager_import_scan_module, literal_all

ENV_VAR = "MS_LOADPATCH_LAZY_IMPORT"

_lock = threading.Lock()
_installed = False
_hooks_registered = False


class PackageState(typing.NamedTuple):
    """What became of one package's import."""

    state: str  # "lazy" | "eager"
    reason: str  # why it is eager
    modules: tuple = ()  # the modules its plan deferred


_packages: dict[str, PackageState] = {}
_plans: dict[str, _Plan] = {}  # lazy package name -> its plan (the table behind __getattr__)
_side_effect_errors: dict[str, str] = {}


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
                _packages[name] = PackageState("eager", "imported before ms_loadpatch was enabled")
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
            row = PackageState(state, "" if state != "eager" else "imported while ms_loadpatch was not enabled")
        packages[name] = {
            "state": row.state,
            "reason": row.reason,
            "deferred": len(row.modules),
            "imported_since": sum(m in sys.modules for m in row.modules),
        }
    return {
        "on": _installed and reason is None,
        "reason": reason or ("" if _installed else "ms_loadpatch not enabled"),
        "env_var": ENV_VAR,
        "packages": packages,
        "side_effect_errors": dict(_side_effect_errors),
    }


def _import_writers(reader) -> None:
    """Post-import hook of a registry's reader: import the modules that write
    into it, as the eager import would have, when a lazy package skipped them."""
    if not any(row.state == "lazy" for row in _packages.values()):
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
            _packages[fullname] = PackageState(
                "eager", f"loaded by {type(spec.loader).__name__}, not from its source file"
            )
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
            plan = _Plan.build(name, self.path, self.get_data(self.path), _REGISTRY)
        except Exception as exc:  # anything unexpected: the eager import, as without the plugin
            _packages[name] = PackageState("eager", f"{type(exc).__name__}: {exc}")
            return super().exec_module(module)
        module.__class__ = LazyPackage
        _plans[name] = plan
        plan.run(module)
        for along in versions.LAZY_IMPORT_ALONG.get(name, ()):
            _import_quietly(along)
        # what __loader__ and __spec__ show is the eager import's (a reload imports eagerly)
        module.__spec__.loader = module.__loader__ = importlib.machinery.SourceFileLoader(name, self.path)
        _packages[name] = PackageState("lazy", "", plan.deferred_modules())


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
            names.update(eager_import_scan_module().bound_by_eager_import(plan.name, LazyPackagesView) or ())
        return sorted(names)


class LazyPackagesView:
    """What eager_import_scan reads of the lazy packages (it imports nothing of this module)."""

    @staticmethod
    def roots(top) -> list[str]:
        """The lazy packages under the top-level package `top`, sorted."""
        return sorted(
            n
            for n, row in list(_packages.items())
            if row.state == "lazy" and n in _plans and (n + ".").startswith(top + ".")
        )

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
            return literal_all(ast, source)
        except Unsupported:
            return None


# what a plan reaches of the lazy packages
_REGISTRY = types.SimpleNamespace(plans=_plans, view=LazyPackagesView)
