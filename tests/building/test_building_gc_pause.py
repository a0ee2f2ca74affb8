"""gc-pause (ms_loadpatch/strategy/building/gc_pause.py): cyclic gc paused
for a whole accelerated load, held until the last of overlapping loads
ends, and the load's objects handed to the oldest generation when it
resumes; left alone when switched off or when the application disabled gc.
"""

import pytest
from _building_helpers import (
    checkpoints,  # noqa: F401  (a fixture)
    seeded_load,
)
from mindspore import nn

from ms_loadpatch.strategy import building, reports
from ms_loadpatch.testing import assert_same_model

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


def _gc_enabled_at_set_train(monkeypatch, cls):
    """gc.isenabled() each time the loaded class's set_train runs (both
    libraries call model.set_train(False) as their load's last step)."""
    import gc

    seen = []
    set_train = nn.Cell.set_train

    def recording(self, *args, **kwargs):
        if type(self) is cls:
            seen.append(gc.isenabled())
        return set_train(self, *args, **kwargs)

    monkeypatch.setattr(nn.Cell, "set_train", recording)
    return seen


@pytest.mark.parametrize("arch", ["mixtral", "vae"])
def test_gc_paused_for_the_whole_load(checkpoints, monkeypatch, arch):
    """gc-pause holds from an accelerated load's first line to its last (not
    only while the model is built) and resumes after it; a load leaves gc
    alone when gc-pause is switched off or the application disabled gc."""
    import gc

    cls, path = checkpoints[arch]
    seen = _gc_enabled_at_set_train(monkeypatch, cls)
    seeded_load(cls, path)
    assert seen == [False] and reports.last_report().gc_paused
    assert gc.isenabled() and building.leftovers() == []
    assert "gc paused" in reports.last_report().summary()

    seen.clear()
    seeded_load(cls, path, off="gc-pause")
    assert seen == [True] and not reports.last_report().gc_paused
    assert "gc paused" not in reports.last_report().summary()

    seen.clear()
    gc.disable()
    try:
        seeded_load(cls, path)
        assert not gc.isenabled()  # the application's setting, kept
    finally:
        gc.enable()
    assert seen == [False] and not reports.last_report().gc_paused


def test_gc_pause_held_until_the_last_overlapping_load_ends(checkpoints, monkeypatch):
    """Loads in two threads overlap and the first one ends while the second
    is still loading: collection stays paused for the second (which a pause
    that each load restores on its own would resume), and the last one to
    end resumes it."""
    import gc
    import threading

    cls, path = checkpoints["qwen2"]
    at_end = {"load-a": threading.Event(), "load-b": threading.Event()}
    a_done = threading.Event()
    set_train = nn.Cell.set_train
    results = {}

    def overlapping(self, *args, **kwargs):
        name = threading.current_thread().name
        if type(self) is cls and name in at_end:
            at_end[name].set()
            if name == "load-a":
                assert at_end["load-b"].wait(300)  # both loads are inside; a ends first
            else:
                assert a_done.wait(300)
                results["load-b gc after a ended"] = gc.isenabled()
        return set_train(self, *args, **kwargs)

    monkeypatch.setattr(nn.Cell, "set_train", overlapping)

    def load():
        name = threading.current_thread().name
        try:
            results[name] = cls.from_pretrained(path)
            results[name + " gc after"] = gc.isenabled()
        except BaseException as exc:  # reported by the assertions below
            results[name] = exc
        finally:
            if name == "load-a":
                a_done.set()

    a = threading.Thread(target=load, name="load-a")
    a.start()
    assert at_end["load-a"].wait(300)
    b = threading.Thread(target=load, name="load-b")
    b.start()
    a.join(300)
    b.join(300)
    assert not a.is_alive() and not b.is_alive()
    assert results["load-a gc after"] is False  # load b still holds the pause
    assert results["load-b gc after a ended"] is False
    assert results["load-b gc after"] is True
    assert gc.isenabled() and building.leftovers() == []
    assert_same_model(results["load-a"], results["load-b"])


def test_gc_resumes_with_the_load_in_the_oldest_generation(checkpoints):
    """When the pause ends, the objects made meanwhile (the model) are handed
    to the oldest generation instead of being traversed by the next young
    collection; the application's own frozen objects stay frozen, and then
    the hand-over is skipped."""
    import gc

    cls, path = checkpoints["mixtral"]
    gc.collect()
    model = seeded_load(cls, path)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and building.leftovers() == []
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    cells = [cell for _, cell in model.cells_and_names()]
    assert all(id(cell) in oldest for cell in cells)
    del oldest

    gc.collect()
    kept = [object()]  # a container the application froze
    gc.freeze()  # the application's (e.g. before forking workers)
    try:
        model = seeded_load(cls, path)
        assert gc.get_freeze_count() > 0 and gc.isenabled()
        assert all(o is not kept for o in gc.get_objects())  # still frozen (get_objects: generations 0-2)
        young = {id(o) for o in gc.get_objects(generation=0)} | {id(o) for o in gc.get_objects(generation=1)}
        assert any(id(cell) in young for _, cell in model.cells_and_names())  # left to collections
    finally:
        gc.unfreeze()
