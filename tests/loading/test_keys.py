"""Key conversion (strategy/keys.py) against mindone's own `_convert_state_dict`,
and loads that take its prefix paths: a base model from a task checkpoint and
a task model from a base checkpoint, patched against unpatched."""

import mindone.diffusers.models.modeling_utils as df_modeling_utils
import mindone.transformers as mt
import mindone.transformers.modeling_utils as tf_modeling_utils
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_qwen2_config

import ms_loadpatch
from ms_loadpatch.strategy.keys import mapped_keys, prefixed_keys
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both


@pytest.fixture(autouse=True)
def _fallbacks():
    with cpu_kernel_fallbacks():  # the CPU wheel lacks kernels these models' construction calls (Arange)
        yield


class _WithConv1d(mt.Qwen2ForCausalLM):
    """A model with an nn.Conv1d, whose weight's key mindone maps (expand_dims)."""

    def __init__(self, config):
        super().__init__(config)
        self.conv = ms.nn.Conv1d(4, 4, 3, has_bias=True)


def _state_dict(names):
    rng = np.random.default_rng(0)
    return {
        name: ms.Parameter(ms.Tensor(rng.standard_normal((4, 4, 3)).astype(np.float32)), name=name) for name in names
    }


def _case_names(model, prefix):
    """Keys in every form the conversion tells apart: as the model names them, with `prefix.` added, with it
    taken away, unknown ones, and the Conv1d weight mindone maps."""
    own = [name for name, _ in model.parameters_and_names()][:6]
    stripped = [name[len(prefix) + 1 :] for name in own if name.startswith(prefix + ".")]
    return own[:2] + [f"{prefix}.{name}" for name in own[2:4]] + stripped[:2] + ["no.such.key", "conv.weight"]


@pytest.mark.parametrize("prefix", ["model", "transformer", ""])
def test_prefixed_keys_as_mindone_transformers_converts(prefix):
    with ms_loadpatch.disabled():
        model = _WithConv1d(tiny_qwen2_config())
    names = _case_names(model, prefix or "model")
    expected = tf_modeling_utils._convert_state_dict(model, _state_dict(names), prefix)
    mappings = tf_modeling_utils._get_pt2ms_mappings(model)
    keys = set(model.state_dict().keys())
    got = prefixed_keys(_state_dict(names), mappings, keys, prefix, lambda mapping, value, key: mapping(value))
    assert list(got) == list(expected)  # the same names in the same (popitem) order
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        np.testing.assert_array_equal(got[name].asnumpy(), expected[name].asnumpy())
    assert "conv.weight" in got and got["conv.weight"].shape == (4, 4, 1, 3)  # mapped, as mindone maps it


def test_mapped_keys_as_mindone_diffusers_converts():
    with ms_loadpatch.disabled():
        model = _WithConv1d(tiny_qwen2_config())
    names = _case_names(model, "model")
    expected = df_modeling_utils._convert_state_dict(model, _state_dict(names))
    mappings = df_modeling_utils._get_pt2ms_mappings(model)
    got = mapped_keys(_state_dict(names), mappings, lambda mapping, value, key: mapping(value))
    assert list(got) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name].asnumpy(), expected[name].asnumpy())


@pytest.mark.parametrize(
    "saved, loaded",
    [(mt.Qwen2ForCausalLM, mt.Qwen2Model), (mt.Qwen2Model, mt.Qwen2ForCausalLM)],
    ids=["base-from-task", "task-from-base"],
)
def test_loads_through_the_prefix_paths_as_unpatched(tmp_path, saved, loaded):
    """A checkpoint whose keys carry the base model's prefix where the model's do not, or lack it where they
    have it: mindone's conversion strips or adds `model.`; the patched load gives the same model."""
    with ms_loadpatch.disabled():
        saved(tiny_qwen2_config()).save_pretrained(str(tmp_path))
    reference, accelerated = load_both(lambda: loaded.from_pretrained(str(tmp_path)))
    assert_same_model(reference, accelerated)
    report = last_report()
    assert report.library == "transformers" and report.tensors_assigned > 0, report.summary()
