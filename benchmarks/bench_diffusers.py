"""Benchmark: unpatched vs patched mindone.diffusers from_pretrained.

Generates its checkpoints (random weights, cached in $MS_LOADPATCH_CACHE or
~/.cache/ms_loadpatch), then per case: each load in a fresh process, median
over --repeats, peak RSS, and the floors measured in the same run (reading
every checkpoint byte; constructing under no_init_parameters). Every weight
is touched before the clock stops. Single models go through the shared
harness (ms_loadpatch.tools.bench); the pipeline has its own child here.

    python benchmarks/bench_diffusers.py --size small --repeats 1   # a quick check
    python benchmarks/bench_diffusers.py                            # the real one (a few GB of files)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import bench_main, bf16_copy, run_single, script_result  # noqa: E402

from ms_loadpatch.tools import bench  # noqa: E402

# "full": UNet2DConditionModel 356M params (SD-like, narrower), Flux-style
# 283M, pipeline = that UNet + an SD VAE (84M) + a CLIP-L-sized text encoder (123M).
SIZES = {
    "full": {
        "unet": dict(
            sample_size=64,
            block_out_channels=[256, 512, 768, 768],
            layers_per_block=2,
            cross_attention_dim=768,
            attention_head_dim=8,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
        ),
        "flux": dict(
            patch_size=1,
            in_channels=64,
            num_layers=4,
            num_single_layers=8,
            attention_head_dim=128,
            num_attention_heads=8,
            joint_attention_dim=1024,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
        ),
        "vae": dict(
            block_out_channels=[128, 256, 512, 512],
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            layers_per_block=2,
            sample_size=512,
        ),
        "text_encoder": dict(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_hidden_layers=12,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=768,
        ),
        "shard": "200MB",
    },
    "small": {
        "unet": dict(
            sample_size=16,
            block_out_channels=[32, 64],
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=4,
            norm_num_groups=8,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        ),
        "flux": dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            axes_dims_rope=[8, 12, 12],
        ),
        "vae": dict(
            block_out_channels=[32, 64],
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            norm_num_groups=8,
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            sample_size=32,
        ),
        "text_encoder": dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=32,
        ),
        "shard": "200KB",
    },
}
CASES = (
    "unet-fp32-as-bf16",
    "unet-bf16-as-bf16",
    "unet-bf16-sharded-as-bf16",
    "flux-bf16-as-bf16",
    "pipeline-bf16-as-bf16",
)


# -- checkpoints


def generate(size, progress):
    config = SIZES[size]

    def made(name, class_name, cfg, shard=None, library="diffusers"):
        return bench.cached_checkpoint(f"df-{size}-{name}", class_name, cfg, shard, library=library, progress=progress)

    unet = made("unet", "UNet2DConditionModel", config["unet"])
    unet_sharded = made("unet-sharded", "UNet2DConditionModel", config["unet"], config["shard"])
    flux = made("flux", "FluxTransformer2DModel", config["flux"])
    paths = {
        "unet-fp32": unet,
        "unet-bf16": bf16_copy(unet),
        "unet-bf16-sharded": bf16_copy(unet_sharded),
        "flux-bf16": bf16_copy(flux),
    }
    components = {
        "unet": paths["unet-bf16"],
        "vae": bf16_copy(made("vae", "AutoencoderKL", config["vae"])),
        "text_encoder": bf16_copy(
            made("text-encoder", "CLIPTextModel", config["text_encoder"], library="transformers")
        ),
    }
    paths["pipeline-bf16"] = assemble_pipeline(size, components)
    return paths


_ASSEMBLE = r"""
import json, os, sys
from transformers import CLIPTokenizer
from mindone.diffusers import PNDMScheduler
out = sys.argv[1]
vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
for suffix in ("", "</w>"):
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[letter + suffix] = len(vocab)
tmp = os.path.join(out, "tokenizer")
os.makedirs(tmp, exist_ok=True)
with open(os.path.join(tmp, "vocab.json"), "w") as f:
    json.dump(vocab, f)
with open(os.path.join(tmp, "merges.txt"), "w") as f:
    f.write("#version: 0.2\n")
CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), model_max_length=77).save_pretrained(tmp)
PNDMScheduler(skip_prk_steps=True, steps_offset=1).save_pretrained(os.path.join(out, "scheduler"))
"""


def assemble_pipeline(size, components):
    """A StableDiffusionPipeline directory: the generated components (symlinked),
    a tokenizer built offline from a tiny vocabulary, a scheduler."""
    out = os.path.join(bench.cache_dir(), f"df-{size}-pipeline-bf16")
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    os.makedirs(out, exist_ok=True)
    for name, path in components.items():
        link = os.path.join(out, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(path, link)
    subprocess.run(
        [sys.executable, "-c", _ASSEMBLE, out],
        check=True,
        env=bench.child_env("unpatched"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": "0.35.1",
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    open(os.path.join(out, ".complete"), "w").close()
    return out


# -- the pipeline child


_PIPELINE_CHILD = r"""
import json, os, sys, time
import ms_loadpatch
from ms_loadpatch import activation
if activation.switched_on():
    assert ms_loadpatch.enable(), ms_loadpatch.status()["refusal"]
else:
    ms_loadpatch.disable()
import mindspore as ms
from mindspore import nn
from mindone.diffusers import DiffusionPipeline
from ms_loadpatch.tools._child import _max_rss_bytes, _reset_peak_rss, prime_memory, touch_all, warm_page_cache
from ms_loadpatch.strategy import reports as report_module
from ms_loadpatch.testing import cpu_kernel_fallbacks
reports = []
emit = report_module.emit
report_module.emit = lambda report: (reports.append(report.as_dict()), emit(report))
path, dtype, prime = sys.argv[1], getattr(ms, sys.argv[2]), int(sys.argv[3])
weights = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names if n.endswith(".safetensors")]
with cpu_kernel_fallbacks():
    warm_page_cache(sorted(weights))  # as the floors' child does before its priming
    prime_memory(prime)
    _reset_peak_rss()
    rss_before = _max_rss_bytes()
    start = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(path, mindspore_dtype=dtype)
    for component in pipe.components.values():
        if isinstance(component, nn.Cell):
            touch_all(component)
    seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"seconds": seconds, "peak_rss_bytes": _max_rss_bytes(), "rss_before_bytes": rss_before,
                              "plugin_enabled": ms_loadpatch.is_enabled(), "reports": reports}))
"""


def measure_pipeline(path, mode, prime, dtype="bfloat16"):
    return script_result(_PIPELINE_CHILD, (path, dtype, prime), mode, "pipeline load")


def bench_pipeline(path, repeats, progress, memory, models=("unet", "vae", "text_encoder")):
    specs = [bench.LoadSpec.resolve(path, subfolder=name) for name in models]
    prime = sum(bench.prime_bytes(spec, memory) for spec in specs)
    floors = {"read_seconds": 0.0, "construct_seconds": 0.0, "read_bytes": 0}
    with bench.step_of(progress, "pipeline floors: read every byte, construct without init (per component)"):
        for spec in specs:
            floor = bench.measure_floors(spec, prime=bench.prime_bytes(spec, memory))
            for key in floors:
                floors[key] += floor[key]
    runs = {"unpatched": [], "patched": []}
    for i in range(repeats):
        for mode in runs:
            with bench.step_of(progress, f"pipeline {mode} load {i + 1}/{repeats}"):
                runs[mode].append(measure_pipeline(path, mode, prime))
    result = {"floors": floors, "repeats": repeats, "memory": memory}
    for mode, mode_runs in runs.items():
        result[mode] = {
            "seconds": [r["seconds"] for r in mode_runs],
            "median_seconds": statistics.median(r["seconds"] for r in mode_runs),
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in mode_runs],
            "rss_before_bytes": [r["rss_before_bytes"] for r in mode_runs],
        }
    fast = runs["patched"][0]["reports"]
    result["patched"]["reports"] = [(r["library"], r["model_class"], r["technique"]) for r in fast]
    result["ratio"] = result["unpatched"]["median_seconds"] / result["patched"]["median_seconds"]
    return result


def run_case(case, paths, args, progress):
    source = case.rsplit("-as-", 1)[0]
    if not case.startswith("pipeline"):
        return run_single(case, paths[source], "bfloat16", args, progress)
    result = bench_pipeline(paths[source], args.repeats, progress, args.memory)
    print(f"\n{case}: components loaded through the fast path: {result['patched']['reports']}")
    return result


def main(argv=None) -> int:
    return bench_main(
        argv,
        __doc__,
        SIZES,
        CASES,
        generate,
        run_case,
        "bf16-as-bf16 >= 2x and >= 30% less RSS; never slower; within 1.5x of the floor",
    )


if __name__ == "__main__":
    sys.exit(main())
