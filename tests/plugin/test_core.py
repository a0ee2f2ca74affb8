"""Plugin core: patch table applied in both import orders, exact disable,
re-enable, the version gate, activation switches and the launcher."""

import json
import logging
import sys
import textwrap

import pytest
from _helpers import installed_pth, report_of, run_python

from ms_loadpatch.targets import TARGETS

pytestmark = pytest.mark.matrix

CHECKS = [
    "patched_after_import",
    "original_after_disable",
    "patched_after_enable",
    "original_inside_disabled",
    "patched_after_disabled_scope",
    "patched_inside_enabled",
    "original_after_enabled_scope",
]


@pytest.fixture(scope="module", params=["plugin-first", "mindone-first"])
def order_report(request):
    proc = run_python(["_probe_targets.py", request.param])
    return request.param, report_of(proc)


@pytest.mark.parametrize("target", [t.key for t in TARGETS])
def test_target_patch_cycle(order_report, target):
    order, report = order_report
    row = report["targets"][target]
    if "not_needed_left_alone" in row:  # a row for a mindspore feature this version lacks
        assert row["not_needed_left_alone"], f"{target} ({order}) was touched although not needed"
        assert next(t for t in TARGETS if t.key == target).feature is not None
        return
    failed = [check for check in CHECKS if not row[check]]
    assert not failed, f"{target} ({order}): failed {failed}"


def test_disable_restores_a_module_no_longer_in_sys_modules():
    """disable() unwraps the module it patched even where sys.modules has
    dropped it meanwhile (pytester's in-process runs drop what they import)."""
    code = textwrap.dedent(
        """
        import sys, wrapt
        import ms_loadpatch
        assert ms_loadpatch.enable()
        import mindone.transformers.modeling_utils as mu
        assert isinstance(vars(mu.PreTrainedModel)["from_pretrained"], wrapt.FunctionWrapper)
        del sys.modules["mindone.transformers.modeling_utils"]
        ms_loadpatch.disable()
        assert not isinstance(vars(mu.PreTrainedModel)["from_pretrained"], wrapt.FunctionWrapper)
        assert not isinstance(mu.load_state_dict, wrapt.FunctionWrapper)
        print("RESTORED")
        """
    )
    proc = run_python(code)
    assert "RESTORED" in proc.stdout, proc.stderr[-3000:]


def test_import_does_not_import_mindspore():
    proc = run_python(
        "import sys, ms_loadpatch; print('REPORT', __import__('json').dumps(sorted("
        "m for m in sys.modules if m.split('.')[0] in ('mindspore', 'mindone'))))"
    )
    assert report_of(proc) == []


def test_all_targets_patched_in_status(order_report):
    _, report = order_report
    assert set(report["states"]) == {t.key for t in TARGETS}
    assert set(report["states"].values()) == {"skipped"}  # last action in the probe was a scoped enable ending disabled


def test_status_lists_patched_targets():
    code = textwrap.dedent(
        """
        import json, ms_loadpatch, mindone.transformers.modeling_utils
        print('REPORT', json.dumps(ms_loadpatch.status()))
        """
    )
    status = report_of(run_python(code))
    assert status["enabled"] is True and status["refusal"] is None
    states = {row["target"]: row["state"] for row in status["targets"]}
    assert states["mindone.transformers.modeling_utils:PreTrainedModel.from_pretrained"] == "patched"
    # diffusers never imported here: waiting for its import, not patched eagerly
    assert states["mindone.diffusers.models.modeling_utils:ModelMixin.from_pretrained"] == "pending"


# -- the version gate (version reading simulated; the real matrix is .ci/matrix)


@pytest.mark.parametrize("fake", [{"mindspore": "2.6.0"}, {"mindone": "0.4.0"}, {"mindspore": "3.0.0"}])
def test_gate_refuses_unsupported_version(monkeypatch, caplog, fake):
    import mindone.transformers.modeling_utils as mu
    from packaging.version import Version

    from ms_loadpatch import core, versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: Version(fake[d]) if d in fake else real(d))
    before = mu.PreTrainedModel.__dict__["from_pretrained"]
    patcher = core._Patcher(TARGETS)  # a private instance: the process-wide one stays as it is
    with caplog.at_level(logging.WARNING, logger="ms_loadpatch"):
        assert patcher.enable() is False
        assert patcher.enable() is False
    assert not patcher.is_enabled()
    refusals = [r for r in caplog.records if "not applied" in r.getMessage()]
    assert len(refusals) == 1, "one warning, not one per call"
    name = next(iter(fake))
    assert f"{name} {fake[name]}" in refusals[0].getMessage()
    status = patcher.status()
    assert status["refusal"] and name in status["refusal"]
    assert all(row["state"] == "skipped" and "refused" in row["reason"] for row in status["targets"])
    assert not patcher._handles
    assert mu.PreTrainedModel.__dict__["from_pretrained"] is before


def test_target_requirement_skips_with_reason(monkeypatch):
    import mindone.transformers.modeling_utils  # noqa: F401

    from ms_loadpatch import core
    from ms_loadpatch.targets import Target

    target = Target(
        "mindone.transformers.modeling_utils",
        "load_state_dict",
        "ms_loadpatch.glue.transformers:load_state_dict",
        requires={"mindone": ">=9"},
    )
    patcher = core._Patcher((target,))
    assert patcher.enable() is True
    row = patcher.status()["targets"][0]
    assert row["state"] == "skipped" and "needs mindone>=9" in row["reason"]
    patcher.disable()


# -- activation without code changes


ENABLED_PROBE = (
    "import sys, json; m = sys.modules.get('ms_loadpatch'); print('REPORT', json.dumps(bool(m and m.is_enabled())))"
)


@pytest.mark.skipif(not installed_pth(), reason="the .pth hook is placed by a wheel install (CI installs one)")
@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("", False), ("0", False)])
def test_env_var_pth_activation(value, expected):
    assert report_of(run_python(ENABLED_PROBE, env_extra={"MS_LOADPATCH": value})) is expected


@pytest.mark.parametrize("value,expected", [("0", False), ("off", False), ("", True), ("1", True)])
def test_env_var_off_switch_on_import(value, expected):
    code = "import ms_loadpatch, json; print('REPORT', json.dumps(ms_loadpatch.is_enabled()))"
    assert report_of(run_python(code, env_extra={"MS_LOADPATCH": value})) is expected


def test_launcher_passes_arguments_and_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import json, sys
        m = sys.modules.get('ms_loadpatch')
        print('REPORT', json.dumps({'argv': sys.argv[1:], 'enabled': bool(m and m.is_enabled())}))
        sys.exit(int(sys.argv[1]))
        """
        )
    )
    proc = run_python(["-m", "ms_loadpatch", "run", "--", sys.executable, str(script), "7", "--lr", "a b"])
    assert proc.returncode == 7, proc.stderr
    assert report_of(proc) == {"argv": ["7", "--lr", "a b"], "enabled": True}


def test_launcher_chains_existing_sitecustomize(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os; os.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = "import os, json; print('REPORT', json.dumps(os.environ.get('USER_SITECUSTOMIZE_RAN')))"
    proc = run_python(
        ["-m", "ms_loadpatch", "run", "--", sys.executable, "-c", code], env_extra={"PYTHONPATH": str(tmp_path)}
    )
    assert report_of(proc) == "1"


def test_launcher_missing_command():
    proc = run_python(["-m", "ms_loadpatch", "run", "--", "no-such-command-xyz"])
    assert proc.returncode == 127 and "not found" in proc.stderr


def test_status_command_prints_targets():
    proc = run_python(["-m", "ms_loadpatch", "status", "--json"])
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert status["enabled"] is True
    features = {t.key for t in TARGETS if t.feature is not None}
    assert {row["state"] for row in status["targets"] if row["target"] not in features} == {"patched"}
    assert {row["state"] for row in status["targets"] if row["target"] in features} <= {"patched", "not needed"}
