"""The mindspore patches through which lazy parameters take their random
draws into the accounting thread's ledger (draws.py), held while any thread
accounts and for that thread only (others get mindspore's own behaviour):
`Parameter.init_mode` (a descriptor over the instance attribute, where the
draw is taken), `Tensor.init_data` (where a kept seed is given back),
`Parameter.init_data` (where recorded writes are replayed) and
`initializer._numpy_seed`."""

from __future__ import annotations

import numpy as np

from ..lane import lane
from .swaps import SharedSwaps, Swaps

originals: dict = {}


class SeedTaken(Exception):
    """Raised by the patched _numpy_seed once it has taken the draw: the initializer stops before filling."""


def _install_filling():
    """`initializer._numpy_seed` and `Tensor.init_data`: a tensor a ledger
    holds fills with its own draw; `Parameter.init_data`: then the writes
    recorded on it are replayed."""
    from mindspore import Parameter, Tensor
    from mindspore.common import initializer as module

    numpy_seed, init_data = module._numpy_seed, vars(Tensor)["init_data"]
    parameter_init_data = vars(Parameter)["init_data"]
    originals.update(
        numpy_seed=numpy_seed,
        init_data=init_data,
        module=module,
        Tensor=Tensor,
        parameter_init_data=parameter_init_data,
        FilledParameter=Parameter,
    )

    def _numpy_seed():
        build = lane.build
        if build is None:
            return numpy_seed()
        replay = build.replay
        if replay is not None:
            build.replay = None
            return np.int64(replay) if type(replay) is int else replay  # batched_draws' words are ints
        seed = numpy_seed()
        if build.capturing:
            build.captured = seed
            raise SeedTaken
        return seed

    def patched_init_data(self, *args, **kwargs):
        build = lane.build
        ledger = build.ledger if build is not None else None
        entry = ledger.seeds.pop(id(self), None) if ledger is not None else None
        if entry is None:
            return init_data(self, *args, **kwargs)
        _tensor, taken = entry
        if isinstance(taken, np.ndarray):  # run in full when made: its values
            self.init = Values(taken)
            return init_data(self, *args, **kwargs)
        build.replay = taken
        try:
            return init_data(self, *args, **kwargs)
        finally:
            left, build.replay = build.replay, None
            if left is not None:
                raise RuntimeError("ms_loadpatch: an initializer filled a tensor without taking its random draw")

    def patched_parameter_init_data(self, *args, **kwargs):
        build = lane.build
        ledger = build.ledger if build is not None else None
        entry = None
        if ledger is not None and ledger.writes and self.has_init:
            entry = ledger.writes.pop(id(self.init_mode), None)
        filled = parameter_init_data(self, *args, **kwargs)
        if entry is not None:
            entry[1].replay_onto(filled)  # deferred_writes.RecordedWrites
        return filled

    patched_init_data.__wrapped__ = init_data
    patched_parameter_init_data.__wrapped__ = parameter_init_data
    return Swaps(
        [
            (module, "_numpy_seed", _numpy_seed),
            (Tensor, "init_data", patched_init_data),
            (Parameter, "init_data", patched_parameter_init_data),
        ]
    )


def _filling_ended():
    for key in ("module", "numpy_seed", "Tensor", "init_data", "FilledParameter", "parameter_init_data"):
        del originals[key]


def _install_accounting():
    """`Parameter.init_mode` as a descriptor: where a lazy parameter's draw is taken."""
    from mindspore import Parameter

    originals["Parameter"] = Parameter
    return Swaps([(Parameter, "init_mode", _InitMode())])


FILLING = SharedSwaps(_install_filling, _filling_ended)
ACCOUNTING = SharedSwaps(_install_accounting, lambda: originals.pop("Parameter"))


def leftovers() -> list[str]:
    """What an ended ledger would have left patched (for tests)."""
    if FILLING.users or ACCOUNTING.users or originals:
        return [f"random-draw accounting still installed ({FILLING.users} + {ACCOUNTING.users} user(s))"]
    return []


class _InitMode:
    """Parameter.init_mode while installed: the instance's own attribute,
    and, when it is set to a lazy initializer tensor in a thread whose ledger
    accounts, that tensor's draws taken now (Parameter.__new__ and set_data
    on a lazy parameter are where mindspore sets it)."""

    def __get__(self, param, owner=None):
        if param is None:
            return self
        try:
            return param.__dict__["init_mode"]
        except KeyError:
            raise AttributeError("init_mode") from None

    def __set__(self, param, value):
        param.__dict__["init_mode"] = value
        build = lane.build
        ledger = build.ledger if build is not None else None
        if ledger is not None and value is not None:
            ledger.take(value)
            if ledger.assignments is not None:
                ledger.assignments.append((param, value))

    def __delete__(self, param):
        del param.__dict__["init_mode"]


class Values:
    """An initializer giving back the values a run in full made."""

    def __init__(self, values):
        self.values = values
        self.seed = (None, None)

    def __call__(self, arr):
        np.copyto(arr, self.values)
