"""Diffusers parameter names to the original (LDM) single-file names, the
inverse of mindone's `convert_ldm_unet_checkpoint` /
`convert_ldm_vae_checkpoint`: to write original-format checkpoints for
tests and benchmarks (nothing can be fetched from a hub)."""

from __future__ import annotations

import re

_RESNET = (
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
)
_UNET_TOP = (
    ("time_embedding.linear_1", "time_embed.0"),
    ("time_embedding.linear_2", "time_embed.2"),
    ("conv_in", "input_blocks.0.0"),
    ("conv_norm_out", "out.0"),
    ("conv_out", "out.2"),
)
_VAE = (
    ("conv_norm_out", "norm_out"),
    ("mid_block.resnets.0", "mid.block_1"),
    ("mid_block.resnets.1", "mid.block_2"),
    ("mid_block.attentions.0", "mid.attn_1"),
    ("conv_shortcut", "nin_shortcut"),
    ("group_norm", "norm"),
    ("to_q", "q"),
    ("to_k", "k"),
    ("to_v", "v"),
    ("to_out.0", "proj_out"),
    ("downsamplers.0", "downsample"),
    ("upsamplers.0", "upsample"),
)


def unet_key(key: str, config: dict) -> str:
    """The LDM name (under `model.diffusion_model.`) of a UNet2DConditionModel
    key, for any number of blocks and layers per block."""
    layers = config["layers_per_block"]
    up_has_attention = [kind.startswith("CrossAttn") for kind in config["up_block_types"]]

    def resnet(rest):
        return next((new + rest[len(old) :] for old, new in _RESNET if rest.startswith(old + ".")), rest)

    def part(kind, rest):
        return "0." + resnet(rest) if kind == "resnets" else "1." + rest

    prefix = "model.diffusion_model."
    for old, new in _UNET_TOP:
        if key.startswith(old + "."):
            return f"{prefix}{new}{key[len(old) :]}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        return f"{prefix}input_blocks.{(layers + 1) * int(m[1]) + int(m[3]) + 1}.{part(m[2], m[4])}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key)
    if m:
        return f"{prefix}input_blocks.{(layers + 1) * (int(m[1]) + 1)}.0.op.{m[2]}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        index = 2 * int(m[2]) if m[1] == "resnets" else 1
        return f"{prefix}middle_block.{index}.{part(m[1], m[3])[2:]}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        return f"{prefix}output_blocks.{(layers + 1) * int(m[1]) + int(m[3])}.{part(m[2], m[4])}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key)
    if m:
        block = int(m[1])
        return f"{prefix}output_blocks.{(layers + 1) * block + layers}.{2 if up_has_attention[block] else 1}.{m[2]}"
    raise KeyError(f"no original-format name for UNet key {key!r}")


def vae_key(key: str, up_blocks: int) -> str:
    """The LDM name (without the `first_stage_model.` a whole-pipeline file
    adds) of an AutoencoderKL key."""
    for old, new in _VAE:
        key = key.replace(old, new)
    key = re.sub(r"down_blocks\.(\d+)\.resnets", r"down.\1.block", key)
    key = re.sub(r"down_blocks\.(\d+)\.downsample", r"down.\1.downsample", key)
    return re.sub(
        r"up_blocks\.(\d+)\.(resnets|upsample)",
        lambda m: f"up.{up_blocks - 1 - int(m.group(1))}.{'block' if m.group(2) == 'resnets' else 'upsample'}",
        key,
    )


def vae_value(key: str, value):
    """LDM attention projections are 1x1 convolutions: a 2-D weight gets two trailing axes."""
    if ".attentions." in key and key.endswith("weight") and value.ndim == 2:
        return value[:, :, None, None]
    return value


def text_encoder_key(key: str) -> str:
    """A mindone CLIP text model key as an SD 1.x file names it (torch's Embedding `weight`)."""
    return "cond_stage_model.transformer." + key.replace("embedding_table", "weight")
