"""A pipeline's from_single_file on an original-format (LDM) checkpoint: the
UNet and VAE go through their accelerated from_single_file with mindone's key
conversion; the text encoders it builds from the file (CLIP, T5) through
build_then_fill too. mindone 0.5.0's CLIP path reads `.weight` of a mindspore
`nn.Embedding` and raises AttributeError: patched, the same error. Patched
and unpatched calls in one process, from the same random state (load_both)."""

from __future__ import annotations

import mindone.diffusers as md
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_unet, tiny_vae

import ms_loadpatch
from ms_loadpatch.api_verdict import api_verdict
from ms_loadpatch.testing import assert_same_model, load_both
from ms_loadpatch.tools import original_format

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.fixture(scope="module")
def ldm_pipeline(tmp_path_factory):
    """A tiny Stable Diffusion pipeline saved (its configs) and its UNet, VAE
    and CLIP text encoder in one original-format file."""
    import mindone.transformers as mt
    import transformers as hf
    from safetensors.numpy import save_file

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    root = tmp_path_factory.mktemp("ldm-pipeline")
    unet_config = {k: list(v) if isinstance(v, tuple) else v for k, v in tiny_unet().items()}
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        unet, vae = md.UNet2DConditionModel(**unet_config), md.AutoencoderKL(**tiny_vae())
        text_encoder = mt.CLIPTextModel(
            hf.CLIPTextConfig(
                vocab_size=128,
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=16,
                projection_dim=8,
            )
        )
        md.StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=None,
            unet=unet,
            scheduler=md.PNDMScheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        ).save_pretrained(str(root / "config"))
    ldm = {original_format.unet_key(name, unet_config): p.asnumpy() for name, p in unet.parameters_and_names()}
    up_blocks = len(tiny_vae()["up_block_types"])
    ldm.update(
        {
            "first_stage_model." + original_format.vae_key(name, up_blocks): original_format.vae_value(
                name, p.asnumpy()
            )
            for name, p in vae.parameters_and_names()
        }
    )
    ldm.update({original_format.text_encoder_key(name): p.asnumpy() for name, p in text_encoder.parameters_and_names()})
    save_file(ldm, str(root / "sd-ldm.safetensors"))
    return root, unet, text_encoder


def test_ldm_unet_converts_to_the_saved_unet(ldm_pipeline):
    """original_format.unet_key is the inverse of mindone's conversion: the file converts back to the UNet."""
    root, unet, _ = ldm_pipeline
    with ms_loadpatch.disabled():
        loaded = md.UNet2DConditionModel.from_single_file(
            str(root / "sd-ldm.safetensors"), config=str(root / "config"), subfolder="unet"
        )
    expected = dict(unet.parameters_and_names())
    got = dict(loaded.parameters_and_names())
    assert expected.keys() == got.keys()
    for name, param in expected.items():
        np.testing.assert_array_equal(got[name].asnumpy(), param.asnumpy(), err_msg=name)


def _pipeline(root, **components):
    return md.StableDiffusionPipeline.from_single_file(
        str(root / "sd-ldm.safetensors"),
        config=str(root / "config"),
        tokenizer=None,
        safety_checker=None,
        feature_extractor=None,
        **components,
    )


@pytest.mark.matrix
def test_pipeline_same_components_as_unpatched(ldm_pipeline):
    """The text encoder passed in (mindone cannot build CLIP from the file);
    the UNet and VAE from the file, converted."""
    root, _, text_encoder = ldm_pipeline
    reference, accelerated = load_both(lambda: _pipeline(root, text_encoder=text_encoder))
    for component in ("unet", "vae"):
        assert_same_model(getattr(reference, component), getattr(accelerated, component))
    assert accelerated.text_encoder is text_encoder
    report = ms_loadpatch.last_report()
    assert report.technique.startswith("from_single_file") and report.model_class in (
        "UNet2DConditionModel",
        "AutoencoderKL",
    )


def test_pipeline_file_read_into_the_components(ldm_pipeline, monkeypatch):
    """The pipeline reads its file once: every tensor becomes a Parameter
    over its own read buffer, and the UNet's parameters alias them (what
    the pipeline does not keep, here the text encoder's, is freed)."""
    from ms_loadpatch.glue import diffusers as glue

    root, unet, text_encoder = ldm_pipeline
    assert api_verdict().adopts, api_verdict().library_problems
    adopted = {}
    real = glue.adopted_parameter
    monkeypatch.setattr(glue, "adopted_parameter", lambda array, name: adopted.setdefault(name, real(array, name)))
    pipeline = _pipeline(root, text_encoder=text_encoder)
    assert any(name.startswith("cond_stage_model.") for name in adopted)
    unet_config = dict(pipeline.unet.config)
    by_ldm_name = {original_format.unet_key(name, unet_config): p for name, p in pipeline.unet.parameters_and_names()}
    assert by_ldm_name.keys() <= adopted.keys()
    if all(p.data_ptr() for p in by_ldm_name.values()):  # 0 on mindspore 2.7 for a host tensor
        assert all(p.data_ptr() == adopted[name].data_ptr() for name, p in by_ldm_name.items())


def test_clip_from_the_file_fails_as_unpatched(ldm_pipeline):
    """mindone 0.5.0's CLIP path raises AttributeError (`Embedding` has no
    `weight`); the patched call raises the same and leaves nothing behind."""
    from _process_state import raised_alike

    root, _, _ = ldm_pipeline
    unpatched = raised_alike(lambda: _pipeline(root), lambda: _pipeline(root))
    assert isinstance(unpatched, AttributeError) and "weight" in str(unpatched)


@pytest.fixture(scope="module")
def t5_checkpoint(tmp_path_factory):
    """A tiny T5 encoder's config, and its weights under SD3's original-format names."""
    import mindone.transformers as mt
    import transformers as hf

    root = tmp_path_factory.mktemp("t5")
    with ms_loadpatch.disabled():
        t5 = mt.T5EncoderModel(hf.T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
        t5.save_pretrained(str(root / "text_encoder_3"))
    # torch's Embedding `weight` for mindspore's `embedding_table`
    return root, {
        "text_encoders.t5xxl.transformer." + name.replace("embedding_table", "weight"): p.asnumpy()
        for name, p in t5.parameters_and_names()
    }


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_t5_from_the_file_same_model_as_unpatched(t5_checkpoint, dtype):
    """create_diffusers_t5_model_from_checkpoint, as SD3's from_single_file
    calls it: float16 keeps T5's `wo` in float32 (its keep_in_fp32 rule)."""
    import mindone.transformers as mt
    from mindone.diffusers.loaders import single_file

    root, arrays = t5_checkpoint
    mindspore_dtype = getattr(ms, dtype) if dtype else None

    def load():
        checkpoint = {key: ms.Parameter(ms.Tensor(value), name=key) for key, value in arrays.items()}
        return single_file.create_diffusers_t5_model_from_checkpoint(
            mt.T5EncoderModel, checkpoint, subfolder="text_encoder_3", config=str(root), mindspore_dtype=mindspore_dtype
        )

    reference, accelerated = load_both(load)
    assert_same_model(reference, accelerated)
    assert ms_loadpatch.last_report().technique.startswith("create_diffusers_t5_model_from_checkpoint")
    wo = [p.dtype for n, p in accelerated.parameters_and_names() if ".wo." in n]
    assert wo and all(d == ms.float32 for d in wo)
    if dtype:
        assert any(p.dtype == ms.float16 for p in accelerated.get_parameters())
