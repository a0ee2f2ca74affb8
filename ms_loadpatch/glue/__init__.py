"""Wrappers that hook the loading strategy into mindone (one module per library)."""

import contextlib
import os


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


def naming_the_file(exc: Exception, path, key: str | None = None, reason=None) -> Exception | None:
    """An exception of `exc`'s type whose message adds the checkpoint file
    (and tensor) it is about, or `reason` (a message naming them), for the
    caller to raise `from exc`; None when the message says it already, or
    when that type cannot be built from a message (then a note on `exc` says it)."""
    path = os.fspath(path)
    if reason is not None:
        where = str(reason)
        if where in str(exc):
            return None
    else:
        if path in str(exc):
            return None
        where = f"checkpoint file: {path}" + (f", tensor {key!r}" if key is not None else "")
    try:
        if isinstance(exc, OSError) and exc.errno is not None and not exc.filename and reason is None:
            tensor = f" (tensor {key!r})" if key is not None else ""
            better = type(exc)(exc.errno, f"{exc.strerror}{tensor}", path)  # "[Errno N] ...: 'path'"
        else:
            better = type(exc)(f"{exc} ({where})")
    except Exception:  # noqa: BLE001 - a type with its own constructor
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(where)
        return None
    return better


@contextlib.contextmanager
def file_named(path, key: str | None = None, reason=None):
    """An Exception escaping the block names the checkpoint file `path` (or
    says `reason`; see naming_the_file), chained from the original;
    BaseExceptions (KeyboardInterrupt) pass as they are."""
    try:
        yield
    except Exception as exc:
        better = naming_the_file(exc, path, key, reason) if path is not None else None
        if better is None:
            raise
        raise better from exc
