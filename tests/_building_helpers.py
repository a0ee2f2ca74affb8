"""What the fast-construction tests (tests/building/) share: the
tiny models they build, the checkpoints saved from them once per test
module, switching techniques off, comparing two models' state, and the
techniques and factory functions they look up."""

import contextlib
import os

import mindone.diffusers as md
import mindspore as ms
import pytest
from _helpers import (
    tiny_cogvideox,
    tiny_cogvideox_vae,
    tiny_hunyuan_video,
    tiny_hunyuan_video_vae,
    tiny_transformers,
    tiny_unet,
    tiny_vae,
    tiny_wan,
    tiny_wan_vae,
)

import ms_loadpatch
from ms_loadpatch.strategy import building, switch
from ms_loadpatch.strategy.building import state
from ms_loadpatch.testing import cpu_kernel_fallbacks

TF_ARCHS = tiny_transformers(
    "qwen2", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "olmoe", "granitemoe", "t5", "bert"
)
DF_ARCHS = {
    "unet": (md.UNet2DConditionModel, tiny_unet()),
    "vae": (md.AutoencoderKL, tiny_vae()),
    "flux": (
        md.FluxTransformer2DModel,
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        ),
    ),
    "cogvideox-2b": (md.CogVideoXTransformer3DModel, tiny_cogvideox("2b")),
    "cogvideox-5b": (md.CogVideoXTransformer3DModel, tiny_cogvideox("5b")),
    "cogvideox-vae": (md.AutoencoderKLCogVideoX, tiny_cogvideox_vae()),
    "wan": (md.WanTransformer3DModel, tiny_wan()),
    "wan-vae": (md.AutoencoderKLWan, tiny_wan_vae()),
    "hunyuan-video": (md.HunyuanVideoTransformer3DModel, tiny_hunyuan_video()),
    "hunyuan-video-vae": (md.AutoencoderKLHunyuanVideo, tiny_hunyuan_video_vae()),
}


@contextlib.contextmanager
def techniques_off(value="all"):
    saved = os.environ.get(switch.ENV_VAR)
    os.environ[switch.ENV_VAR] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(switch.ENV_VAR, None)
        else:
            os.environ[switch.ENV_VAR] = saved


def assert_same_state(expected_model, actual_model, skip=()):
    skip = (building.CellInitTemplate.PER_INSTANCE_TIME,) + tuple(skip)
    expected, actual = state.model_state(expected_model, skip), state.model_state(actual_model, skip)
    assert expected == actual, state.first_difference(expected, actual)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastbuild")
    out = {}
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        for name, (cls, config) in TF_ARCHS.items():
            ms.set_seed(0)
            cls(config()).save_pretrained(str(root / name), max_shard_size="40KB")
            out[name] = (cls, str(root / name))
        for name, (cls, config) in DF_ARCHS.items():
            ms.set_seed(0)
            cls(**config).save_pretrained(str(root / name))
            out[name] = (cls, str(root / name))
    return out


def ms_factory(name):
    """mindspore's `mint.ones` / `ops.zeros` ... by its dotted name."""
    module, function = name.split(".")
    return getattr(getattr(ms, module), function)


def sibling_clone_technique():
    return next(t for t in building.TECHNIQUES if t.name == "sibling-clone")


MOE_FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "olmoe"]


def seeded_load(cls, path, off=None, **kwargs):
    ms.set_seed(11)  # dropout primitives draw their seeds from the global generator: same sequence both ways
    with techniques_off(off) if off else contextlib.nullcontext():
        return cls.from_pretrained(path, **kwargs)
