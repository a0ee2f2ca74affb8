"""Tiny models of the families whose `_init_weights` writes in place
(`.data.normal_()`, `.zero_()`, `.fill_()`, `weight[pad] = 0`), for the
deferred-writes tests and their plain-wheel child processes."""

import os

import mindone.transformers as mt
import mindspore as ms
import transformers as hf
from safetensors.numpy import load_file, save_file

from ms_loadpatch.testing import cpu_kernel_fallbacks

_SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen3-moe": (
        mt.Qwen3MoeForCausalLM,
        lambda **kw: hf.Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            **_SMALL,
            **kw,
        ),
    ),
    "qwen2-moe": (
        mt.Qwen2MoeForCausalLM,
        lambda **kw: hf.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            **_SMALL,
            **kw,
        ),
    ),
    "gemma2": (
        mt.Gemma2ForCausalLM,
        lambda **kw: hf.Gemma2Config(intermediate_size=64, head_dim=8, **{"pad_token_id": 1, **_SMALL, **kw}),
    ),
    "nllb-moe": (
        mt.NllbMoeForConditionalGeneration,
        lambda **kw: hf.NllbMoeConfig(
            vocab_size=128,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            num_experts=4,
            expert_capacity=4,
            sparse_step=1,
            max_position_embeddings=64,
            **kw,
        ),
    ),
    "llama-pad": (
        mt.LlamaForCausalLM,
        lambda **kw: hf.LlamaConfig(intermediate_size=64, **{"pad_token_id": 1, **_SMALL, **kw}),
    ),
}
# families whose init pass writes in place into lazy parameters (Llama's writes go to its real embedding)
WRITES_IN_PLACE = {"qwen3-moe", "qwen2-moe", "gemma2", "nllb-moe"}
# weights a "lacking" checkpoint drops: an output head, a norm, a projection, one expert (where the family has them)
DROPPED = (
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.experts.2.up_proj.weight",
    "model.decoder.layer_norm.weight",
    "model.decoder.layers.0.self_attn.q_proj.weight",
    "model.encoder.layers.1.ffn.fc1.weight",
)


def save_family(cls, config, directory, drop=False):
    """`cls(config)` built from seed 0, saved to `directory`; `drop`: without the DROPPED weights it has."""
    with cpu_kernel_fallbacks():
        ms.set_seed(0)
        cls(config).save_pretrained(directory)
    if drop:
        path = os.path.join(directory, "model.safetensors")
        tensors = load_file(path)
        gone = [k for k in DROPPED if k in tensors]
        assert gone, "the lacking checkpoint lacks nothing"
        for key in gone:
            del tensors[key]
        save_file(tensors, path, metadata={"format": "np"})
    return directory
