"""Calls that build a model and then fill it: `ControlNetModel.from_unet`,
`SparseControlNetModel.from_unet`, `UNetMotionModel.from_unet2d`,
`UNet2DConditionModel.from_single_file`, and layers built into the UNet
(an IP adapter, `_load_ip_adapter_weights`; a rank-32 LoRA on every
attention projection, `load_lora_adapter`), and a StableDiffusionPipeline
(that UNet and an SD VAE) from one original-format (LDM) file, unpatched vs
patched, each call in a fresh process; `from-pretrained` and
`pipeline-from-pretrained` are the same weights' from_pretrained, the
yardsticks of the single-file loads.

The UNet is Stable Diffusion 1.5's layout at 0.6x its width
(block_out_channels 192-384-768-768, 1.26 GB in fp32), generated once into
the cache; the other cases load it with from_pretrained before the timed
part (and make the adapter's tensors there). The timed part is the call
and a read of every page of the result; with --memory primed (default)
memory is faulted in and freed first.

    python benchmarks/bench_build_then_fill.py                          # every case, 3 runs each
    python benchmarks/bench_build_then_fill.py --cases controlnet --repeats 5 --memory as-is

Targets: from_unet at least 5x, from_unet2d at least 2x faster patched;
single-file (model and pipeline) at least 2.5x, and within 1.25x of the
patched from_pretrained; no case slower patched.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from common import script_result

from ms_loadpatch.tools import bench

UNET = {
    "block_out_channels": [192, 384, 768, 768],
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "layers_per_block": 2,
    "sample_size": 64,
    "norm_num_groups": 32,
}

CASES = {
    "controlnet": "md.ControlNetModel.from_unet(unet)",
    "sparse-controlnet": "md.SparseControlNetModel.from_unet(unet)",
    "motion": "md.UNetMotionModel.from_unet2d(unet)",
    "single-file": "md.UNet2DConditionModel.from_single_file(path + '/diffusion_pytorch_model.safetensors', "
    "config=path)",
    "from-pretrained": "md.UNet2DConditionModel.from_pretrained(path)",
    "pipeline-single-file": "md.StableDiffusionPipeline.from_single_file(pipeline + '/sd-ldm.safetensors', "
    "config=pipeline, **NO_TEXT)",
    "pipeline-from-pretrained": "md.StableDiffusionPipeline.from_pretrained(pipeline, **NO_TEXT)",
    "ip-adapter": "unet._load_ip_adapter_weights(adapter) or unet",
    "lora": "unet.load_lora_adapter(adapter, prefix=None) or unet",
}

# the adapter's tensors (Parameters, as mindone's loaders read them), made before the timed part
_ADAPTERS = r"""
def parameters(shapes):
    rng = np.random.default_rng(0)
    return {k: ms.Parameter(ms.Tensor(rng.standard_normal(v, dtype=np.float32) * 0.02), name=k) for k, v in shapes.items()}


def ip_adapter(unet, clip=1024):
    cross, channels, shapes, key = unet.config.cross_attention_dim, unet.config.block_out_channels, {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        block = None if name.startswith("mid_block") else int(name.split(".")[1])
        hidden = channels[-1] if block is None else (
            list(reversed(channels))[block] if name.startswith("up_blocks") else channels[block])
        shapes[f"{key}.to_k_ip.weight"] = shapes[f"{key}.to_v_ip.weight"] = (hidden, cross)
        key += 2
    projection = {"proj.weight": (cross * 4, clip), "proj.bias": (cross * 4,), "norm.weight": (cross,),
                  "norm.bias": (cross,)}
    return {"image_proj": parameters(projection), "ip_adapter": parameters(shapes)}


def lora(unet, rank=32):
    shapes = {}
    for name, cell in unet.cells_and_names():
        if name.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")):
            out_features, in_features = cell.weight.shape
            shapes[f"{name}.lora_A.weight"], shapes[f"{name}.lora_B.weight"] = (rank, in_features), (out_features, rank)
    return parameters(shapes)
"""

_CHILD = r"""
import json, sys, time
import ms_loadpatch
import mindone.diffusers as md
from ms_loadpatch.testing import cpu_kernel_fallbacks
from ms_loadpatch.tools._child import prime_memory, touch_all
path, call, prime, ADAPTERS, pipeline = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
NO_TEXT = dict(text_encoder=None, tokenizer=None, safety_checker=None, feature_extractor=None)
import mindspore as ms, numpy as np
exec(ADAPTERS)
with cpu_kernel_fallbacks():
    unet = md.UNet2DConditionModel.from_pretrained(path) if "unet" in call else None
    adapter = ip_adapter(unet) if "ip_adapter" in call else lora(unet) if "lora" in call else None
    prime_memory(prime)
    start = time.perf_counter()
    result = eval(call)
    models = [result] if isinstance(result, ms.nn.Cell) else [result.unet, result.vae]
    for model in models:
        touch_all(model)
    seconds = time.perf_counter() - start
report = ms_loadpatch.last_report() if ms_loadpatch.is_enabled() else None
print("RESULT " + json.dumps({"seconds": seconds, "parameters": sum(len(list(m.get_parameters())) for m in models),
                              "technique": report.technique if report else None}))
"""


VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "sample_size": 512,
}


def pipeline_directory(unet_path) -> str:
    """A StableDiffusionPipeline directory over the cached UNet and an SD VAE
    (no text encoder: it is passed as None), with both in one original-format
    file `sd-ldm.safetensors`; made once, in the cache."""
    import json

    from safetensors.numpy import load_file, save_file

    from ms_loadpatch.tools import original_format

    vae_path = bench.cached_checkpoint("sd-vae", "AutoencoderKL", VAE, library="diffusers")
    target = os.path.join(os.path.dirname(unet_path), f"sd-pipeline-{os.path.basename(unet_path)}")
    if os.path.isfile(os.path.join(target, "sd-ldm.safetensors")):
        return target
    os.makedirs(os.path.join(target, "scheduler"), exist_ok=True)
    for name, source in (("unet", unet_path), ("vae", vae_path)):
        if not os.path.exists(os.path.join(target, name)):
            os.symlink(source, os.path.join(target, name))
    with open(os.path.join(target, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump({"_class_name": "PNDMScheduler", "skip_prk_steps": True, "steps_offset": 1}, f)
    with open(os.path.join(target, "model_index.json"), "w") as f:
        json.dump(
            {
                "_class_name": "StableDiffusionPipeline",
                "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"],
                "scheduler": ["diffusers", "PNDMScheduler"],
                "text_encoder": [None, None],
                "tokenizer": [None, None],
                "safety_checker": [None, None],
                "feature_extractor": [None, None],
                "requires_safety_checker": False,
            },
            f,
        )
    with open(os.path.join(unet_path, "config.json")) as f:
        unet_config = json.load(f)
    ldm = {
        original_format.unet_key(k, unet_config): v
        for k, v in load_file(os.path.join(unet_path, "diffusion_pytorch_model.safetensors")).items()
    }
    ldm.update(
        {
            "first_stage_model." + original_format.vae_key(k, len(VAE["up_block_types"])): original_format.vae_value(
                k, v
            )
            for k, v in load_file(os.path.join(vae_path, "diffusion_pytorch_model.safetensors")).items()
        }
    )
    save_file(ldm, os.path.join(target, "sd-ldm.safetensors.partial"))
    os.rename(os.path.join(target, "sd-ldm.safetensors.partial"), os.path.join(target, "sd-ldm.safetensors"))
    return target


def measure(path, call, mode, prime, pipeline):
    return script_result(_CHILD, (path, call, prime, _ADAPTERS, pipeline), mode, call)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    args = parser.parse_args(argv)
    path = bench.cached_checkpoint("sd-unet-0.6x", "UNet2DConditionModel", UNET, library="diffusers")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    pipeline = pipeline_directory(path) if "pipeline" in args.cases else ""
    largest = max(size, os.path.getsize(os.path.join(pipeline, "sd-ldm.safetensors")) if pipeline else 0)
    prime = 2 * largest + (256 << 20) if args.memory == "primed" else 0
    print(
        f"source UNet {size / 1e9:.2f} GB"
        + (f", pipeline file {largest / 1e9:.2f} GB" if pipeline else "")
        + f"; memory {args.memory}; {args.repeats} runs per mode, alternating"
    )
    print(f"{'case':<20} {'unpatched s':>12} {'patched s':>10} {'ratio':>7}  runs (unpatched | patched)")
    patched = {}
    for case in args.cases.split(","):
        runs = {"unpatched": [], "patched": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(path, CASES[case], mode, prime, pipeline))
        medians = {mode: statistics.median(r["seconds"] for r in results) for mode, results in runs.items()}
        patched[case] = medians["patched"]
        assert runs["patched"][0]["technique"], f"{case}: the patched call was not accelerated"
        shown = " | ".join(" ".join(f"{r['seconds']:.2f}" for r in runs[mode]) for mode in runs)
        print(
            f"{case:<20} {medians['unpatched']:>12.3f} {medians['patched']:>10.3f} "
            f"{medians['unpatched'] / medians['patched']:>6.1f}x  {shown}",
            flush=True,
        )
    for single, pretrained in (
        ("single-file", "from-pretrained"),
        ("pipeline-single-file", "pipeline-from-pretrained"),
    ):
        if {single, pretrained} <= patched.keys():
            print(f"{single} / {pretrained}, both patched: {patched[single] / patched[pretrained]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
