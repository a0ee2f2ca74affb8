"""Calls that build then fill (glue/build_then_fill.py): ControlNetModel,
SparseControlNetModel, ControlNetUnionModel, ControlNetXSAdapter and
UNetControlNetXSModel `from_unet`; the Flux, SD3, HunyuanDiT and QwenImage
ControlNets' `from_transformer`; UNetMotionModel `from_unet2d`; and
`from_single_file` (diffusers-format and original-format files). Patched and
unpatched calls in one process, from the same random state (load_both): the
same model (names, shapes, dtypes, bits, parameter metadata, cell state),
numpy's, Python's and mindspore's generators left alike, the copies aliasing
the same source tensors; a call failing halfway leaves the process as it was."""

from __future__ import annotations

import mindone.diffusers as md
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_unet, tiny_vae, tiny_wan, tiny_wan_vae

import ms_loadpatch
from ms_loadpatch.api_verdict import api_verdict
from ms_loadpatch.testing import assert_same_model, load_both

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.fixture(scope="module")
def unets():
    """The tiny UNet, one wide enough for motion modules (GroupNorm of 32 groups), a tiny Flux transformer."""
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        return {
            "tiny": md.UNet2DConditionModel(**_unet_config()),
            "wide": md.UNet2DConditionModel(**_wide_config()),
            "flux": _tiny_flux(),
            "xl": md.UNet2DConditionModel(**_xl_config()),
            **_tiny_transformers(),
            "xs": md.UNet2DConditionModel(**dict(_unet_config(), layers_per_block=2, use_linear_projection=True)),
        }


def _unet_config():
    """The tiny UNet's, with lists of its own: SparseControlNetModel.from_unet
    edits the source's `down_block_types` in place (patched and unpatched)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in tiny_unet().items()}


def _wide_config():
    return dict(_unet_config(), block_out_channels=[32, 64], norm_num_groups=8, attention_head_dim=8)


def _xl_config():
    """An SDXL-like UNet (text_time additional embedding), which ControlNetUnionModel.from_unet needs."""
    return dict(
        _unet_config(),
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=4 * 6 + 8,
        transformer_layers_per_block=[1, 1],
    )


def _aliased(model, source) -> list | None:
    """Names of `model`'s parameters sharing memory with `source`'s parameter
    of that name; None where data_ptr() cannot tell (mindspore 2.7 gives 0
    for a tensor with no device address)."""
    by_name = dict(source.parameters_and_names())
    if not all(p.data_ptr() for p in by_name.values()):
        return None
    return sorted(n for n, p in model.parameters_and_names() if n in by_name and p.data_ptr() == by_name[n].data_ptr())


def _tiny_flux():
    return md.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )


def _tiny_transformers():
    """SD3 (two layers: its last is context-only), HunyuanDiT (the pooled
    width its ControlNet assumes), QwenImage; their CPU kernels come from cpu_kernel_fallbacks."""
    return {
        "sd3": md.SD3Transformer2DModel(
            sample_size=8,
            patch_size=1,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=8,
            caption_projection_dim=16,
            pooled_projection_dim=8,
            out_channels=4,
        ),
        "hunyuan": md.HunyuanDiT2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            cross_attention_dim=8,
            cross_attention_dim_t5=8,
            pooled_projection_dim=1024,
            hidden_size=16,
            text_len=4,
            text_len_t5=4,
        ),
        "qwen": md.QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
        ),
    }


CASES = {
    "controlnet": ("tiny", lambda unet: md.ControlNetModel.from_unet(unet)),
    "controlnet-random": ("tiny", lambda unet: md.ControlNetModel.from_unet(unet, load_weights_from_unet=False)),
    "sparse-controlnet": ("wide", lambda unet: md.SparseControlNetModel.from_unet(unet)),
    "motion": ("wide", lambda unet: md.UNetMotionModel.from_unet2d(unet)),
    "flux-controlnet": (
        "flux",
        lambda flux: md.FluxControlNetModel.from_transformer(
            flux, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2
        ),
    ),
    "sd3-controlnet": ("sd3", lambda sd3: md.SD3ControlNetModel.from_transformer(sd3, num_layers=1)),
    # mindone reads `transformer_num_layers`, which HunyuanDiT2DModel's config does not have
    "hunyuan-controlnet": (
        "hunyuan",
        lambda dit: md.HunyuanDiT2DControlNetModel.from_transformer(dit, transformer_num_layers=2),
    ),
    "qwen-controlnet": (
        "qwen",
        lambda qwen: md.QwenImageControlNetModel.from_transformer(
            qwen, num_layers=1, attention_head_dim=8, num_attention_heads=2
        ),
    ),
    # copies with Cell.load_state_dict (assign_value: lazy_writes); a mint.randn parameter
    "union-controlnet": (
        "xl",
        lambda unet: md.ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(4, 8)),
    ),
    "xs-adapter": (
        "xs",
        lambda unet: md.ControlNetXSAdapter.from_unet(unet, size_ratio=0.5, conditioning_embedding_out_channels=(4, 8)),
    ),
    # builds an adapter with a nested from_unet and copies from it; replaces its own blocks with new ones
    "xs-unet": (
        "xs",
        lambda unet: md.UNetControlNetXSModel.from_unet(
            unet, size_ratio=1, ctrl_optional_kwargs=dict(conditioning_embedding_out_channels=(4, 8))
        ),
    ),
}
# the calls whose copies alias the source's tensors under the same names (load_param_into_net)
ALIASING = (
    "controlnet",
    "sparse-controlnet",
    "motion",
    "flux-controlnet",
    "sd3-controlnet",
    "hunyuan-controlnet",
    "qwen-controlnet",
    "xs-unet",
)


@pytest.mark.parametrize(
    "case", [pytest.param("controlnet", marks=pytest.mark.matrix), *(case for case in CASES if case != "controlnet")]
)
def test_same_model_as_unpatched(unets, case):
    which, build = CASES[case]
    unet = unets[which]
    reference, accelerated = load_both(lambda: build(unet))  # raises if the random state ends elsewhere
    assert_same_model(reference, accelerated)
    report = ms_loadpatch.last_report()
    assert report is not None and report.model_class == type(accelerated).__name__
    assert "draws taken when made" in report.technique
    if case != "xs-unet":  # its adapter, filled inside the nested call, gives what the UNet lacks
        assert report.missing_initialised > 0  # what the source lacks was filled here, not at creation
    shared = _aliased(reference, unet)
    assert _aliased(accelerated, unet) == shared
    if shared is not None:
        assert bool(shared) is (case in ALIASING)
    # what the plain build leaves on every parameter, also where load_param_into_net wrote to a lazy one
    for (name, ref), (_, acc) in zip(reference.parameters_and_names(), accelerated.parameters_and_names()):
        assert ("init_param" in vars(acc)) == ("init_param" in vars(ref)), name
        assert getattr(acc, "init_mode", None) is None and not acc.has_init, name


def test_copies_into_lazy_parameters_without_the_fast_copy(unets, monkeypatch):
    """Where the lazy-assign probe fails, assign_value on a lazy parameter
    fills it with its own draw first and then assigns (as the plain build
    does): the same model and random state."""
    import dataclasses

    from ms_loadpatch.api_probes import LAZY_ASSIGN
    from ms_loadpatch.glue import build_then_fill
    from ms_loadpatch.strategy.verdict import Problem

    injected = Problem(LAZY_ASSIGN, (), "injected: the fast copy differs")
    failed = dataclasses.replace(api_verdict(), library_problems=api_verdict().library_problems + (injected,))
    assert not failed.assigns_lazily
    monkeypatch.setattr(build_then_fill, "api_verdict", lambda: failed)
    reference, accelerated = load_both(lambda: CASES["union-controlnet"][1](unets["xl"]))
    assert_same_model(reference, accelerated)


@pytest.mark.matrix
def test_lazy_assign_probe_passes():
    """The fast copy into a lazy parameter is what assign_value leaves, on every mindspore of the range."""

    assert api_verdict().assigns_lazily, api_verdict().library_problems


def test_zeroed_blocks_and_random_embedding(unets):
    """What the UNet lacks: the conditioning embedding keeps its initializers'
    values (the same draws), the zero modules are zeros."""
    reference, accelerated = load_both(lambda: md.ControlNetModel.from_unet(unets["tiny"]))
    for model in (reference, accelerated):
        assert not model.controlnet_mid_block.weight.asnumpy().any()
        assert model.controlnet_cond_embedding.conv_in.weight.asnumpy().std() > 0
    np.testing.assert_array_equal(
        accelerated.controlnet_cond_embedding.conv_in.weight.asnumpy(),
        reference.controlnet_cond_embedding.conv_in.weight.asnumpy(),
    )


def test_failure_halfway_leaves_the_process_as_it_was(unets):
    """A UNet whose down block is float16 fails load_param_into_net's strict
    dtype check after the build: the same error, the same random state, and
    nothing of the plugin left behind."""
    from _process_state import raised_alike

    unet = unets["tiny"]
    param = unet.down_blocks[0].resnets[0].conv1.weight
    param.set_dtype(ms.float16)
    try:
        raised_alike(lambda: md.ControlNetModel.from_unet(unet), lambda: md.ControlNetModel.from_unet(unet))
    finally:
        param.set_dtype(ms.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_source(dtype):
    """A float16 / bfloat16 source: the plain build casts its random float32
    values to it (`model.to(unet.dtype)`); the lazy build fills in float32
    and casts, as Parameter.init_data does: the same bits."""
    with ms_loadpatch.disabled():
        unet = md.UNet2DConditionModel(**_wide_config()).to(getattr(ms, dtype))
    reference, accelerated = load_both(lambda: md.UNetMotionModel.from_unet2d(unet))
    assert_same_model(reference, accelerated)
    assert accelerated.dtype == getattr(ms, dtype)
    assert ms_loadpatch.last_report().technique.startswith("from_unet2d")


# -- from_single_file: a diffusers-format file, and an original-format (LDM) one that goes through key conversion


@pytest.fixture(scope="module")
def single_files(tmp_path_factory):
    """Diffusers-format single files of the tiny UNet, VAE, Wan transformer
    and Wan VAE (with their configs), and the VAE's weights in the original
    (LDM) layout."""
    from safetensors.numpy import save_file

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    root = tmp_path_factory.mktemp("single-file")
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        md.UNet2DConditionModel(**tiny_unet()).save_pretrained(root / "unet")
        md.WanTransformer3DModel(**tiny_wan()).save_pretrained(root / "wan")
        md.AutoencoderKLWan(**tiny_wan_vae()).save_pretrained(root / "wan-vae")
        vae = md.AutoencoderKL(**tiny_vae())
        vae.save_pretrained(root / "vae")
    from ms_loadpatch.tools import original_format

    up_blocks = len(tiny_vae()["up_block_types"])
    ldm = {
        original_format.vae_key(name, up_blocks): original_format.vae_value(name, param.asnumpy())
        for name, param in vae.parameters_and_names()
    }
    save_file(ldm, str(root / "vae-ldm.safetensors"))
    return root, vae


SINGLE_FILE_CASES = {
    "unet": (md.UNet2DConditionModel, "unet/diffusion_pytorch_model.safetensors", "unet", {}),
    "unet-fp16": (
        md.UNet2DConditionModel,
        "unet/diffusion_pytorch_model.safetensors",
        "unet",
        {"mindspore_dtype": ms.float16},
    ),
    "vae": (md.AutoencoderKL, "vae/diffusion_pytorch_model.safetensors", "vae", {}),
    "vae-ldm": (md.AutoencoderKL, "vae-ldm.safetensors", "vae", {}),
    "wan": (md.WanTransformer3DModel, "wan/diffusion_pytorch_model.safetensors", "wan", {}),
    "wan-bf16": (
        md.WanTransformer3DModel,
        "wan/diffusion_pytorch_model.safetensors",
        "wan",
        {"mindspore_dtype": ms.bfloat16},
    ),
    "wan-vae": (md.AutoencoderKLWan, "wan-vae/diffusion_pytorch_model.safetensors", "wan-vae", {}),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param("vae-ldm", marks=pytest.mark.matrix), *(case for case in SINGLE_FILE_CASES if case != "vae-ldm")],
)
def test_single_file_same_model_as_unpatched(single_files, case):
    root, _ = single_files
    cls, file, config, kwargs = SINGLE_FILE_CASES[case]
    reference, accelerated = load_both(
        lambda: cls.from_single_file(str(root / file), config=str(root / config), **kwargs)
    )
    assert_same_model(reference, accelerated)
    report = ms_loadpatch.last_report()
    assert report.model_class == cls.__name__ and report.technique.startswith("from_single_file")
    assert not accelerated.training and not reference.training


def test_ldm_file_converts_to_the_saved_vae(single_files):
    """The original-format file really is the VAE: unpatched conversion gives its values back."""
    root, vae = single_files
    with ms_loadpatch.disabled():
        loaded = md.AutoencoderKL.from_single_file(str(root / "vae-ldm.safetensors"), config=str(root / "vae"))
    expected = {name: p.asnumpy() for name, p in vae.parameters_and_names()}
    got = {name: p.asnumpy() for name, p in loaded.parameters_and_names()}
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_single_file_reads_into_the_model(single_files, monkeypatch):
    """The patched read gives mindone Parameters over the read buffer; the
    model's parameters alias them, so no checkpoint copy is made."""
    from ms_loadpatch.glue import diffusers as glue

    root, _ = single_files
    assert api_verdict().adopts, api_verdict().library_problems
    adopted = {}

    def spy(array, name):
        adopted[name] = glue_adopt(array, name)
        return adopted[name]

    glue_adopt = glue.adopted_parameter
    monkeypatch.setattr(glue, "adopted_parameter", spy)
    model = md.AutoencoderKL.from_single_file(
        str(root / "vae/diffusion_pytorch_model.safetensors"), config=str(root / "vae")
    )
    params = dict(model.parameters_and_names())
    assert adopted.keys() == params.keys()
    if all(p.data_ptr() for p in adopted.values()):  # 0 on mindspore 2.7 for a host tensor
        assert all(params[name].data_ptr() == adopted[name].data_ptr() for name in params)
        assert len({p.data_ptr() for p in adopted.values()}) == len(adopted)  # each tensor in a buffer of its own


def test_source_parameters_shared_into_the_model_are_left_as_they_are():
    """A source model's cell the call puts into its model (PIA's conv_in, an
    IP adapter's encoder_hid_proj): its parameters are not this build's, and
    keep their state (an initializer kept in init_mode, as mindone's diffusers
    load leaves a loaded parameter)."""
    from mindspore import nn
    from mindspore.common.initializer import initializer

    from ms_loadpatch.strategy.building.construction import built_with_draws

    source = nn.Dense(3, 2)
    kept = initializer("zeros", (2, 3), ms.float32)
    source.weight.init_mode = kept

    class Holder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.own = nn.Dense(3, 2)
            self.shared = source

    model, filled = built_with_draws(Holder, foreign={id(p) for p in source.get_parameters()})
    assert source.weight.init_mode is kept
    assert filled == 2 and not model.own.weight.has_init and model.own.weight.init_mode is None
