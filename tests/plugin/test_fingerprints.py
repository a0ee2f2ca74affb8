"""fingerprints.py: the mindone functions the glue repeats are checked by
the hash of their source; a library whose function differs loads on
mindone's own path (the same model), its wrappers call the original, and
status() names the function."""

import mindone.diffusers as md
import mindone.transformers as mt
import pytest
from _helpers import tiny_qwen2_config, tiny_vae

import ms_loadpatch
from ms_loadpatch import fingerprints
from ms_loadpatch.glue import common
from ms_loadpatch.strategy import reports
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprints")
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(root / "qwen2")
        md.AutoencoderKL(**tiny_vae()).save_pretrained(root / "vae")
    return {
        "transformers": (mt.Qwen2ForCausalLM, str(root / "qwen2")),
        "diffusers": (md.AutoencoderKL, str(root / "vae")),
    }


@pytest.fixture
def rechecked():
    """Fingerprints checked afresh in the test and after it."""
    fingerprints.forget()
    yield
    fingerprints.forget()


def _pretend_changed(monkeypatch, name):
    library, module, qualname, _ = fingerprints.REPEATED[name]
    monkeypatch.setitem(fingerprints.REPEATED, name, (library, module, qualname, "0" * 16))
    fingerprints.forget()  # checked again with the pretended source


def _loaded(checkpoints, library):
    """(model, whether the load was accelerated)."""
    cls, directory = checkpoints[library]
    reports._last_reports.clear()
    model = cls.from_pretrained(directory)
    report = reports.last_report()
    return model, report is not None and report.library == library


def test_the_installed_mindone_is_the_code_repeated(checkpoints, rechecked):
    for library in checkpoints:
        _loaded(checkpoints, library)  # imports every module the glue repeats code of
    assert {name: fingerprints.changed(name) for name in fingerprints.REPEATED} == dict.fromkeys(fingerprints.REPEATED)
    (row,) = fingerprints.rows()
    assert row.state == "active" and "checked when" not in row.reason, row
    assert any(r["name"] == "repeated-mindone-code" for r in ms_loadpatch.status()["techniques"])


@pytest.mark.parametrize(
    "library,name",
    [
        ("transformers", "transformers.convert_state_dict"),
        ("transformers", "transformers.initialize_weights"),
        ("diffusers", "diffusers.load_shard_file"),
    ],
)
def test_a_changed_function_sends_its_library_down_mindones_path(checkpoints, rechecked, monkeypatch, library, name):
    other = "diffusers" if library == "transformers" else "transformers"
    _pretend_changed(monkeypatch, name)
    model, accelerated = _loaded(checkpoints, library)
    assert not accelerated
    _, other_accelerated = _loaded(checkpoints, other)
    assert other_accelerated, "the other library's loads are still accelerated"
    (row,) = fingerprints.rows()
    qualname = fingerprints.REPEATED[name][2]
    assert row.state == "skipped" and qualname in row.reason and "source" in row.reason, row
    with ms_loadpatch.disabled():
        reference = checkpoints[library][0].from_pretrained(checkpoints[library][1])
    assert_same_model(reference, model)


@pytest.mark.parametrize("method,name", [("half", "transformers.half"), ("float", "diffusers.float")])
def test_a_changed_cast_method_runs_mindones_own(checkpoints, rechecked, monkeypatch, method, name):
    model, _ = _loaded(checkpoints, "transformers")
    with ms_loadpatch.disabled():
        reference, _ = _loaded(checkpoints, "transformers")
        getattr(reference, method)()
    _pretend_changed(monkeypatch, name)
    monkeypatch.setattr(common, "cast_parameters", lambda *a: pytest.fail("the repeated cast ran"))
    assert getattr(model, method)() is model
    assert_same_model(reference, model)


def test_a_function_that_cannot_be_checked_is_taken_for_changed(rechecked, monkeypatch, checkpoints):
    _loaded(checkpoints, "transformers")
    library, module, _, expected = fingerprints.REPEATED["transformers.tie_weights"]
    monkeypatch.setitem(
        fingerprints.REPEATED, "transformers.tie_weights", (library, module, "PreTrainedModel.no_such_method", expected)
    )
    fingerprints.forget()
    reason = fingerprints.changed("transformers.tie_weights")
    assert reason is not None and "cannot be checked" in reason and "no_such_method" in reason
    assert fingerprints.library_problem("transformers") == reason and fingerprints.library_problem("diffusers") is None
