"""gc-pause: no cyclic garbage collection while the model is built."""

from __future__ import annotations

import gc

from .. import gcpause
from .technique import ProbeFailed, Technique


class GcPause(Technique):
    """Collection is paused while the model is built (strategy/gcpause.py,
    the pause a whole load holds too) and resumed when the window closes.
    Process-wide, not per thread: other threads' cyclic garbage waits for
    the end of the window (objects, values and reference-counted freeing
    are unchanged). Left alone when the application has disabled gc itself."""

    name = gcpause.NAME
    description = "cyclic garbage collection paused while the model is built and loaded (process-wide; nothing else changes)"
    pauses_collection = True

    def __init__(self):
        self.paused = False

    def prepare(self):
        if not all(callable(getattr(gc, f, None)) for f in ("isenabled", "disable", "enable")):
            raise ProbeFailed("the gc module lacks isenabled / disable / enable")

    def install(self):
        if not gcpause.hold():
            gcpause.release()
            return False
        self.paused = True
        return True

    def uninstall(self):
        if self.paused:
            self.paused = False
            gcpause.release()

    def leftovers(self):
        return ["cyclic garbage collection still paused"] if self.paused else []
