"""signature-cache: inspect.signature cached per function in mindspore's decorators."""

from __future__ import annotations

import sys
import threading
import types

from . import window
from .swaps import Swaps
from .technique import ProbeFailed, Technique


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
        if args or kwargs or window.state.builder != threading.get_ident() or type(fn) is not types.FunctionType:
            return self._real.signature(fn, *args, **kwargs)
        entry = self._cache.get(fn)
        if (
            entry is not None
            and entry[0] is fn.__code__
            and entry[1] is fn.__defaults__
            and entry[2] is fn.__kwdefaults__
        ):
            return entry[3]
        result = self._real.signature(fn)
        self._cache[fn] = (fn.__code__, fn.__defaults__, fn.__kwdefaults__, result)
        return result


class SignatureCache(Technique):
    """`prim_attr_register` / `prim_arg_register` (every Primitive built from
    Python, e.g. the MatMul of each Dense and the Load of each Parameter) and
    `cell_attr_register` call `inspect.signature(__init__)` per instance; the
    Signature of a function is the same every time, so it is cached."""

    name = "signature-cache"
    description = "inspect.signature cached per __init__ in mindspore's primitive and cell decorators"

    def __init__(self):
        self.modules = []  # mindspore's decorator modules, each with its shim
        self.shims = []
        self.swaps = Swaps()

    def prepare(self):
        import inspect

        from mindspore import nn, ops

        modules = []
        for label, fn in (
            ("prim_attr_register", getattr(ops, "prim_attr_register", None)),
            ("prim_arg_register", getattr(ops, "prim_arg_register", None)),
            ("nn.Dense.__init__ (cell_attr_register)", vars(nn.Dense).get("__init__")),
        ):
            names = getattr(fn, "__globals__", None)
            module = sys.modules.get(names.get("__name__")) if names is not None else None
            if module is None or vars(module) is not names or names.get("inspect") is not inspect:
                raise ProbeFailed(f"{label}'s module does not use the inspect module by that name")
            if all(m is not module for m in modules):
                modules.append(module)
        self.modules = modules
        self.shims = [_CachedSignatureInspect(inspect) for _ in modules]

    def install(self):
        if any(vars(module).get("inspect") is not shim._real for module, shim in zip(self.modules, self.shims)):
            return False
        self.swaps = Swaps((module, "inspect", shim) for module, shim in zip(self.modules, self.shims))
        self.swaps.install()
        return True

    def uninstall(self):
        self.swaps.uninstall()

    def leftovers(self):
        return self.swaps.leftovers()
