"""A model's init pass over lazily built parameters: the calls `Cell.apply`
makes, in its order, with a parameter's data made only where the pass
touches it.

An `_init_weights` mostly gives a parameter a new initializer
(`param.set_data(initializer(Normal(std), ...))`): on a lazy parameter that
keeps it lazy, and the ledger (draws.py) takes the draw the plain pass makes
filling it. Anything else that reaches a lazy parameter's data during the
pass (`param.data`, indexing into it, an in-place method such as `normal_`
or `fill_`) first fills it from its initializer with its own seed, as the
plain build holds it, then runs as written: exact, slower only there
(counted: `filling_on_touch`).
"""

from __future__ import annotations

import contextlib
import threading

_APPLY_METHODS = ("apply", "cells", "name_cells")


def cells_in_apply_order(root):
    """(cell, own) in the order `root.apply(fn)` calls fn: children first, in
    `name_cells()` order (each child once per parent, a cell shared by two
    parents under both). `own` is True for a cell whose class changes how
    apply walks: the caller then calls its `apply` for the whole subtree."""
    from mindspore import nn

    base = {name: vars(nn.Cell)[name] for name in _APPLY_METHODS}
    plain: dict[type, bool] = {}
    stack = [(root, False)]
    while stack:
        cell, children_done = stack.pop()
        if children_done:
            yield cell, False
            continue
        kind = type(cell)
        if kind not in plain:
            plain[kind] = all(getattr(kind, name, None) is base[name] for name in _APPLY_METHODS)
        if not plain[kind]:
            yield cell, True
            continue
        stack.append((cell, True))
        children = cell.__dict__.get("_cells")
        if children:
            unique, seen = [], set()
            for child in children.values():
                if child is not None and child not in seen:
                    seen.add(child)
                    unique.append(child)
            stack += [(child, False) for child in reversed(unique)]


def run(root, initialize) -> None:
    """`root.apply(initialize)`'s calls, without its per-cell recursion."""
    for cell, own in cells_in_apply_order(root):
        if own:
            cell.apply(initialize)
        else:
            initialize(cell)


class Filled:
    def __init__(self):
        self.count = 0  # lazy parameters whose data the pass touched


@contextlib.contextmanager
def filling_on_touch():
    """While held, in this thread: reading a lazy Parameter's `data`,
    indexing into it, or calling an in-place method on it fills it first
    (Parameter.init_data; under a ledger, with its own seed). Yields the count."""
    import mindspore as ms

    builder = threading.get_ident()
    cls = ms.Parameter
    patched = {}
    filled = Filled()

    def fill(param):
        if threading.get_ident() == builder and param.has_init:
            param.init_data()
            filled.count += 1

    data = next((vars(k)["data"] for k in cls.__mro__ if "data" in vars(k)), None)
    if data is not None:
        patched["data"] = _FillingData(lambda p: (fill(p), data.__get__(p, type(p)))[1],
                                       lambda p, v: data.__set__(p, v))
    for name in _in_place_methods(ms):
        patched[name] = _filling_first(cls, name, fill)
    patched["__setitem__"] = _filling_first(cls, "__setitem__", fill)
    originals = {name: vars(cls)[name] for name in patched if name in vars(cls)}
    try:
        for name, value in patched.items():
            setattr(cls, name, value)
        yield filled
    finally:
        for name in patched:
            if name in originals:
                setattr(cls, name, originals[name])
            else:
                delattr(cls, name)


class _FillingData(property):
    """Parameter.data during a pass: fills a lazy parameter first."""


def _in_place_methods(ms) -> list[str]:
    """The in-place methods of mindspore tensors (`normal_`, `fill_`, ...)."""
    import inspect

    names = set()
    for owner in (ms.Tensor, ms.Parameter):
        for name in dir(owner):
            if name.endswith("_") and not name.startswith("_") and inspect.isroutine(getattr(owner, name, None)):
                names.add(name)
    return sorted(names)


def _filling_first(cls, name, fill):
    own = vars(cls).get(name)

    def method(self, *args, **kwargs):
        fill(self)
        if own is not None:
            return own(self, *args, **kwargs)
        return getattr(super(cls, self), name)(*args, **kwargs)

    method.__name__ = name
    return method


def leftovers() -> list[str]:
    """Parameter attributes a pass would have left patched (for tests)."""
    import mindspore as ms

    return [f"Parameter.{name} still fills on touch" for name, value in vars(ms.Parameter).items()
            if getattr(value, "__qualname__", "").startswith("_filling_first")
            or isinstance(value, _FillingData)]
