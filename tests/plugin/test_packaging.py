"""Packaging: the plugin never chooses its host's mindspore or mindone.

pyproject declares neither as a dependency (only in the `mindone` and `test`
extras, with versions.SUPPORTED's ranges), and a real `pip install` of a
wheel built from this checkout into an environment that already has a
mindspore leaves that mindspore as it was."""

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig

import pytest
from _helpers import REPO, TESTS_DIR
from packaging.requirements import Requirement

from ms_loadpatch import versions

HOST_LIBRARIES = ("mindspore", "mindone")


def _pyproject():
    path = os.path.join(REPO, "pyproject.toml")
    if not os.path.exists(path):
        pytest.skip("tests run outside the source tree")
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the test extra installs tomli there
        import tomli as tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)["project"]


def test_host_libraries_are_not_dependencies():
    names = {Requirement(line).name for line in _pyproject()["dependencies"]}
    assert not names & set(HOST_LIBRARIES), "pip would upgrade or downgrade the user's framework"


@pytest.mark.parametrize("extra", ["mindone", "test"])
def test_extras_install_the_supported_ranges(extra):
    declared = {
        Requirement(line).name: Requirement(line).specifier for line in _pyproject()["optional-dependencies"][extra]
    }
    for distribution, specifier in versions.SUPPORTED.items():
        assert declared[distribution] == specifier, (extra, distribution)


def _requirements():
    project = _pyproject()
    return [Requirement(line) for line in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_every_dependency_declares_a_floor():
    """.ci/matrix's floors cell pins each `name>=X` to `name==X`: a dependency
    without a floor would go untested at its oldest; one raised there must be
    a declared one."""
    requirements = _requirements()
    for req in requirements:
        if req.name not in HOST_LIBRARIES:
            assert any(spec.operator == ">=" for spec in req.specifier), f"{req} declares no floor"
    names = {req.name for req in requirements}
    for name, (version, why) in versions.FLOORS_RAISED.items():
        assert name in names and why, name
        declared = next(req for req in requirements if req.name == name)
        assert declared.specifier.contains(version) and not any(
            spec.operator == ">=" and spec.version == version for spec in declared.specifier
        ), (name, version)


def test_requires_python_is_the_supported_and_tested_range():
    """requires-python is versions.SUPPORTED_PYTHON; every tested Python is in
    it, and its oldest and newest minors are tested."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    declared = SpecifierSet(_pyproject()["requires-python"])
    assert declared == versions.SUPPORTED_PYTHON
    tested = sorted((Version(v) for v in versions.TESTED_PYTHONS))
    assert all(declared.contains(v) for v in tested)
    assert not declared.contains(Version(f"{tested[0].major}.{tested[0].minor - 1}"))
    assert not declared.contains(Version(f"{tested[-1].major}.{tested[-1].minor + 1}"))
    assert sys.version_info[:2] >= (tested[0].major, tested[0].minor)


def _run(args, timeout=600, **kwargs):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _versions_seen_by(python) -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for d in ('mindspore', 'mindone'):\n"
        "    try:\n"
        "        dist = m.distribution(d)\n"
        "        out[d] = [dist.version, str(dist.locate_file(''))]\n"
        "    except m.PackageNotFoundError:\n"
        "        out[d] = None\n"
        "print(json.dumps(out))"
    )
    return json.loads(_run([python, "-c", code]).stdout)


def _is_the_plugins(entry: str) -> bool:
    name = entry.lower().replace("-", "_")
    return "ms_loadpatch" in name


def _host_site_without_the_plugin(view):
    """This environment's site-packages as a user's would be before installing
    the plugin: every entry symlinked except ms-loadpatch's own (the test
    environment has the plugin installed; pip would otherwise find it there
    and install nothing)."""
    host_site = sysconfig.get_paths()["purelib"]  # where this environment's mindspore lives
    view.mkdir()
    for entry in os.listdir(host_site):
        if not _is_the_plugins(entry):
            os.symlink(os.path.join(host_site, entry), view / entry)
    return view


@pytest.mark.matrix
def test_pip_install_keeps_the_installed_mindspore(tmp_path):
    """The user's environment: this test environment's mindspore and mindone
    (whatever version the matrix installed), seen by a new venv through a
    .pth line, as an environment with a framework installed by other means
    would be. `pip install WHEEL` there, with the package index reachable,
    must keep that mindspore and mindone: nothing installed over them."""
    _pyproject()
    installed = {d: importlib.metadata.version(d) for d in HOST_LIBRARIES}
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), REPO])
    (wheel,) = wheels.glob("ms_loadpatch-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    own_site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    host_view = _host_site_without_the_plugin(tmp_path / "host-site")
    with open(os.path.join(own_site, "zz_host_site.pth"), "w") as f:
        f.write(str(host_view) + "\n")
    before = _versions_seen_by(python)
    assert before["mindspore"][0] == installed["mindspore"], before

    proc = _run([python, "-m", "pip", "install", "--progress-bar", "off", str(wheel)])
    after = _versions_seen_by(python)
    print(
        f"mindspore before: {before['mindspore'][0]}, after: {after['mindspore'][0]}; "
        f"mindone before: {before['mindone'][0]}, after: {after['mindone'][0]}"
    )
    assert after == before, f"pip changed the host's framework:\n{proc.stdout[-3000:]}"
    newly_installed = {dist.metadata["Name"].lower() for dist in importlib.metadata.distributions(path=[own_site])}
    assert "ms-loadpatch" in newly_installed
    assert not newly_installed & set(HOST_LIBRARIES), newly_installed
    # and the installed plugin works there: it is accepted with that mindspore
    code = "import json, ms_loadpatch.versions as v; print(json.dumps(v.check().versions))"
    seen = json.loads(_run([python, "-c", code], cwd=str(tmp_path)).stdout)
    assert seen == installed


def test_tests_share_helpers_not_test_modules():
    """Tests live in one folder per area; shared test code at the top of
    tests/ (conftest.py, _*.py): no test module, helper or child script
    imports a test module (whose fixtures and collection would come along),
    and no test module sits outside an area."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+test_\w+", re.MULTILINE)
    offenders, loose = {}, []
    for root, _, names in os.walk(TESTS_DIR):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            if name.startswith("test_") and root == TESTS_DIR:
                loose.append(name)
            with open(os.path.join(root, name)) as f:
                found = pattern.findall(f.read())
            if found:
                offenders[os.path.relpath(os.path.join(root, name), TESTS_DIR)] = len(found)
    assert offenders == {}
    assert loose == []
