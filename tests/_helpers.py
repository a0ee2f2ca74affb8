"""What several test modules share: running a fresh Python process and
reading the report it prints, and the tiny model configs the tests build,
so that "the tiny Qwen2" is one model wherever a test says it.

A plain module (conftest.py keeps the fixtures and the environment set at
import): test modules import it by name, as pytest puts tests/ on sys.path,
and so can the child scripts beside it, which run from tests/. It imports
no model library at import; the config factories import theirs when called.
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def run_python(code_or_args, env_extra=None, env_drop=(), timeout=600, cwd=None):
    """Run a fresh Python process (real import order, real environment)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.pop("MS_LOADPATCH", None)
    env.update(env_extra or {})
    args = [sys.executable] + (["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or TESTS_DIR)


def installed_pth() -> bool:
    """Whether a wheel install placed the `.pth` that activates the plugin at start-up."""
    import site

    return any(os.path.exists(os.path.join(d, "ms_loadpatch_autoload.pth")) for d in site.getsitepackages())


def report_of(proc):
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT ") :])
    raise AssertionError(
        f"no REPORT line; exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )


# -- tiny models: tens of cells, built and saved in well under a second


def tiny_qwen2_config(**extra):
    """The tiny Qwen2 (2 layers, hidden 32, vocab 128) as a transformers
    Qwen2Config; `extra` adds fields (tie_word_embeddings=True), it cannot
    change these."""
    import transformers as hf

    return hf.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        **extra,
    )


def tiny_transformers(*names) -> dict:
    """name -> (mindone.transformers class, a function making its config)
    for the tiny models of these families, in the order asked: dense (qwen2
    with tied embeddings, llama), MoE (mixtral; qwen3_moe, qwen2_moe,
    deepseek_v2 and olmoe, whose experts keep the config; granitemoe, with
    fused experts), encoder-decoder (t5) and encoder (bert)."""
    import mindone.transformers as mt
    import transformers as hf

    families = {
        "qwen2": (mt.Qwen2ForCausalLM, lambda: tiny_qwen2_config(tie_word_embeddings=True)),
        "mixtral": (
            mt.MixtralForCausalLM,
            lambda: hf.MixtralConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=16,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        # MoE families whose experts keep the config (`self.config = config`): copies must refer to the same object
        "qwen3_moe": (
            mt.Qwen3MoeForCausalLM,
            lambda: hf.Qwen3MoeConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        "qwen2_moe": (
            mt.Qwen2MoeForCausalLM,
            lambda: hf.Qwen2MoeConfig(  # a shared expert beside the routed ones
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        "deepseek_v2": (
            mt.DeepseekV2ForCausalLM,
            lambda: hf.DeepseekV2Config(  # shared experts, another MLP class
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                moe_intermediate_size=16,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=0,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_group=1,
                topk_group=1,
            ),
        ),
        "olmoe": (
            mt.OlmoeForCausalLM,
            lambda: hf.OlmoeConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        # experts fused into one Parameter over mint.empty (a fused family; its norms and experts are never lazy)
        "granitemoe": (
            mt.GraniteMoeForCausalLM,
            lambda: hf.GraniteMoeConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=16,
                num_local_experts=4,
                num_experts_per_tok=2,
            ),
        ),
        "t5": (
            mt.T5ForConditionalGeneration,
            lambda: hf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        ),
        "bert": (
            mt.BertModel,
            lambda: hf.BertConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
            ),
        ),
        "llama": (
            mt.LlamaForCausalLM,
            lambda: hf.LlamaConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                tie_word_embeddings=False,
            ),
        ),
    }
    return {name: families[name] for name in names}


def tiny_vae() -> dict:
    """Keyword arguments of mindone.diffusers.AutoencoderKL for the tiny VAE (a new dict each call)."""
    return dict(
        block_out_channels=[4, 8],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )


def tiny_unet() -> dict:
    """Keyword arguments of mindone.diffusers.UNet2DConditionModel for the tiny UNet (a new dict each call)."""
    return dict(
        block_out_channels=(4, 8),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        norm_num_groups=4,
        attention_head_dim=2,
    )


def tiny_cogvideox(layout="2b") -> dict:
    """Keyword arguments of mindone.diffusers.CogVideoXTransformer3DModel, tiny:
    `2b` CogVideoX-2b's layout (sin-cos positions), `5b` CogVideoX-5b's
    (rotary positions). Builds under cpu_kernel_fallbacks()."""
    config = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=8,
        num_layers=1,
        sample_width=8,
        sample_height=8,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
        use_rotary_positional_embeddings=False,
        use_learned_positional_embeddings=False,
    )
    if layout == "5b":
        config.update(num_layers=2, use_rotary_positional_embeddings=True)
    return config


def tiny_cogvideox_vae() -> dict:
    """Keyword arguments of mindone.diffusers.AutoencoderKLCogVideoX, tiny."""
    return dict(
        block_out_channels=(8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        down_block_types=("CogVideoXDownBlock3D",) * 2,
        up_block_types=("CogVideoXUpBlock3D",) * 2,
        in_channels=3,
        out_channels=3,
    )


def tiny_wan() -> dict:
    """Keyword arguments of mindone.diffusers.WanTransformer3DModel, tiny
    (Wan2.1's layout). Builds under cpu_kernel_fallbacks()."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def tiny_wan_vae() -> dict:
    """Keyword arguments of mindone.diffusers.AutoencoderKLWan, tiny."""
    return dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])


def tiny_hunyuan_video() -> dict:
    """Keyword arguments of mindone.diffusers.HunyuanVideoTransformer3DModel,
    tiny (dual-stream, single-stream and refiner blocks); builds on the plain
    CPU wheel (its rotary table is made in the forward pass)."""
    return dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 4, 4),
    )


def tiny_hunyuan_video_vae() -> dict:
    """Keyword arguments of mindone.diffusers.AutoencoderKLHunyuanVideo, tiny."""
    return dict(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)


def tiny_t5_tokenizer():
    """A T5 tokenizer (unigram, sentencepiece-style) over a few words, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + word, -1.0) for word in "a cat the walks on grass".split()]
    pieces += [(letter, -5.0) for letter in "abcdefghijklmnopqrstuvwxyz"]
    unigram = Tokenizer(models.Unigram(pieces, unk_id=2))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    return T5TokenizerFast(
        tokenizer_object=unigram,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=8,
    )


# -- a forward pass on the CPU backend


@contextlib.contextmanager
def flux_cpu_routes():
    """Ops FluxTransformer2DModel's forward needs that the CPU wheel lacks,
    routed to equivalents; applied to both models, so the comparison is fair.
    mint.arange (Arange), mint.outer (Outer), Tensor.repeat_interleave
    (RepeatInterleaveInt), mint.stack (StackExt), ops.layer_norm behind
    mint.nn.LayerNorm (LayerNormExt), mint.nn.functional.gelu (GeluExt), and
    attention: mindone's sdpa always runs FlashAttentionScore (its math branch
    falls through), so its own math_attention_op is called instead."""
    import mindspore as ms
    import wrapt
    from mindone.diffusers.models import attention_dispatch
    from mindone.diffusers.models.layers_compat import math_attention_op
    from mindspore import mint, ops

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    def outer(wrapped, instance, args, kwargs):
        x, y = args
        return x.reshape(-1, 1) * y.reshape(1, -1)

    def repeat_interleave(wrapped, instance, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return ops.repeat_elements(instance, rep=args[0], axis=dim)

    def stack(wrapped, instance, args, kwargs):
        return ops.stack(args[0], axis=kwargs.get("dim", args[1] if len(args) > 1 else 0))

    def layer_norm(wrapped, instance, args, kwargs):
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        given = dict(zip(names, args), **kwargs)
        x, eps = given["input"], given.get("eps", 1e-5)
        axes = tuple(range(-len(given["normalized_shape"]), 0))
        mean = x.mean(axis=axes, keep_dims=True)
        y = (x - mean) / ops.sqrt(((x - mean) ** 2).mean(axis=axes, keep_dims=True) + eps)
        if given.get("weight") is not None:
            y = y * given["weight"]
        if given.get("bias") is not None:
            y = y + given["bias"]
        return y

    def gelu(wrapped, instance, args, kwargs):
        x = args[0]
        if kwargs.get("approximate", "none") == "tanh":
            return 0.5 * x * (1.0 + ops.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))
        return 0.5 * x * (1.0 + ops.erf(x / 1.4142135623730951))

    def sdpa(wrapped, instance, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "backend"}
        return math_attention_op(*args, **kwargs)

    with contextlib.ExitStack() as stack_:
        stack_.enter_context(cpu_kernel_fallbacks())
        for owner, attribute, route in (
            (mint, "outer", outer),
            (ms.Tensor, "repeat_interleave", repeat_interleave),
            (mint, "stack", stack),
            (ops, "layer_norm", layer_norm),
            (mint.nn.functional, "gelu", gelu),
            (attention_dispatch, "scaled_dot_product_attention", sdpa),
        ):
            stack_.enter_context(wrapt.scoped_function_wrapper(owner, attribute, route))
        yield


def npz_arrays(path) -> dict:
    """name -> array of an .npz file (a rank's parameters)."""
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def assert_same_arrays(expected, actual, what):
    assert sorted(expected) == sorted(actual), f"{what}: parameter names differ"
    differing = [
        n
        for n in expected
        if expected[n].shape != actual[n].shape
        or not np.array_equal(expected[n].view(np.uint32), actual[n].view(np.uint32))
    ]
    assert not differing, f"{what}: {len(differing)} parameters differ, e.g. {differing[:3]}"
