"""primitive-defaults: a primitive built without arguments takes its defaults from a cache."""

from __future__ import annotations

import inspect

from .technique import InitHooks, ProbeFailed, Technique

# What the decorators' `deco` (mindspore.ops.primitive) refers to: the code reproduced below.
_DECO_NAMES = frozenset(
    {
        "Primitive",
        "PrimitiveWithCheck",
        "PrimitiveWithInfer",
        "__class__",
        "__init__",
        "__name__",
        "apply_defaults",
        "arguments",
        "bind",
        "hasattr",
        "init_attrs",
        "inspect",
        "isinstance",
        "signature",
        "substitute_name",
    }
)
_DECO_CONSTS = (None, "substitute_name", "self", "name")
_SETTERS = {"prim_attr_register": "add_prim_attr", "prim_arg_register": "_set_prim_arg"}


class PrimitiveDefaults(Technique):
    """Every Parameter makes a `Load` primitive and every mint Linear a
    `Dense` one, each through mindspore's `prim_attr_register` /
    `prim_arg_register` decorator, which binds the call's arguments with
    `inspect` (`signature(fn).bind(self, ...)`, `apply_defaults()`) before
    registering each as an attribute: some 40% of such a primitive's cost.
    Called without arguments, the bound arguments are always `__init__`'s
    defaults, so they come from a per-class list (the very default objects
    `apply_defaults` would give); everything else the decorator does runs as
    it does there (the base class's `__init__`, `init_attrs`, the setter per
    argument, then the decorated function). A class is taken up at its first
    build in the window (a dispatcher on `Primitive.__init__` notices it);
    only a class whose `__init__` is one of the two decorators' code, whose
    decorated function takes only parameters with defaults after `self`,
    and that has no `substitute_name`, is served; any call with arguments,
    in another thread, or on a subclass takes the decorator itself."""

    name = "primitive-defaults"
    description = (
        "a primitive built without arguments (the Load of every Parameter, the Dense of every mint "
        "Linear) takes its decorator's bound defaults from a per-class cache instead of inspect"
    )

    def __init__(self):
        self.hooks = InitHooks()
        self.served = 0

    def prepare(self):
        from mindspore.ops import primitive

        self.primitive_class = primitive.Primitive
        self.with_infer, self.with_check = primitive.PrimitiveWithInfer, primitive.PrimitiveWithCheck
        codes = {}
        for register, setter in _SETTERS.items():
            decorator = getattr(primitive, register, None)
            if decorator is None:
                raise ProbeFailed(f"mindspore.ops.primitive has no {register}")
            code = getattr(decorator(lambda self: None), "__code__", None)
            if (
                code is None
                or set(code.co_names) != _DECO_NAMES | {setter}
                or code.co_consts != _DECO_CONSTS
                or code.co_freevars != ("fn",)
            ):
                raise ProbeFailed(f"{register}'s decorator is not the code this technique reproduces")
            codes[code] = setter
        self.deco_codes = codes

    def install(self):
        return self.hooks.install(self.primitive_class, self._hook)

    def uninstall(self):
        self.hooks.restore()

    def leftovers(self):
        return self.hooks.leftovers()

    def probe_started(self):
        return self.served

    def probe_finished(self, served_before):
        if self.served == served_before:
            return "no primitive of the probe model took its defaults from the cache: the technique does not work here"
        return None

    def _plan(self, cls):
        """(decorated fn, setter, ((name, default), ...), fn's defaults, kwdefaults), or None."""
        init = cls.__init__
        setter = self.deco_codes.get(getattr(init, "__code__", None))
        fn = getattr(init, "decorated_func", None)
        if setter is None or fn is None or hasattr(cls, "substitute_name") or not inspect.isfunction(fn):
            return None
        parameters = list(inspect.signature(fn).parameters.values())
        if (
            not parameters
            or parameters[0].name != "self"
            or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ):
            return None
        defaults = []
        for parameter in parameters[1:]:
            if (
                parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                or parameter.default is inspect.Parameter.empty
            ):
                return None  # bind makes () / {} or raises: left to the decorator
            defaults.append((parameter.name, parameter.default))
        return fn, setter, tuple(defaults), fn.__defaults__, fn.__kwdefaults__

    def _hook(self, cls, base_init):
        plan = self._plan(cls)
        if plan is None:
            self.hooks.leave(cls)
            return
        technique = self

        def build(cls, init, prim, args, kwargs):
            if args or kwargs:
                return init(prim, *args, **kwargs)
            return technique._build(cls, plan, init, prim)

        self.hooks.wrap(cls, build)

    def _build(self, cls, plan, init, prim):
        """What the decorator does for a call without arguments, its defaults taken from `plan`."""
        fn, setter, defaults, fn_defaults, fn_kwdefaults = plan
        if fn.__defaults__ is not fn_defaults or fn.__kwdefaults__ is not fn_kwdefaults:
            return init(prim)  # defaults replaced since the plan was made
        class_name = cls.__name__
        if isinstance(prim, self.with_infer):
            self.with_infer.__init__(prim, class_name)
        elif isinstance(prim, self.with_check):
            self.with_check.__init__(prim, class_name)
        else:
            self.primitive_class.__init__(prim, class_name)
        init_attrs = prim.init_attrs
        del init_attrs["name"]
        for name, value in defaults:
            getattr(prim, setter)(name, value)
            init_attrs[name] = value
        fn(prim)
        self.served += 1
        return None
