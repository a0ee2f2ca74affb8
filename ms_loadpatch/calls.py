"""How a glue wrapper reads the call it wraps: an argument by its name, where
ever the caller put it, and whether the call runs inside an accelerated load.

Positions come from the wrapped function's own signature (mindone's or
mindspore's, read once per function), so a wrapper names the parameter it
needs instead of counting; a name the function does not have is an error,
not a silent default.
"""

from __future__ import annotations

import functools
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


def inside_load(active):
    """Decorates a wrapper `wrapper(load, wrapped, instance, args, kwargs)` run
    only inside the load `active()` returns (the load, or None): anywhere
    else the call goes straight through."""

    def decorate(wrapper):
        @functools.wraps(wrapper)
        def gated(wrapped, instance, args, kwargs):
            load = active()
            if load is None:
                return wrapped(*args, **kwargs)
            return wrapper(load, wrapped, instance, args, kwargs)

        return gated

    return decorate
