"""The plan of a lazy package (lazy_import.py): its `__init__` parsed with
`ast` into steps, each relative import deferred into a table of names that
resolve on first access as the eager import binds them; every other
statement run as it is. Building a plan imports and executes nothing."""

from __future__ import annotations

import importlib
import os
import sys


class Unsupported(Exception):
    """The `__init__` holds something the lazy loader does not handle: import it eagerly."""


class _Binding:
    __slots__ = ("index", "module", "attr", "star")

    def __init__(self, index, module, attr, star=None):
        self.index = index  # position of the statement that binds it (later ones win)
        self.module = module  # absolute name of the module to import
        self.attr = attr  # attribute of it, or None for the module itself
        self.star = star  # index of the star import it comes from, or None


class Plan:
    """A lazy package's `__init__` as steps, and the table its deferred names
    resolve from (`registry`: the lazy packages' plans, `.plans`, and the
    view eager_import_scan reads, `.view`)."""

    def __init__(self, name, directory, registry):
        self.name = name
        self.registry = registry
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
    def build(cls, name, path, source, registry):
        import ast

        plan = cls(name, os.path.dirname(path), registry)
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
                steps.append(
                    (
                        "if",
                        index,
                        test,
                        self._needs(ast, node.test),
                        self._steps(ast, node.body, path, counter),
                        self._steps(ast, node.orelse, path, counter),
                    )
                )
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
        base = ".".join(parts[: len(parts) - node.level + 1])
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
        child = module[len(self.name) + 1 :].split(".")[0]
        if child not in self._child_names():
            raise Unsupported(f"{self.name}.{child} not found next to the __init__")
        return child

    def _child_names(self):
        if self._children is None:
            self._children = _module_names(self.directory)
        return self._children

    def _file_of(self, module):
        parts = module[len(self.name) + 1 :].split(".")
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
        listed = literal_all(ast, source)
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
        for name in list(self.table) if needs is None else [n for n in needs if n in self.table]:
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
            bound = eager_import_scan_module().bound_by_eager_import(self.name, self.registry.view)
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
        return (
            not self.complete
            and not (name.startswith("__") and name.endswith("__"))
            and (name in self._child_names() or name in self.star_children)
        )

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
        for other, plan in list(self.registry.plans.items()):
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


def literal_all(ast, source):
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
    if end < 0 or source[end + 1 : line_end if line_end >= 0 else None].split("#")[0].strip():
        raise Unsupported("__all__ is not one top-level literal")
    names = ast.literal_eval(source[source.index("=", start) + 1 : end + 1].strip())
    if not all(isinstance(n, str) for n in names):
        raise Unsupported("__all__ holds a non-string")
    return list(names)


def eager_import_scan_module():
    """The module predicting what the eager import binds (imported on first
    dir() or access to such a name)."""
    from . import eager_import_scan

    return eager_import_scan
