"""numpy draws taken n at a time: n of mindspore's `_numpy_seed()` (one
`np.random.randint(low=1, high=1 << 63, dtype=np.int64)` each) as one call,
checked once per process on this mindspore and numpy: the same numbers,
types and global RandomState as n calls."""

from __future__ import annotations

import numpy as np

from ..probe_cache import ProbeCache
from .draw_patches import originals as _originals

_SEED_HIGH = 1 << 63
NAME = "batched-draws"  # MS_LOADPATCH_TECHNIQUES_OFF name: every draw taken on its own
_checks = ProbeCache()  # "checks": (problem or None, words usable)


_MASK = (1 << 63) - 1  # legacy randint's mask for the range below
_RANGE = _SEED_HIGH - 2  # high - 1 - low: a masked value above it is drawn again


def _global_mt19937():
    """The bit generator of numpy's global RandomState when it is MT19937 (else None)."""
    get = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    generator = get() if get is not None else getattr(np.random.mtrand._rand, "_bit_generator", None)
    return generator if type(generator) is np.random.MT19937 else None


def seeds_from_words(generator, n: int) -> list:
    """n of `randint(low=1, high=1 << 63, dtype=np.int64)` from MT19937's
    32-bit words, as numpy's legacy masked rejection makes them: two words a
    value (the first high), masked to 63 bits, drawn again when above the
    range; plus low. Python ints (an np.int64 each costs as much as the
    draw): a seed given back to an initializer is made np.int64 there."""
    seeds: list = []
    while len(seeds) < n:
        words = generator.random_raw(2 * (n - len(seeds))).tolist()
        for high, low in zip(words[0::2], words[1::2]):
            value = ((high << 32) | low) & _MASK
            if value <= _RANGE:
                seeds.append(value + 1)
    return seeds


def words_usable() -> bool:
    """Whether owed draws are made from the global MT19937's words
    (problem() checked that they equal randint's here)."""
    return problem() is None and _checks.get("checks", _check)[1]


def same_numpy_state(a, b) -> bool:
    """Two `RandomState.get_state()` tuples are the same state."""
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _numpy_seed_as_known():
    return np.random.randint(low=1, high=(1 << 63), dtype=np.int64)


def problem() -> str | None:
    """None when mindspore's `_numpy_seed` is the one-line draw this module
    knows and, on this numpy, one randint of size n gives the same numbers
    (type included) and leaves the same RandomState as n calls of it."""
    return _checks.get("checks", _check)[0]


def _check() -> tuple:
    try:
        found = _check_batched_draws()
    except Exception as exc:  # noqa: BLE001 - an internal it relies on changed
        found = f"{type(exc).__name__}: {exc}"
    try:
        words = found is None and _check_raw_words() is None
    except Exception:  # noqa: BLE001 - numpy's generator internals differ: randint it is
        words = False
    return found, words


def _check_batched_draws() -> str | None:
    from mindspore.common import initializer as module

    original = _originals.get("numpy_seed") or module._numpy_seed  # draw_patches' stand-in while installed
    known, theirs = _numpy_seed_as_known.__code__, getattr(original, "__code__", None)
    if (
        module.np is not np
        or theirs is None
        or (theirs.co_code, theirs.co_consts, theirs.co_names) != (known.co_code, known.co_consts, known.co_names)
    ):
        return "mindspore's initializer._numpy_seed is not np.random.randint(low=1, high=1 << 63, dtype=np.int64)"
    one_by_one, batched = np.random.RandomState(0), np.random.RandomState(0)
    for start, n in ((0, 1), (0, 2), (610, 17)):  # 17 draws from word 610 cross MT19937's refill at 624
        one_by_one.set_state(_state_at(start))
        batched.set_state(_state_at(start))
        singles = [one_by_one.randint(low=1, high=_SEED_HIGH, dtype=np.int64) for _ in range(n)]
        batch = batched.randint(low=1, high=_SEED_HIGH, dtype=np.int64, size=n)
        if [type(v) for v in singles] != [type(v) for v in batch] or list(batch) != singles:
            return f"numpy {np.__version__}: randint(size={n}) gives other numbers than {n} calls"
        if not same_numpy_state(one_by_one.get_state(), batched.get_state()):
            return f"numpy {np.__version__}: randint(size={n}) leaves another state than {n} calls"
    return None


def _check_raw_words() -> str | None:
    """None when seeds_from_words on the global generator gives the numbers,
    types and state of as many randint calls (a refill crossed), and a crafted
    word pair above the range is drawn again as randint does."""
    state = np.random.get_state()
    try:
        for start, n in ((0, 3), (610, 17)):  # the second crosses the refill
            np.random.set_state(_state_at(start))
            singles = [_numpy_seed_as_known() for _ in range(n)]
            after = np.random.get_state()
            np.random.set_state(_state_at(start))
            generator = _global_mt19937()
            if generator is None:
                return "numpy's global RandomState does not use MT19937"
            words = seeds_from_words(generator, n)
            if [type(np.int64(v)) for v in words] != [type(v) for v in singles] or words != singles:
                return f"numpy {np.__version__}: the words give other numbers than {n} randint calls"
            if not same_numpy_state(after, np.random.get_state()):
                return f"numpy {np.__version__}: the words leave another state than {n} randint calls"
        np.random.set_state(rejecting_state())
        singles = [_numpy_seed_as_known() for _ in range(2)]
        after = np.random.get_state()
        np.random.set_state(rejecting_state())
        if seeds_from_words(_global_mt19937(), 2) != singles or not same_numpy_state(after, np.random.get_state()):
            return f"numpy {np.__version__}: a value above the range is not drawn again as randint does"
    finally:
        np.random.set_state(state)
    return None


def _state_at(position: int):
    """A legacy MT19937 state (seed 1234's words) at `position` of its 624."""
    if not _words_1234:
        _words_1234.append(np.random.RandomState(1234).get_state()[1])
    return ("MT19937", _words_1234[0], position, 0, 0.0)


_words_1234: list = []


def rejecting_state():
    """A legacy MT19937 state whose next two words make a value above
    randint's range (2**63 - 1 after the mask): untempered into the key."""
    key = np.random.RandomState(99).get_state()[1].copy()
    key[0], key[1] = _untemper(0x7FFFFFFF), _untemper(0xFFFFFFFF)
    return ("MT19937", key, 0, 0, 0.0)


def _untemper(y: int) -> int:
    """The MT19937 state word whose tempered output is y (each tempering step undone, last first)."""

    def undo(y, step):  # y = x ^ step(x): x found a few bits a round
        x = y
        for _ in range(6):
            x = y ^ step(x)
        return x & 0xFFFFFFFF

    y = undo(y, lambda x: x >> 18)
    y = undo(y, lambda x: (x << 15) & 0xEFC60000)
    y = undo(y, lambda x: (x << 7) & 0x9D2C5680)
    return undo(y, lambda x: x >> 11)


def allowed() -> bool:
    """Batching is on (not switched off) and its check passed here."""
    from .. import switch

    return not switch.is_off(NAME) and problem() is None


WORDS_UP_TO = 64  # batches made from words; a larger one costs less as one randint than as Python ints


def take(n: int):
    """n seeds, as n `_numpy_seed()` calls give them, in one call (allowed() first)."""
    generator = _global_mt19937() if n <= WORDS_UP_TO and words_usable() else None
    if generator is not None:  # for a copy's few draws, randint's argument checks cost more than the draws
        return seeds_from_words(generator, n)
    return np.random.randint(low=1, high=_SEED_HIGH, dtype=np.int64, size=n)
