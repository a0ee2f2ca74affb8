"""Recipes of freshly built cells (what sibling-clone copies from): written
from a real build, compared between two builds."""

from __future__ import annotations

import collections

from . import draws
from .cell_init_template import CellInitTemplate

SCALARS = (type(None), bool, int, float, complex, str, bytes)
PER_INSTANCE_TIME = CellInitTemplate.PER_INSTANCE_TIME


# Only these libraries' cells are copied: their constructors are exercised by
# the identity suites; a user's own cell class is always built by its __init__.
CLONABLE_PACKAGES = frozenset({"mindspore", "mindone", "ms_loadpatch"})  # ms_loadpatch: the probe's cells
_MISSING = object()
_ORDERED_DICTS = (collections.OrderedDict,)


class Unclonable(Exception):
    """Something in a freshly built cell sibling-clone does not know how to copy."""


def copy_initializer(init):
    copy = object.__new__(type(init))
    copy.__dict__.update({k: (dict(v) if type(v) is dict else v) for k, v in vars(init).items()})
    return copy


class RecipeWriter:
    """The recipe of a freshly built cell: per-instance objects described,
    everything else shared; raises Unclonable for what it cannot copy."""

    def __init__(self, technique, root, shared=()):
        self.t = technique
        self.root = root
        self.shared = shared  # ids of objects the first build of this class held too: shared by every build
        self.slots: dict[int, int] = {}
        self.keep = []  # the objects whose ids are slots stay alive meanwhile
        self.referenced: set[int] = set()
        self.unrecorded: set[int] = set()  # empty containers made by a bare factory call

    def _slot(self, value):
        slot = len(self.slots)
        self.slots[id(value)] = slot
        self.keep.append(value)
        return slot

    def write(self):
        recipe = self._cell(self.root)
        if self.referenced & self.unrecorded:
            raise Unclonable("an empty container referred to twice")
        return recipe

    def _cell(self, cell):
        """(class, slot, shared values by key in __dict__ order, empty containers to make, objects to build)."""
        if type(cell).__module__.split(".", 1)[0] not in CLONABLE_PACKAGES:
            raise Unclonable(f"{type(cell).__qualname__} is not mindspore's or mindone's")
        slot = self._slot(cell)
        shared, fresh, built = {}, [], []
        for key, value in vars(cell).items():
            item = ("time",) if key == PER_INSTANCE_TIME else self._item(value)
            shared[key] = item[1] if item[0] == "share" else None
            if item[0] == "container" and not item[3] and item[2] in (dict, list, set) + _ORDERED_DICTS:
                fresh.append((key, item[2]))
                self.unrecorded.add(item[1])
            elif item[0] != "share":
                built.append((key, item))
        return (type(cell), slot, shared, tuple(fresh), tuple(built))

    def _item(self, value):
        t = self.t
        if id(value) in self.shared and not isinstance(value, (self.t.cell_class, self.t.parameter_class)):
            return ("share", value)
        if id(value) in self.slots:
            self.referenced.add(self.slots[id(value)])
            return ("ref", self.slots[id(value)])
        kind = type(value)
        if kind in SCALARS or isinstance(value, t.dtype_class):
            return ("share", value)
        if isinstance(value, t.cell_class):
            return ("cell", self._cell(value))
        if isinstance(value, t.parameter_class):
            return self._parameter(value)
        if isinstance(value, t.tensor_class):
            return self._tensor(value)
        if isinstance(value, t.primitive_class):
            return self._primitive(value)
        if kind in (dict, list, set, tuple) or kind.__name__ == "OrderedDict" and kind.__module__ == "collections":
            if kind is tuple and not value:
                return ("share", value)  # the empty tuple is one object
            if kind is tuple:
                slot = None
                self.keep.append(value)  # not referable, but a second build may share it (a code constant)
            else:
                slot = self._slot(value)
            if kind in (list, tuple, set):
                entries = [self._item(v) for v in value]
            else:
                entries = [(k, self._item(v)) for k, v in value.items()]
                if not all(type(k) in SCALARS for k, _ in entries):
                    raise Unclonable("a dict with object keys")
            return ("container", slot, kind, entries, id(value))
        if (
            isinstance(value, type)
            or kind.__name__ in ("function", "builtin_function_or_method")
            and getattr(value, "__closure__", None) is None
            and getattr(value, "__self__", None) in (None,)
            or kind.__name__ == "builtin_function_or_method"
            and not hasattr(getattr(value, "__self__", None), "__dict__")
        ):
            return ("share", value)
        if hasattr(value, "__dict__") and not callable(value):
            # An object the cell refers to (the config an expert keeps): shared, and the recipe holds
            # only if the next real build refers to the very same object (same_recipe compares identity).
            return ("share", value)
        raise Unclonable(f"a {kind.__qualname__}")

    def _parameter(self, param):
        t = self.t
        init_tensor = param.init_mode
        init = getattr(init_tensor, "init", None)
        if (
            not param.has_init
            or init is None
            or type(init).__dict__.get("__slots__")
            or not isinstance(init, t.initializer_class)
        ):
            raise Unclonable("a parameter that is not lazy")
        if any(type(v) not in SCALARS for v in vars(init).values() if type(v) is not dict):
            raise Unclonable("an initializer holding objects")
        slot = self._slot(param)
        flags = dict(
            requires_grad=param.requires_grad,
            layerwise_parallel=param.layerwise_parallel,
            parallel_optimizer=param.parallel_optimizer,
        )
        shape, dtype = tuple(init_tensor.shape), init_tensor.dtype
        with draws.suspended():  # a scratch parameter the plain build never makes: no draw
            fresh = t.parameter_class(t.initializer(copy_initializer(init), shape, dtype), name=param.name, **flags)
        overrides = []
        for key, value in vars(param).items():
            other = vars(fresh).get(key, _MISSING)
            if type(value) in SCALARS:
                if type(other) is not type(value) or other != value:
                    overrides.append((key, value))
        return ("param", slot, copy_initializer(init), shape, dtype, param.name, flags, tuple(overrides))

    def _tensor(self, tensor):
        """A tensor __init__ computed (a rotary table): its values, read once,
        made again from host memory in each copy. Only plain tensors of a
        numpy dtype: what a copy gives is compared with the real build
        (values, dtype, shape, device) before it is used."""
        if type(tensor) is not self.t.tensor_class or tensor.has_init:
            raise Unclonable("a tensor")
        try:
            array = tensor.asnumpy()
        except Exception as exc:  # noqa: BLE001 - its op failed (no kernel here): the build keeps its own error
            raise Unclonable("a tensor that cannot be read") from exc
        if array.dtype.isbuiltin != 1 or self.t.numpy.dtype(array.dtype.str) != array.dtype:  # bf16: no numpy type
            raise Unclonable(f"a {tensor.dtype} tensor")
        slot = self._slot(tensor)
        return ("tensor", slot, array.tobytes(), array.dtype.str, tuple(array.shape), tensor.dtype)

    def _primitive(self, prim):
        slot = self._slot(prim)
        instance_name = vars(prim).get("instance_name")
        return ("prim", slot, type(prim), dict(prim.init_attrs), instance_name, id(prim))


def same_recipe(a, b) -> bool:
    """Two recipes describe the same build: same structure, shared values
    equal (scalars) or identical (objects), initializers of one class with
    equal fields; an object the second build shares with the first (held by
    both) matches the first's description of it."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple) and a and type(a[0]) is str:  # a node
        if a[0] in ("prim", "container") and b[0] == "share":
            return a[-1] == id(b[1])
        if a[0] != b[0] or len(a) != len(b):
            return False
        if a[0] == "share":
            return _same_value(a[1], b[1])
        if a[0] in ("prim", "container"):
            a, b = a[:-1], b[:-1]  # without the object ids
        return all(same_recipe(x, y) for x, y in zip(a[1:], b[1:]))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_recipe(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    return _same_value(a, b)


def _same_value(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in SCALARS:
        return a == b or a != a and b != b  # NaN
    if type(a) is tuple:
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "mindspore.common.initializer":
        return vars(a) == vars(b)
    return type(a).__module__.startswith("mindspore") and not hasattr(a, "__dict__") and a == b  # dtypes
