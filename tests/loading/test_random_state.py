"""A seeded script draws the same numbers after a call with the plugin on as
without it (from_pretrained, and calls that build then fill): numpy's global RandomState (mindspore's initializers seed from
it), Python's random, mindspore's default generator; and gets the same
model, weights its checkpoint lacks included. Fresh processes, one
PYTHONHASHSEED, the first call of a process (the probes run) and a later one.

diffusers loads: UNet, VAE, UNet3D (also lacking weights), ControlNet from
a UNet, a UNet's single file, CogVideoX's transformer (2b and 5b layouts)
and VAE, the CogVideoX pipeline (with a T5 encoder), Wan's transformer
(also lacking weights) and VAE.

transformers loads: dense Qwen2 as stored and as bf16, with weights the
checkpoint lacks, a Mixtral built from its first cell with every
construction technique (experts copied), Qwen3-MoE (its `_init_weights`
writes with `Tensor.normal_` / `zero_`: recorded on lazy parameters with
their generator steps), also lacking its output head and one expert,
Gemma2 (a padding row), NLLB-MoE (`fill_` too), CLIP's text model.
"""

import json
import os
import subprocess
import sys

import pytest
from _helpers import TESTS_DIR

CHILD = os.path.join(TESTS_DIR, "_random_state_child.py")
# the version matrix runs the probes, what differs between mindspore versions (2 processes a version)
CASES = [
    "diffusers-unet",
    "diffusers-vae",
    "diffusers-unet3d",
    "diffusers-unet3d-missing",
    "diffusers-controlnet",
    "diffusers-single-file",
    "diffusers-cogvideox",
    "diffusers-cogvideox-5b",
    "diffusers-cogvideox-vae",
    "diffusers-wan",
    "diffusers-wan-missing",
    "diffusers-wan-vae",
    "diffusers-cogvideox-pipeline",
    "transformers-from-config",
    pytest.param("probes", marks=pytest.mark.matrix),
    "transformers-qwen2",
    "transformers-qwen2-bf16",
    pytest.param("transformers-qwen2-missing", marks=pytest.mark.matrix),
    "transformers-mixtral",
    "transformers-qwen3-moe",
    "transformers-qwen3-moe-missing",
    "transformers-gemma2",
    "transformers-nllb-moe",
    "transformers-clip-text",
]


def run_python(args, env_extra):
    env = {k: v for k, v in os.environ.items() if k != "MS_LOADPATCH"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(CHILD)
    )


@pytest.fixture(scope="module")
def diffusers_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-state")
    code = f"""
import os
os.environ["MS_LOADPATCH"] = "0"
import mindone.diffusers as D
from ms_loadpatch.testing import cpu_kernel_fallbacks
with cpu_kernel_fallbacks():
    D.UNet2DConditionModel(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8, norm_num_groups=4,
        attention_head_dim=2).save_pretrained(os.path.join({str(root)!r}, "diffusers-unet"))
    D.AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
        norm_num_groups=4, sample_size=16).save_pretrained(os.path.join({str(root)!r}, "diffusers-vae"))
    # TemporalConvLayer zeroes its last conv after that conv drew: a copied block must draw as the real one
    D.UNet3DConditionModel(block_out_channels=(4, 8), norm_num_groups=4, layers_per_block=1, sample_size=8,
        in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=8,
        attention_head_dim=2).save_pretrained(os.path.join({str(root)!r}, "diffusers-unet3d"))
    from _helpers import tiny_cogvideox, tiny_cogvideox_vae, tiny_t5_tokenizer, tiny_wan, tiny_wan_vae
    for case, cls, config in (("diffusers-cogvideox", D.CogVideoXTransformer3DModel, tiny_cogvideox("2b")),
                              ("diffusers-cogvideox-5b", D.CogVideoXTransformer3DModel, tiny_cogvideox("5b")),
                              ("diffusers-cogvideox-vae", D.AutoencoderKLCogVideoX, tiny_cogvideox_vae()),
                              ("diffusers-wan", D.WanTransformer3DModel, tiny_wan()),
                              ("diffusers-wan-vae", D.AutoencoderKLWan, tiny_wan_vae())):
        cls(**config).save_pretrained(os.path.join({str(root)!r}, case))
    import transformers as hf
    import mindone.transformers as mt
    D.CogVideoXPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=mt.T5EncoderModel(hf.T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                                   num_heads=2, relative_attention_num_buckets=4)),
        vae=D.AutoencoderKLCogVideoX(**tiny_cogvideox_vae()),
        transformer=D.CogVideoXTransformer3DModel(**tiny_cogvideox("2b")),
        scheduler=D.CogVideoXDDIMScheduler(),
    ).save_pretrained(os.path.join({str(root)!r}, "diffusers-cogvideox-pipeline"))
    from safetensors.numpy import load_file, save_file
    small = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    for name, model in (
            ("transformers-qwen2", mt.Qwen2ForCausalLM(hf.Qwen2Config(intermediate_size=64, **small))),
            ("transformers-mixtral", mt.MixtralForCausalLM(hf.MixtralConfig(
                intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, **small))),
            ("transformers-qwen3-moe", mt.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
                intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8,
                **small))),
            ("transformers-gemma2", mt.Gemma2ForCausalLM(hf.Gemma2Config(
                intermediate_size=64, head_dim=8, pad_token_id=1, **small))),
            ("transformers-nllb-moe", mt.NllbMoeForConditionalGeneration(hf.NllbMoeConfig(
                vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=4, expert_capacity=4,
                sparse_step=1, max_position_embeddings=64))),
            ("transformers-clip-text", mt.CLIPTextModel(hf.CLIPTextConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16)))):
        model.save_pretrained(os.path.join({str(root)!r}, name))
    for case, dropped in (("transformers-qwen2", ("model.layers.1.mlp.up_proj.weight",
                                                  "model.layers.0.self_attn.q_proj.bias", "lm_head.weight")),
                          ("transformers-qwen3-moe", ("model.layers.1.mlp.experts.3.up_proj.weight",
                                                      "model.layers.0.mlp.gate.weight", "lm_head.weight")),
                          ("diffusers-unet3d", ("down_blocks.1.temp_convs.0.conv4.3.weight",
                                                "up_blocks.0.temp_convs.1.conv4.3.bias",
                                                "down_blocks.0.temp_convs.0.conv1.2.weight")),
                          ("diffusers-wan", ("scale_shift_table", "blocks.1.attn1.to_q.weight",
                                             "condition_embedder.time_proj.bias"))):
        source, missing = os.path.join({str(root)!r}, case), os.path.join({str(root)!r}, case + "-missing")
        os.makedirs(missing)
        for name in os.listdir(source):
            if name.endswith(".json"):
                with open(os.path.join(source, name)) as f, open(os.path.join(missing, name), "w") as g:
                    g.write(f.read())
        file = "model.safetensors" if case.startswith("transformers") else "diffusion_pytorch_model.safetensors"
        tensors = load_file(os.path.join(source, file))
        for key in dropped:
            del tensors[key]
        save_file(tensors, os.path.join(missing, file), metadata={{"format": "np"}})
"""
    proc = run_python(["-c", code], env_extra={"MS_LOADPATCH": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(root)


def _draws(case, directory, plugin: bool):
    # a small MoE passes every construction technique from its first cell (experts copied)
    env = {"PYTHONHASHSEED": "0", "GLOG_v": "3", "MS_LOADPATCH_FAST_CONSTRUCTION_FROM": "0"}
    if not plugin:
        env["MS_LOADPATCH"] = "0"
    proc = run_python([CHILD, case, directory], env_extra=env)
    for line in proc.stdout.splitlines():
        if line.startswith("DRAWS "):
            result = json.loads(line[len("DRAWS ") :])
            assert result["enabled"] is plugin
            return result
    raise AssertionError(f"no DRAWS line; exit {proc.returncode}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("case", CASES)
def test_global_random_state_after_call_is_unpatched(case, diffusers_checkpoints):
    unpatched = _draws(case, diffusers_checkpoints, plugin=False)
    patched = _draws(case, diffusers_checkpoints, plugin=True)
    # Where ms.set_seed does not fix mindspore's default generator (2.7.0: a state of its own per
    # process), what both processes must agree on is whether each call moved it from there.
    comparable = unpatched["seeded"] == patched["seeded"]
    for call, (want, got) in enumerate(zip(unpatched["after"], patched["after"]), start=1):
        if not comparable:
            want["mindspore"] = want["mindspore"] != unpatched["seeded"]
            got["mindspore"] = got["mindspore"] != patched["seeded"]
        assert got == want, f"{case}, call {call}: global random state differs from an unpatched process"


def test_kept_restores_numpy_and_python_generators_even_on_error(monkeypatch):
    """kept() launches no mindspore op: reading mindspore's generator state
    from two threads' first loads at once hung mindspore 2.10 (found by
    benchmarks/stress_loads.py)."""
    import random

    import mindspore as ms
    import numpy as np

    from ms_loadpatch.strategy import randomstate

    def no_op_allowed(*args, **kwargs):
        raise AssertionError("kept() must not launch a mindspore op")

    monkeypatch.setattr(ms, "get_rng_state", no_op_allowed)
    monkeypatch.setattr(ms, "set_rng_state", no_op_allowed)
    np.random.seed(3)
    random.seed(3)
    expected = (np.random.rand(), random.random())
    np.random.seed(3)
    random.seed(3)
    with pytest.raises(ValueError):
        with randomstate.kept():
            np.random.rand(5)
            random.random()
            raise ValueError("inside")
    assert (np.random.rand(), random.random()) == expected
