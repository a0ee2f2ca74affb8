"""Building cells and parameters with less Python work, producing the same objects.

Entered inside the lazy-construction window (construct.lazy_construction and
the from_config wrappers), under CONSTRUCTION_LOCK, for the building thread
only: each technique swaps one mindspore function for a dispatcher that runs
the fast version in the building thread and the original everywhere else,
and the originals are put back in `finally` when the outermost window closes.

Every technique has a probe that runs once per process on the installed
mindspore: the small probe model is built plain and with the techniques
(all together first; only if that differs, each alone to find which), and
the full state of both is compared (every cell's class,
`__dict__` keys in order and values, parameter metadata, primitive
attributes, global registries). A failed probe skips the technique;
`technique_status()` says which and why. `MS_LOADPATCH_TECHNIQUES_OFF` turns
techniques off by name (comma-separated, or `all`).

Per-instance values that legitimately differ between two builds of the same
model (with or without a technique): `Cell._create_time` (a clock reading)
and object ids.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import types

from ..activation import env_int

ENV_VAR = "MS_LOADPATCH_TECHNIQUES_OFF"
# A build's first cells are plain; the probes run and the techniques engage at
# this cell (0: from the first). Below it the probes (~0.2 s) cost more than
# the techniques save (~0.15 ms a cell): a dense model of a few hundred cells.
START_ENV_VAR = "MS_LOADPATCH_FAST_CONSTRUCTION_FROM"
DEFAULT_START = 1000
ACTIVE, SKIPPED, OFF = "active", "skipped", "off"

# The thread whose construction takes the fast paths (None: no window open).
# Set and cleared under CONSTRUCTION_LOCK, by the outermost window only.
_builder: int | None = None
_depth = 0
# Cells the last outermost window had built when its techniques engaged (None: never).
engaged_at: int | None = None
_state_lock = threading.Lock()


def window_open() -> bool:
    return _depth > 0


def _building() -> bool:
    return _builder == threading.get_ident()


class _DeferredInstanceCount:
    """`Cell.total_instance_count += 1` rewrites a class attribute of nn.Cell,
    and CPython then invalidates the attribute cache of every subclass (some
    5,000 once mindone is imported): about 36 us per cell. The fast paths
    count their cells here and add them to the class attribute once, when
    their technique is uninstalled (the window's `finally`); only its value
    during the build differs (mindspore reads it when compiling a jit
    function, not while building)."""

    def __init__(self):
        self.pending = 0

    def flush(self, cell_class):
        pending, self.pending = self.pending, 0
        if pending:
            cell_class.total_instance_count += pending


class ProbeFailed(Exception):
    """The fast path cannot be shown to match mindspore's on this install."""


# -- technique 1: Cell.__init__ from a template


class CellInitTemplate:
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
    # Everything Cell.__init__ may refer to (2.7.0 - 2.10.0). Any other name
    # there is a side effect this technique would not reproduce: skipped.
    KNOWN_NAMES = frozenset({
        "Cell", "Cell_", "OrderedDict", "__init__", "__setattr__", "_cell_tag", "add_flags", "cells_compile_cache",
        "compile_cache", "getenv", "hasattr", "id", "init_pipeline", "int", "logger", "os", "super", "time",
        "total_instance_count", "warning", "setattr", "object", "dict", "set", "list",
    })
    PER_INSTANCE_TIME = "_create_time"
    _SCALARS = (type(None), bool, int, float, str)

    def __init__(self):
        self.original = None
        self.template = None
        self.fresh = ()
        self.plain_classes: dict[type, bool] = {}
        self.count = _DeferredInstanceCount()

    def prepare(self):
        from mindspore import nn

        cell_class = nn.Cell
        original = vars(cell_class).get("__init__")
        code = getattr(original, "__code__", None)
        if code is None:
            raise ProbeFailed("nn.Cell.__init__ is not a Python function")
        unknown = sorted(set(code.co_names) - self.KNOWN_NAMES)
        if unknown:
            raise ProbeFailed(f"nn.Cell.__init__ refers to {', '.join(unknown)}: side effects this technique does "
                              "not reproduce")
        module = original.__globals__
        for needed in ("Cell_", "cells_compile_cache", "init_pipeline"):
            if needed not in module:
                raise ProbeFailed(f"nn.Cell.__init__'s module has no {needed}")

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
        self.cell_base = module["Cell_"]
        self.compile_cache = module["cells_compile_cache"]
        self.init_pipeline = module["init_pipeline"]
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
            if (_builder != threading.get_ident() or flags or not technique._plain(type(self))
                    or environ.get("GC_COLLECT_IN_CELL") == "1"):
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
        cell_class.__init__ = __init__
        return True

    def uninstall(self):
        self.cell_class.__init__ = self.original
        self.count.flush(self.cell_class)


# -- technique 2: inspect.signature cached per function in the primitive / cell decorators


class _CachedSignatureInspect:
    """Stands for the `inspect` module in mindspore's decorator modules:
    `signature(fn)` comes from a per-function cache in the building thread
    (a Signature is immutable; the cache entry is checked against the
    function's code and defaults), the real `inspect` everywhere else."""

    def __init__(self, real):
        self._real = real
        self._cache: dict = {}

    def __getattr__(self, name):
        return getattr(self._real, name)

    def signature(self, fn, *args, **kwargs):
        if args or kwargs or _builder != threading.get_ident() or type(fn) is not types.FunctionType:
            return self._real.signature(fn, *args, **kwargs)
        entry = self._cache.get(fn)
        if entry is not None and entry[0] is fn.__code__ and entry[1] is fn.__defaults__ \
                and entry[2] is fn.__kwdefaults__:
            return entry[3]
        result = self._real.signature(fn)
        self._cache[fn] = (fn.__code__, fn.__defaults__, fn.__kwdefaults__, result)
        return result


class SignatureCache:
    """`prim_attr_register` / `prim_arg_register` (every Primitive built from
    Python, e.g. the MatMul of each Dense and the Load of each Parameter) and
    `cell_attr_register` call `inspect.signature(__init__)` per instance; the
    Signature of a function is the same every time, so it is cached."""

    name = "signature-cache"
    description = "inspect.signature cached per __init__ in mindspore's primitive and cell decorators"

    def __init__(self):
        self.modules = []
        self.shims = []

    def prepare(self):
        import inspect

        from mindspore import nn, ops

        modules = []
        for label, fn in (("prim_attr_register", getattr(ops, "prim_attr_register", None)),
                          ("prim_arg_register", getattr(ops, "prim_arg_register", None)),
                          ("nn.Dense.__init__ (cell_attr_register)", vars(nn.Dense).get("__init__"))):
            module = getattr(fn, "__globals__", None)
            if module is None or module.get("inspect") is not inspect:
                raise ProbeFailed(f"{label}'s module does not use the inspect module by that name")
            if all(m is not module for m in modules):
                modules.append(module)
        self.modules = modules
        self.shims = [_CachedSignatureInspect(inspect) for _ in modules]

    def install(self):
        if any(module.get("inspect") is not shim._real for module, shim in zip(self.modules, self.shims)):
            return False
        for module, shim in zip(self.modules, self.shims):
            module["inspect"] = shim
        return True

    def uninstall(self):
        for module, shim in zip(self.modules, self.shims):
            module["inspect"] = shim._real


# -- technique 3: the parameter-name walk without nested generators


class FlatNameWalk:
    """Assigning a child cell calls `update_parameters_name(prefix)`, which
    walks the child's whole subtree through recursive generators
    (`parameters_and_names` over `cells_and_names`): nested cells re-walk
    their subtrees at every level. The fast version walks the same cells in
    the same order with one explicit stack (same dedup of cells and
    parameters, same names, same `is_init` reset). Any cell in the subtree
    whose class overrides the walk methods takes mindspore's own path."""

    name = "flat-name-walk"
    description = "Cell.update_parameters_name walks the subtree with one stack instead of nested generators"
    KNOWN_NAMES = frozenset({"Validator", "check_str_and_none_by_regular", "parameters_and_names", "is_init",
                             "name"})

    def prepare(self):
        from mindspore import nn

        cell_class = nn.Cell
        original = vars(cell_class).get("update_parameters_name")
        code = getattr(original, "__code__", None)
        if code is None:
            raise ProbeFailed("nn.Cell.update_parameters_name is not a Python function")
        unknown = sorted(set(code.co_names) - self.KNOWN_NAMES)
        if unknown:
            raise ProbeFailed(f"nn.Cell.update_parameters_name refers to {', '.join(unknown)}")
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
            plain = (getattr(cls, "cells_and_names", None) is cells_and_names
                     and getattr(cls, "parameters_and_names", None) is parameters_and_names)
            self.plain_classes[cls] = plain
        return plain

    def _walk(self, root):
        """(name, parameter) as root.parameters_and_names() yields them, or None
        when a cell of the subtree overrides how it is walked."""
        plain = self._plain
        if not plain(type(root)):
            return None
        seen_cells, seen_params, out = set(), set(), []
        stack = [("", root)]
        while stack:
            cell_name, cell = stack.pop()
            if cell in seen_cells:
                continue
            seen_cells.add(cell)
            for par_name, par in cell._params.items():
                if par is not None and par.inited_param is not None:
                    par = par.inited_param
                if par is not None and id(par) not in seen_params:
                    seen_params.add(id(par))
                    out.append((cell_name + "." + par_name if cell_name else par_name, par))
            children = []
            for child_name, child in cell._cells.items():
                if child:  # truthiness as cells_and_names tests it (an empty CellList is skipped)
                    if not plain(type(child)):
                        return None
                    children.append((cell_name + "." + child_name if cell_name else child_name, child))
            stack.extend(reversed(children))
        return out

    def install(self):
        if vars(self.cell_class).get("update_parameters_name") is not self.original:
            return False
        technique, original, check_prefix = self, self.original, self.check_prefix

        def update_parameters_name(self, prefix="", recurse=True):
            if _builder != threading.get_ident() or recurse is not True:
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
        self.cell_class.update_parameters_name = update_parameters_name
        return True

    def uninstall(self):
        self.cell_class.update_parameters_name = self.original


# -- technique 4: no cyclic garbage collection while the model is built (and loaded)


# Holders of the pause (construction windows, whole loads, in any thread):
# collection resumes when the last one leaves, and only if ms_loadpatch paused it.
_gc_lock = threading.Lock()
_gc_holders = 0
_gc_paused = False


def _hold_collection_pause() -> bool:
    """One more holder; True when collection is paused by ms_loadpatch (False:
    the application had disabled gc itself, and it is left to it)."""
    import gc

    global _gc_holders, _gc_paused
    with _gc_lock:
        if _gc_holders == 0 and gc.isenabled():
            gc.disable()
            _gc_paused = True
        _gc_holders += 1
        return _gc_paused


def _release_collection_pause() -> None:
    import gc

    global _gc_holders, _gc_paused
    with _gc_lock:
        _gc_holders -= 1
        if _gc_holders == 0 and _gc_paused:
            _gc_paused = False
            gc.enable()


class GcPause:
    """Building a model allocates hundreds of thousands of container objects;
    each allocation burst triggers a cyclic collection, and the full ones
    rescan every object of the process (mindone's imports alone are some
    300k). Collection is paused while the model is built and resumed when
    the window closes. This one is process-wide, not per thread: other
    threads' cyclic garbage waits for the end of the window (objects, values
    and reference-counted freeing are unchanged). Left alone when the
    application has disabled gc itself."""

    name = "gc-pause"
    description = "cyclic garbage collection paused while the model is built and loaded (process-wide; nothing else changes)"

    def __init__(self):
        self.paused = False

    def prepare(self):
        import gc

        if not all(callable(getattr(gc, f, None)) for f in ("isenabled", "disable", "enable")):
            raise ProbeFailed("the gc module lacks isenabled / disable / enable")

    def install(self):
        if not _hold_collection_pause():
            _release_collection_pause()
            return False
        self.paused = True
        return True

    def uninstall(self):
        if self.paused:
            self.paused = False
            _release_collection_pause()


@contextlib.contextmanager
def collection_paused_for_load():
    """gc-pause over a whole accelerated load, from its first line to its
    last: after the build, mindone's key checks, `tie_weights` and `set_train`
    walk ~30k cells of a many-expert model, and the full collections their
    allocations trigger rescan everything (~1.5 s of a 6.4 s MoE load).
    Yields whether collection is paused; `MS_LOADPATCH_TECHNIQUES_OFF=gc-pause`
    leaves gc alone. Pausing changes no object, so it needs no probe build."""
    if GcPause.name in switched_off():
        yield False
        return
    paused = _hold_collection_pause()
    try:
        yield paused
    finally:
        _release_collection_pause()


# -- technique 5: siblings built with the same arguments are copied from the first


class _Unclonable(Exception):
    """Something in a freshly built cell this technique does not know how to copy."""


class SiblingClone:
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
    builds shared (the config, a module-level primitive). Tensors, non-lazy
    parameters, closures, bound methods and unknown objects in the cell,
    arguments other than scalars and config-like objects, and classes outside
    mindspore / mindone leave the build to `__init__`. A config is matched by
    identity, by the identities of its attributes and by their values at
    each call (a config changed between builds starts the learning over)."""

    name = "sibling-clone"
    description = ("cells built again with the same arguments (each expert of a MoE layer) copied from a recipe "
                   "checked against real builds")
    _SCALARS = (type(None), bool, int, float, complex, str, bytes)
    # A cell whose first build copied this many cells from recipes (an MoE
    # block of copied experts) gets no recipe of its own: learning one costs
    # two more compiles, a copy and two state comparisons of its whole subtree
    # (0.6 s for a 128-expert block), and a copy of it saves only the
    # per-expert calls (~5 ms a block).
    COPIES_INSIDE_LIMIT = 16

    def __init__(self):
        self.hooked: dict = {}
        self.entries: dict = {}
        self.cloned = 0
        self.count = _DeferredInstanceCount()

    def prepare(self):
        import mindspore as ms
        from mindspore import nn
        from mindspore.common import dtype as mstype
        from mindspore.common.initializer import Initializer, initializer
        from mindspore.ops.primitive import Primitive

        original = vars(nn.Cell).get("__init__")
        module = getattr(original, "__globals__", {})
        for needed in ("Cell_", "cells_compile_cache", "init_pipeline"):
            if needed not in module:
                raise ProbeFailed(f"nn.Cell.__init__'s module has no {needed}")
        if "init_attrs" not in vars(Primitive(name="ms_loadpatch_probe")):
            raise ProbeFailed("Primitive keeps no init_attrs")
        self.cell_class, self.parameter_class, self.tensor_class = nn.Cell, ms.Parameter, ms.Tensor
        self.primitive_class, self.initializer_class, self.initializer = Primitive, Initializer, initializer
        self.dtype_class = mstype.Type
        self.cell_base, self.compile_cache = module["Cell_"], module["cells_compile_cache"]
        self.init_pipeline = module["init_pipeline"]

    # installation: Cell.__init__ notices each class; its own __init__ is wrapped for the window

    def install(self):
        cell_class = self.cell_class
        current = vars(cell_class).get("__init__")
        if current is None:
            return False
        technique, hooked = self, self.hooked

        def __init__(cell, *args, **kwargs):
            if _builder == threading.get_ident():
                cls = type(cell)
                if cls not in hooked:
                    technique._hook(cls, current)
            return current(cell, *args, **kwargs)

        __init__.__wrapped__ = current
        __init__.__doc__ = current.__doc__
        self.base_init, self.base_dispatcher = current, __init__
        self.entries.clear()
        cell_class.__init__ = __init__
        return True

    def uninstall(self):
        for cls, (had_own, previous, wrapper) in list(self.hooked.items()):
            if wrapper is not None and vars(cls).get("__init__") is wrapper:
                if had_own:
                    cls.__init__ = previous
                else:
                    delattr(cls, "__init__")
        self.hooked.clear()
        self.entries.clear()
        if vars(self.cell_class).get("__init__") is self.base_dispatcher:
            self.cell_class.__init__ = self.base_init
        self.count.flush(self.cell_class)

    def _hook(self, cls, base_init):
        init = cls.__init__
        if init is self.base_dispatcher or init is base_init:
            self.hooked[cls] = (False, None, None)  # nothing but Cell.__init__ to skip
            return
        had_own = "__init__" in vars(cls)
        previous = vars(cls).get("__init__")
        technique = self

        def wrapper(cell, *args, **kwargs):
            if _builder != threading.get_ident() or type(cell) is not cls:
                return init(cell, *args, **kwargs)
            return technique._build(cls, init, cell, args, kwargs)

        wrapper.__wrapped__ = init
        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(wrapper, attribute, getattr(init, attribute, None))
        self.hooked[cls] = (had_own, previous, wrapper)
        cls.__init__ = wrapper

    # matching calls

    def _key(self, cls, args, kwargs):
        """A hashable key of the call, and the configs' items to check at reuse; None: not matchable."""
        parts, configs = [cls], []
        for value in (*args, *(v for _, v in sorted(kwargs.items()))):
            kind = type(value)
            if kind in self._SCALARS:
                parts.append((kind, value))
            elif kind is tuple and all(type(v) in self._SCALARS for v in value):
                parts.append((kind, value))
            elif isinstance(value, (self.cell_class, self.tensor_class, self.primitive_class)) \
                    or not hasattr(value, "__dict__") or isinstance(value, type):
                return None
            else:
                items = list(vars(value).items())
                parts.append(("object", id(value), tuple(id(v) for _, v in items)))
                configs.append((value, items))
        if kwargs:
            parts.append(tuple(sorted(kwargs)))
        parts.append(len(args))
        return tuple(parts), configs

    @staticmethod
    def _config_snapshot(configs):
        import copy

        return [(value, [(k, copy.deepcopy(v) if type(v) in (dict, list, set) else v) for k, v in items])
                for value, items in configs]

    @staticmethod
    def _configs_unchanged(snapshot) -> bool:
        return all(list(vars(value).items()) == items for value, items in snapshot)

    def _build(self, cls, init, cell, args, kwargs):
        try:
            keyed = self._key(cls, args, kwargs)
        except TypeError:  # an unhashable scalar-looking value
            keyed = None
        if keyed is None:
            return init(cell, *args, **kwargs)
        key, configs = keyed
        entry = self.entries.get(key)
        if entry is not None and entry[0] == "never":  # learnt: this class and call are built by __init__
            return init(cell, *args, **kwargs)
        if entry is not None and entry[0] == "recipe" and self._configs_unchanged(entry[2]):
            self._fill_root(cell, entry[1])
            self.cloned += 1
            return None
        if entry is None:  # a call seen once (e.g. a layer with its own index) is not worth a recipe
            copies_before = self.cloned
            init(cell, *args, **kwargs)
            mostly_copies = self.cloned - copies_before >= self.COPIES_INSIDE_LIMIT
            self.entries[key] = ("never" if mostly_copies else "seen", None, None)
            return None
        snapshot = self._config_snapshot(configs)
        init(cell, *args, **kwargs)
        if entry[0] in ("seen", "recipe"):  # second build, or the config changed: (re)start learning
            self.entries[key] = ("first", self._compile(cell, keep=True), snapshot)
        elif entry[0] == "first" and self._configs_unchanged(snapshot) and entry[2] == snapshot:
            self.entries[key] = self._learn(cell, entry[1], snapshot)
        return None

    # recipes

    def _compile(self, cell, keep=False, first=None):
        """The recipe of `cell`; with `keep`, (recipe, the objects it describes: kept alive for the
        second build, which shares what both builds hold, e.g. a module-level primitive)."""
        try:
            compiler = _Compiler(self, cell, shared=first[1] if first is not None else ())
            recipe = compiler.compile()
        except _Unclonable:
            return None
        return (recipe, {id(o): o for o in compiler.keep}) if keep else recipe

    def _learn(self, cell, first, snapshot):
        """The entry for a class and its arguments after a second real build:
        a recipe when both builds gave the same recipe and a copy made from
        it equals the second cell, else "never" (built by its own __init__)."""
        recipe = self._compile(cell, first=first) if first is not None else None
        if recipe is None or not _same_recipe(first[0], recipe):
            return ("never", None, snapshot)
        try:
            copy = type(cell).__new__(type(cell))
            self._fill_root(copy, recipe)
            same = model_state(copy) == model_state(cell)
        except Exception:
            return ("never", None, snapshot)
        return ("recipe", recipe, snapshot) if same else ("never", None, snapshot)

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
            param = self.parameter_class(self.initializer(_copy_initializer(init), shape, dtype), name=name, **flags)
            for attribute, value in overrides:
                setattr(param, attribute, value)
            made[slot] = param
            return param
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


def _copy_initializer(init):
    copy = object.__new__(type(init))
    copy.__dict__.update({k: (dict(v) if type(v) is dict else v) for k, v in vars(init).items()})
    return copy


class _Compiler:
    """The recipe of a freshly built cell: per-instance objects described,
    everything else shared; raises _Unclonable for what it cannot copy."""

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

    def compile(self):
        recipe = self._cell(self.root)
        if self.referenced & self.unrecorded:
            raise _Unclonable("an empty container referred to twice")
        return recipe

    def _cell(self, cell):
        """(class, slot, shared values by key in __dict__ order, empty containers to make, objects to build)."""
        if type(cell).__module__.split(".", 1)[0] not in _CLONABLE_PACKAGES:
            raise _Unclonable(f"{type(cell).__qualname__} is not mindspore's or mindone's")
        slot = self._slot(cell)
        shared, fresh, built = {}, [], []
        for key, value in vars(cell).items():
            item = ("time",) if key == CellInitTemplate.PER_INSTANCE_TIME else self._item(value)
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
        if kind in SiblingClone._SCALARS or isinstance(value, t.dtype_class):
            return ("share", value)
        if isinstance(value, t.cell_class):
            return ("cell", self._cell(value))
        if isinstance(value, t.parameter_class):
            return self._parameter(value)
        if isinstance(value, t.tensor_class):
            raise _Unclonable("a tensor")
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
                if not all(type(k) in SiblingClone._SCALARS for k, _ in entries):
                    raise _Unclonable("a dict with object keys")
            return ("container", slot, kind, entries, id(value))
        if isinstance(value, type) or kind.__name__ in ("function", "builtin_function_or_method") \
                and getattr(value, "__closure__", None) is None and getattr(value, "__self__", None) in (None,) \
                or kind.__name__ == "builtin_function_or_method" and not hasattr(getattr(value, "__self__", None), "__dict__"):
            return ("share", value)
        raise _Unclonable(f"a {kind.__qualname__}")

    def _parameter(self, param):
        t = self.t
        init_tensor = param.init_mode
        init = getattr(init_tensor, "init", None)
        if not param.has_init or init is None or type(init).__dict__.get("__slots__") \
                or not isinstance(init, t.initializer_class):
            raise _Unclonable("a parameter that is not lazy")
        if any(type(v) not in SiblingClone._SCALARS for v in vars(init).values() if type(v) is not dict):
            raise _Unclonable("an initializer holding objects")
        slot = self._slot(param)
        flags = dict(requires_grad=param.requires_grad, layerwise_parallel=param.layerwise_parallel,
                     parallel_optimizer=param.parallel_optimizer)
        shape, dtype = tuple(init_tensor.shape), init_tensor.dtype
        fresh = t.parameter_class(t.initializer(_copy_initializer(init), shape, dtype), name=param.name, **flags)
        overrides = []
        for key, value in vars(param).items():
            other = vars(fresh).get(key, _MISSING)
            if type(value) in SiblingClone._SCALARS:
                if type(other) is not type(value) or other != value:
                    overrides.append((key, value))
        return ("param", slot, _copy_initializer(init), shape, dtype, param.name, flags, tuple(overrides))

    def _primitive(self, prim):
        slot = self._slot(prim)
        instance_name = vars(prim).get("instance_name")
        return ("prim", slot, type(prim), dict(prim.init_attrs), instance_name, id(prim))


def _same_recipe(a, b) -> bool:
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
        return all(_same_recipe(x, y) for x, y in zip(a[1:], b[1:]))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_recipe(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    return _same_value(a, b)


def _same_value(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in SiblingClone._SCALARS:
        return a == b or a != a and b != b  # NaN
    if type(a) is tuple:
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "mindspore.common.initializer":
        return vars(a) == vars(b)
    return type(a).__module__.startswith("mindspore") and not hasattr(a, "__dict__") and a == b  # dtypes


# Only these libraries' cells are copied: their constructors are exercised by
# the identity suites; a user's own cell class is always built by its __init__.
_CLONABLE_PACKAGES = frozenset({"mindspore", "mindone", "ms_loadpatch"})  # ms_loadpatch: the probe's cells
_MISSING = object()
_ORDERED_DICTS = (__import__("collections").OrderedDict,)


TECHNIQUES = (CellInitTemplate(), SignatureCache(), FlatNameWalk(), SiblingClone(), GcPause())


# -- probes


def _probe_model():
    """A small model touching what the techniques change: mindspore layers
    with primitives and initializers, containers, nested cells with
    parameters, a tied parameter, a cell without auto_prefix, a Parameter
    from a tensor, a buffer, a cell with bprop, a child replaced later."""
    import mindspore as ms
    from mindspore import Parameter, mint, nn, ops
    from mindspore.common.initializer import initializer

    class Leaf(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(4, 3)
            self.linear = mint.nn.Linear(3, 5, bias=False)
            self.norm = nn.LayerNorm((5,))
            self.scale = Parameter(ops.ones(5), name="scale")
            self.gain = Parameter(initializer("normal", [5]), name="gain", requires_grad=False)
            self.act = nn.GELU()
            self.matmul = ops.MatMul(transpose_b=True)

        def construct(self, x):
            return self.norm(self.linear(self.dense(x))) * self.scale

    class WithBprop(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.inner = nn.Dense(3, 3, has_bias=False)

        def construct(self, x):
            return self.inner(x)

        def bprop(self, x, out, dout):
            return (dout,)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 4)
            self.blocks = nn.CellList([Leaf() for _ in range(2)])
            self.seq = nn.SequentialCell([nn.Dense(5, 5), nn.ReLU(), Leaf().dense])
            self.unprefixed = WithBprop()
            self.head = nn.Dense(4, 16, has_bias=False)
            self.head.weight = self.embed.embedding_table  # tied
            self.conv = nn.Conv2d(2, 2, 3)
            self.register_buffer("positions", ms.Tensor([1, 2, 3], ms.int32))
            self.replaced = nn.Dense(2, 2)
            self.replaced = nn.Dense(2, 3)
            self.inner_list = nn.CellList()
            self.inner_list.append(Leaf())
            self.tail = _LateParam()
            settings = Settings()
            # a class's first build is its own, its second is noted, the next two teach the recipe, then copies
            self.experts = nn.CellList([Expert(settings) for _ in range(5)] + [Expert(settings, scale=1)])

        def construct(self, x):
            return x

    class Settings:  # a config object, as transformers passes to every layer
        def __init__(self):
            self.width, self.act = 3, "gelu"
            self.sizes = [3, 5]

    class Expert(nn.Cell):  # built several times with the same arguments: sibling-clone copies it
        def __init__(self, settings, scale=2):
            super().__init__()
            self.settings = settings
            self.width = settings.width * scale
            self.up = mint.nn.Linear(settings.width, self.width, bias=False)
            self.down = nn.Dense(self.width, settings.width)
            self.act = nn.GELU() if settings.act == "gelu" else nn.ReLU()
            self.sizes = list(settings.sizes)
            self.pair = nn.CellList([mint.nn.Linear(2, 2), mint.nn.Linear(2, 2)])

        def construct(self, x):
            return self.down(self.act(self.up(x)))

    class _LateParam(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = nn.Dense(2, 2)
            self.a.extra = Parameter(initializer("zeros", [2]), name="extra")

    return Model()


def _normal(value, ids: dict, depth=0):
    """A comparable rendering of `value`: objects by structure, identity kept as first-seen order."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.ops.primitive import Primitive

    if depth > 12:
        return ("deep", type(value).__name__)
    if isinstance(value, (type(None), bool, int, float, str, bytes)):
        return value
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    key = id(value)
    if key in ids:
        return ("same-as", ids[key][0])
    ids[key] = (len(ids), value)  # the object is kept: its id cannot be reused while ids lives
    if isinstance(value, nn.Cell):
        return ("cell", ids[key][0])  # cells are compared one by one
    if isinstance(value, ms.Parameter):
        init_mode = value.init_mode
        return ("param", type(value).__name__, value.name, tuple(value.shape), str(value.dtype), value.requires_grad,
                value.has_init, value.layerwise_parallel, value.parallel_optimizer, value.is_init, value.init_flag,
                value.requires_aggr, value.sliced,
                _normal(getattr(init_mode, "init", None), ids, depth + 1) if init_mode is not None else None,
                _normal(vars(value), ids, depth + 1))
    if isinstance(value, ms.Tensor):
        if value.has_init:
            return ("lazy-tensor", tuple(value.shape), str(value.dtype), _normal(value.init, ids, depth + 1))
        return ("tensor", tuple(value.shape), str(value.dtype), value.asnumpy().tobytes())
    if isinstance(value, Primitive):
        return ("primitive", type(value).__qualname__, value.name, _normal(vars(value), ids, depth + 1))
    if isinstance(value, dict):
        return (type(value).__name__, [(k, _normal(v, ids, depth + 1)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_normal(v, ids, depth + 1) for v in value])
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(repr(_normal(v, ids, depth + 1)) for v in value))
    if hasattr(value, "__dict__"):
        return ("object", type(value).__module__, type(value).__qualname__,
                _normal(vars(value), ids, depth + 1))
    text = repr(value)
    if " at 0x" in text:  # an opaque object (e.g. a C++ ParamInfo): its content is compared through its owner
        return ("opaque", type(value).__qualname__)
    return ("repr", type(value).__qualname__, text)


def model_state(model, skip=(CellInitTemplate.PER_INSTANCE_TIME,)) -> list:
    """Every cell (preorder, shared ones once): name, class, flags, `__dict__`
    keys in order and values (cells by position, parameters and primitives by
    content); `skip`: documented per-instance values."""
    ids: dict = {}
    cells = list(model.cells_and_names())
    for position, (_, cell) in enumerate(cells):
        ids[id(cell)] = (position, cell)
    out = []
    for name, cell in cells:
        state = [(k, "<per-instance>" if k in skip else _normal(v, ids)) for k, v in vars(cell).items()]
        mixed = getattr(cell, "get_mixed_precision_type", None)  # C++ side of the cell (flags live in __dict__)
        out.append((name, type(cell).__qualname__, cell.cls_name, cell._cell_tag,
                    repr(mixed()) if callable(mixed) else None, state))
    params = [(n, _normal(p, {})) for n, p in model.parameters_and_names()]
    return [out, params]


def _registries():
    from mindspore import nn

    module = vars(nn.Cell)["__init__"].__globals__ if "__init__" in vars(nn.Cell) else {}
    cache = module.get("cells_compile_cache")
    return nn.Cell.total_instance_count, (len(cache) if isinstance(cache, dict) else None), len(nn.Cell.global_cells)


@contextlib.contextmanager
def _no_cyclic_collection():
    """Registry counts must not depend on when earlier cyclic garbage goes (Cell.__del__ counts down)."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_probe(techniques=()):
    from .construct import CONSTRUCTION_LOCK, lazy_construction

    with CONSTRUCTION_LOCK, lazy_construction(fast=False), \
            (contextlib.nullcontext() if any(isinstance(t, GcPause) for t in techniques) else _no_cyclic_collection()):
        before = _registries()
        with _window(lambda: list(techniques), record=False):
            model = _probe_model()
        after = _registries()
    registered = _compile_cache_entries(model)
    return model, tuple(a - b if a is not None and b is not None else None for a, b in zip(after, before)), registered


def _compile_cache_entries(model):
    from mindspore import nn

    cache = vars(nn.Cell)["__init__"].__globals__.get("cells_compile_cache") if "__init__" in vars(nn.Cell) else None
    if not isinstance(cache, dict):
        return None
    return [id(cell) in cache and cache[id(cell)] is cell._compile_cache for _, cell in model.cells_and_names()]


def _probe_output(model):
    """The output of the probe model's first leaf once its lazy weights get fixed values."""
    import numpy as np
    import mindspore as ms

    leaf = model.blocks[0]
    for _, param in leaf.parameters_and_names():
        value = ms.Tensor(np.linspace(-1, 1, int(np.prod(param.shape)), dtype=np.float32).reshape(param.shape))
        param.set_data(value.astype(param.dtype))
    x = ms.Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    return leaf(x).asnumpy()


_reference = None  # the plain probe model's (state, registry deltas, compile-cache entries, output): once per process


def _plain_reference():
    global _reference
    if _reference is None:
        model, delta, registered = _build_probe()
        state = model_state(model)
        _reference = (state, delta, registered, _probe_output(model))
    return _reference


def _prepare(technique) -> str | None:
    try:
        technique.prepare()
    except ProbeFailed as exc:
        return str(exc)
    except Exception as exc:  # a layout this technique does not know
        return f"{type(exc).__name__}: {exc}"
    return None


def _compare(techniques) -> str | None:
    """None when the probe model built with `techniques` equals the plain one."""
    import numpy as np

    try:
        ref_state, ref_delta, ref_registered, ref_output = _plain_reference()
        cloners = [t for t in techniques if isinstance(t, SiblingClone)]
        cloned_before = [t.cloned for t in cloners]
        candidate, cand_delta, cand_registered = _build_probe(techniques)
        if any(t.cloned == before for t, before in zip(cloners, cloned_before)):
            return "the probe model's repeated cells were not copied: the technique does not work here"
        if ref_delta != cand_delta:
            return f"global registries change differently (instance count, compile cache, cells): {cand_delta} != {ref_delta}"
        if ref_registered != cand_registered:
            return "cells are registered in the compile cache differently"
        cand_state = model_state(candidate)
        if ref_state != cand_state:
            return f"the probe model differs: {_first_difference(ref_state, cand_state)}"
        output = _probe_output(candidate)
        if output.dtype != ref_output.dtype or output.tobytes() != ref_output.tobytes():
            return "the probe model computes a different output"
    except Exception as exc:
        return f"the probe failed: {type(exc).__name__}: {exc}"
    return None


def _run_probe(technique) -> str | None:
    """None when the probe model built with `technique` alone equals the plain one."""
    return _prepare(technique) or _compare([technique])


def _run_probes() -> dict[str, str | None]:
    """Every technique's verdict: one probe build with all that prepare;
    only if that differs, one per technique to find which."""
    results, ready = {}, []
    for technique in TECHNIQUES:
        reason = _prepare(technique)
        results[technique.name] = reason
        if reason is None:
            ready.append(technique)
    if ready and _compare(ready) is not None:
        for technique in ready:
            results[technique.name] = _compare([technique])
    return results


def _first_difference(a, b, path="") -> str:
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                label = x[0] if isinstance(x, tuple) and x and isinstance(x[0], str) else i
                return _first_difference(x, y, f"{path}/{label}")
    return f"{path}: {a!r:.200} != {b!r:.200}"


_probe_results: dict[str, str | None] = {}
_probe_lock = threading.Lock()


def probe_result(technique) -> str | None:
    """The probe's verdict for `technique` on this process's mindspore (run once)."""
    if _depth:  # inside a window the probe would compare the fast path with itself
        raise RuntimeError("ms_loadpatch: fast-construction probes cannot run inside a construction window")
    with _probe_lock:
        if technique.name not in _probe_results:
            _probe_results.update(_run_probes())
        return _probe_results[technique.name]


def leftovers() -> list[str]:
    """What a closed window would have left behind (for tests): empty when
    nothing of fast construction is installed."""
    import gc

    found = []
    if _depth or _builder is not None:
        found.append(f"a construction window is open (depth {_depth})")
    for technique in TECHNIQUES:
        if isinstance(technique, (CellInitTemplate, FlatNameWalk)) and getattr(technique, "original", None) is not None:
            name = "__init__" if isinstance(technique, CellInitTemplate) else "update_parameters_name"
            if vars(technique.cell_class).get(name) is not technique.original:
                found.append(f"nn.Cell.{name} is not mindspore's")
        if isinstance(technique, SignatureCache):
            found += [f"{m.get('__name__')} still uses the cached inspect" for m in technique.modules
                      if isinstance(m.get("inspect"), _CachedSignatureInspect)]
        if isinstance(technique, SiblingClone):
            found += [f"{cls.__qualname__}.__init__ still wrapped" for cls in technique.hooked]
            if technique.entries:
                found.append("sibling-clone recipes kept")
        if getattr(technique, "count", None) is not None and technique.count.pending:
            found.append(f"{technique.name}: {technique.count.pending} cells not counted")
        if isinstance(technique, GcPause) and technique.paused:
            found.append("cyclic garbage collection still paused")
    if _gc_holders or _gc_paused:
        found.append(f"cyclic garbage collection pause held ({_gc_holders} holder(s))")
    from mindspore import nn

    if "_StartCounter" in getattr(vars(nn.Cell).get("__init__"), "__qualname__", ""):
        found.append("nn.Cell.__init__ still counts cells")
    if not gc.isenabled():
        found.append("gc is disabled")
    return found


def named_off() -> set[str]:
    """The names MS_LOADPATCH_TECHNIQUES_OFF lists, as written (`all` included)."""
    return {part.strip() for part in os.environ.get(ENV_VAR, "").split(",") if part.strip()}


def switched_off() -> set[str]:
    names = named_off()
    if "all" in names:
        return {t.name for t in TECHNIQUES}
    return names


def technique_status() -> list[dict]:
    """One row per technique: name, description, state (active / skipped /
    off) and the reason. Runs the probes (once per process); needs mindspore."""
    off = switched_off()
    rows = []
    for technique in TECHNIQUES:
        if technique.name in off:
            rows.append({"name": technique.name, "description": technique.description, "state": OFF,
                         "reason": f"switched off by {ENV_VAR}"})
            continue
        reason = probe_result(technique)
        rows.append({"name": technique.name, "description": technique.description,
                     "state": ACTIVE if reason is None else SKIPPED,
                     "reason": "probe passed: the probe model is identical with and without it" if reason is None
                     else f"probe failed: {reason}"})
    return rows


def active_techniques() -> list:
    off = switched_off()
    return [t for t in TECHNIQUES if t.name not in off and probe_result(t) is None]


# -- the window


class _StartCounter:
    """Counts the cells the building thread makes (a pass-through wrapper of
    nn.Cell.__init__) and, at the `start`-th, takes itself out and calls
    `reached()`, which runs the probes (once per process) and installs the
    techniques for the rest of the build (True when it installed any). A
    model of few cells is built plainly: the probes cost more than the
    techniques would save it."""

    def __init__(self, start, reached):
        from mindspore import nn

        self.cell_class, self.start, self.reached = nn.Cell, start, reached
        self.count = 0
        self.original = self.wrapper = None

    def install(self):
        original = vars(self.cell_class).get("__init__")
        if original is None:
            return False
        counter = self

        def __init__(cell, *args, **kwargs):
            global engaged_at
            if _builder == threading.get_ident():
                counter.count += 1
                if counter.count >= counter.start and counter.uninstall() and counter.reached():
                    engaged_at = counter.count
            return original(cell, *args, **kwargs)

        __init__.__wrapped__ = original
        __init__.__doc__ = original.__doc__
        self.original, self.wrapper = original, __init__
        self.cell_class.__init__ = __init__
        return True

    def uninstall(self) -> bool:
        """Puts nn.Cell.__init__ back; False when already done."""
        if self.wrapper is None:
            return False
        if vars(self.cell_class).get("__init__") is self.wrapper:
            self.cell_class.__init__ = self.original
        self.wrapper = None
        return True


def _install_chosen(choose, installed) -> bool:
    """Runs the probes (outside the open window: they build models of their
    own) and installs the active techniques into it; True when any was."""
    global _builder, _depth
    builder, depth = _builder, _depth
    _builder, _depth = None, 0
    try:
        techniques = choose()
    finally:
        _builder, _depth = builder, depth
    before = len(installed)
    for technique in techniques:
        if technique.install():
            installed.append(technique)
    return len(installed) > before


@contextlib.contextmanager
def _window(choose, start: int = 0, record: bool = True):
    """Open the building thread's window (outermost call only; the caller
    holds CONSTRUCTION_LOCK): `choose()` gives the techniques, installed at
    once when `start` is 0, else once the build has made `start` cells.
    `record`: the window sets `engaged_at` (the probes' windows do not)."""
    global _builder, _depth, engaged_at
    if _depth:
        if _builder != threading.get_ident():  # cannot happen under the lock; never share a window
            raise RuntimeError("ms_loadpatch: fast construction window opened from two threads")
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    installed, counter = [], None
    try:
        _builder = threading.get_ident()
        _depth = 1
        if record:
            engaged_at = None
        if start > 0:
            counter = _StartCounter(start, lambda: _install_chosen(choose, installed))
            counter.install()
        elif _install_chosen(choose, installed) and record:
            engaged_at = 0
        yield
    finally:
        _depth = 0
        _builder = None
        if counter is not None:
            counter.uninstall()
        for technique in reversed(installed):
            technique.uninstall()


def start_after_cells() -> int:
    """The cell of a build at which the techniques engage: START_ENV_VAR, else DEFAULT_START."""
    value = env_int(START_ENV_VAR, minimum=0)
    return DEFAULT_START if value is None else value


@contextlib.contextmanager
def fast_construction(lazy_parameters: bool = True):
    """Construction in this thread takes every active technique's fast path
    once it has made start_after_cells() cells. Call with CONSTRUCTION_LOCK
    held. Without `lazy_parameters` (from_config: parameters get their random
    values while the model is built) cells are never copied: a copy would
    skip its draws from the random generator."""
    if _depth and _builder == threading.get_ident():
        with _window(list):
            yield
        return

    def choose():
        techniques = active_techniques()
        return techniques if lazy_parameters else [t for t in techniques if not isinstance(t, SiblingClone)]

    with _window(choose, start_after_cells()):
        yield
