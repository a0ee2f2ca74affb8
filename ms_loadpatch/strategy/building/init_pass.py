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

Cells sibling-clone copied from one recipe are alike: once real calls on
three of them did the same and only that (each of the cell's own lazy
parameters given a new initializer of the same shape and dtype, the draws
taken in order and nothing else drawn from numpy, Python's `random` or
mindspore's generators, no data touched, the attributes, parameters' state
and buffers of the cell's subtree unchanged), the call on the others is
replayed (`_Replays`): the same initializers and draws, without the call.
"""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np

from .. import switch
from . import batched_draws, deferred_writes

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
        stack.append((cell, True))
        children = cell.__dict__.get("_cells")
        if children:
            unique, seen = [], set()
            for child in children.values():
                if child is not None and child not in seen:
                    seen.add(child)
                    unique.append(child)
            stack += [(child, False) for child in reversed(unique)]


def run(
    root, initialize, is_done=None, mark_done=None, ledger=None, copied_from=None, counts=None, owe_draws=False
) -> None:
    """`root.apply(f)`'s calls, without its per-cell recursion, where `f` is
    mindone's `_initialize_weights`: `initialize(cell)` then `mark_done(cell)`
    unless `is_done(cell)` (without them: `initialize(cell)` alone). With a
    `ledger`, `copied_from(cell)` (the sibling-clone recipe of a copied cell)
    and the pass's `counts` (filling_on_touch's), calls on cells copied from
    one recipe are replayed once three real ones agreed; with `owe_draws`
    (is_done and mark_done run no code but the plugin's on a plain cell),
    replays' draws are owed and taken as one batch before anything else runs."""
    replays = _Replays(ledger, counts, owe_draws) if ledger is not None and copied_from is not None else None
    settle = ledger.take_owed_draws if replays is not None else (lambda: None)

    def one(cell):
        if replays is not None and ledger.owed and not _plain_cell(type(cell)):
            settle()  # its flag's lookup may run the class's own code
        if is_done is not None and is_done(cell):
            return
        source = copied_from(cell) if replays is not None else None
        if source is None:
            settle()
            initialize(cell)
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


_plain_cells: dict[type, bool] = {}


def _plain_cell(cls) -> bool:
    """Attribute lookups and writes on `cls` are nn.Cell's (no code of the class's own runs)."""
    plain = _plain_cells.get(cls)
    if plain is None:
        from mindspore import nn

        plain = _plain_cells[cls] = (
            cls.__getattribute__ is object.__getattribute__
            and cls.__getattr__ is nn.Cell.__getattr__
            and cls.__setattr__ is nn.Cell.__setattr__
            and not any(_FLAG in vars(klass) for klass in cls.__mro__)
        )
    return plain


_FLAG = "_is_hf_initialized"


class _Replays:
    """Per sibling-clone recipe: the effect real calls agreed on, replayed on the later copies."""

    AGREEING_CALLS = 3  # real calls with one effect before it is replayed

    def __init__(self, ledger, counts, owe_draws=False):
        self.ledger, self.counts = ledger, counts
        self.owe = owe_draws and ledger.batching()
        self.entries: dict[int, list] = {}  # id(recipe) -> [effect, real calls agreeing (-1: never), recipe]

    @contextlib.contextmanager
    def one_by_one(self):
        """Draws taken at once while code not the plugin's runs between calls (a class's own apply)."""
        owe, self.owe = self.owe, False
        try:
            yield
        finally:
            self.owe = owe

    def call(self, cell, source, initialize) -> None:
        entry = self.entries.get(id(source))
        if entry is None:
            entry = self.entries[id(source)] = [None, 0, source]
        if entry[1] >= self.AGREEING_CALLS and self._replay(cell, entry[0]):
            self.counts.replayed += 1
            return
        self.ledger.take_owed_draws()  # before a real call, which may draw
        if entry[1] < 0 or entry[1] >= self.AGREEING_CALLS:
            initialize(cell)
            return
        effect = self._recorded(cell, initialize)
        if effect is None or (entry[0] is not None and effect != entry[0]):
            entry[1] = -1
        else:
            entry[0], entry[1] = effect, entry[1] + 1

    def _recorded(self, cell, initialize):
        """Calls initialize(cell); returns its effect, or None when it did
        anything a replay would not do."""
        ledger = self.ledger
        params = {attr: p for attr, p in (cell.__dict__.get("_params") or {}).items() if p is not None}
        subtree = _subtree_state(cell)
        if subtree is None or not all(p.has_init for p in params.values()):
            initialize(cell)
            return None
        own = {id(p): attr for attr, p in params.items()}
        before = {attr: p.init_mode for attr, p in params.items()}
        random_state, python_state = np.random.get_state(), random.getstate()
        counts = self.counts
        before_counts = (counts.filled, counts.deferred, counts.generator_steps, ledger.run_in_full)
        ledger.assignments = []
        try:
            initialize(cell)
        finally:
            assignments, ledger.assignments = ledger.assignments, None
        if (
            before_counts != (counts.filled, counts.deferred, counts.generator_steps, ledger.run_in_full)
            or python_state != random.getstate()
            or _subtree_state(cell) != subtree
        ):
            return None
        effect, replayed = [], np.random.RandomState()
        replayed.set_state(random_state)
        for param, tensor in assignments:
            attr, old, init = own.get(id(param)), before.get(own.get(id(param))), tensor.init
            if attr is None or old is None or init is None or (tensor.shape, tensor.dtype) != (old.shape, old.dtype):
                return None
            drew = ledger.drew(tensor)
            if drew:  # the draw must be the one the ledger took, in this order
                if replayed.randint(low=1, high=(1 << 63), dtype=np.int64) != ledger.seeds[id(tensor)][1]:
                    return None
            elif type(init) not in ledger.classes[0]:
                return None
            state = [(k, dict(v) if type(v) is dict else v) for k, v in vars(init).items()]
            if not all(_plain_value(v) for _, v in state):
                return None
            effect.append((attr, type(init), state, tensor.shape, tensor.dtype, drew))
        same_draws = batched_draws.same_numpy_state(replayed.get_state(), np.random.get_state())
        if len({item[0] for item in effect}) != len(effect) or not same_draws:
            return None
        return effect

    def _replay(self, cell, effect) -> bool:
        params = cell.__dict__.get("_params") or {}
        targets = []
        for attr, kind, state, shape, dtype, drew in effect:
            param = params.get(attr)
            tensor = param.init_mode if param is not None and param.has_init else None
            if tensor is None or tensor.init is None or tensor.shape != shape or tensor.dtype != dtype:
                return False
            targets.append((tensor, kind, state, drew))
        owe = self.owe and _plain_cell(type(cell))
        for tensor, kind, state, drew in targets:
            init = object.__new__(kind)
            init.__dict__.update({k: dict(v) if type(v) is dict else v for k, v in state})
            self.ledger.reinitialize(tensor, init, drew, owe)
        return True


_SCALARS = (type(None), bool, int, float, str, np.floating, np.integer)
# a parameter's own state besides its initializer (init_mode, what a replay gives back)
_PARAMETER_SWITCHES = ("name", "requires_grad", "layerwise_parallel", "parallel_optimizer")


SUBTREE_LIMIT = 64  # cells under a recipe's cell whose calls are learnt and replayed


def _subtree_state(cell):
    """What a replay would not restore, over `cell` and the cells below it:
    their attributes and the entries of dict attributes by identity, each
    parameter's attributes (a lazy one's initializer aside) and switches,
    and the bytes of every real tensor (buffers, parameters built real).
    None when some bytes cannot be read, or when the subtree has more than
    SUBTREE_LIMIT cells (a block of experts: checking it costs more than
    the few real calls on its copies)."""
    import mindspore as ms

    state = []
    for count, (_, sub) in enumerate(cell.cells_and_names()):
        if count == SUBTREE_LIMIT:
            return None
        for key, value in vars(sub).items():
            if key == _FLAG:
                continue
            state.append((key, id(value)))
            if isinstance(value, dict):  # _params, _cells, _buffers: OrderedDicts
                state.append(tuple((k, id(v)) for k, v in value.items()))
                values = value.values()
            else:
                values = (value,)
            for item in values:
                lazy = isinstance(item, ms.Parameter) and item.has_init
                if isinstance(item, ms.Parameter):
                    state.append(tuple((k, id(v)) for k, v in vars(item).items() if not (lazy and k == "init_mode")))
                    state.append(tuple(getattr(item, name, None) for name in _PARAMETER_SWITCHES))
                if isinstance(item, ms.Tensor) and not lazy:
                    try:
                        state.append(item.asnumpy().tobytes())
                    except Exception:  # a tensor whose bytes are not readable here: never replayed
                        return None
    return state


def _plain_value(value) -> bool:
    if type(value) is dict:
        return all(isinstance(v, _SCALARS) for v in value.values())
    return isinstance(value, _SCALARS) or type(value) is tuple and all(isinstance(v, _SCALARS) for v in value)


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
    are recorded into it instead. Yields the pass's PassCounts."""
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

    kinds = deferred_writes.usable_kinds() if ledger is not None else frozenset()
    recorder = deferred_writes.Recorder(ledger, kinds, fill, counts) if kinds else None

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
        patched[name] = _filling_first(cls, name, fill, recorder if name in kinds else None, builder)
    swaps = [(cls, name, value) for name, value in patched.items()]
    swaps.append((Generator, "_step", _counting_steps(vars(Generator)["_step"], counts, builder)))
    originals = [(owner, name, vars(owner)[name] if name in vars(owner) else None) for owner, name, _ in swaps]
    try:
        for owner, name, value in swaps:
            setattr(owner, name, value)
        yield counts
    finally:
        for owner, name, original in originals:
            if original is not None:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


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


def batched_draws_row() -> dict:
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
