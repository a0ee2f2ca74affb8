"""A model's init pass over lazily built parameters: the calls `Cell.apply`
makes, in its order, with a parameter's data made only where the pass
touches it.

An `_init_weights` mostly gives a parameter a new initializer
(`param.set_data(initializer(Normal(std), ...))`): on a lazy parameter that
keeps it lazy, and the ledger (draws.py) takes the draw the plain pass makes
filling it. An in-place write deferred_writes models (`weight.data.normal_()`,
`zero_`, `weight[pad] = 0`) is recorded with its generator step. Anything
else that reaches a lazy parameter's data during the pass first fills it
from its initializer with its own seed, as the plain build holds it, then
runs as written: exact, slower only there (counted: `filling_on_touch`).

Calls on cells sibling-clone copied from one recipe are replayed once three
real ones agreed (replays.py): the same initializers, draws and recorded
writes, without the call.
"""

from __future__ import annotations

import contextlib
import threading

from .. import switch
from . import batched_draws, deferred_writes
from .replays import Replays, plain_cell
from .swaps import Swaps

BATCHED_DRAWS = batched_draws.NAME

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
        children = cell.__dict__.get("_cells")
        if not children:  # a leaf: its call now, where it would come off the stack next
            yield cell, False
            continue
        stack.append((cell, True))
        unique, seen = [], set()
        for child in children.values():
            if child is not None and child not in seen:
                seen.add(child)
                unique.append(child)
        stack += [(child, False) for child in reversed(unique)]


def run(
    root,
    initialize,
    is_done=None,
    mark_done=None,
    ledger=None,
    recipe_by_id=None,
    counts=None,
    owe_draws=False,
    flag=None,
) -> None:
    """`root.apply(f)`'s calls, without its per-cell recursion, where `f` is
    mindone's `_initialize_weights`: `initialize(cell)` then `mark_done(cell)`
    unless `is_done(cell)` (without them: `initialize(cell)` alone; `flag`, a
    cellpasses.PlainFlag: its `is_set` and `set`). With a `ledger`,
    `recipe_by_id(id(cell))` (the sibling-clone recipe of a copied cell, or
    None) and the pass's `counts` (filling_on_touch's), calls on cells copied from one
    recipe are replayed once three real ones agreed; with `owe_draws`
    (is_done and mark_done run no code but the plugin's on a plain cell),
    replays' draws are owed and taken as one batch before anything else runs."""
    if flag is not None:
        is_done, mark_done = flag.is_set, flag.set
    replays = Replays(ledger, counts, owe_draws) if ledger is not None and recipe_by_id is not None else None
    settle = ledger.take_owed_draws if replays is not None else (lambda: None)
    # on a plain cell the flag is read and written in its instance dict, and a replayed call needs no more
    plain_state = flag.plain_state if flag is not None and replays is not None else None

    def one(cell):
        state = plain_state(cell) if plain_state is not None else None  # True, the dict where it is unset, None
        if state is True:
            return
        source = recipe_by_id(id(cell)) if replays is not None else None
        tried = source is not None and state is not None
        if tried and replays.replayed(cell, source):
            state[flag.name] = flag.value
            return
        if replays is not None and ledger.owed and not plain_cell(type(cell)):
            settle()  # its flag's lookup may run the class's own code
        if state is None and is_done is not None and is_done(cell):
            return
        if source is None:
            settle()
            initialize(cell)
        elif tried:
            replays.call_refused(cell, source, initialize)
        else:
            replays.call(cell, source, initialize)
        if mark_done is not None:
            mark_done(cell)

    try:
        for cell, own in cells_in_apply_order(root):
            if own:
                settle()
                with replays.one_by_one() if replays is not None else contextlib.nullcontext():
                    cell.apply(one)
            else:
                one(cell)
    finally:
        settle()  # the draws of calls made before a failure, as the plain pass took them


class PassCounts:
    def __init__(self):
        self.filled = 0  # lazy parameters whose data the pass touched
        self.deferred = 0  # in-place writes on lazy parameters recorded (deferred_writes)
        self.replayed = 0  # calls replayed on cells copied from one recipe
        self.generator_steps = 0  # steps of mindspore's generators taken in the building thread


@contextlib.contextmanager
def filling_on_touch(ledger=None):
    """While held, in this thread: reading a lazy Parameter's `data`,
    indexing into it, or calling an in-place method on it fills it first
    (Parameter.init_data; under a ledger, with its own seed). With a
    `ledger`, the in-place writes deferred_writes verified on this mindspore
    are recorded into it instead (probed at the first such write). Yields the pass's PassCounts."""
    import sys

    import mindspore as ms
    from mindspore.common.generator import Generator

    builder = threading.get_ident()
    cls = ms.Parameter
    patched = {}
    counts = PassCounts()

    def fill(param):
        if threading.get_ident() == builder and param.has_init:
            param.init_data()
            counts.filled += 1
        return param

    use_recorder = ledger is not None and not switch.is_off(deferred_writes.NAME)
    recorder = deferred_writes.Recorder(ledger, deferred_writes.LazyKinds(), fill, counts) if use_recorder else None

    data = next((vars(k)["data"] for k in cls.__mro__ if "data" in vars(k)), None)
    if data is not None:

        def read_data(param):
            if threading.get_ident() == builder and param.has_init:
                lazy = recorder.data(param, sys._getframe(1)) if recorder is not None else None
                if lazy is not None:
                    return lazy
                fill(param)
            return data.__get__(param, type(param))

        patched["data"] = _FillingData(read_data, lambda p, v: data.__set__(p, v))
    for name in _in_place_methods(ms) + ["__setitem__", "__getitem__"]:
        patched[name] = _filling_first(cls, name, fill, recorder if name in deferred_writes.KINDS else None, builder)
    patched_steps = (Generator, "_step", _counting_steps(vars(Generator)["_step"], counts, builder))
    with Swaps([*((cls, name, value) for name, value in patched.items()), patched_steps]):
        yield counts


def _counting_steps(step, counts, builder):
    """Generator._step during a pass: counts the builder's steps (a call
    that draws from mindspore's generators is never replayed)."""

    def _step(self, *args, **kwargs):
        if threading.get_ident() == builder:
            counts.generator_steps += 1
        return step(self, *args, **kwargs)

    _step.__qualname__ = "_counting_steps"
    return _step


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


def _filling_first(cls, name, fill, recorder, builder):
    """Parameter.`name` during a pass: on a lazy parameter in the building
    thread, recorded (`recorder`: a write it models) or filled first."""
    own = vars(cls).get(name)

    def method(self, *args, **kwargs):
        if (
            recorder is not None
            and self.has_init
            and threading.get_ident() == builder
            and recorder.record(self, False, (), name, args, kwargs)
        ):
            return None if name == "__setitem__" else self
        fill(self)
        if own is not None:
            return own(self, *args, **kwargs)
        return getattr(super(cls, self), name)(*args, **kwargs)

    method.__name__ = name
    return method


def batched_draws_row():
    """status()'s row for replays' draws taken in batches."""
    from .. import verdict

    description = (
        "the numpy draws of sibling-clone copies and of init-pass calls replayed on them taken in one "
        "call per copy or run of replays (checked: mindspore's _numpy_seed, numpy's batched randint, "
        "the same numbers made from the global MT19937's words)"
    )
    if switch.is_off(BATCHED_DRAWS):
        return verdict.row_off(BATCHED_DRAWS, None, description)
    words = (
        "; made from the global MT19937's words"
        if batched_draws.words_usable()
        else "; one randint each (the words check failed)"
    )
    return verdict.row(
        BATCHED_DRAWS,
        None,
        description,
        batched_draws.problem(),
        passed="probe passed: one randint of size n equals n of mindspore's draws here" + words,
    )


def leftovers() -> list[str]:
    """Parameter attributes a pass would have left patched (for tests)."""
    import mindspore as ms
    from mindspore.common.generator import Generator

    found = [
        f"Parameter.{name} still fills on touch"
        for name, value in vars(ms.Parameter).items()
        if getattr(value, "__qualname__", "").startswith("_filling_first") or isinstance(value, _FillingData)
    ]
    if getattr(vars(Generator)["_step"], "__qualname__", "") == "_counting_steps":
        found.append("Generator._step still counts steps")
    return found
