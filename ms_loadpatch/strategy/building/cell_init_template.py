"""cell-init-template: nn.Cell.__init__'s fixed attributes copied from a template."""

from __future__ import annotations

import os
import threading
import time

from . import window
from .swaps import Swap
from .technique import ProbeFailed, Technique, cell_method, cell_registration


class CellInitTemplate(Technique):
    """`nn.Cell.__init__` sets some 70 attributes one by one through
    `object.__setattr__`; the fast path copies them from a template dict taken
    from a real Cell.__init__ once per process, then re-creates what is per
    instance: every mutable container (fresh, of the same type), the creation
    time, the compile-cache registration, and runs the same calls
    (`Cell_.__init__`, the instance count, `init_pipeline`, the bprop check).
    A class that defines a data descriptor under a template name, `flags`,
    and GC_COLLECT_IN_CELL=1 take mindspore's own path."""

    name = "cell-init-template"
    description = "nn.Cell.__init__'s fixed attribute set copied from a per-process template"
    # Every global name nn.Cell.__init__ refers to on the tested mindspores (versions.py); any other
    # is a side effect this technique would not reproduce: skipped.
    KNOWN_NAMES = frozenset(
        {
            "Cell",
            "Cell_",
            "OrderedDict",
            "__init__",
            "__setattr__",
            "_cell_tag",
            "add_flags",
            "cells_compile_cache",
            "compile_cache",
            "getenv",
            "hasattr",
            "id",
            "init_pipeline",
            "int",
            "logger",
            "os",
            "super",
            "time",
            "total_instance_count",
            "warning",
            "setattr",
            "object",
            "dict",
            "set",
            "list",
        }
    )
    PER_INSTANCE_TIME = "_create_time"
    _SCALARS = (type(None), bool, int, float, str)

    def __init__(self):
        self.original = None
        self.template = None
        self.fresh = ()
        self.plain_classes: dict[type, bool] = {}
        self.count = window.DeferredInstanceCount()
        self.swap = None

    def prepare(self):
        cell_class, original = cell_method("__init__", self.KNOWN_NAMES)
        cell_base, compile_cache, init_pipeline = cell_registration()

        class _TemplateCell(cell_class):
            pass

        first, second = _TemplateCell(), _TemplateCell()
        items = list(vars(first).items())
        if list(vars(second)) != [k for k, _ in items]:
            raise ProbeFailed("two plain cells have different attribute sets")
        template, fresh = {}, []
        for key, value in items:
            other = vars(second)[key]
            if key == self.PER_INSTANCE_TIME:
                template[key] = None
            elif type(value) in (dict, set, list) or type(value).__name__ == "OrderedDict":
                if value or other or value is other or type(other) is not type(value):
                    raise ProbeFailed(f"Cell attribute {key} is a container that is not empty and per instance")
                template[key] = None
                fresh.append((key, type(value)))
            elif type(value) in self._SCALARS:
                if type(other) is not type(value) or other != value:
                    raise ProbeFailed(f"Cell attribute {key} differs between two plain cells")
                template[key] = value
            else:
                raise ProbeFailed(f"Cell attribute {key} holds a {type(value).__name__}: not known to be shareable")
        if self.PER_INSTANCE_TIME not in template:
            raise ProbeFailed(f"Cell has no {self.PER_INSTANCE_TIME}")
        if "_auto_prefix" not in template or "has_bprop" not in template:
            raise ProbeFailed("Cell.__init__ sets no _auto_prefix / has_bprop")
        self.original = original
        self.template = template
        self.fresh = tuple(fresh)
        self.cell_class = cell_class
        self.cell_base, self.compile_cache, self.init_pipeline = cell_base, compile_cache, init_pipeline
        self.plain_classes.clear()

    def _plain(self, cls) -> bool:
        """No data descriptor (property, slot) under a template name: object.__setattr__ is a dict store."""
        plain = self.plain_classes.get(cls)
        if plain is None:
            plain = True
            for key in self.template:
                for klass in cls.__mro__:
                    if key in vars(klass):
                        kind = type(vars(klass)[key])
                        if hasattr(kind, "__set__") or hasattr(kind, "__delete__"):
                            plain = False
                        break
                if not plain:
                    break
            self.plain_classes[cls] = plain
        return plain

    def install(self):
        if vars(self.cell_class).get("__init__") is not self.original:
            return False  # someone else replaced it meanwhile: leave theirs
        technique = self
        original, template, fresh = self.original, self.template, self.fresh
        cell_class, cell_base, compile_cache = self.cell_class, self.cell_base, self.compile_cache
        init_pipeline, environ = self.init_pipeline, os.environ
        create_time = self.PER_INSTANCE_TIME
        count = self.count

        def __init__(self, auto_prefix=True, flags=None):
            if (
                window.state.builder != threading.get_ident()
                or flags
                or not technique._plain(type(self))
                or environ.get("GC_COLLECT_IN_CELL") == "1"
            ):
                return original(self, auto_prefix, flags)
            cell_base.__init__(self, self._cell_tag)
            count.pending += 1
            state = self.__dict__
            state.update(template)
            for key, factory in fresh:
                state[key] = factory()
            state["_auto_prefix"] = auto_prefix
            state[create_time] = int(time.time() * 1e9)
            compile_cache[id(self)] = self.compile_cache
            init_pipeline()
            if hasattr(self, "bprop"):
                state["has_bprop"] = True

        __init__.__wrapped__ = original
        __init__.__doc__ = original.__doc__
        self.swap = Swap(cell_class, "__init__", __init__)
        self.swap.install()
        return True

    def uninstall(self):
        self.swap.uninstall()
        self.count.flush(self.cell_class)

    def leftovers(self):
        found = []
        if self.original is not None and vars(self.cell_class).get("__init__") is not self.original:
            found.append("nn.Cell.__init__ is not mindspore's")
        if self.count.pending:
            found.append(f"{self.name}: {self.count.pending} cells not counted")
        return found
