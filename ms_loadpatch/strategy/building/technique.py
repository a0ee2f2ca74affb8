"""What a construction technique is: the interface every one implements."""

from __future__ import annotations


class ProbeFailed(Exception):
    """The fast path cannot be shown to match mindspore's on this install."""


class Technique:
    """One construction technique. `prepare()` finds what it patches on the
    installed mindspore (raises ProbeFailed when it cannot), `install()`
    patches it for the open window (False: someone else's patch is there,
    nothing done), `uninstall()` puts the originals back, `leftovers()` says
    what an uninstalled technique still holds. The probe builds its model
    with the technique and compares the whole state with a plain build;
    `probe_started()` / `probe_finished(token)` add the technique's own
    check (a reason when it did not do its work)."""

    name = ""
    description = ""
    # the probe build leaves cyclic collection to the technique (gc-pause)
    pauses_collection = False

    def prepare(self) -> None:
        raise NotImplementedError

    def install(self) -> bool:
        raise NotImplementedError

    def uninstall(self) -> None:
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        return []

    def probe_started(self):
        return None

    def probe_finished(self, token) -> str | None:
        return None
