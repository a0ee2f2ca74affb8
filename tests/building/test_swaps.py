"""The one swap primitive building/ patches mindspore with
(strategy/building/swaps.py): what it puts back, what it leaves alone."""

import threading

import pytest

from ms_loadpatch.strategy.building.swaps import SharedSwaps, Swap, Swaps


class Base:
    def method(self):
        return "base"


class Child(Base):
    def own(self):
        return "own"


def test_a_swap_puts_back_the_own_attribute_or_none():
    own_before = vars(Child)["own"]
    swaps = Swaps([(Child, "own", lambda self: "fast"), (Child, "method", lambda self: "fast")])
    with swaps:
        assert Child().own() == "fast" and Child().method() == "fast"
        assert len(swaps.leftovers()) == 2
    assert vars(Child)["own"] is own_before and "method" not in vars(Child)  # inherited again, not copied down
    assert Child().method() == "base" and swaps.leftovers() == []


def test_a_patch_laid_over_a_swap_is_left_in_place():
    swap = Swap(Child, "own", lambda self: "fast")
    swap.install()
    theirs = lambda self: "theirs"  # noqa: E731
    Child.own = theirs
    swap.uninstall()
    try:
        assert vars(Child)["own"] is theirs and swap.leftover() is None
    finally:
        Child.own = swap.original


def test_swaps_install_all_or_none():
    class Locked:
        __slots__ = ()

    before = dict(vars(Child))
    swaps = Swaps([(Child, "own", lambda self: "fast"), (Locked(), "x", 1)])  # the second cannot be set
    with pytest.raises((AttributeError, TypeError)):
        swaps.install()
    assert dict(vars(Child)) == before


def test_shared_swaps_install_once_for_every_user_and_end_with_the_last():
    made, ended = [], []

    def make():
        made.append(1)
        return Swaps([(Child, "own", lambda self: "fast")])

    shared = SharedSwaps(make, lambda: ended.append(1))
    barrier, results = threading.Barrier(2), []

    def user():
        with shared:
            barrier.wait(10)
            results.append(Child().own())
            barrier.wait(10)

    threads = [threading.Thread(target=user) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == ["fast", "fast"] and made == [1] and ended == [1]
    assert Child().own() == "own" and shared.users == 0 and shared.swaps is None
