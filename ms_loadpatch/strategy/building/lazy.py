"""Parameters built from initializers stay lazy (no memory, no random fill),
for the building thread only; CONSTRUCTION_LOCK serialises every build
ms_loadpatch runs."""

from __future__ import annotations

import contextlib
import threading

from .swaps import Swaps

# The lazy window changes a class attribute of Parameter. Every construction
# ms_loadpatch runs, lazy or not, holds this lock; re-entrant for nested models.
CONSTRUCTION_LOCK = threading.RLock()


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


def _lazy_in_this_thread():
    from mindspore import Parameter

    return Swaps([(Parameter, "init_param", _LazyInThread())])


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


def unshared_lazy_parameter(default_input, name: str, **kwargs):
    """A Parameter left lazy as under no_init_parameters (Parameter.__new__
    reads `init_param` False from the class it is called with), made through
    a subclass that says so: nothing every thread reads is changed and no
    lock is taken, so a probe may make one anywhere (under an import lock,
    while another thread builds)."""
    from mindspore import Parameter

    lazy = Parameter.__new__(_lazy_class(Parameter), default_input, name=name, **kwargs)
    lazy.__init__(default_input, name=name, **kwargs)
    return lazy


_LAZY_CLASSES: dict = {}


def _lazy_class(parameter_class):
    if parameter_class not in _LAZY_CLASSES:
        _LAZY_CLASSES[parameter_class] = type("UnsharedLazyParameter", (parameter_class,), {"init_param": False})
    return _LAZY_CLASSES[parameter_class]


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
