"""Fast construction's probes and switches (ms_loadpatch/strategy/building/):
every technique passes its probe on this mindspore; a broken fast path is
caught by its probe; a failed probe skips the technique and the load is
still identical; MS_LOADPATCH_TECHNIQUES_OFF switches techniques off.
"""

import copy
import gc

import pytest
from _building_helpers import (
    checkpoints,  # noqa: F401  (a fixture)
    techniques_off,
)
from mindspore import nn

from ms_loadpatch.strategy import building, reports, switch
from ms_loadpatch.strategy.building import batched_draws, deferred_writes, init_pass, probe
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
from ms_loadpatch.strategy.building.swaps import Swap
from ms_loadpatch.strategy.probe_cache import ProbeCache
from ms_loadpatch.testing import assert_same_model, load_both

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


NAMES = [t.name for t in building.TECHNIQUES]
# status also reports the init pass's deferred writes and batched draws
ROWS = NAMES + [deferred_writes.NAME, init_pass.BATCHED_DRAWS]


@pytest.mark.matrix
def test_every_probe_passes_on_this_mindspore():
    rows = building.technique_status()
    assert [r.name for r in rows] == ROWS
    for row in rows:
        assert row.libraries == () and row.reason.startswith("probe passed"), row  # libraries: the table's
        assert row.state == "active", row
        assert row.description


def test_env_var_switches_techniques_off():
    with techniques_off("signature-cache, gc-pause"):
        states = {r.name: r.state for r in building.technique_status()}
        assert states == {
            "cell-init-template": "active",
            "signature-cache": "off",
            "primitive-defaults": "active",
            "flat-name-walk": "active",
            "sibling-clone": "active",
            "gc-pause": "off",
            "host-factories": "active",
            "deferred-writes": "active",
            "batched-draws": "active",
        }
        assert [t.name for t in building.active_techniques()] == [
            "cell-init-template",
            "primitive-defaults",
            "flat-name-walk",
            "sibling-clone",
        ]
        assert [t.name for t in building.active_techniques(early=True)] == ["host-factories"]
    with techniques_off("deferred-writes"):
        assert deferred_writes.usable_kinds() == frozenset()
        assert {r.name: r.state for r in building.technique_status()}["deferred-writes"] == "off"
    with techniques_off("all"):
        rows = building.technique_status()
        assert [r.name for r in rows] == ROWS
        assert {r.state for r in rows} == {"off"}
        assert all(switch.ENV_VAR in r.reason for r in rows)
        original = vars(nn.Cell)["__init__"]
        with CONSTRUCTION_LOCK, building.fast_construction():
            assert vars(nn.Cell)["__init__"] is original


class _WrongPrefixTemplate(building.CellInitTemplate):
    """A fast Cell.__init__ that forgets one per-instance value."""

    def install(self):
        installed = super().install()
        fast = nn.Cell.__init__

        def __init__(cell, auto_prefix=True, flags=None):
            fast(cell, auto_prefix, flags)
            cell.__dict__["_auto_prefix"] = True

        self.swap.uninstall()  # the broken one in its place, through the same primitive
        self.swap = Swap(nn.Cell, "__init__", __init__)
        self.swap.install()
        return installed


class _UnprefixedWalk(building.FlatNameWalk):
    """A name walk that drops the prefix."""

    def install(self):
        original = self.original
        self.swap = Swap(
            nn.Cell, "update_parameters_name", lambda cell, prefix="", recurse=True: original(cell, "", recurse)
        )
        self.swap.install()
        return True


class _ValueChangingWalk(building.FlatNameWalk):
    """A name walk that also overwrites the values of Parameters made over tensors."""

    def install(self):
        original = self.original

        def walk(cell, prefix="", recurse=True):
            original(cell, prefix, recurse)
            for _, param in cell.parameters_and_names():
                if not param.has_init:
                    param.asnumpy()[...] = 0

        self.swap = Swap(nn.Cell, "update_parameters_name", walk)
        self.swap.install()
        return True


class _SharedContainers(building.CellInitTemplate):
    """A template whose containers are shared between cells instead of fresh."""

    def install(self):
        self.fresh = tuple((key, (lambda shared=factory(): shared)) for key, factory in self.fresh)  # noqa: B008
        return super().install()


class _SharedParameters(building.SiblingClone):
    """Copies that share the first cell's parameters, and no check of recipes."""

    def _learn(self, cell, first, snapshot):
        self.shared = {}
        recipe = self._write_recipe(cell)
        return ("recipe" if recipe is not None else "never", recipe, snapshot, False)

    def _make(self, item, made):
        if item[0] == "param":
            return self.shared.setdefault(id(item), super()._make(item, made))
        return super()._make(item, made)


class _CopiedReferences(building.SiblingClone):
    """Copies that hold an equal copy of an object the real builds share (the config)."""

    def _fill_cell(self, cell, recipe, made):
        super()._fill_cell(cell, recipe, made)
        for key, value in list(vars(cell).items()):
            if type(value).__name__ == "Settings":  # the probe model's config
                vars(cell)[key] = copy.copy(value)


class _SharedOwnCopies(building.SiblingClone):
    """Copies from a recipe even where the real builds held different objects."""

    def _learn(self, cell, first, snapshot):
        recipe = self._write_recipe(cell)
        return ("recipe" if recipe is not None else "never", recipe, snapshot, False)


class _SharedTensors(building.SiblingClone):
    """Copies that share one tensor per recipe entry instead of each making its own."""

    def _make(self, item, made):
        if item[0] == "tensor":
            made[item[1]] = vars(self).setdefault("tensors", {}).setdefault(id(item), super()._make(item, made))
            return made[item[1]]
        return super()._make(item, made)


class _ZeroTensors(_SharedOwnCopies):
    """Copies whose tensors have the right shape and dtype and the wrong values (no check of recipes)."""

    def _make(self, item, made):
        made_item = super()._make(item, made)
        if item[0] == "tensor":
            made[item[1]] = made_item = made_item * 0
        return made_item


class _DefaultsWithoutAttributes(building.PrimitiveDefaults):
    """Defaults put into the Python dicts only, not registered on the C++ side (add_prim_attr skipped)."""

    def _plan(self, cls):
        plan = super()._plan(cls)
        return plan and (plan[0], "_set_prim_arg", *plan[2:])


class _DefaultsWithoutInitAttrs(building.PrimitiveDefaults):
    """Primitives whose init_attrs lack the defaults."""

    def _build(self, cls, plan, init, prim):
        super()._build(cls, plan, init, prim)
        prim.init_attrs.clear()


@pytest.mark.parametrize(
    "broken",
    [
        _DefaultsWithoutAttributes,
        _DefaultsWithoutInitAttrs,
        _WrongPrefixTemplate,
        _UnprefixedWalk,
        _ValueChangingWalk,
        _SharedContainers,
        _SharedParameters,
        _CopiedReferences,
        _SharedOwnCopies,
        _SharedTensors,
        _ZeroTensors,
    ],
)
def test_probe_catches_a_wrong_fast_path(broken):
    reason = probe.run_probe(broken())
    assert reason is not None and ("differs" in reason or "registries" in reason), reason
    for name in ("__init__", "update_parameters_name"):  # mindspore's again after the probe
        assert vars(nn.Cell)[name].__module__.startswith("mindspore"), name


def test_late_techniques_are_probed_with_the_active_early_ones():
    host = next(t for t in building.TECHNIQUES if t.name == "host-factories")
    assert building.probe_result(host) is None
    late = [t for t in building.TECHNIQUES if not t.engages_early]
    made = host.made
    assert all(reason is None for reason in probe.run_probes(late, alongside=[host]).values())
    assert host.made > made  # the probe model's factories were served in the probe build, as in a real build
    assert building.leftovers() == []


def test_probes_run_with_collection_paused(monkeypatch):
    """The probes' renderings would trigger a full collection of everything
    imported; they run under the pause a load holds, and resume it after."""
    seen = []
    monkeypatch.setattr(building, "_probe_results", ProbeCache())
    for technique in building.TECHNIQUES:
        prepare = technique.prepare
        monkeypatch.setattr(technique, "prepare", lambda prepare=prepare: seen.append(gc.isenabled()) or prepare())
    assert gc.isenabled()
    assert all(row.state == "active" for row in building.technique_status())
    assert seen and not any(seen)
    assert gc.isenabled() and building.leftovers() == []


def test_techniques_that_differ_only_together_all_fail(monkeypatch):
    monkeypatch.setattr(probe, "_compare", lambda techniques, alongside=(): "differs" if len(techniques) > 1 else None)
    late = [t for t in building.TECHNIQUES if not t.engages_early]
    results = probe.run_probes(late)
    assert all(results[t.name] == "only together with the others: differs" for t in late), results


def test_failed_probe_skips_and_load_stays_identical(checkpoints, monkeypatch):
    failing = {name: "simulated probe failure" for name in NAMES}
    monkeypatch.setattr(building, "_probe_results", ProbeCache(failing))
    failed_writes = (frozenset(), {kind: "simulated probe failure" for kind in deferred_writes.KINDS})
    monkeypatch.setattr(deferred_writes, "_verdicts", ProbeCache({"kinds": failed_writes}))
    monkeypatch.setattr(batched_draws, "_checks", ProbeCache({"checks": ("simulated probe failure", False)}))
    rows = building.technique_status()
    assert {r.state for r in rows} == {"skipped"} and all("simulated" in r.reason for r in rows)
    installs = []
    for technique in building.TECHNIQUES:
        monkeypatch.setattr(technique, "install", lambda t=technique: installs.append(t.name) or False)
    cls, path = checkpoints["mixtral"]
    reference, accelerated = load_both(lambda: cls.from_pretrained(path))
    assert installs == []
    assert reports.last_report().tensors_assigned > 0
    assert reports.last_report().writes_deferred == 0
    assert_same_model(reference, accelerated)
