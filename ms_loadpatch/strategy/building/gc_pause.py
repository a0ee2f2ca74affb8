"""gc-pause: cyclic garbage collection paused while models are built and loaded.

Building a many-expert model allocates hundreds of thousands of containers;
each burst triggers a collection, and the full ones rescan every object of
the process. One pause, held by construction windows (the gc-pause
technique) and by whole loads, in any thread: collection resumes when the
last holder leaves, and only if ms_loadpatch paused it (an application that
disabled gc itself keeps it disabled). Pausing changes no object.
"""

from __future__ import annotations

import contextlib
import gc
import threading

from .. import switch
from .technique import ProbeFailed, Technique

NAME = "gc-pause"

_lock = threading.Lock()
_holders = 0
_paused = False


def hold() -> bool:
    """One more holder; True when collection is paused by ms_loadpatch."""
    global _holders, _paused
    with _lock:
        if _holders == 0 and gc.isenabled():
            gc.disable()
            _paused = True
        _holders += 1
        return _paused


def release() -> None:
    global _holders, _paused
    with _lock:
        _holders -= 1
        if _holders == 0 and _paused:
            _paused = False
            _promote_to_oldest()
            gc.enable()


def _promote_to_oldest() -> bool:
    """Moves every tracked object to the oldest generation without
    traversing it; False (nothing done) when the application has frozen
    objects or this Python lacks the calls."""
    freeze, unfreeze, count = (getattr(gc, f, None) for f in ("freeze", "unfreeze", "get_freeze_count"))
    if freeze is None or unfreeze is None or count is None or count() != 0:
        return False
    freeze()
    unfreeze()
    return True


@contextlib.contextmanager
def collection_paused():
    """The pause over a whole accelerated load (after the build, mindone's
    key checks, `tie_weights` and `set_train` walk every cell again, and the
    collections their allocations trigger rescan everything) and over the
    construction probes (their renderings would trigger a full collection of
    every module mindone imported). Yields whether collection is paused; the
    techniques-off switch leaves gc alone."""
    if switch.is_off(NAME):
        yield False
        return
    paused = hold()
    try:
        yield paused
    finally:
        release()


def leftovers() -> list[str]:
    """What a finished load would have left behind (for tests)."""
    found = []
    if _holders or _paused:
        found.append(f"cyclic garbage collection pause held ({_holders} holder(s))")
    if not gc.isenabled():
        found.append("gc is disabled")
    return found


class GcPause(Technique):
    """Collection is paused while the model is built (the pause above,
    which a whole load holds too) and resumed when the window closes.
    Process-wide, not per thread: other threads' cyclic garbage waits for
    the end of the window (objects, values and reference-counted freeing
    are unchanged). Left alone when the application has disabled gc itself."""

    name = NAME
    description = (
        "cyclic garbage collection paused while the model is built and loaded (process-wide; nothing else changes)"
    )
    pauses_collection = True

    def __init__(self):
        self.paused = False

    def prepare(self):
        if not all(callable(getattr(gc, f, None)) for f in ("isenabled", "disable", "enable")):
            raise ProbeFailed("the gc module lacks isenabled / disable / enable")

    def install(self):
        if not hold():
            release()
            return False
        self.paused = True
        return True

    def uninstall(self):
        if self.paused:
            self.paused = False
            release()

    def leftovers(self):
        return ["cyclic garbage collection still paused"] if self.paused else []
