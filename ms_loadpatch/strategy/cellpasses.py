"""The per-cell passes of a transformers load after the build, without
mindspore's per-cell exception and attribute dispatch.

After the build, a load passes over every cell again: the init flag
(`_is_hf_initialized`, ms_loadpatch's stand-in for post_init's init pass),
mindone's `tie_weights` (`hasattr(cell, "_tie_weights")`, twice) and
`set_train(False)` (`add_flags`: `hasattr(cell, "_func_graph_flags")`, then
the flag dicts). A name a cell lacks falls through to
`nn.Cell.__getattr__`, which looks in four dicts and raises a formatted
AttributeError, and every write goes through `nn.Cell.__setattr__`'s type
dispatch, for every cell of the model. Here the same questions are
answered by looking where those methods look, and plain values are written
where `nn.Cell.__setattr__` would put them (the instance `__dict__`); a cell
whose class defines any of these names or overrides a method involved takes
mindspore's path for it.

That is knowledge of mindspore's code, so `probe()` checks it once per
process on the installed version: the methods name nothing else, and twin
trees (shared and repeated children, a None child, an overriding class)
answer and end up alike (building.state.model_state). A failed probe
leaves every pass to mindspore and status() says why;
MS_LOADPATCH_TECHNIQUES_OFF=cell-passes turns it off.
"""

from __future__ import annotations

from . import randomstate, switch, verdict
from .lane import entered, lane
from .probe_cache import ProbeCache

NAME = "cell-passes"
DESCRIPTION = (
    "the per-cell passes after a transformers build (the init flag, tie_weights' hasattr, "
    "set_train's flags) without nn.Cell.__getattr__'s raised miss or __setattr__'s dispatch"
)

# Where nn.Cell.__getattr__ looks a name up that normal lookup missed.
GETATTR_DICTS = ("_params", "_buffers", "_cells", "_params_list")
# Where nn.Cell.__setattr__ (through _set_attr_for_object) treats a plain value's name specially.
SETATTR_DICTS = ("_params", "_cells", "_buffers")
# The names the passes read or write on cells (a class defining the one asked about takes mindspore's path).
NAMES = ("_func_graph_flags", "_is_hf_initialized", "_tie_weights", "training")
# nn.Cell methods each pass reproduces: a class overriding one takes mindspore's path for it.
LOOKUP_METHODS = ("__getattr__", "__setattr__")
TRAIN_METHODS = LOOKUP_METHODS + (
    "add_flags",
    "add_flags_recursive",
    "cells",
    "name_cells",
    "_add_mixed_precision_flag",
)

# The global names each reproduced method may use (anything else is a side effect not reproduced).
KNOWN_NAMES = {
    "__getattr__": {"__dict__", "AttributeError", "format", "type", "__name__"},
    "__setattr__": {
        "isinstance",
        "Parameter",
        "ParameterTuple",
        "_set_attr_for_param_or_param_tuple",
        "_is_parameter_list_or_tuple",
        "_set_attr_for_parameter_in_list_or_tuple",
        "Cell",
        "_set_attr_for_cell",
        "_Buffer",
        "__dict__",
        "register_buffer",
        "Primitive",
        "set_prim_instance_name",
        "_primitives",
        "object",
        "__setattr__",
        "_set_attr_for_object",
    },
    "_set_attr_for_object": {
        "__dict__",
        "get",
        "isinstance",
        "Tensor",
        "set_data",
        "TypeError",
        "type",
        "__name__",
        "object",
        "__setattr__",
    },
    "set_train": {"_phase", "add_flags_recursive"},
    "add_flags_recursive": {"add_flags", "cells", "add_flags_recursive"},
    "add_flags": {"hasattr", "_func_graph_flags", "update", "__dict__", "_add_mixed_precision_flag"},
    "cells": {"name_cells", "values"},
    "name_cells": {"set", "OrderedDict", "_cells", "items", "add"},
}
# Plain values: nn.Cell.__setattr__ gives these to _set_attr_for_object (not Parameters, cells, tensors, lists).
_PLAIN_VALUES = (bool, int, str, dict)

_verdicts = ProbeCache()  # "twins": the reason or None
_plain: dict[tuple, bool] = {}  # (class, methods, names) -> plain


def switched_off() -> bool:
    return switch.is_off(NAME)


def active() -> bool:
    """Not switched off and the probe passed (it runs here the first time)."""
    return not switched_off() and probe() is None


def _is_plain(cls, methods, names) -> bool:
    """True when instances of `cls` look names up as nn.Cell does, use its
    own `methods`, and the class defines none of `names`."""
    key = (cls, methods, names)
    plain = _plain.get(key)
    if plain is None:
        from mindspore import nn

        own = vars(nn.Cell)
        plain = (
            cls.__getattribute__ is object.__getattribute__
            and all(getattr(cls, method, None) is own.get(method) for method in methods)
            and not any(name in vars(klass) for klass in cls.__mro__ for name in names)
        )
        _plain[key] = plain
    return plain


def _plain_for(cls, name: str) -> bool:
    """_is_plain(cls, LOOKUP_METHODS, (name,)), keyed for the per-cell calls below."""
    plain = _plain_names.get((cls, name))
    if plain is None:
        plain = _plain_names[(cls, name)] = _is_plain(cls, LOOKUP_METHODS, (name,))
    return plain


_plain_names: dict[tuple, bool] = {}  # (class, name) -> _plain_for


def has_attribute(cell, name: str) -> bool:
    """hasattr(cell, name), without raising on a plain cell that lacks it."""
    if not _plain_for(type(cell), name):
        return hasattr(cell, name)
    return _plain_has(cell, cell.__dict__, name)


def _plain_has(cell, instance_dict, name: str) -> bool:
    if name in instance_dict:
        return True
    for attr in GETATTR_DICTS:
        found = instance_dict.get(attr)
        if found is not None and name in found:
            return hasattr(cell, name)  # nn.Cell.__getattr__ finds it there
    return False


def set_plain(cell, name: str, value) -> None:
    """setattr(cell, name, value) for a plain value (bool, int, str, dict):
    into the instance `__dict__`, where nn.Cell.__setattr__ would end in
    object.__setattr__."""
    if not _plain_for(type(cell), name) or type(value) not in _PLAIN_VALUES:
        setattr(cell, name, value)
        return
    instance_dict = cell.__dict__
    for attr in SETATTR_DICTS:
        found = instance_dict.get(attr)
        if found is not None and name in found:
            setattr(cell, name, value)  # mindspore's own handling (or error) for a parameter / cell / buffer name
            return
    instance_dict[name] = value


def lookups():
    """(has_attribute, set_plain) for one pass: this module's when active, else hasattr and setattr."""
    return (has_attribute, set_plain) if active() else (hasattr, setattr)


def flag_value(cell, name: str):
    """getattr(cell, name, False), a plain cell's own flag read from its
    instance `__dict__` (where set_plain puts it), without nn.Cell.__getattr__'s raised miss."""
    if not _plain_for(type(cell), name):
        return hasattr(cell, name) and getattr(cell, name, False)
    instance_dict = cell.__dict__
    if name in instance_dict:
        return instance_dict[name]
    return _plain_has(cell, instance_dict, name) and getattr(cell, name, False)


class PlainFlag:
    """A flag a pass reads as `getattr(cell, name, False)` and sets as
    `setattr(cell, name, value)`, through flag_value and set_plain."""

    def __init__(self, name: str, value=True):
        self.name, self.value = name, value

    def is_set(self, cell):
        return flag_value(cell, self.name)

    def set(self, cell) -> None:
        set_plain(cell, self.name, self.value)

    def plain_state(self, cell):
        """On a plain cell: True when the flag is set; its instance `__dict__`
        when it is unset and `set` would only write it there (no parameter,
        cell or buffer of that name). None otherwise (is_set tells)."""
        name = self.name
        if not _plain_for(type(cell), name) or type(self.value) not in _PLAIN_VALUES:
            return None
        instance_dict = cell.__dict__
        if name in instance_dict:
            return True if instance_dict[name] else None
        for attr in GETATTR_DICTS:
            found = instance_dict.get(attr)
            if found is not None and name in found:
                return None
        return instance_dict


def set_train(root, mode: bool) -> None:
    """root.set_train(mode) as nn.Cell's: `_phase` on the root, then add_flags(training=mode)
    on every cell in add_flags_recursive's order (depth first, each cell's
    children once each as name_cells gives them, a cell shared by two parents
    flagged under both). A cell of a class that is not plain gets its own
    add_flags_recursive, as mindspore's recursion would call it."""
    root._phase = "train" if mode else "predict"
    flags = {"training": mode}
    stack = [root]
    plain = _plain
    while stack:
        cell = stack.pop()
        key = (type(cell), TRAIN_METHODS, NAMES)
        if not (plain[key] if key in plain else _is_plain(*key)):
            cell.add_flags_recursive(training=mode)
            continue
        instance_dict = cell.__dict__
        graph_flags = instance_dict.get("_func_graph_flags")  # a plain class: what `cell._func_graph_flags` reads
        if graph_flags is None:
            if not has_attribute(cell, "_func_graph_flags"):
                set_plain(cell, "_func_graph_flags", {})
            graph_flags = cell._func_graph_flags
        graph_flags.update(flags)
        instance_dict.update(flags)  # _add_mixed_precision_flag: nothing for `training`
        children = instance_dict.get("_cells")
        if children:
            unique, seen = [], set()
            for child in children.values():  # name_cells: not None, each cell once
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    unique.append(child)
            unique.reverse()
            stack += unique


def probe() -> str | None:
    """None when this module's passes match mindspore's on the installed version (run once,
    outside construction windows: a load asks before its build). Asked from
    inside the probe (a patched method it calls) or a window before it ran:
    not yet, so mindspore's path."""
    if lane.probing_cell_passes:
        return "the probe is running"
    from .building import window

    if window.state.depth and "twins" not in _verdicts:  # its cells would be built by the window's techniques
        return "not probed yet: a construction window is open"
    return _verdicts.get("twins", _probe_marked)


def _probe_marked() -> str | None:
    with entered("probing_cell_passes", True), randomstate.kept():
        return _probe()


def _code_problem(function, known: set) -> str | None:
    import inspect

    if callable(function):
        function = inspect.unwrap(function)  # mindspore's own, under a wrapper (set_train's is ms_loadpatch's)
    unknown = verdict.unknown_globals(function, known)
    if unknown is None:
        return f"{getattr(function, '__qualname__', function)} is not a Python function"
    if unknown:
        return f"nn.Cell.{function.__code__.co_name} refers to {', '.join(unknown)}"
    return None


def _probe() -> str | None:
    try:
        from mindspore import nn

        own = vars(nn.Cell)
        for method, known in KNOWN_NAMES.items():
            problem = _code_problem(own.get(method), known)
            if problem is not None:
                return f"{problem}: not reproduced here"
        private = {c for c in own["__getattr__"].__code__.co_consts if isinstance(c, str) and c.startswith("_")}
        if private != set(GETATTR_DICTS):
            return f"nn.Cell.__getattr__ looks in {', '.join(sorted(private))}, not {', '.join(GETATTR_DICTS)}"
        return _compare_twins(nn)
    except Exception as exc:  # an internal it relies on changed
        return f"{type(exc).__name__}: {exc}"


def _probe_tree(nn):
    """A tree touching every case: flags already there or not, a shared cell
    (two parents), a repeated child, a None child, an empty CellList, a
    class overriding add_flags, names in the dicts nn.Cell.__getattr__ reads."""
    import mindspore as ms
    import numpy as np

    class Flagging(nn.Cell):
        def add_flags(self, **flags):
            self.seen = sorted(flags)
            return super().add_flags(**flags)

    class Tied(nn.Cell):
        def _tie_weights(self):
            pass

    shared = nn.Dense(2, 2)
    root = nn.Cell()
    root.first = nn.SequentialCell([shared, nn.ReLU(), shared])
    root.second = nn.CellList([shared, nn.CellList(), Flagging(), Tied()])
    root.second[2].inner = nn.Dense(2, 2)
    root.dropped = nn.Dense(2, 2)
    root.dropped = None  # stays in _cells as None
    root.register_buffer("_tie_weights", ms.Tensor(np.zeros(1, np.float32)))  # found by __getattr__
    root.first.add_flags(training=True)  # a cell with its flag dict already made
    return root


def _compare_twins(nn) -> str | None:
    from .building.state import first_difference, model_state

    real, fast = _probe_tree(nn), _probe_tree(nn)
    for (_, a), (_, b) in zip(real.cells_and_names(), fast.cells_and_names()):
        for name in NAMES + ("_params", "missing"):
            if hasattr(a, name) != has_attribute(b, name):
                return f"has_attribute({type(b).__name__}, {name!r}) differs from hasattr"
        if not getattr(a, "_is_hf_initialized", False):
            a._is_hf_initialized = True
        if not (has_attribute(b, "_is_hf_initialized") and getattr(b, "_is_hf_initialized", False)):
            set_plain(b, "_is_hf_initialized", True)
    cell_set_train = vars(nn.Cell)["set_train"]
    cell_set_train = getattr(cell_set_train, "__wrapped__", cell_set_train)  # mindspore's, not ms_loadpatch's wrapper
    for mode in (False, True):
        cell_set_train(real, mode)
        set_train(fast, mode)
        expected, got = model_state(real), model_state(fast)
        if expected != got:
            return f"set_train({mode}) leaves a tree unlike nn.Cell's: {first_difference(expected, got)}"
    return None


def technique_status(libraries: list) -> verdict.TechniqueRow:
    """status()'s row, for the `libraries` whose glue uses these passes; runs the probe."""
    if switched_off():
        return verdict.row_off(NAME, libraries, DESCRIPTION)
    return verdict.row(NAME, libraries, DESCRIPTION, probe(), passed="probe passed: twin trees answer and end up alike")
