"""flat-name-walk: Cell.update_parameters_name with one stack instead of nested generators."""

from __future__ import annotations

import threading

from . import window
from .swaps import Swap
from .technique import ProbeFailed, Technique, cell_method


class FlatNameWalk(Technique):
    """Assigning a child cell calls `update_parameters_name(prefix)`, which
    walks the child's whole subtree through recursive generators
    (`parameters_and_names` over `cells_and_names`): nested cells re-walk
    their subtrees at every level. The fast version walks the same cells in
    the same order with one explicit stack (same dedup of cells and
    parameters, same names, same `is_init` reset). Any cell in the subtree
    whose class overrides the walk methods takes mindspore's own path."""

    name = "flat-name-walk"
    installed = False  # in the open window (named_parameters serves its builder only then)
    description = "Cell.update_parameters_name walks the subtree with one stack instead of nested generators"
    KNOWN_NAMES = frozenset({"Validator", "check_str_and_none_by_regular", "parameters_and_names", "is_init", "name"})

    def prepare(self):
        cell_class, original = cell_method("update_parameters_name", self.KNOWN_NAMES)
        validator = original.__globals__.get("Validator")
        check = getattr(validator, "check_str_and_none_by_regular", None)
        if check is None:
            raise ProbeFailed("no Validator.check_str_and_none_by_regular beside update_parameters_name")
        for method in ("cells_and_names", "parameters_and_names"):
            if not callable(vars(cell_class).get(method)):
                raise ProbeFailed(f"nn.Cell defines no {method}")
        self.cell_class = cell_class
        self.original = original
        self.check_prefix = check
        self.walk_methods = (vars(cell_class)["cells_and_names"], vars(cell_class)["parameters_and_names"])
        self.plain_classes: dict[type, bool] = {}

    def _plain(self, cls) -> bool:
        plain = self.plain_classes.get(cls)
        if plain is None:
            cells_and_names, parameters_and_names = self.walk_methods
            plain = (
                getattr(cls, "cells_and_names", None) is cells_and_names
                and getattr(cls, "parameters_and_names", None) is parameters_and_names
            )
            self.plain_classes[cls] = plain
        return plain

    def _walk(self, root, cells=None):
        """(name, parameter) as root.parameters_and_names() yields them, or None
        when a cell of the subtree overrides how it is walked; `cells` (a
        list) gets every cell as root.cells_and_names() yields them."""
        plain_of, is_plain = self.plain_classes, self._plain
        if not is_plain(type(root)):
            return None
        seen_cells, seen_params, out = set(), set(), []
        stack = [("", root)]
        while stack:
            cell_name, cell = stack.pop()
            if cell in seen_cells:
                continue
            seen_cells.add(cell)
            if cells is not None:
                cells.append(cell)
            prefix = cell_name + "." if cell_name else ""
            for par_name, par in cell._params.items():
                if par is not None:
                    inited = par.inited_param
                    if inited is not None:
                        par = inited
                    if id(par) not in seen_params:
                        seen_params.add(id(par))
                        out.append((prefix + par_name, par))
            if cell._cells:
                children = []
                for child_name, child in cell._cells.items():
                    if child:  # truthiness as cells_and_names tests it (an empty CellList is skipped)
                        plain = plain_of.get(type(child))
                        if not (is_plain(type(child)) if plain is None else plain):
                            return None
                        children.append((prefix + child_name, child))
                stack.extend(reversed(children))
        return out

    def named_parameters(self, root, cells=None):
        """root.parameters_and_names() as a list, walked with one stack, when
        this technique is installed and the calling thread is the builder;
        None otherwise (or when a cell of the subtree overrides the walk).
        `cells` (a list) gets root.cells_and_names()'s cells from the same walk."""
        if not self.installed or window.state.builder != threading.get_ident():
            return None
        return self._walk(root, cells)

    def install(self):
        if vars(self.cell_class).get("update_parameters_name") is not self.original:
            return False
        technique, original, check_prefix = self, self.original, self.check_prefix

        def update_parameters_name(self, prefix="", recurse=True):
            if window.state.builder != threading.get_ident() or recurse is not True:
                return original(self, prefix, recurse)
            check_prefix(prefix)
            named = technique._walk(self)
            if named is None:
                return original(self, prefix, recurse)
            if prefix != "":
                for name, param in named:
                    param.is_init = False
                    param.name = prefix + name
            else:
                for name, param in named:
                    param.name = name

        update_parameters_name.__wrapped__ = original
        update_parameters_name.__doc__ = original.__doc__
        self.swap = Swap(self.cell_class, "update_parameters_name", update_parameters_name)
        self.swap.install()
        self.installed = True
        return True

    def uninstall(self):
        self.installed = False
        self.swap.uninstall()

    def leftovers(self):
        original = getattr(self, "original", None)
        if original is not None and vars(self.cell_class).get("update_parameters_name") is not original:
            return ["nn.Cell.update_parameters_name is not mindspore's"]
        return []
