"""Wrappers that hook the loading strategy into mindone (one module per library)."""


def overridden_method(cls, base, names) -> str | None:
    """"X overrides m" for the first class between `cls` and `base` that
    defines one of `names` itself (it took over the loading path), else None."""
    for klass in cls.__mro__:
        if klass is base:
            break
        for name in names:
            if name in vars(klass):
                return f"{klass.__name__} overrides {name}"
    return None
