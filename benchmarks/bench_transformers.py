"""Benchmark: unpatched vs patched mindone.transformers from_pretrained.

Generates its checkpoints (random weights, cached in $MS_LOADPATCH_CACHE or
~/.cache/ms_loadpatch), then per case: each load in a fresh process, median
over --repeats, peak RSS, and the floors measured in the same run (reading
every checkpoint byte; constructing under no_init_parameters; one cast pass
where the dtype changes). Every weight is touched before the clock stops.

    python benchmarks/bench_transformers.py --size small --repeats 1   # a quick check
    python benchmarks/bench_transformers.py                            # the real one (~3 GB of files)
    python benchmarks/bench_transformers.py --cases qwen3_moe-fp32-as-fp32,olmoe-fp32-as-fp32  # MoE families
    python benchmarks/bench_transformers.py --cases glm4_moe-wide-fp32-as-fp32  # 8x wider, ~1.2 GB
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import bench_main, bf16_copy, run_single  # noqa: E402
from moe_families import families  # noqa: E402

from ms_loadpatch.tools import bench  # noqa: E402

# "full": Qwen2-0.5B's real shape (494M parameters, 2 GB in fp32, 4 shards) and
# a Mixtral-style MoE with 18.8k tensors (48 layers x 128 experts x 3 + attention).
SIZES = {
    "full": {
        "qwen2": dict(
            vocab_size=151936,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
        "moe": dict(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            num_local_experts=128,
            num_experts_per_tok=2,
        ),
        "qwen2_shard": "600MB",
        "moe_shard": "50MB",
    },
    "small": {
        "qwen2": dict(
            vocab_size=4096,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            tie_word_embeddings=True,
        ),
        "moe": dict(
            vocab_size=256,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=16,
            num_local_experts=16,
            num_experts_per_tok=2,
        ),
        "qwen2_shard": "1MB",
        "moe_shard": "200KB",
    },
}
# case -> (checkpoint, dtype passed to from_pretrained)
CASES = {
    "qwen2-fp32-as-fp32": ("qwen2-fp32", "float32"),
    "qwen2-fp32-as-bf16": ("qwen2-fp32", "bfloat16"),
    "qwen2-bf16-as-bf16": ("qwen2-bf16", "bfloat16"),
    "moe-fp32-as-fp32": ("moe-fp32", "float32"),
    "moe-fp32-as-bf16": ("moe-fp32", "bfloat16"),
}
# every MoE family mindone ships, at 24 layers x 128 experts (moe_families.py): not in the default run;
# "-wide" cases: the same layers and experts with 8x the hidden and intermediate sizes (~1.2 GB in fp32)
FAMILY_SIZES = {"full": (24, 128), "small": (2, 16)}
WIDE = 8
FAMILY_CASES = {f"{family}-fp32-as-fp32": (family, "float32") for family in families()}
FAMILY_CASES.update({f"{family}-wide-fp32-as-fp32": (f"{family}-wide", "float32") for family in families()})
DEFAULT_CASES = list(CASES)
CASES.update(FAMILY_CASES)
TARGETS = (
    "Qwen2-0.5B fp32 >= 20x faster; never slower; within 1.5x of (construct + read + one cast pass); "
    "peak RSS no higher than unpatched; every MoE family >= 4x (fp32 as fp32)"
)


class _Checkpoints(dict):
    """Checkpoint name -> directory, each generated (or taken from the cache) when a case first asks for it."""

    def __init__(self, size, progress):
        super().__init__()
        self.size, self.progress = size, progress

    def __missing__(self, name):
        config, size = SIZES[self.size], self.size
        if name == "qwen2-fp32":
            path = bench.cached_checkpoint(
                f"tf-{size}-qwen2", "Qwen2ForCausalLM", config["qwen2"], config["qwen2_shard"], progress=self.progress
            )
        elif name == "qwen2-bf16":
            path = bf16_copy(self["qwen2-fp32"])
        elif name == "moe-fp32":
            path = bench.cached_checkpoint(
                f"tf-{size}-moe", "MixtralForCausalLM", config["moe"], config["moe_shard"], progress=self.progress
            )
        else:  # an MoE family, or its wide variant
            family, _, wide = name.partition("-")
            class_name, family_config = families(*FAMILY_SIZES[size], width=WIDE if wide else 1)[family]
            path = bench.cached_checkpoint(
                f"tf-{size}-{name}", class_name, family_config, config["moe_shard"], progress=self.progress
            )
        self[name] = path
        return path


def generate(size, progress):
    return _Checkpoints(size, progress)


def run_case(case, paths, args, progress):
    source, dtype = CASES[case]
    return run_single(case, paths[source], dtype, args, progress)


def main(argv=None) -> int:
    return bench_main(argv, __doc__, SIZES, CASES, generate, run_case, TARGETS, default_cases=DEFAULT_CASES)


if __name__ == "__main__":
    sys.exit(main())
