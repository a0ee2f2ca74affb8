"""The process state a load may change and must put back, and calls that
must raise: shared by the bad-input, fault, interrupt, build-then-fill and
adapter tests."""

import os
import sys
import threading

import mindspore as ms
import pytest
import wrapt

import ms_loadpatch
from ms_loadpatch import core
from ms_loadpatch.glue.build_then_fill import BuildThenFillCall
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
from ms_loadpatch.strategy.lane import lane
from ms_loadpatch.strategy.load import Load


def process_state() -> dict:
    return {
        "enabled": ms_loadpatch.is_enabled(),
        "handles": {key: handle for key, (_, handle) in core._PATCHER._handles.items()},
        "env": dict(os.environ),
        "modules": set(sys.modules),
    }


def _lock_is_free() -> bool:
    result = []

    def probe():  # from another thread: the lock is re-entrant for its owner
        got = CONSTRUCTION_LOCK.acquire(blocking=False)
        if got:
            CONSTRUCTION_LOCK.release()
        result.append(got)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result == [True]


def assert_state_restored(before: dict) -> None:
    """Every target still patched by the same, still installed, handle;
    Parameter's no-init flag back on; the construction lock free; no
    load or build-then-fill call left current; the environment unchanged."""
    after = process_state()
    assert after["enabled"] == before["enabled"], f"enabled {before['enabled']} -> {after['enabled']}"
    # A module first imported during the call gets its targets patched by the
    # post-import hook, as it would had it been imported before.
    imported = after["modules"] - before["modules"]
    added = after["handles"].keys() - before["handles"].keys()
    unexplained = sorted(key for key in added if key.partition(":")[0] not in imported)
    assert not unexplained, f"targets patched by the call: {unexplained}"
    assert before["handles"].keys() <= after["handles"].keys(), "a patched target was unpatched by the call"
    for key, handle in before["handles"].items():
        assert after["handles"][key] is handle, key
        target = next(t for t in core.TARGETS if t.key == key)
        _, _, installed = wrapt.resolve_path(__import__(target.module, fromlist=["_"]), target.path)
        assert installed is handle, f"{key}: {installed!r} is installed instead of the handle"
    assert getattr(ms.Parameter, "init_param", True) is True, "no_init_parameters' class flag left off"
    assert _lock_is_free(), "construction lock still held"
    assert Load.current() is None, "a load is still current"
    assert BuildThenFillCall.current() is None, "a build-then-fill call is still current"
    build = lane.build
    held = build is not None and (
        build.ledger is not None or build.fast_assign is not None or build.foreign or build.owing or build.replay
    )
    assert not held, "the thread's build session still holds a build's state"
    assert not lane.probing_cell_passes, "the cell-passes probe is still marked running"
    changed = {k for k in before["env"].keys() | after["env"].keys() if before["env"].get(k) != after["env"].get(k)}
    assert not changed, f"environment variables changed: {sorted(changed)}"
    from ms_loadpatch.strategy import building

    left = building.leftovers()
    assert left == [], (
        f"fast construction left behind: {left}"
    )  # fast construction: nn.Cell methods, class __init__s, gc, counts


def raised_alike(unpatched_call, patched_call):
    """The error of `unpatched_call()` (plugin off), after checking that
    `patched_call()` (plugin on), run from the same global random state,
    raises the same (type and message), leaves numpy's, Python's and
    mindspore's generators where the unpatched call did, and leaves nothing
    of the plugin behind."""
    from ms_loadpatch.testing import global_random_state, random_state_difference, set_global_random_state

    start = global_random_state()
    with ms_loadpatch.disabled():
        unpatched = raised(unpatched_call)
    after_unpatched = global_random_state()
    set_global_random_state(start)
    before = process_state()
    patched = raised(patched_call)
    assert_state_restored(before)
    assert type(patched) is type(unpatched) and str(patched) == str(unpatched)
    moved = random_state_difference(after_unpatched, global_random_state())
    assert moved is None, f"the patched call leaves {moved} elsewhere than the unpatched call"
    return unpatched


def raised(call):
    """The exception `call()` raises; fails the test if it returns (a model would be half loaded)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - the exception is what is being tested
        return exc
    pytest.fail(f"no exception: returned {type(result).__name__}")


def random_state_digest() -> str:
    """One string for numpy's, Python's and mindspore's default generator's states, to compare across processes."""
    import hashlib

    from ms_loadpatch.testing import global_random_state

    numpy_state, python_state, generator = global_random_state()
    digest = hashlib.sha256(numpy_state[1].tobytes() + repr(numpy_state[2:]).encode() + repr(python_state).encode())
    if generator is not None:
        digest.update(generator.tobytes())
    return digest.hexdigest()
