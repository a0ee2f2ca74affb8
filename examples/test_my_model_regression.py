"""A regression test for your own model, written with ms_loadpatch's pytest
plugin (installed with the package; nothing to configure).

    pytest examples/test_my_model_regression.py

Point MY_CHECKPOINT at your checkpoint directory; without it a tiny
generated Qwen2 is used.
"""

import os

import pytest

from _tiny_model import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return os.environ.get("MY_CHECKPOINT") or tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")))


def test_patched_load_is_identical(ms_loadpatch_compare, checkpoint):
    # Loads unpatched, then patched; fails listing the first differing tensors.
    reference, accelerated = ms_loadpatch_compare(checkpoint)
    assert reference is not accelerated


def test_patched_load_is_identical_in_bfloat16(ms_loadpatch_compare, checkpoint):
    import mindspore as ms

    ms_loadpatch_compare(checkpoint, dtype=ms.bfloat16)  # keyword arguments go to from_pretrained


@pytest.mark.ms_loadpatch_disabled
def test_unpatched_reference_path(checkpoint):
    # The marker runs this test with the plugin off (and turns it back on after).
    import ms_loadpatch
    from mindone.transformers import AutoModelForCausalLM

    from _tiny_model import cpu_fallbacks

    assert not ms_loadpatch.is_enabled()
    with cpu_fallbacks():
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert type(model).__name__ == "Qwen2ForCausalLM"
