"""Run in a subprocess by test_interrupts_io.py: a patched load under an
exhausted resource limit, then the same load with the limit lifted.

argv[1]: "nofile" (RLIMIT_NOFILE, a checkpoint of many shards) or "as"
(RLIMIT_AS, a checkpoint larger than the address space left); argv[2]: a
scratch directory. LIMITS_COLD=1: every file read on the cold plan. Prints one line `REPORT {json}`: the error of the limited
load (type, message, cause), reader threads left, whether the process state
came back, and whether the load after lifting the limit equals an unpatched one.
"""

import json
import os
import resource
import sys
import threading

import mindone.transformers as mt
import numpy as np
import transformers as hf

import ms_loadpatch
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both, write_random_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _process_state import assert_state_restored, process_state  # noqa: E402

KIND, SCRATCH = sys.argv[1], sys.argv[2]


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


if KIND == "nofile":
    config = hf.Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    directory = write_random_checkpoint(
        mt.Qwen2ForCausalLM, config, os.path.join(SCRATCH, "many"), max_shard_bytes=2_000
    )
    shards = len([f for f in os.listdir(directory) if f.endswith(".safetensors")])
    os.environ["HF_ENABLE_PARALLEL_LOADING"] = "1"  # 8 reader threads: the most files open at once
    limit_free = int(os.environ.get("LIMIT_FREE_FDS", "0"))
    resource_id = resource.RLIMIT_NOFILE
else:
    config = hf.Qwen2Config(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1024,
        tie_word_embeddings=False,
    )
    directory = write_random_checkpoint(mt.Qwen2ForCausalLM, config, os.path.join(SCRATCH, "big"))
    shards = 1
    resource_id = resource.RLIMIT_AS


def load():
    return mt.Qwen2ForCausalLM.from_pretrained(directory)


report = {"shards": shards, "cold_plans": 0}
if os.environ.get("LIMITS_COLD"):  # every file taken for cold on slow storage: the cold plan, split in chunks
    from ms_loadpatch.strategy import prefetch, threaded_read

    real_plan = prefetch.read_plan

    def counted_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        report["cold_plans"] += plan.cold
        return plan

    prefetch._cached_share = lambda path: 0.0
    prefetch.first_read_rate = lambda path: 1.0
    prefetch.read_plan = counted_plan
    threaded_read.COLD_SPLIT_FROM = 0
with cpu_kernel_fallbacks(), ms_loadpatch.enabled():
    with ms_loadpatch.disabled():
        load()  # warm: imports and first-use allocations happen before the limit
    load()
    before = process_state()
    soft, hard = resource.getrlimit(resource_id)
    if KIND == "nofile":
        report["fds_open"] = open_fds()
        resource.setrlimit(resource_id, (open_fds() + limit_free, hard))
    else:
        size = os.path.getsize(os.path.join(directory, "model.safetensors"))
        report["file_bytes"] = size
        # room for the model's lazy construction and small allocations, not for the file's data
        resource.setrlimit(resource_id, (vm_size() + size // 2, hard))
    report["cold_plans"] = 0  # the limited load's
    try:
        model = load()
        report["error"] = None
        del model
    except BaseException as exc:  # noqa: BLE001 - reported
        report["error"] = {
            "type": type(exc).__name__,
            "mro": [k.__name__ for k in type(exc).__mro__],
            "message": str(exc),
            "cause": repr(exc.__cause__),
        }
    finally:
        resource.setrlimit(resource_id, (soft, hard))
    limited_cold_plans = report["cold_plans"]
    report["reader_threads"] = [t.name for t in threading.enumerate() if t.name.startswith("ms_loadpatch-read")]
    try:
        assert_state_restored(before)
        report["state_restored"] = True
    except AssertionError as exc:
        report["state_restored"] = str(exc)
    reference, accelerated = load_both(load)
    try:
        assert_same_model(reference, accelerated)
        report["next_load_identical"] = True
    except AssertionError as exc:
        report["next_load_identical"] = str(exc)[:2000]
    report["checksum"] = float(np.sum([p.asnumpy().astype(np.float64).sum() for p in accelerated.get_parameters()]))
report["cold_plans"] = limited_cold_plans
print("REPORT " + json.dumps(report), flush=True)
