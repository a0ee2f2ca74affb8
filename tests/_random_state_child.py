"""Child process for test_random_state.py: seed, run one kind of call twice,
and print the global generators' draws after each call as one JSON line.

    python _random_state_child.py CASE DIRECTORY

CASE: `diffusers-unet`, `diffusers-vae`, `diffusers-unet3d[-missing]`,
`diffusers-cogvideox[-5b|-vae|-pipeline]`, `diffusers-wan[-missing|-vae]`
(from_pretrained of the checkpoint in DIRECTORY/CASE), `diffusers-controlnet` (ControlNetModel.from_unet of that
UNet), `diffusers-single-file` (the UNet's file through from_single_file),
`transformers-*` (from_pretrained of DIRECTORY/CASE, see
TRANSFORMERS; `-bf16`: as bfloat16), `transformers-from-config`, `probes`
(every probe the plugin runs, through status(), against no call at all).
The plugin is on unless MS_LOADPATCH=0. After each load, a digest of every
parameter's name, dtype and bytes.
"""

import hashlib
import json
import os
import random
import sys

case, directory = sys.argv[1], sys.argv[2]

# isort: split
import ms_loadpatch  # noqa: E402,F401  (first, as a user's script; MS_LOADPATCH=0 leaves it off)

# isort: split
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402

from ms_loadpatch.testing import cpu_kernel_fallbacks  # noqa: E402

# case -> (mindone.transformers class, checkpoint directory under DIRECTORY)
TRANSFORMERS = {
    "transformers-qwen2": ("Qwen2ForCausalLM", "transformers-qwen2"),
    "transformers-qwen2-bf16": ("Qwen2ForCausalLM", "transformers-qwen2"),
    "transformers-qwen2-missing": ("Qwen2ForCausalLM", "transformers-qwen2-missing"),
    "transformers-mixtral": ("MixtralForCausalLM", "transformers-mixtral"),
    "transformers-qwen3-moe": ("Qwen3MoeForCausalLM", "transformers-qwen3-moe"),
    "transformers-qwen3-moe-missing": ("Qwen3MoeForCausalLM", "transformers-qwen3-moe-missing"),
    "transformers-gemma2": ("Gemma2ForCausalLM", "transformers-gemma2"),
    "transformers-nllb-moe": ("NllbMoeForConditionalGeneration", "transformers-nllb-moe"),
    "transformers-clip-text": ("CLIPTextModel", "transformers-clip-text"),
}


def digest(model):
    """Of a model, or of a pipeline's models."""
    from mindspore import nn

    h = hashlib.sha256()
    models = {"": model} if isinstance(model, nn.Cell) else model.components
    for component, cell in models.items():
        if not isinstance(cell, nn.Cell):
            continue
        for name, param in cell.parameters_and_names():
            h.update(f"{component} {name} {param.dtype}".encode())
            h.update(param.asnumpy().tobytes())
    return h.hexdigest()


def call():
    if case.startswith("diffusers-"):
        import mindone.diffusers as D

        if case == "diffusers-controlnet":  # built from a UNet, then filled from it
            return D.ControlNetModel.from_unet(
                D.UNet2DConditionModel.from_pretrained(os.path.join(directory, "diffusers-unet"))
            )
        if case == "diffusers-cogvideox-pipeline":
            return D.DiffusionPipeline.from_pretrained(os.path.join(directory, case))
        if case == "diffusers-single-file":
            return D.UNet2DConditionModel.from_single_file(
                os.path.join(directory, "diffusers-unet", "diffusion_pytorch_model.safetensors"),
                config=os.path.join(directory, "diffusers-unet"),
            )
        cls = {
            "diffusers-unet": D.UNet2DConditionModel,
            "diffusers-vae": D.AutoencoderKL,
            "diffusers-unet3d": D.UNet3DConditionModel,
            "diffusers-unet3d-missing": D.UNet3DConditionModel,
            "diffusers-cogvideox": D.CogVideoXTransformer3DModel,
            "diffusers-cogvideox-5b": D.CogVideoXTransformer3DModel,
            "diffusers-cogvideox-vae": D.AutoencoderKLCogVideoX,
            "diffusers-wan": D.WanTransformer3DModel,
            "diffusers-wan-missing": D.WanTransformer3DModel,
            "diffusers-wan-vae": D.AutoencoderKLWan,
        }[case]
        return cls.from_pretrained(os.path.join(directory, case))
    if case in TRANSFORMERS:
        import mindone.transformers as mt

        class_name, checkpoint = TRANSFORMERS[case]
        kwargs = {"mindspore_dtype": ms.bfloat16} if case.endswith("-bf16") else {}
        return getattr(mt, class_name).from_pretrained(os.path.join(directory, checkpoint), **kwargs)
    elif case == "transformers-from-config":
        import transformers as hf
        from mindone.transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(
            hf.Qwen2Config(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
            )
        )
    elif case == "probes":  # with the plugin off, nothing: every probe must leave the generators as not probing
        import mindone.transformers.modeling_utils  # noqa: F401

        if ms_loadpatch.is_enabled():
            ms_loadpatch.status()
    else:
        raise SystemExit(f"unknown case {case}")


def mindspore_state():
    return ms.get_rng_state().asnumpy().tolist() if hasattr(ms, "get_rng_state") else None


def draws():
    return {"numpy": repr(np.random.rand()), "python": repr(random.random()), "mindspore": mindspore_state()}


after = []
with cpu_kernel_fallbacks():
    ms.set_seed(7)
    random.seed(7)
    seeded = mindspore_state()  # mindspore 2.7.0's set_seed leaves its default generator at a per-process state
    for _ in range(2):  # the first call of a process (probes run) and a later one
        model = call()
        after.append({**draws(), "parameters": digest(model) if model is not None else None})
print("DRAWS " + json.dumps({"enabled": ms_loadpatch.is_enabled(), "seeded": seeded, "after": after}))
