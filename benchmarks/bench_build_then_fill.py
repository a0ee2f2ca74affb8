"""Calls that build a model and then fill it: `ControlNetModel.from_unet`,
`SparseControlNetModel.from_unet`, `UNetMotionModel.from_unet2d`,
`UNet2DConditionModel.from_single_file`, and layers built into the UNet
(an IP adapter, `_load_ip_adapter_weights`; a rank-32 LoRA on every
attention projection, `load_lora_adapter`), unpatched vs patched, each call
in a fresh process; `from-pretrained` is the same weights' from_pretrained,
the yardstick of the single-file load.

The UNet is Stable Diffusion 1.5's layout at 0.6x its width
(block_out_channels 192-384-768-768, 1.26 GB in fp32), generated once into
the cache; the other cases load it with from_pretrained before the timed
part (and make the adapter's tensors there). The timed part is the call and a read of every page of the result;
with --memory primed (default) memory is faulted in and freed first.

    python benchmarks/bench_build_then_fill.py                          # every case, 3 runs each
    python benchmarks/bench_build_then_fill.py --cases controlnet --repeats 5 --memory as-is

Targets: from_unet at least 5x, from_unet2d at least 2x faster patched;
single-file at least 2.5x, and within 1.25x of the patched from_pretrained;
no case slower patched.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from common import script_result
from ms_loadpatch.tools import bench

UNET = {"block_out_channels": [192, 384, 768, 768], "cross_attention_dim": 768, "attention_head_dim": 8,
        "layers_per_block": 2, "sample_size": 64, "norm_num_groups": 32}

CASES = {
    "controlnet": "md.ControlNetModel.from_unet(unet)",
    "sparse-controlnet": "md.SparseControlNetModel.from_unet(unet)",
    "motion": "md.UNetMotionModel.from_unet2d(unet)",
    "single-file": "md.UNet2DConditionModel.from_single_file(path + '/diffusion_pytorch_model.safetensors', "
                   "config=path)",
    "from-pretrained": "md.UNet2DConditionModel.from_pretrained(path)",
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
path, call, prime, ADAPTERS = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import mindspore as ms, numpy as np
exec(ADAPTERS)
with cpu_kernel_fallbacks():
    unet = md.UNet2DConditionModel.from_pretrained(path) if "unet" in call else None
    adapter = ip_adapter(unet) if "ip_adapter" in call else lora(unet) if "lora" in call else None
    prime_memory(prime)
    start = time.perf_counter()
    model = eval(call)
    touch_all(model)
    seconds = time.perf_counter() - start
report = ms_loadpatch.last_report() if ms_loadpatch.is_enabled() else None
print("RESULT " + json.dumps({"seconds": seconds, "parameters": len(list(model.get_parameters())),
                              "technique": report.technique if report else None}))
"""


def measure(path, call, mode, prime):
    return script_result(_CHILD, (path, call, prime, _ADAPTERS), mode, call)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    args = parser.parse_args(argv)
    path = bench.cached_checkpoint("sd-unet-0.6x", "UNet2DConditionModel", UNET, library="diffusers")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    prime = 2 * size + (256 << 20) if args.memory == "primed" else 0
    print(f"source UNet {size / 1e9:.2f} GB; memory {args.memory}; {args.repeats} runs per mode, alternating")
    print(f"{'case':<20} {'unpatched s':>12} {'patched s':>10} {'ratio':>7}  runs (unpatched | patched)")
    patched = {}
    for case in args.cases.split(","):
        runs = {"unpatched": [], "patched": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(path, CASES[case], mode, prime))
        medians = {mode: statistics.median(r["seconds"] for r in results) for mode, results in runs.items()}
        patched[case] = medians["patched"]
        assert runs["patched"][0]["technique"], f"{case}: the patched call was not accelerated"
        shown = " | ".join(" ".join(f"{r['seconds']:.2f}" for r in runs[mode]) for mode in runs)
        print(f"{case:<20} {medians['unpatched']:>12.3f} {medians['patched']:>10.3f} "
              f"{medians['unpatched'] / medians['patched']:>6.1f}x  {shown}", flush=True)
    if {"single-file", "from-pretrained"} <= patched.keys():
        print(f"single-file / from_pretrained, both patched: {patched['single-file'] / patched['from-pretrained']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
