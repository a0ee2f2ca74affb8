"""What several test modules share: running a fresh Python process and
reading the report it prints, and the tiny model configs the tests build,
so that "the tiny Qwen2" is one model wherever a test says it.

A plain module (conftest.py keeps the fixtures and the environment set at
import): test modules import it by name, as pytest puts tests/ on sys.path,
and so can the child scripts beside it, which run from tests/. It imports
no model library at import; the config factories import theirs when called.
"""

import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_python(code_or_args, env_extra=None, env_drop=(), timeout=600, cwd=None):
    """Run a fresh Python process (real import order, real environment)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.pop("MS_LOADPATCH", None)
    env.update(env_extra or {})
    args = [sys.executable] + (["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or TESTS_DIR)


def report_of(proc):
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT ") :])
    raise AssertionError(f"no REPORT line; exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")


# -- tiny models: tens of cells, built and saved in well under a second


def tiny_qwen2_config(**extra):
    """The tiny Qwen2 (2 layers, hidden 32, vocab 128) as a transformers
    Qwen2Config; `extra` adds fields (tie_word_embeddings=True), it cannot
    change these."""
    import transformers as hf

    return hf.Qwen2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, **extra)


def tiny_vae() -> dict:
    """Keyword arguments of mindone.diffusers.AutoencoderKL for the tiny VAE (a new dict each call)."""
    return dict(block_out_channels=[4, 8], in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=4, sample_size=16)


def tiny_unet() -> dict:
    """Keyword arguments of mindone.diffusers.UNet2DConditionModel for the tiny UNet (a new dict each call)."""
    return dict(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8, norm_num_groups=4,
                attention_head_dim=2)
