"""How a glue wrapper reads the call it wraps: an argument by its name, where
ever the caller put it; and the one wrapper (`on_load`) that hands a call of
mindone's loading path to the method of the load running it.

Positions come from the wrapped function's own signature (mindone's or
mindspore's, read once per function), so a wrapper names the parameter it
needs instead of counting; a name the function does not have is an error,
not a silent default.
"""

from __future__ import annotations

import inspect

_positions_by_code: dict = {}


def _positions(wrapped) -> dict[str, int]:
    """parameter name -> its index in the wrapper's `args` (a bound method's
    first parameter is already bound)."""
    function = getattr(wrapped, "__func__", wrapped)
    bound = hasattr(wrapped, "__self__")
    key = (getattr(function, "__code__", function), bound)
    positions = _positions_by_code.get(key)
    if positions is None:
        parameters = list(inspect.signature(function).parameters.values())[1 if bound else 0 :]
        positions = {
            p.name: i for i, p in enumerate(parameters) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        positions.update({p.name: None for p in parameters if p.kind is p.KEYWORD_ONLY})
        _positions_by_code[key] = positions
    return positions


def _position(wrapped, name: str):
    positions = _positions(wrapped)
    if name not in positions:
        raise TypeError(f"ms_loadpatch: {getattr(wrapped, '__qualname__', wrapped)} has no parameter {name!r}")
    return positions[name]


def argument(wrapped, args, kwargs, name: str, default=None):
    """The value of parameter `name` in the call `wrapped(*args, **kwargs)`,
    `default` when the caller left it out."""
    position = _position(wrapped, name)
    if position is not None and position < len(args):
        return args[position]
    return kwargs.get(name, default)


def arguments(wrapped, args, kwargs, *names: str) -> tuple:
    """The values of parameters `names` in the call (None for those left out)."""
    return tuple(argument(wrapped, args, kwargs, name) for name in names)


def with_argument(wrapped, args, kwargs, name: str, value):
    """(args, kwargs) of the same call with parameter `name` set to `value`,
    where the caller passed it (by position or by name; by name if not passed)."""
    position = _position(wrapped, name)
    if position is not None and position < len(args):
        return args[:position] + (value,) + args[position + 1 :], kwargs
    return args, {**kwargs, name: value}


class Call:
    """One call of a function of mindone's loading path, handed to the load
    method that models it: its arguments by name, and the call itself."""

    __slots__ = ("wrapped", "instance", "args", "kwargs")

    def __init__(self, wrapped, instance, args, kwargs):
        self.wrapped, self.instance, self.args, self.kwargs = wrapped, instance, args, kwargs

    def __call__(self):
        """The call as it is (the library's own code)."""
        return self.wrapped(*self.args, **self.kwargs)

    def argument(self, name: str, default=None):
        return argument(self.wrapped, self.args, self.kwargs, name, default)

    def arguments(self, *names: str) -> tuple:
        return arguments(self.wrapped, self.args, self.kwargs, *names)

    def with_argument(self, name: str, value) -> Call:
        """The same call with parameter `name` set to `value`."""
        return Call(self.wrapped, self.instance, *with_argument(self.wrapped, self.args, self.kwargs, name, value))

    @property
    def count(self) -> int:
        """How many arguments the caller passed."""
        return len(self.args) + len(self.kwargs)


class CallForm:
    """What a load method models of the call it handles: `accepts(load,
    call)` true for the calls it models (None: every call), `fingerprint`
    the library function (fingerprints key) whose source it repeats, and
    `active`, the kind's classmethod giving the load it acts in."""

    __slots__ = ("accepts", "fingerprint", "active")

    def __init__(self, accepts=None, fingerprint: str | None = None, active: str = "current"):
        self.accepts, self.fingerprint, self.active = accepts, fingerprint, active


def handles(accepts=None, fingerprint: str | None = None, active: str = "current"):
    """Declares a method `method(self, call)` of a load kind the handler of
    one function of mindone's loading path (a targets.TARGETS row naming
    "module:Kind.method"); `on_load` makes its wrapper."""

    def declare(method):
        method.call_form = CallForm(accepts, fingerprint, active)
        return method

    return declare


def on_load(kind, name: str):
    """The wrapper of a row naming `kind.name`: the load running in this
    thread (the kind's `active`), the fingerprint and call-form checks, then
    the method with the call; a call outside such a load, or of a form the
    method does not model, goes straight through."""
    method = getattr(kind, name)
    form = method.call_form
    active = getattr(kind, form.active)

    def on_load_wrapper(wrapped, instance, args, kwargs):
        load = active()
        if load is None:
            return wrapped(*args, **kwargs)
        call = Call(wrapped, instance, args, kwargs)
        if form.accepts is not None and not form.accepts(load, call):
            return wrapped(*args, **kwargs)
        if form.fingerprint is not None:
            from . import fingerprints  # its probes import the libraries: only once a load runs

            if fingerprints.changed(form.fingerprint):
                return wrapped(*args, **kwargs)
        return method(load, call)

    on_load_wrapper.__qualname__ = f"on_load({kind.__name__}.{name})"
    return on_load_wrapper
