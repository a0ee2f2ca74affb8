"""`ms-loadpatch status`: a verdict per library (will loads be accelerated
here, and if not why and what to do), then entry points, techniques with
their probe results, versions; `--json` with a stable shape; `--no-import`.

Each case runs the command in a fresh process, as a user would; refused
versions and missing packages are simulated in that process only."""

import json
import platform
import textwrap

import pytest
from _helpers import report_of, run_python
from packaging.version import Version

from ms_loadpatch import versions
from ms_loadpatch.targets import TARGETS

# The documented shape of `status --json` (README "Status").
TOP_KEYS = {
    "enabled",
    "versions",
    "supported",
    "tested",
    "python",
    "refusal",
    "untested",
    "development",
    "libraries",
    "techniques",
    "targets",
    "import",
    "activation",
    "last_build",
    "lazy_import",
    "multi_node",
}
MULTI_NODE_KEYS = {"env_var", "mode", "job_ranks", "node", "store", "leader_channels"}
PYTHON_KEYS = {"version", "supported", "tested", "tested_here"}
LIBRARY_KEYS = {"accelerated", "reason", "advice"}
TECHNIQUE_KEYS = {"name", "kind", "libraries", "description", "state", "reason"}
TARGET_KEYS = {"target", "library", "public", "state", "reason", "refused", "blocked_by"}
IMPORT_KEYS = {"imported", "seconds", "errors"}
ACTIVATION_KEYS = {"env_var", "env_value", "pth_installed", "allow_untested_var"}


def _status(args=(), prelude="", env_extra=None):
    """Run the status command after `prelude` (a simulation) in a fresh process."""
    code = prelude + textwrap.dedent(
        f"""
        import sys
        from ms_loadpatch import cli
        sys.exit(cli.main(["status", *{list(args)!r}]))
        """
    )
    proc = run_python(code, env_extra=env_extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _verdicts(stdout):
    return {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in stdout.splitlines()
        if line.startswith("mindone.") and ": " in line
    }


@pytest.mark.matrix
def test_verdict_on_the_installed_versions():
    gate = versions.check()
    if not gate.ok:
        pytest.skip(f"refused by the gate: {gate.refusal}")
    out = _status().stdout
    lines = out.splitlines()
    assert lines[0].startswith("(imported mindspore and mindone's target modules in ")
    verdicts = _verdicts(out)
    for library in versions.LIBRARIES:
        assert verdicts[f"mindone.{library}"].startswith("accelerated (techniques: lazy-construction"), out
    import mindspore as ms

    cell_to = "to" in vars(ms.nn.Cell)  # mindspore 2.10+: the transformers glue wraps it too
    assert ("cell-to-keeping-lazy" in verdicts["mindone.transformers"]) is cell_to
    assert "cell-to-keeping-lazy" not in verdicts["mindone.diffusers"]
    assert f"mindspore {ms.__version__} (supported {versions.SUPPORTED['mindspore']}; tested " in out
    assert f"techniques (probed on mindspore {ms.__version__}):" in out
    # entry points listed under their library, internals summed up, not 28 flat lines
    assert "mindone.transformers entry points:\n  patched    PreTrainedModel.from_pretrained" in out
    assert "mindone.diffusers entry points:\n  patched    ModelMixin.from_pretrained" in out
    assert out.count("internals of its loading path: ") == 2
    public = [t for t in TARGETS if t.public]
    assert sum(line.startswith("  patched    ") for line in lines) == len(public)


def test_json_has_the_documented_shape():
    status = json.loads(_status(["--json"]).stdout)
    assert set(status) == TOP_KEYS
    assert set(status["libraries"]) == set(versions.LIBRARIES)
    for verdict in status["libraries"].values():
        assert set(verdict) == LIBRARY_KEYS
    assert status["techniques"] and all(set(row) == TECHNIQUE_KEYS for row in status["techniques"])
    assert len(status["targets"]) == len(TARGETS)
    assert all(set(row) == TARGET_KEYS for row in status["targets"])
    assert set(status["import"]) == IMPORT_KEYS and status["import"]["imported"] is True
    assert status["import"]["errors"] == {}
    assert set(status["activation"]) == ACTIVATION_KEYS
    assert status["tested"] == {name: list(v) for name, v in versions.TESTED.items()}
    assert set(status["python"]) == PYTHON_KEYS
    assert set(status["multi_node"]) == MULTI_NODE_KEYS and status["multi_node"]["job_ranks"] is None
    if versions.check().ok:
        assert all(v["accelerated"] is True for v in status["libraries"].values())


def test_no_import_keeps_the_cheap_form():
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from ms_loadpatch import cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["status", "--no-import", "--json"])
        status = json.loads(out.getvalue())
        imported = sorted(m for m in sys.modules if m.split(".")[0] in ("mindspore", "mindone"))
        print("REPORT", json.dumps({"status": status, "imported": imported}))
        """
    )
    report = report_of(run_python(code))
    assert report["imported"] == []
    status = report["status"]
    assert status["import"]["imported"] is False and status["techniques"] == []
    if versions.check().ok:
        for verdict in status["libraries"].values():
            assert verdict["accelerated"] is None and "not imported yet" in verdict["reason"]


FAKE_VERSION = textwrap.dedent(
    """
    import importlib.metadata as _metadata
    _real_version = _metadata.version
    _fake = {fake!r}
    def _version(name):
        if name in _fake:
            if _fake[name] is None:
                raise _metadata.PackageNotFoundError(name)
            return _fake[name]
        return _real_version(name)
    _metadata.version = _version
    """
)


def test_refused_version_says_not_accelerated_and_what_to_do(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    out = _status(prelude=FAKE_VERSION.format(fake={"mindspore": "2.11.0"})).stdout
    verdicts = _verdicts(out)
    newest = max(versions.TESTED["mindspore"], key=Version)
    for library in versions.LIBRARIES:
        assert verdicts[f"mindone.{library}"].startswith(
            f"not accelerated: mindspore 2.11.0 is outside the supported range {versions.SUPPORTED['mindspore']}, "
            f"newer than the newest tested ({newest})"
        ), out
    assert out.count(f"what to do: install a tested version (mindspore {versions.tested_versions('mindspore')}") == 2
    assert f"set {versions.ALLOW_UNTESTED_ENV_VAR}=1" in out
    assert "  patched    " not in out, "nothing may be patched on a refused version"
    # every row says the gate refused in a field of its own, not only in its text
    rows = json.loads(_status(["--json"], prelude=FAKE_VERSION.format(fake={"mindspore": "2.11.0"})).stdout)["targets"]
    assert rows and all(row["refused"] and row["state"] == "skipped" for row in rows), rows[:3]


def test_untested_version_with_the_override_is_accelerated_with_a_warning():
    out = _status(
        prelude=FAKE_VERSION.format(fake={"mindspore": "2.11.0"}), env_extra={versions.ALLOW_UNTESTED_ENV_VAR: "1"}
    ).stdout
    assert _verdicts(out)["mindone.transformers"].startswith("accelerated"), out
    assert "warning: mindspore 2.11.0 is outside the supported range" in out
    assert f"accepted because {versions.ALLOW_UNTESTED_ENV_VAR} is set" in out


def test_mindone_from_source_gets_the_fast_path():
    """A development build of a supported mindone (installed from its git master) is accepted while the code
    ms_loadpatch repeats or wraps is that release's: here it is (the installed code is 0.5.0's)."""
    out = _status(prelude=FAKE_VERSION.format(fake={"mindone": "0.5.0.dev0+g0a1b2c3"})).stdout
    for library in versions.LIBRARIES:
        assert _verdicts(out)[f"mindone.{library}"].startswith("accelerated"), out
    assert "note: mindone 0.5.0.dev0+g0a1b2c3 is a development build of 0.5.0: accepted while" in out
    assert "  patched    PreTrainedModel.from_pretrained" in out


def test_mindone_from_source_whose_code_differs_is_refused_naming_the_function():
    """A development build whose code differs from the release's (faked: the hash expected for
    from_pretrained) loads on mindone's own path, the status naming the first function that differs."""
    prelude = FAKE_VERSION.format(fake={"mindone": "0.5.0.dev0+g0a1b2c3"}) + (
        "from ms_loadpatch import fingerprints\n"
        "row = fingerprints.REPEATED['transformers.from_pretrained']\n"
        "fingerprints.REPEATED['transformers.from_pretrained'] = (*row[:3], '0' * 16)\n"
    )
    verdicts = _verdicts(_status(prelude=prelude).stdout)
    assert verdicts["mindone.transformers"].startswith(
        "not accelerated: mindone 0.5.0.dev0+g0a1b2c3 is a development build of 0.5.0"
    ), verdicts
    assert "PreTrainedModel.from_pretrained is not the code ms_loadpatch repeats" in verdicts["mindone.transformers"]
    assert verdicts["mindone.diffusers"].startswith("accelerated"), verdicts


@pytest.mark.parametrize("fake", ["0.6.0", "0.4.0.dev0", "0.6.0.dev0+gabc"])
def test_mindone_out_of_range_is_refused_and_the_override_accepts_it(monkeypatch, fake):
    """Newer, older, or a development build of an unsupported release: refused, saying what to do; with
    MS_LOADPATCH_ALLOW_UNTESTED=1 accepted once by the gate, and no target checks the range again."""
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV_VAR, raising=False)
    prelude = FAKE_VERSION.format(fake={"mindone": fake})
    out = _status(prelude=prelude).stdout
    for library in versions.LIBRARIES:
        assert _verdicts(out)[f"mindone.{library}"].startswith(
            f"not accelerated: mindone {fake} is outside the supported range {versions.SUPPORTED['mindone']}"
        ), out
    assert f"set {versions.ALLOW_UNTESTED_ENV_VAR}=1" in out
    out = _status(prelude=prelude, env_extra={versions.ALLOW_UNTESTED_ENV_VAR: "1"}).stdout
    for library in versions.LIBRARIES:
        assert _verdicts(out)[f"mindone.{library}"].startswith("accelerated"), out
    assert f"warning: mindone {fake} is outside the supported range" in out
    assert "  patched    PreTrainedModel.from_pretrained" in out and "needs mindone" not in out


def test_missing_mindone_says_what_to_install():
    prelude = FAKE_VERSION.format(fake={"mindone": None}) + "import sys\nsys.modules['mindone'] = None\n"
    out = _status(prelude=prelude).stdout
    for library in versions.LIBRARIES:
        assert _verdicts(out)[f"mindone.{library}"] == "not accelerated: mindone not installed", out
    assert "what to do: install the tested versions with: pip install 'ms-loadpatch[mindone]'" in out
    assert "importing it failed: ModuleNotFoundError" in out


def test_switched_off_says_not_enabled():
    out = _status(env_extra={"MS_LOADPATCH": "0"}).stdout
    for library in versions.LIBRARIES:
        assert _verdicts(out)[f"mindone.{library}"] == "not accelerated: ms_loadpatch is not enabled in this process"
    assert "what to do: import ms_loadpatch, set MS_LOADPATCH=1" in out


@pytest.mark.matrix
def test_status_names_the_running_python_and_the_tested_ones():
    """On every matrix cell's Python: the running Python, requires-python and
    the Pythons the tests run on; this one among them."""
    out = _status(["--no-import"]).stdout
    running = platform.python_version()
    assert (
        f"  python {running} (supported {versions.SUPPORTED_PYTHON}; tested {', '.join(versions.TESTED_PYTHONS)})\n"
    ) in out, out
    status = json.loads(_status(["--no-import", "--json"]).stdout)
    assert status["python"] == {
        "version": running,
        "supported": str(versions.SUPPORTED_PYTHON),
        "tested": list(versions.TESTED_PYTHONS),
        "tested_here": True,
    }


def test_status_says_when_the_running_python_is_not_tested():
    prelude = "from ms_loadpatch import versions\nversions.TESTED_PYTHONS = ('3.0',)\n"
    out = _status(["--no-import"], prelude=prelude).stdout
    minor = ".".join(platform.python_version_tuple()[:2])
    assert (
        f"  python {platform.python_version()} (supported {versions.SUPPORTED_PYTHON}; tested 3.0, not {minor})" in out
    )
