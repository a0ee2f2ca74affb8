"""Many-expert configs with small hidden sizes for every MoE family mindone
ships (its `transformers.models`), for bench_construct.py and
bench_transformers.py, with each family's own config class: `layers` decoder
layers of `experts` routed experts (shared experts where the family has
them). Families whose experts are one fused parameter (granitemoe,
granitemoeshared, jetmoe, dbrx) get at least 80 layers, to pass 1000 cells."""

from __future__ import annotations

COMMON = dict(vocab_size=128, num_attention_heads=4, num_key_value_heads=2)  # hidden_size: 32 x width


def families(layers=24, experts=128, width=1) -> dict:
    """family -> (mindone class name, its config class's keyword arguments)"""
    E, W = experts, width
    F = max(layers, 80)  # experts fused into one parameter: 14-18 cells a layer, more layers to pass 1000 cells
    common = dict(COMMON, hidden_size=32 * W)
    base = dict(common, num_hidden_layers=layers)
    fused = dict(common, num_hidden_layers=F, intermediate_size=16 * W, num_local_experts=E, num_experts_per_tok=2)
    # a dense MLP size beside the experts' own (families with shared experts or dense layers)
    sized = dict(base, intermediate_size=64 * W, moe_intermediate_size=16 * W)
    top2 = dict(num_experts_per_tok=2)
    return {
        "mixtral": ("MixtralForCausalLM", dict(base, intermediate_size=16 * W, num_local_experts=E)),
        "qwen3_moe": ("Qwen3MoeForCausalLM", dict(sized, num_experts=E, head_dim=8, **top2)),
        "qwen2_moe": (
            "Qwen2MoeForCausalLM",
            dict(sized, num_experts=E, shared_expert_intermediate_size=32 * W, **top2),
        ),
        "olmoe": ("OlmoeForCausalLM", dict(base, intermediate_size=16 * W, num_experts=E, **top2)),
        "phimoe": ("PhimoeForCausalLM", dict(base, intermediate_size=16 * W, num_local_experts=E)),
        "deepseek_v2": (
            "DeepseekV2ForCausalLM",
            dict(
                sized,
                n_routed_experts=E,
                n_shared_experts=1,
                first_k_dense_replace=0,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_group=1,
                topk_group=1,
                **top2,
            ),
        ),
        "granitemoe": ("GraniteMoeForCausalLM", fused),
        "granitemoeshared": ("GraniteMoeSharedForCausalLM", dict(fused, shared_intermediate_size=32 * W)),
        "jetmoe": (
            "JetMoeForCausalLM",
            dict(
                vocab_size=128,
                hidden_size=32 * W,
                num_key_value_heads=2,
                kv_channels=8,
                num_hidden_layers=F,
                intermediate_size=16 * W,
                num_local_experts=E,
                **top2,
            ),
        ),
        "dbrx": (
            "DbrxForCausalLM",
            dict(
                vocab_size=128,
                d_model=32 * W,
                n_heads=4,
                n_layers=F,
                attn_config={"kv_n_heads": 2},
                ffn_config={"ffn_hidden_size": 16 * W, "moe_num_experts": E, "moe_top_k": 2},
            ),
        ),
        "ernie4_5_moe": (
            "Ernie4_5_MoeForCausalLM",
            dict(sized, moe_num_experts=E, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=1),
        ),
        "glm4_moe": (
            "Glm4MoeForCausalLM",
            dict(
                sized,
                n_routed_experts=E,
                n_shared_experts=1,
                first_k_dense_replace=0,
                n_group=1,
                topk_group=1,
                head_dim=8,
                **top2,
            ),
        ),
        # encoder-decoder, a sparse layer every 4th (the family's default): layers / 2 each side
        "nllb_moe": (
            "NllbMoeForConditionalGeneration",
            dict(
                vocab_size=128,
                d_model=32 * W,
                encoder_layers=max(layers // 2, 1),
                decoder_layers=max(layers // 2, 1),
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=16 * W,
                decoder_ffn_dim=16 * W,
                num_experts=E,
                expert_capacity=4,
                max_position_embeddings=64,
            ),
        ),
        "hunyuan_v1_moe": (
            "HunYuanMoEV1ForCausalLM",
            dict(base, intermediate_size=16 * W, num_experts=E, moe_topk=2, head_dim=8),
        ),
    }
