"""sibling-clone: cells built again with the same arguments copied from a recipe."""

from __future__ import annotations

import contextlib
import time

from . import batched_draws, draws, window
from .recipes import SCALARS, RecipeWriter, Unclonable, copy_initializer, same_recipe
from .state import model_state
from .technique import InitHooks, ProbeFailed, Technique, cell_registration


class SiblingClone(Technique):
    """A model builds many cells of one class with the same arguments (the
    experts of every MoE layer, identical MLPs). Within a window, a class is
    noticed at its first build (its `__init__` is wrapped until the window
    closes); a call is noted at its first build (or, when that build was
    mostly copies, left to `__init__` for good), the next two with the same
    arguments run `__init__` and each gives a recipe, taken right after `__init__` returned; when both
    recipes are the same and a copy made from the recipe equals the second
    cell (`model_state`: every cell's `__dict__`, parameters, primitives),
    later builds with those arguments are copies. A copy re-creates every
    per-instance object as mindspore makes it: cells (`Cell_.__init__`,
    instance count, compile cache, `init_pipeline`, a fresh `_create_time`),
    lazy Parameters by `Parameter(initializer(...))` with the same name and
    flags, primitives as mindspore copies them (`type(p)(**p.init_attrs)`),
    initializers and containers; it shares immutable values and what both
    builds shared (a module-level primitive; the config, or any other object
    both builds refer to: identity where the real builds share). A tensor
    `__init__` computed (a rotary table) is read into the recipe and made
    from host memory in each copy, without the ops that computed it. bf16
    tensors, tensors that cannot be read, non-lazy parameters, closures,
    bound methods, an object the two builds hold different copies of,
    arguments other than scalars and config-like objects, and classes
    outside mindspore / mindone leave the build to `__init__`. A config is matched by
    identity, by the identities of its attributes and by their values at
    each call (a config changed between builds starts the learning over)."""

    name = "sibling-clone"
    description = (
        "cells built again with the same arguments (each expert of a MoE layer) copied from a recipe "
        "checked against real builds"
    )
    # A cell whose first build copied this many cells from recipes (an MoE
    # block of copied experts) gets no recipe of its own: learning one costs
    # two more recipes written, a copy and two state comparisons of its whole
    # subtree, and a copy of it saves only the per-expert calls.
    COPIES_INSIDE_LIMIT = 16

    def __init__(self):
        self.hooks = InitHooks()
        self.entries: dict = {}
        self.cloned = 0
        self.sources: dict[int, tuple] = {}  # id(copied cell) -> the recipe it was filled from
        self.copies: list = []  # the copied cells, kept alive while their ids key `sources`
        self.builds: dict[type, list[int]] = {}  # class -> [builds, copies] in this window
        self.reasons: dict[type, str] = {}  # class -> the first reason one of its calls got no recipe
        self.count = window.DeferredInstanceCount()

    def prepare(self):
        import mindspore as ms
        import numpy
        from mindspore import nn
        from mindspore.common import dtype as mstype
        from mindspore.common.initializer import Initializer, initializer
        from mindspore.ops.primitive import Primitive

        self.cell_base, self.compile_cache, self.init_pipeline = cell_registration()
        if "init_attrs" not in vars(Primitive(name="ms_loadpatch_probe")):
            raise ProbeFailed("Primitive keeps no init_attrs")
        self.cell_class, self.parameter_class, self.tensor_class = nn.Cell, ms.Parameter, ms.Tensor
        self.primitive_class, self.initializer_class, self.initializer = Primitive, Initializer, initializer
        self.dtype_class = mstype.Type
        self.numpy = numpy

    # installation: Cell.__init__ notices each class; its own __init__ is wrapped for the window

    def install(self):
        self.entries.clear()
        self.builds.clear()
        self.reasons.clear()
        return self.hooks.install(self.cell_class, self._hook)

    def copied_from_by_id(self):
        """A lookup of id(cell) -> the recipe the cell was copied from in the
        open window (the same object for every copy of one cell of it), or
        None; good for the length of the window."""
        return self.sources.get

    def uninstall(self):
        self.sources.clear()
        self.copies.clear()
        self.hooks.restore()
        if window.state.recording:
            window.state.notes[self.name] = self._build_notes()
        self.entries.clear()
        self.builds.clear()
        self.reasons.clear()
        self.count.flush(self.cell_class)

    def leftovers(self):
        found = self.hooks.leftovers()
        if self.entries or self.builds or self.sources or self.copies:
            found.append("sibling-clone recipes kept")
        if self.count.pending:
            found.append(f"{self.name}: {self.count.pending} cells not counted")
        return found

    def probe_started(self):
        return self.cloned

    def probe_finished(self, cloned_before):
        if self.cloned == cloned_before:
            return "the probe model's repeated cells were not copied: the technique does not work here"
        return None

    def _hook(self, cls, base_init):
        if cls.__init__ is self.hooks.dispatcher or cls.__init__ is base_init:
            self.hooks.leave(cls)  # nothing but Cell.__init__ to skip
        else:
            self.hooks.wrap(cls, self._build)

    # matching calls

    def _key(self, cls, args, kwargs):
        """A hashable key of the call, and the config-like objects to snapshot; None: not matchable."""
        parts, configs = [cls], []
        for value in args if not kwargs else (*args, *(v for _, v in sorted(kwargs.items()))):
            kind = type(value)
            if kind in SCALARS:
                parts.append((kind, value))
            elif kind is tuple and all(type(v) in SCALARS for v in value):
                parts.append((kind, value))
            elif (
                isinstance(value, (self.cell_class, self.tensor_class, self.primitive_class))
                or not hasattr(value, "__dict__")
                or isinstance(value, type)
            ):
                return None
            else:
                parts.append(("object", id(value), tuple(map(id, vars(value).values()))))
                configs.append(value)
        if kwargs:
            parts.append(tuple(sorted(kwargs)))
        parts.append(len(args))
        return tuple(parts), configs

    @staticmethod
    def _config_snapshot(configs):
        import copy

        return [
            (value, [(k, copy.deepcopy(v) if type(v) in (dict, list, set) else v) for k, v in vars(value).items()])
            for value in configs
        ]

    @staticmethod
    def _configs_unchanged(snapshot) -> bool:
        return all(list(vars(value).items()) == items for value, items in snapshot)

    def _build(self, cls, init, cell, args, kwargs):
        counts = self.builds.get(cls)
        if counts is None:
            counts = self.builds[cls] = [0, 0]
        counts[0] += 1
        try:
            keyed = self._key(cls, args, kwargs)
        except TypeError:  # an unhashable scalar-looking value
            keyed = None
        if keyed is None:
            self.reasons.setdefault(cls, "its arguments are not matchable (a cell, tensor, class or plain object)")
            return init(cell, *args, **kwargs)
        key, configs = keyed
        entry = self.entries.get(key)
        if entry is not None and entry[0] == "never":  # learnt: this class and call are built by __init__
            return init(cell, *args, **kwargs)
        if entry is not None and entry[0] == "recipe" and self._configs_unchanged(entry[2]):
            made_before = self.count.pending
            with draws.owing(entry[4]) if entry[3] else contextlib.nullcontext():
                self._fill_root(cell, entry[1])
            self.cloned += 1
            counts[1] += self.count.pending - made_before  # the cells of its subtree
            return None
        if entry is None:  # a call seen once (e.g. a layer with its own index) is not worth a recipe
            copies_before = self.cloned
            init(cell, *args, **kwargs)
            copies_inside = self.cloned - copies_before
            if copies_inside >= self.COPIES_INSIDE_LIMIT:
                self.entries[key] = ("never", None, None)
                self.reasons.setdefault(
                    cls,
                    f"its first build copied {copies_inside} cells: built by __init__, its own repeated cells copied",
                )
            else:
                self.entries[key] = ("seen", None, None)
            return None
        snapshot = self._config_snapshot(configs)
        init(cell, *args, **kwargs)
        if entry[0] in ("seen", "recipe"):  # second build, or the config changed: (re)start learning
            self.entries[key] = ("first", self._write_recipe(cell, keep=True), snapshot)
        elif entry[0] == "first" and self._configs_unchanged(snapshot) and entry[2] == snapshot:
            self.entries[key] = self._learn(cell, entry[1], snapshot)
            if self.entries[key][0] == "never":
                self.reasons.setdefault(cls, self.entries[key][1])
        return None

    def _build_notes(self) -> dict:
        """The window's copies, and why each class built more than once was never copied."""
        not_copied = {}
        learnt = {key[0] for key, entry in self.entries.items() if entry[0] == "recipe"}
        for cls, (builds, copies) in self.builds.items():
            if builds > 1 and not copies:
                default = (
                    "copied only within the cells that hold it"
                    if cls in learnt
                    else "every call had other arguments (e.g. a layer index)"
                )
                not_copied[f"{cls.__module__}.{cls.__qualname__}"] = self.reasons.get(cls, default)
        return {"cells_copied": sum(copies for _, copies in self.builds.values()), "not_copied": not_copied}

    # recipes

    def _write_recipe(self, cell, keep=False, first=None):
        """The recipe of `cell`; with `keep`, (recipe, the objects it describes: kept alive for the
        second build, which shares what both builds hold, e.g. a module-level primitive)."""
        try:
            writer = RecipeWriter(self, cell, shared=first[1] if first is not None else ())
            recipe = writer.write()
        except Unclonable as exc:
            self.reasons.setdefault(type(cell), f"not copyable: {exc}")
            return None
        return (recipe, {id(o): o for o in writer.keep}) if keep else recipe

    def _learn(self, cell, first, snapshot):
        """The entry for a class and its arguments after a second real build:
        a recipe when both builds gave the same recipe and a copy made from
        it equals the second cell, else "never" (built by its own __init__).
        ("recipe", recipe, snapshot, owe, templates): `owe` when the trial
        copy drew nothing from numpy, so copies may owe their draws
        (draws.owing), `templates` the (initializer, shape) of each lazy
        parameter a copy makes."""
        recipe = self._write_recipe(cell, first=first) if first is not None else None
        if recipe is None:
            return ("never", "not copyable", snapshot)
        if not same_recipe(first[0], recipe):
            return ("never", "two builds with the same arguments gave different recipes", snapshot)
        numpy_state = self.numpy.random.get_state()
        try:
            copy = type(cell).__new__(type(cell))
            with draws.suspended():  # a trial copy the plain build never makes: no draws
                self._fill_root(copy, recipe)
            same = model_state(copy) == model_state(cell)
        except Exception as exc:
            return ("never", f"copying failed: {type(exc).__name__}: {exc}", snapshot)
        finally:
            # a copy that draws from numpy other than through the ledger takes its draws one by one
            draws_elsewhere = not batched_draws.same_numpy_state(numpy_state, self.numpy.random.get_state())
            if draws_elsewhere:
                self.numpy.random.set_state(numpy_state)
        if not same:
            return ("never", "a copy differs from a real build", snapshot)
        return ("recipe", recipe, snapshot, not draws_elsewhere, _parameter_templates(recipe))

    def _new_cell(self, cls):
        cell = cls.__new__(cls)
        self._init_cell(cell)
        return cell

    def _init_cell(self, cell):
        self.cell_base.__init__(cell, cell._cell_tag)
        self.count.pending += 1

    def _fill_root(self, cell, recipe):
        self._init_cell(cell)
        made = {}
        self._fill_cell(cell, recipe, made)

    def _fill_cell(self, cell, recipe, made):
        _, slot, shared, fresh, built = recipe
        made[slot] = cell
        self.sources[id(cell)] = recipe
        self.copies.append(cell)
        state = cell.__dict__
        state.update(shared)  # every key in order; per-instance ones are overwritten in place below
        for key, factory in fresh:
            state[key] = factory()
        if built:
            make = self._make
            for key, item in built:
                state[key] = make(item, made)
        self.compile_cache[id(cell)] = cell.compile_cache
        self.init_pipeline()

    def _make(self, item, made):
        kind = item[0]
        if kind == "share":
            return item[1]
        if kind == "ref":
            return made[item[1]]
        if kind == "time":  # Cell._create_time: a clock reading per instance
            return int(time.time() * 1e9)
        if kind == "cell":
            cell = self._new_cell(item[1][0])
            self._fill_cell(cell, item[1], made)
            return cell
        if kind == "param":
            _, slot, init, shape, dtype, name, flags, overrides = item
            param = self.parameter_class(self.initializer(copy_initializer(init), shape, dtype), name=name, **flags)
            for attribute, value in overrides:
                setattr(param, attribute, value)
            made[slot] = param
            return param
        if kind == "tensor":
            _, slot, data, dtype, shape, _ = item
            tensor = self.tensor_class(self.numpy.frombuffer(data, dtype).reshape(shape).copy())
            made[slot] = tensor
            return tensor
        if kind == "prim":
            _, slot, cls, init_attrs, instance_name, _ = item
            prim = cls(**init_attrs)
            if instance_name is not None:
                prim.set_prim_instance_name(instance_name)
            made[slot] = prim
            return prim
        if kind == "container":
            _, slot, cls, entries, _ = item
            if cls in (list, tuple, set):
                value = cls(self._make(e, made) for e in entries)
            else:
                value = cls((k, self._make(e, made)) for k, e in entries)
            if slot is not None:
                made[slot] = value
            return value
        raise AssertionError(kind)


def _parameter_templates(recipe) -> tuple:
    """(initializer, shape) of each parameter a copy from `recipe` makes (`_make`'s "param" items)."""
    found, items = [], [item for _, item in recipe[4]]
    while items:
        item = items.pop()
        kind = item[0]
        if kind == "param":
            found.append((item[2], item[3]))
        elif kind == "cell":
            items += [inner for _, inner in item[1][4]]
        elif kind == "container":
            items += [entry if item[2] in (list, tuple, set) else entry[1] for entry in item[3]]
    return tuple(found)
