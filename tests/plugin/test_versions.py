"""The version gate and the per-version technique.

Simulated versions and simulated missing features here; the real versions
are run by `.ci/matrix` (the tests marked `matrix` below check the installed
mindspore itself: it gets the fast path, or the gate refuses it cleanly)."""

import logging
import sys
import textwrap

import pytest
from _helpers import report_of, run_python
from packaging.version import Version

from ms_loadpatch import api_probes, core, versions
from ms_loadpatch.api_verdict import _verdicts as api_verdicts
from ms_loadpatch.api_verdict import api_verdict
from ms_loadpatch.targets import TARGETS

TF_FROM_PRETRAINED = "mindone.transformers.modeling_utils:PreTrainedModel.from_pretrained"


@pytest.fixture
def fresh_techniques():
    """API verdicts probed afresh for the test; construction probes it ran (under an nn.Cell the test changed)
    forgotten after it, the ones known before kept: a later test must meet this process's own answers."""
    building = sys.modules.get("ms_loadpatch.strategy.building")
    kept = building._probe_results.as_dict() if building is not None else {}
    api_verdicts.forget()
    yield
    api_verdicts.forget()
    building = sys.modules.get("ms_loadpatch.strategy.building")
    if building is not None:
        building._probe_results.forget()
        building._probe_results.update(kept)


def _fake_versions(monkeypatch, fake):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: Version(fake[d]) if d in fake else real(d))


# -- ranges


@pytest.mark.parametrize(
    "version,accepted",
    [
        ("2.6.0", False),
        ("2.7.0", True),
        ("2.7.1", True),
        ("2.7.1.post1", True),
        ("2.7.2", True),
        ("2.8.0", True),
        ("2.9.0", True),
        ("2.9.1", True),
        ("2.10.0", True),
        ("2.11.0", False),
        ("3.0.0", False),
    ],
)
def test_mindspore_range(monkeypatch, version, accepted):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    _fake_versions(monkeypatch, {"mindspore": version, "mindone": "0.5.0"})
    result = versions.check()
    assert result.ok is accepted
    if not accepted:
        assert f"mindspore {version} is " in result.refusal
        assert f"the supported range {versions.SUPPORTED['mindspore']}" in result.refusal


@pytest.mark.matrix
@pytest.mark.parametrize(
    "version,accepted",
    [
        ("2.7.1.post1", True),
        ("2.7.0.post2", True),
        ("2.7.1+cpu", True),
        ("2.7.1.post1+ascend.910b", True),
        ("2.10.0+cpu", True),
        ("2.10.0.post1", True),
        ("2.10.1+cpu", True),
        ("2.6.0.post1", False),
        ("2.6.9+cpu", False),
        ("2.7.0rc1", False),
        ("2.11.0+cpu", False),
        ("2.11.0.post1", False),
        ("2.11.0rc1", False),
        ("2.11.0.dev0", False),
    ],
)
def test_post_and_local_releases_follow_their_release(monkeypatch, version, accepted):
    """A post release (2.7.1.post1) or a local build (2.7.1+cpu) of a
    supported release passes the gate with it; one of a refused release, or a
    pre-release of the first refused minor, does not. On every matrix cell:
    the packaging installed there parses and compares them the same way."""
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    _fake_versions(monkeypatch, {"mindspore": version, "mindone": "0.5.0"})
    result = versions.check()
    assert result.ok is accepted, result.refusal
    assert result.versions["mindspore"] == version
    if not accepted:
        assert f"mindspore {version} is " in result.refusal


@pytest.mark.parametrize("version", ["0.5.0.post1", "0.5.0+local", "0.5.3"])
def test_mindone_post_and_local_releases_pass(monkeypatch, version):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    _fake_versions(monkeypatch, {"mindspore": "2.7.1.post1", "mindone": version})
    assert versions.check().ok


def test_newer_than_tested_is_refused_naming_the_newest_and_the_override(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    _fake_versions(monkeypatch, {"mindspore": "2.11.0", "mindone": "0.5.0"})
    refusal = versions.check().refusal
    newest = max(versions.TESTED["mindspore"], key=Version)
    assert (
        f"mindspore 2.11.0 is outside the supported range {versions.SUPPORTED['mindspore']}, newer than the newest "
        f"tested ({newest})"
    ) in refusal
    assert f"set {versions.ALLOW_UNTESTED_ENV_VAR}=1" in refusal
    _fake_versions(monkeypatch, {"mindspore": "2.6.0", "mindone": "0.5.0"})
    assert "mindspore 2.6.0 is outside the supported range" in versions.check().refusal


@pytest.mark.parametrize(
    "mindone,accepted",
    [("0.5.0.dev0+g0a1b2c3", True), ("0.5.0.dev7", True), ("0.6.0.dev0", False), ("0.4.9.dev1", False)],
)
def test_a_development_build_of_a_supported_release_is_accepted_for_its_fingerprints(monkeypatch, mindone, accepted):
    """mindone from source: a .devN (and +local) build of a release in the range passes the gate, noted
    as development (the fingerprints then decide); one of a release outside it is refused."""
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    _fake_versions(monkeypatch, {"mindspore": "2.10.0", "mindone": mindone})
    result = versions.check()
    assert result.ok is accepted, result
    assert bool(result.development) is accepted
    if accepted:
        assert result.development[0].startswith(f"mindone {mindone} is a development build of ")
        assert versions.meets("mindone", Version(mindone), str(versions.SUPPORTED["mindone"]))
    else:
        assert f"mindone {mindone} is outside the supported range" in result.refusal


@pytest.mark.parametrize("value,accepted", [("1", True), ("true", True), ("0", False), ("", False)])
def test_override_accepts_untested_versions_visibly(monkeypatch, value, accepted):
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV_VAR, value)
    _fake_versions(monkeypatch, {"mindspore": "2.11.0", "mindone": "0.6.0"})
    result = versions.check()
    assert result.ok is accepted
    if accepted:
        assert len(result.untested) == 2 and "mindspore 2.11.0" in result.untested[0]
    else:
        assert not result.untested


def test_overridden_version_still_runs_every_probe(monkeypatch, fresh_techniques):
    """The override accepts the version, not the technique: a probe that
    fails still skips targets."""
    import mindone.transformers.modeling_utils  # noqa: F401

    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV_VAR, "1")
    _fake_versions(monkeypatch, {"mindspore": "2.11.0"})
    _drop_no_init(monkeypatch)
    api_verdicts.forget()
    patcher = core._Patcher(TARGETS)
    try:
        assert patcher.enable() is True
        rows = {row["target"]: row for row in patcher.status()["targets"]}
        assert rows[TF_FROM_PRETRAINED]["state"] == "skipped"
        assert "lacks mindspore.nn.utils.no_init_parameters" in rows[TF_FROM_PRETRAINED]["reason"]
        assert patcher.status()["untested"]
    finally:
        patcher.disable()


def test_tested_versions_cover_the_range_edges():
    """The matrix runs the first and the last supported version: the newest
    supported one is the newest tested one (the policy for newer ones)."""
    tested = sorted(Version(v) for v in versions.TESTED["mindspore"])
    assert all(versions.SUPPORTED["mindspore"].contains(v) for v in tested)
    assert tested[0] == Version("2.7.0")
    assert not versions.SUPPORTED["mindspore"].contains(Version(f"{tested[-1].major}.{tested[-1].minor + 1}.0"))


def test_matrix_pythons_are_tested_and_have_the_versions():
    """Every Python the matrix maps a mindspore to is a tested one, for a
    tested mindspore; the floors cell is a tested version; every tested
    Python runs some cell or, for the default, the README suite."""
    tested = set(versions.TESTED["mindspore"])
    assert set(versions.MATRIX_PYTHONS) <= tested
    used = set(versions.MATRIX_PYTHONS.values()) | {versions.MATRIX_DEFAULT_PYTHON}
    assert used == set(versions.TESTED_PYTHONS)
    assert versions.FLOORS_CELL in tested
    oldest = min(versions.TESTED_PYTHONS, key=Version)
    assert versions.MATRIX_PYTHONS.get(versions.FLOORS_CELL) == oldest, "the floors run on the oldest Python"
    assert min(tested, key=Version) == versions.FLOORS_CELL, "the floors run with the oldest mindspore"
    # mindspore publishes no 3.12 wheel before 2.7.2, none of 2.10 for 3.9
    for mindspore, python in versions.MATRIX_PYTHONS.items():
        if python == "3.12":
            assert Version(mindspore) >= Version("2.7.2"), mindspore
        if python == "3.9":
            assert Version(mindspore) < Version("2.10"), mindspore


def test_tested_mindone_is_supported():
    assert versions.TESTED["mindone"]
    for version in versions.TESTED["mindone"]:
        assert versions.SUPPORTED["mindone"].contains(Version(version)), version


# -- feature probes: a mindspore lacking what the strategy uses gets mindone's own path


def test_all_features_present_by_default(fresh_techniques):
    import mindspore as ms

    if not versions.check().ok:
        pytest.skip("refused by the gate")
    chosen = api_verdict()
    assert chosen.problems == () and chosen.refusal is None
    assert chosen.mindspore == ms.__version__
    assert (chosen.assign, chosen.cast, chosen.construct) == (
        "Parameter.set_data (transformers: then its lazy initializer dropped, as Parameter.init_data does)",
        "Tensor.set_dtype",
        "Parameter.init_param scoped to the building thread (no_init_parameters' flag)",
    )


def _drop_no_init(monkeypatch):
    import mindspore.nn.utils

    monkeypatch.delattr(mindspore.nn.utils, "no_init_parameters")


def _drop_set_data(monkeypatch):
    import mindspore as ms

    monkeypatch.setattr(ms.Parameter, "set_data", None)


def _drop_set_dtype(monkeypatch):
    import mindspore as ms

    monkeypatch.setattr(ms.Tensor, "set_dtype", None)


def _drop_from_numpy(monkeypatch):
    import mindspore as ms

    monkeypatch.setattr(ms.Tensor, "from_numpy", None)


def _drop_bfloat16(monkeypatch):
    from mindspore.common import np_dtype

    monkeypatch.delattr(np_dtype, "bfloat16")


def _invalid_bfloat16(monkeypatch):
    from mindspore.common import np_dtype

    monkeypatch.setattr(np_dtype, "np_dtype_valid", lambda warn: False)


def _bfloat16_maps_elsewhere(monkeypatch):
    import mindspore as ms
    import numpy as np

    real = ms.Tensor.from_numpy
    monkeypatch.setattr(ms.Tensor, "from_numpy", staticmethod(lambda a: real(np.asarray(a, dtype=np.float32))))


@pytest.mark.parametrize(
    "simulate,expected",
    [
        (_drop_no_init, "lacks mindspore.nn.utils.no_init_parameters"),
        (_drop_set_data, "lacks Parameter.set_data"),
        (_drop_set_dtype, "lacks Tensor.set_dtype"),
        (_drop_from_numpy, "lacks Tensor.from_numpy"),
        (_drop_bfloat16, "lacks mindspore.common.np_dtype.bfloat16"),
        (_invalid_bfloat16, "lacks a usable mindspore.common.np_dtype.bfloat16"),
        (_bfloat16_maps_elsewhere, "Tensor.from_numpy(np_dtype.bfloat16 array) gives Float32, not BFloat16"),
    ],
)
def test_unusable_mindspore_is_reported(monkeypatch, fresh_techniques, simulate, expected):
    simulate(monkeypatch)
    chosen = api_verdict()
    assert any(problem.reason.startswith(expected) for problem in chosen.problems), chosen.problems
    assert chosen.refusal.startswith(f"mindspore {chosen.mindspore} cannot take the fast path: ")
    for library in versions.LIBRARIES:
        assert expected in chosen.refusal_for(library)


def _cell_gets_half(monkeypatch):
    import mindspore as ms

    monkeypatch.setattr(ms.nn.Cell, "half", lambda self: self, raising=False)


def _cell_to_probe_fails(monkeypatch):
    """A Cell.to whose result the fast path does not reproduce (it also casts integer parameters)."""
    import mindspore as ms

    def to(self, dtype):
        for param in self.get_parameters():
            param.set_dtype(dtype)
        return self

    monkeypatch.setattr(ms.nn.Cell, "to", to, raising=False)


def _fill_keeps_the_initializer(monkeypatch):
    """The lazy initializer left in place after set_data: copies would rebuild from it."""
    from ms_loadpatch.strategy import assign

    monkeypatch.setattr(assign, "fill", lambda param, value: param.set_data(value))


@pytest.mark.parametrize(
    "simulate,technique,expected",
    [
        (_cell_gets_half, api_probes.MIXIN_METHODS, "nn.Cell.half shadows mindone's ModuleUtilsMixin.half"),
        (
            _fill_keeps_the_initializer,
            api_probes.LAZY_FILL,
            "filling a lazy parameter: its probe failed (copy of a "
            "parameter filled by the fast path does not have its value)",
        ),
        (
            _cell_to_probe_fails,
            api_probes.CELL_TO,
            "nn.Cell.to shadows mindone's ModuleUtilsMixin.to and its probe failed",
        ),
    ],
)
def test_mindspore_shadowing_a_mixin_method_skips_transformers_only(
    monkeypatch, fresh_techniques, simulate, technique, expected
):
    """Per-library gate: a problem of mindone.transformers' path leaves
    diffusers accelerated; the probe's finding is typed (technique, libraries, reason)."""
    simulate(monkeypatch)
    chosen = api_verdict()
    assert chosen.problems == ()
    assert expected in chosen.refusal_for("transformers")
    assert chosen.refusal_for("diffusers") is None
    (problem,) = chosen.library_problems
    assert (problem.technique, problem.libraries) == (technique, ("transformers",)) and expected in problem.reason
    assert chosen.problem_of(technique) == problem.reason and chosen.draws_problem is None


def test_a_failed_draws_probe_is_named_by_technique(monkeypatch, fresh_techniques):
    """A failed random-draws probe, whatever its reason's wording: the draws
    problem (which gates every build-then-fill call), transformers skipped,
    its status row skipped with the reason, the cell-to row untouched."""
    from ms_loadpatch.strategy.building import draws

    monkeypatch.setattr(draws, "probe", lambda: "seeds went elsewhere")
    chosen = api_verdict()
    assert chosen.draws_problem is not None and "seeds went elsewhere" in chosen.draws_problem
    assert chosen.problem_of(api_probes.CELL_TO) is None
    assert "seeds went elsewhere" in chosen.refusal_for("transformers") and chosen.refusal_for("diffusers") is None
    rows = {row.name: row for row in chosen.rows()}
    assert (
        rows[api_probes.RANDOM_DRAWS].state == "skipped"
        and "seeds went elsewhere" in rows[api_probes.RANDOM_DRAWS].reason
    )
    if api_probes.CELL_TO in rows:
        assert rows[api_probes.CELL_TO].state == "active", rows[api_probes.CELL_TO]


def test_transformers_problem_skips_transformers_targets_only(monkeypatch, fresh_techniques):
    import mindone.diffusers.models.modeling_utils  # noqa: F401
    import mindone.transformers.modeling_utils  # noqa: F401

    _cell_gets_half(monkeypatch)
    api_verdicts.forget()
    patcher = core._Patcher(TARGETS)
    try:
        assert patcher.enable() is True
        status = patcher.status()
        for row in status["targets"]:
            if row["library"] == "transformers":  # pending: a module not imported here (mindone.peft)
                assert row["state"] in ("skipped", "not needed", "pending"), row
            else:
                assert row["state"] in ("patched", "pending"), row  # pending: a module not imported here
        assert status["libraries"]["transformers"]["accelerated"] is False
        assert "nn.Cell.half shadows" in status["libraries"]["transformers"]["reason"]
        assert status["libraries"]["diffusers"]["accelerated"] is True
    finally:
        patcher.disable()


def test_cell_to_target_matches_the_installed_mindspore(fresh_techniques):
    """The nn.Cell.to row is patched exactly where nn.Cell defines `to` (2.10+), "not needed" elsewhere."""
    import mindone.transformers.modeling_utils  # noqa: F401
    import mindspore as ms

    patcher = core._Patcher(TARGETS)
    try:
        with core.disabled():  # only the private patcher's wrappers below
            original = vars(ms.nn.Cell).get("to")
            patcher.enable()
            row = next(r for r in patcher.status()["targets"] if r["target"].endswith(":nn.Cell.to"))
            if original is not None:
                assert row["state"] == "patched", row
                assert patcher.is_handle(vars(ms.nn.Cell)["to"])
            else:
                assert row["state"] == "not needed" and "no `to`" in row["reason"], row
                assert "to" not in vars(ms.nn.Cell)
            patcher.disable()
            assert vars(ms.nn.Cell).get("to") is original
    finally:
        patcher.disable()


def test_cell_to_skip_probe_tells_a_skip_that_changes_the_tree():
    """cell_to_keeping_lazy skips the cells its pass would leave untouched; the
    probe compares that with the full walk, and a skip that drops a needed
    cast or buffer replacement fails it."""
    import mindspore as ms

    if "to" not in vars(ms.nn.Cell):
        pytest.skip("this mindspore's nn.Cell has no `to`: cell_to_keeping_lazy is not used")
    from ms_loadpatch.strategy.assign import cell_to_keeping_lazy

    assert api_probes._probe_cell_to_skip(ms, cell_to_keeping_lazy) is None

    def skips_every_cell(cell, dtype, skip_untouched=True):
        return cell if skip_untouched else cell_to_keeping_lazy(cell, dtype, skip_untouched=False)

    assert "unlike the full walk" in api_probes._probe_cell_to_skip(ms, skips_every_cell)


def test_unusable_mindspore_skips_every_target(monkeypatch, fresh_techniques, caplog):
    import mindone.transformers.modeling_utils as mu

    before = mu.PreTrainedModel.__dict__["from_pretrained"]  # as the process-wide patcher left it
    _drop_no_init(monkeypatch)
    api_verdicts.forget()  # importing mindone above probed the complete mindspore
    patcher = core._Patcher(TARGETS)  # a private instance: the process-wide one stays as it is
    with caplog.at_level(logging.WARNING, logger="ms_loadpatch"):
        assert patcher.enable() is True  # versions are fine; the targets cannot be applied
    try:
        rows = {row["target"]: row for row in patcher.status()["targets"]}
        assert rows[TF_FROM_PRETRAINED]["state"] == "skipped"
        assert "lacks mindspore.nn.utils.no_init_parameters" in rows[TF_FROM_PRETRAINED]["reason"]
        assert not patcher._handles
        assert mu.PreTrainedModel.__dict__["from_pretrained"] is before
        warnings = [r for r in caplog.records if "lacks" in r.getMessage()]
        assert len(warnings) == 1, "one warning, not one per target"
    finally:
        patcher.disable()


# -- the installed mindspore, as .ci/matrix runs it on each version


@pytest.mark.matrix
def test_installed_mindspore_gets_the_fast_path(fresh_techniques):
    gate = versions.check()
    if not gate.ok:
        pytest.skip(f"refused by the gate: {gate.refusal} (test_refused_version_is_clean covers it)")
    import mindspore as ms
    import numpy as np
    from mindspore.common import np_dtype
    from mindspore.common.initializer import initializer
    from mindspore.nn.utils import no_init_parameters

    assert gate.versions["mindspore"] == ms.__version__
    chosen = api_verdict()
    assert chosen.problems == (), chosen.problems
    assert chosen.library_problems == (), chosen.library_problems  # every probe (cell_to, fill) passes here
    # the behaviour the strategy relies on, by value: set_data on a lazy
    # parameter really loads it (other ways report success and stay lazy)
    values = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    for source, dtype in ((values, ms.float32), (values.astype(np_dtype.bfloat16), ms.bfloat16)):
        with no_init_parameters():
            param = ms.Parameter(initializer("normal", (2, 3), ms.float32), name="w")
        assert param.has_init
        if dtype != param.dtype:
            param.set_dtype(dtype)  # metadata only on a lazy parameter
        tensor = ms.Tensor.from_numpy(source)
        assert tensor.dtype == dtype
        param.set_data(tensor)
        assert not param.has_init and param.dtype == dtype
        expected = source.astype(np.float32)
        assert np.array_equal(param.astype(ms.float32).asnumpy(), expected)
        assert np.array_equal(param.astype(ms.float32).asnumpy(), expected), "value changed at second use"


REFUSAL_PROBE = textwrap.dedent(
    """
    import importlib.metadata as metadata, json, sys
    real_version = metadata.version
    metadata.version = lambda name: "2.11.0" if name == "mindspore" else real_version(name)
    import ms_loadpatch
    enabled = ms_loadpatch.enable()
    imported = None
    try:
        import mindone.transformers.modeling_utils as mu
        import mindone.diffusers.models.modeling_utils as du
        imported = all(type(f).__module__.split(".")[0] != "wrapt" for f in (
            mu.PreTrainedModel.__dict__["from_pretrained"], du.ModelMixin.__dict__["from_pretrained"],
            vars(mu.nn.Cell).get("to")))
    except Exception as exc:
        imported = f"mindone import failed: {type(exc).__name__}"
    print("REPORT", json.dumps({"enabled": enabled, "unpatched": imported, "status": ms_loadpatch.status()}))
    """
)


@pytest.mark.matrix
def test_refused_version_is_clean(monkeypatch):
    """A mindspore newer than the newest tested one (simulated in a fresh
    process on top of the installed mindspore and mindone): nothing patched,
    one warning, mindone exactly as without the plugin."""
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    proc = run_python(REFUSAL_PROBE)
    report = report_of(proc)
    assert report["enabled"] is False
    status = report["status"]
    assert status["enabled"] is False and status["refusal"].startswith(
        "mindspore 2.11.0 is outside the supported range"
    )
    assert all(row["state"] == "skipped" and row["reason"].startswith("refused: ") for row in status["targets"])
    assert all(verdict["accelerated"] is False for verdict in status["libraries"].values())
    assert report["unpatched"] is True, report["unpatched"]
    assert proc.stderr.count("ms_loadpatch is not applied") == 1, proc.stderr[-2000:]
