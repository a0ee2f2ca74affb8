"""Benchmark: the video families at their real sizes, unpatched vs patched
from_pretrained in bf16: CogVideoX-2b's transformer, its VAE, the T5-XXL
encoder its pipeline uses, the CogVideoX-2b pipeline as a whole, Wan2.1-1.3B's
transformer, and CogVideoX-5b's transformer.

Checkpoints are generated locally with random bf16 weights
(testing.write_random_checkpoint: the model built without init only to learn
its names and shapes), cached in $MS_LOADPATCH_CACHE or ~/.cache/ms_loadpatch.
Each load runs in a fresh process, sides alternating, medians over
--repeats, peak RSS, floors (read every byte; build under
no_init_parameters) measured in the same run. `--patched-only CASES`: those
cases without the unpatched side (a load that cannot fit this machine's
memory unpatched: it builds in float32 before casting), the patched load
against its floors, taking turns with them.

    python benchmarks/bench_video_families.py --size small --repeats 1       # a quick check
    python benchmarks/bench_video_families.py --cases cogvideox-2b,wan-1.3b  # real size, some cases
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_diffusers import bench_pipeline, measure_pipeline  # noqa: E402
from common import format_summary, summary_row  # noqa: E402

from ms_loadpatch.tools import bench  # noqa: E402

# "full": the published configs (THUDM/CogVideoX-2b and -5b, google/t5-v1_1-xxl's
# encoder, Wan-AI/Wan2.1-T2V-1.3B-Diffusers); "small": the same layouts, tiny.
COGVIDEOX_2B = dict(
    num_attention_heads=30,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    num_layers=30,
    text_embed_dim=4096,
    time_embed_dim=512,
    sample_width=90,
    sample_height=60,
    sample_frames=49,
    patch_size=2,
    max_text_seq_length=226,
    spatial_interpolation_scale=1.875,
    use_rotary_positional_embeddings=False,
)
# the same layout, tiny
COGVIDEOX_2B_SMALL = dict(
    COGVIDEOX_2B,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    text_embed_dim=64,
    time_embed_dim=32,
    sample_width=16,
    sample_height=16,
    sample_frames=9,
    max_text_seq_length=16,
)
SIZES = {
    "full": {
        "cogvideox-2b": ("CogVideoXTransformer3DModel", "diffusers", COGVIDEOX_2B),
        "cogvideox-5b": (
            "CogVideoXTransformer3DModel",
            "diffusers",
            dict(COGVIDEOX_2B, num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
        ),
        "cogvideox-vae": ("AutoencoderKLCogVideoX", "diffusers", dict(scaling_factor=1.15258426)),
        "t5-xxl": (
            "T5EncoderModel",
            "transformers",
            dict(
                vocab_size=32128,
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                feed_forward_proj="gated-gelu",
                relative_attention_num_buckets=32,
            ),
        ),
        "wan-1.3b": (
            "WanTransformer3DModel",
            "diffusers",
            dict(
                patch_size=(1, 2, 2),
                num_attention_heads=12,
                attention_head_dim=128,
                in_channels=16,
                out_channels=16,
                text_dim=4096,
                freq_dim=256,
                ffn_dim=8960,
                num_layers=30,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                eps=1e-6,
                rope_max_seq_len=1024,
            ),
        ),
        "shard_bytes": 5 << 30,
    },
    "small": {
        "cogvideox-2b": (
            "CogVideoXTransformer3DModel",
            "diffusers",
            COGVIDEOX_2B_SMALL,
        ),
        "cogvideox-5b": (
            "CogVideoXTransformer3DModel",
            "diffusers",
            dict(COGVIDEOX_2B_SMALL, num_layers=3, use_rotary_positional_embeddings=True),
        ),
        "cogvideox-vae": (
            "AutoencoderKLCogVideoX",
            "diffusers",
            dict(
                block_out_channels=(16, 16),
                latent_channels=4,
                layers_per_block=1,
                norm_num_groups=4,
                down_block_types=("CogVideoXDownBlock3D",) * 2,
                up_block_types=("CogVideoXUpBlock3D",) * 2,
            ),
        ),
        "t5-xxl": (
            "T5EncoderModel",
            "transformers",
            dict(
                vocab_size=256,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                feed_forward_proj="gated-gelu",
                relative_attention_num_buckets=8,
            ),
        ),
        "wan-1.3b": (
            "WanTransformer3DModel",
            "diffusers",
            dict(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=32,
                in_channels=16,
                out_channels=16,
                text_dim=64,
                freq_dim=256,
                ffn_dim=128,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=64,
            ),
        ),
        "shard_bytes": 2 << 20,
    },
}
MODELS = ("cogvideox-2b", "cogvideox-vae", "t5-xxl", "wan-1.3b", "cogvideox-5b")
PIPELINE = "cogvideox-2b-pipeline"
CASES = ("cogvideox-2b", "cogvideox-vae", "t5-xxl", PIPELINE, "wan-1.3b", "cogvideox-5b")
PIPELINE_COMPONENTS = {"transformer": "cogvideox-2b", "vae": "cogvideox-vae", "text_encoder": "t5-xxl"}


# -- checkpoints

_WRITE = r"""
import json, sys
import ms_loadpatch
ms_loadpatch.disable()
import transformers
import mindone.diffusers as D
import mindone.transformers as T
from ms_loadpatch.testing import write_random_checkpoint
class_name, library, config, out, shard = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if library == "transformers":
    cls = getattr(T, class_name)
    config = getattr(transformers, cls.config_class.__name__)(**config, architectures=[class_name])
else:
    cls = getattr(D, class_name)
write_random_checkpoint(cls, config, out, dtype="bfloat16", max_shard_bytes=shard)
"""


def _cached(name, make, key_data, progress):
    """A directory in the cache made once by `make(staging)`; its name carries a hash of `key_data`."""
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:12]
    target = os.path.join(bench.cache_dir(), f"{name}-{key}")
    if os.path.isfile(os.path.join(target, ".complete")):
        return target
    os.makedirs(bench.cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=bench.cache_dir())
    try:
        with bench.step_of(progress, f"generating {name} (once; cached in {bench.cache_dir()})"):
            make(staging)
        open(os.path.join(staging, ".complete"), "w").close()
        os.chmod(staging, 0o755)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def generate(size, progress):
    sizes = SIZES[size]
    paths = {}
    for name in MODELS:
        class_name, library, config = sizes[name]

        def write(out, name=name, class_name=class_name, library=library, config=config):
            args = [class_name, library, json.dumps(config), out, str(sizes["shard_bytes"])]
            proc = subprocess.run(
                [sys.executable, "-c", _WRITE, *args], env=bench.child_env("unpatched"), capture_output=True, text=True
            )
            if proc.returncode:
                raise bench.ChildError(f"writing {name} failed, exit {proc.returncode}", stderr=proc.stderr)

        key_data = {"class": class_name, "config": config, "shard": sizes["shard_bytes"], "format": 2}
        paths[name] = _cached(f"video-{size}-{name}", write, key_data, progress)
    components = {part: paths[name] for part, name in PIPELINE_COMPONENTS.items()}
    paths[PIPELINE] = _cached(
        f"video-{size}-{PIPELINE}", lambda out: assemble_pipeline(out, components), components, progress
    )
    return paths


_ASSEMBLE = r"""
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import T5TokenizerFast
from mindone.diffusers import CogVideoXDDIMScheduler
out = sys.argv[1]
pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
unigram = Tokenizer(models.Unigram(pieces, unk_id=2))
unigram.pre_tokenizer = pre_tokenizers.Metaspace()
unigram.decoder = decoders.Metaspace()
T5TokenizerFast(tokenizer_object=unigram, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0,
                model_max_length=226).save_pretrained(out + "/tokenizer")
CogVideoXDDIMScheduler(timestep_spacing="trailing", prediction_type="v_prediction").save_pretrained(out + "/scheduler")
"""


def assemble_pipeline(out, components):
    """A CogVideoXPipeline directory: the generated models (symlinked), a
    T5 tokenizer built offline over a tiny vocabulary, its scheduler."""
    for part, path in components.items():
        os.symlink(path, os.path.join(out, part))
    subprocess.run([sys.executable, "-c", _ASSEMBLE, out], check=True, env=bench.child_env("unpatched"))
    index = {
        "_class_name": "CogVideoXPipeline",
        "_diffusers_version": "0.35.1",
        "scheduler": ["diffusers", "CogVideoXDDIMScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "CogVideoXTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLCogVideoX"],
    }
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


# -- measuring


def patched_alone(specs, repeats, progress, memory, load):
    """The patched load (`load(prime)`, a run's dict) against its floors,
    without the unpatched side; `specs`: the models it loads. Floors and
    load take turns, each round's floors right before its load: a checkpoint
    larger than what the page cache keeps beside the loaded model is read
    partly from the disk by both."""
    prime = sum(bench.prime_bytes(spec, memory) for spec in specs)
    rounds, runs = [], []
    for i in range(repeats):
        floors = {"read_seconds": 0.0, "construct_seconds": 0.0}
        with bench.step_of(progress, f"floors: read every checkpoint byte, construct without init {i + 1}/{repeats}"):
            for spec in specs:
                floor = bench.measure_floors(spec, prime=bench.prime_bytes(spec, memory))
                for key in floors:
                    floors[key] += floor[key]
        rounds.append(floors)
        with bench.step_of(progress, f"patched load {i + 1}/{repeats}"):
            runs.append(load(prime))
    return {
        "floors": {key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
        "floor_rounds": rounds,
        "patched": {
            "seconds": [r["seconds"] for r in runs],
            "median_seconds": statistics.median(r["seconds"] for r in runs),
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in runs],
            "rss_before_bytes": [r["rss_before_bytes"] for r in runs],
            "report": runs[0].get("report") or runs[0].get("reports"),
        },
        "checkpoint_bytes": sum(spec.checkpoint_bytes() for spec in specs),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--patched-only", default="", help="comma-separated cases measured without the unpatched side")
    parser.add_argument("--memory", choices=bench.MEMORY_MODES, default="primed")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    args = parser.parse_args(argv)
    selected = [c for c in args.cases.split(",") if c]
    alone = {c for c in args.patched_only.split(",") if c}
    unknown = (set(selected) | alone) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    progress = bench.Progress()
    paths = generate(args.size, progress)
    rows, alone_rows, results, not_measured = [], [], {}, {}
    for case in selected:
        try:
            result = measure_case(case, paths, args, progress, alone)
        except bench.ChildError as exc:  # e.g. a load that runs out of memory
            not_measured[case] = str(exc)
            print(f"\n{case}: not measured: {exc}", flush=True)
            continue
        results[case] = result
        if case in alone:
            floors, pat = result["floors"], result["patched"]
            floor = floors["read_seconds"] + floors["construct_seconds"]
            alone_rows.append(
                f"{case:28}{pat['median_seconds']:>9.3f}s  floors read {floors['read_seconds']:.3f}s "
                f"+ build {floors['construct_seconds']:.3f}s: {pat['median_seconds'] / floor:.2f}x; "
                f"peak RSS {max(pat['peak_rss_bytes']) / 2**20:,.0f} MB "
                f"(checkpoint {result['checkpoint_bytes'] / 2**20:,.0f} MB)"
            )
        else:
            rows.append(summary_row(case, result))
    print()
    print(format_summary(rows, "the 2b pipeline and Wan2.1-1.3B >= 10x; the 5b transformer within 1.2x of its floors"))
    if alone_rows:
        print("\npatched alone (no unpatched side):")
        print("\n".join(alone_rows))
    for case, reason in not_measured.items():
        print(f"not measured: {case}: {reason}")
    print(f"memory: {args.memory}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"size": args.size, "memory": args.memory, "results": results, "not_measured": not_measured},
                f,
                indent=2,
            )
    return 1 if not_measured else 0


def measure_case(case, paths, args, progress, alone):
    if case == PIPELINE and case in alone:
        specs = [bench.LoadSpec.resolve(paths[case], subfolder=part, dtype="bfloat16") for part in PIPELINE_COMPONENTS]
        return patched_alone(
            specs, args.repeats, progress, args.memory, lambda prime: measure_pipeline(paths[case], "patched", prime)
        )
    if case == PIPELINE:
        result = bench_pipeline(paths[case], args.repeats, progress, args.memory, tuple(PIPELINE_COMPONENTS))
        print(f"\n{case}: components through the fast path: {result['patched']['reports']}")
        return result
    spec = bench.LoadSpec.resolve(paths[case], dtype="bfloat16")
    if case in alone:
        return patched_alone(
            [spec],
            args.repeats,
            progress,
            args.memory,
            lambda prime: bench.measure_load(spec, "patched", prime=prime, warm=True),
        )
    result = bench.run_bench(spec, repeats=args.repeats, progress=progress, memory=args.memory, time_to_model=False)
    print()
    print(bench.format_table(result, f"{case}: {spec.class_name} ({args.size})"))
    return result


if __name__ == "__main__":
    sys.exit(main())
