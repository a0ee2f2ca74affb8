"""Tiny checkpoints the bad-input and interrupt tests break or cut short: a
Qwen2 and a VAE, each as one file and sharded (the `checkpoints` fixture,
once per module), with the helpers that find their files and load them."""

import mindone.diffusers as md
import mindone.transformers as mt
import mindspore as ms
import pytest
from _helpers import tiny_qwen2_config, tiny_vae

import ms_loadpatch
from ms_loadpatch.testing import cpu_kernel_fallbacks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        model = mt.Qwen2ForCausalLM(tiny_qwen2_config())
        model.save_pretrained(root / "tf-single")
        model.save_pretrained(root / "tf-sharded", max_shard_size="20KB")
        vae = md.AutoencoderKL(**tiny_vae())
        vae.save_pretrained(root / "df-single")
        vae.save_pretrained(root / "df-sharded", max_shard_size="12KB")
    return root


def shards(directory):
    return sorted(str(p) for p in directory.iterdir() if p.name.endswith(".safetensors"))


def file_to_break(directory):
    """The file to break: the only one, or the second shard."""
    files = shards(directory)
    return files[1] if len(files) > 1 else files[0]


def load(library, directory):
    if library == "tf":
        return mt.Qwen2ForCausalLM.from_pretrained(str(directory))
    if library == "tf-bf16":
        return mt.Qwen2ForCausalLM.from_pretrained(str(directory), mindspore_dtype=ms.bfloat16)
    return md.AutoencoderKL.from_pretrained(str(directory))
