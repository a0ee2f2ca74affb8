"""A build session: what the mindspore-side replacements of a build read
while it runs (the draw patches, the lazy assign_value), kept on one object
reached through the lane (strategy/lane.py). An accelerated load owns one
(`Load.build`, current while the load runs); builds outside a load (the
probes, from_config, a call that builds then fills) use their thread's.
Each block sets the fields it needs and puts back what was there."""

from __future__ import annotations

import contextlib

from ..lane import lane


class BuildSession:
    __slots__ = ("ledger", "owing", "known", "replay", "capturing", "captured", "fast_assign", "foreign")

    def __init__(self):
        self.ledger = None  # draws.Ledger accounting here (or only giving back); None: no accounting
        self.owing = False  # draws.owing held: known draws owed, taken as one batch
        self.known = False  # ... and the copies' draws are known to the ledger
        self.replay = None  # a seed _numpy_seed gives back to the initializer filling now
        self.capturing = False  # Ledger.take stops an initializer at its draw
        self.captured = None  # ... and the seed it took
        self.fast_assign = None  # lazy_writes: None: assign_value left to mindspore; True: copies taken
        self.foreign = frozenset()  # ids of parameters this build did not make (left to mindspore)

    @classmethod
    def inheriting(cls, outer: BuildSession | None) -> BuildSession:
        """A session starting from `outer`'s fields (a load started inside a build sees what it saw before)."""
        made = cls()
        if outer is not None:
            for name in cls.__slots__:
                setattr(made, name, getattr(outer, name))
        return made


def session() -> BuildSession:
    """This thread's build session."""
    found = lane.build
    if found is None:
        found = lane.build = BuildSession()
    return found


@contextlib.contextmanager
def holding(**fields):
    """Fields of this thread's build session set for the block, then put back."""
    current = session()
    outer = {name: getattr(current, name) for name in fields}
    for name, value in fields.items():
        setattr(current, name, value)
    try:
        yield current
    finally:
        for name, value in outer.items():
            setattr(current, name, value)
