"""Parameters built from initializers stay lazy (no memory, no random fill),
for the building thread only; CONSTRUCTION_LOCK serialises every build
ms_loadpatch runs."""

from __future__ import annotations

import contextlib
import threading

# The lazy window changes a class attribute of Parameter. Every construction
# ms_loadpatch runs, lazy or not, holds this lock; re-entrant for nested models.
CONSTRUCTION_LOCK = threading.RLock()
_ABSENT = object()


class _LazyInThread:
    """Parameter.init_param during a lazy window: False (lazy) for Parameters
    created in the constructing thread, True in every other thread.
    mindspore's no_init_parameters sets the same attribute (Parameter.__new__
    reads it) to a plain False, which makes any model another thread builds
    meanwhile lazy too, and an unpatched load of that model then keeps its
    random values (Cell.load_state_dict does not fill lazy parameters)."""

    def __init__(self):
        self.thread = threading.get_ident()

    def __get__(self, instance, owner=None):
        return threading.get_ident() != self.thread


@contextlib.contextmanager
def _lazy_in_this_thread():
    from mindspore import Parameter

    previous = Parameter.__dict__.get("init_param", _ABSENT)
    Parameter.init_param = _LazyInThread()
    try:
        yield
    finally:
        if previous is _ABSENT:
            del Parameter.init_param
        else:
            Parameter.init_param = previous


_THREAD_SCOPED: bool | None = None


def _thread_scoped_works() -> bool:
    """Whether this mindspore's Parameter.__new__ still takes the flag from
    Parameter.init_param (as no_init_parameters sets it): checked once, on one
    tiny parameter; otherwise mindspore's own no_init_parameters is used."""
    global _THREAD_SCOPED
    if _THREAD_SCOPED is None:
        from mindspore import Parameter
        from mindspore.common.initializer import initializer

        with _lazy_in_this_thread():
            _THREAD_SCOPED = bool(Parameter(initializer("zeros", [1]), name="ms_loadpatch_probe").has_init)
    return _THREAD_SCOPED


@contextlib.contextmanager
def lazy_parameters():
    """Parameters made from initializers in this thread stay lazy. Holds CONSTRUCTION_LOCK."""
    with CONSTRUCTION_LOCK:
        if _thread_scoped_works():
            lazy = _lazy_in_this_thread()
        else:
            from mindspore.nn.utils import no_init_parameters

            lazy = no_init_parameters()
        with lazy:
            yield
