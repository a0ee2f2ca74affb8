"""Each measured load in a fresh interpreter (`tools/_child.py`), and the
checkpoints they load, generated once in a child and cached; no mindspore
import here, so the parent's memory does not count in a child's peak RSS."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from .spec import LoadSpec, UsageError, distribution_version
from .steps import Progress, step_of

CACHE_ENV_VAR = "MS_LOADPATCH_CACHE"
# Said beside results of children that report cpu_kernel_fallbacks
FALLBACK_NOTE = (
    "; testing.cpu_kernel_fallbacks() applied to both loads "
    "(kernels missing from mindspore's CPU wheel routed to equivalent ops)"
)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Built-in checkpoints (Qwen2ForCausalLM, fp32, random weights, generated
# locally). "default" is sized so the whole bench takes well under a minute on
# 2 cores, most of it process start-up, while the gap shows; it is sharded
# like real checkpoints. "tiny" is for tests.
SIZES: dict[str, dict] = {
    "tiny": {
        "class_name": "Qwen2ForCausalLM",
        "config": {
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
        },
        "max_shard_size": None,
    },
    "default": {
        "class_name": "Qwen2ForCausalLM",
        "config": {
            "vocab_size": 16384,
            "hidden_size": 512,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 1536,
        },
        "max_shard_size": "100MB",
    },
}


class ChildError(RuntimeError):
    """A child process failed; `result` is what it reported (may be empty)."""

    def __init__(self, message: str, result: dict | None = None, stderr: str = ""):
        super().__init__(message)
        self.result = result or {}
        self.stderr = stderr


# -- built-in and cached checkpoints


def cache_dir() -> str:
    """$MS_LOADPATCH_CACHE, else ~/.cache/ms_loadpatch."""
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "ms_loadpatch")


def cached_checkpoint(
    name: str,
    class_name: str,
    config: dict,
    max_shard_size=None,
    seed: int = 0,
    library: str = "transformers",
    progress: "Progress | None" = None,
) -> str:
    """A checkpoint of `class_name` (in mindone.`library`, or "module:Class")
    built from `config` (random weights, fixed seed; save_pretrained layout),
    generated in a child process on first use and kept in cache_dir().
    The directory name carries a hash of everything that shapes the files."""
    key_data = {
        "class": class_name,
        "library": library,
        "config": config,
        "shard": max_shard_size,
        "seed": seed,
        "mindone": distribution_version("mindone"),
        "mindspore": distribution_version("mindspore"),
        "format": 1,
    }
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:12]
    target = os.path.join(cache_dir(), f"{name}-{key}")
    if os.path.isfile(os.path.join(target, ".complete")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-{key}-", dir=cache_dir())
    try:
        task = {
            "task": "generate",
            "class_name": class_name,
            "library": library,
            "config": config,
            "out": staging,
            "max_shard_size": max_shard_size,
            "seed": seed,
        }
        with step_of(progress, f"generating checkpoint {name} (once; cached in {cache_dir()})"):
            run_child(task, mode="unpatched")
        with open(os.path.join(staging, ".complete"), "w") as f:
            json.dump(key_data, f)
        os.chmod(staging, 0o755)  # mkdtemp made it private; the cache may be shared
        try:
            os.rename(staging, target)  # atomic: a concurrent generator's copy is as good as ours
        except OSError:
            if not os.path.isfile(os.path.join(target, ".complete")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def builtin_checkpoint(size: str = "default", progress: "Progress | None" = None) -> str:
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    entry = SIZES[size]
    return cached_checkpoint(
        f"bench-{size}", entry["class_name"], entry["config"], entry["max_shard_size"], progress=progress
    )


# -- child processes


def child_env(mode: str) -> dict:
    """Environment of a child: MS_LOADPATCH=0 keeps `import ms_loadpatch` a
    no-op (the unpatched reference); =1 makes it enable at start-up."""
    if mode not in ("patched", "unpatched"):
        raise ValueError(mode)
    env = dict(os.environ)
    env["MS_LOADPATCH"] = "1" if mode == "patched" else "0"
    env.pop("MS_LOADPATCH_REPORT", None)  # the parent reports; keep the children's stderr small
    return env


def run_child(task: dict, mode: str, timeout: float | None = None, env_extra: dict | None = None) -> dict:
    """Run one task in a fresh interpreter; return the JSON it reports.
    Raises ChildError (UsageError for a bad class name) when it fails.
    `env_extra`: more environment (a rank's, for the multi-rank benchmark)."""
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-") as tmp:
        task = dict(task, result=os.path.join(tmp, "result.json"))
        task_file = os.path.join(tmp, "task.json")
        with open(task_file, "w") as f:
            json.dump(task, f)
        # Appended, so an installed ms_loadpatch wins; makes a source checkout work too.
        bootstrap = (
            f"import sys; sys.path.append({_PACKAGE_PARENT!r}); from ms_loadpatch.tools._child import main; main()"
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c", bootstrap, task_file],
                env={**child_env(mode), **(env_extra or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ChildError(f"{task['task']} ({mode}) did not finish within {timeout} s") from exc
        result = {}
        if os.path.isfile(task["result"]):
            with open(task["result"]) as f:
                result = json.load(f)
    if proc.returncode != 0 or "error" in result or not result:
        if result.get("usage"):
            raise UsageError(result["error"])
        message = result.get("error") or f"exited with code {proc.returncode} without a result"
        raise ChildError(f"{task['task']} ({mode}) failed: {message}", result, proc.stderr)
    return result


# --memory: "primed" faults in and frees memory right before each timed part,
# in every process alike (see _child.prime_memory); "as-is" takes the machine as it comes.
MEMORY_MODES = ("primed", "as-is")


def prime_bytes(spec: LoadSpec, memory: str, cold: bool = False) -> int:
    """Enough for the largest load: the checkpoint read, plus a second copy
    where the load may cast or reads cold (the page cache then takes fresh
    memory too). No more: priming more than the free memory would push a
    warm checkpoint out of the page cache."""
    if memory not in MEMORY_MODES:
        raise UsageError(f"--memory must be one of {', '.join(MEMORY_MODES)}")
    if memory != "primed":
        return 0
    return (2 if cold or spec.casts() else 1) * spec.checkpoint_bytes() + (256 << 20)


def load_task(
    spec: LoadSpec, snapshot: str | None = None, prime: int = 0, barrier: dict | None = None, warm: bool = False
) -> dict:
    """`barrier` ({"directory", "parties"}): the load starts when that many
    processes are ready (ranks of a job loading at the same moment). `warm`:
    the checkpoint read through the page cache before the priming, as the
    floors' child does, so both meet the same page cache."""
    return {
        "task": "load",
        "spec": dataclasses.asdict(spec),
        "snapshot": snapshot,
        "prime_bytes": prime,
        "barrier": barrier,
        "warm": warm,
    }


def measure_load(
    spec: LoadSpec,
    mode: str,
    snapshot: str | None = None,
    timeout=None,
    prime: int = 0,
    barrier: dict | None = None,
    env_extra: dict | None = None,
    warm: bool = False,
) -> dict:
    """One from_pretrained in a fresh process ("patched" or "unpatched"),
    timed up to the last weight touched. Keys: seconds, peak_rss_bytes,
    rss_before_bytes, report (patched: LoadReport.as_dict()), device, ..."""
    return run_child(load_task(spec, snapshot, prime, barrier, warm), mode=mode, timeout=timeout, env_extra=env_extra)


def measure_floors(spec: LoadSpec, timeout=None, prime: int = 0) -> dict:
    """Lower bounds measured in one fresh process: reading every checkpoint
    byte, and constructing the model under no_init_parameters() with no init pass."""
    task = {"task": "floors", "spec": dataclasses.asdict(spec), "prime_bytes": prime}
    return run_child(task, mode="unpatched", timeout=timeout)


# -- time to model: what a user's script waits for


# A user's script, as it would be written: the patched side turns the plugin
# on by `import ms_loadpatch` first (counted with the imports), the unpatched
# side does not import it. Only the harness's own helpers (CPU kernel
# fallbacks, touching the weights, memory priming) are imported untimed.
_TIME_TO_MODEL_SCRIPT = """
import sys, time
started = time.time()
spawned, mode, task_file = float(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "patched":
    import ms_loadpatch
import mindspore
imported_mindspore = time.time()
import importlib, json, os
task = json.load(open(task_file))
spec = task["spec"]
module_name, _, class_name = spec["class_name"].rpartition(":")
cls = getattr(importlib.import_module(module_name or "mindone." + (spec["library"] or "transformers")), class_name)
imported_mindone = time.time()
sys.path.append(task["package_parent"])
from ms_loadpatch.tools import _child
kwargs = {"subfolder": spec["subfolder"]} if spec["subfolder"] and not spec["single_file"] else {}
if spec["dtype"]:
    library = "diffusers" if ".diffusers" in cls.__module__ else "transformers"
    kwargs["dtype" if library == "transformers" else "mindspore_dtype"] = getattr(mindspore, spec["dtype"])
with _child._fallbacks(_child._on_cpu()):
    _child.prime_memory(task["prime_bytes"])
    load_start = time.time()
    if spec["single_file"]:
        model_dir = os.path.join(spec["path"], spec["subfolder"])
        model = cls.from_single_file(os.path.join(model_dir, spec["single_file"]), config=model_dir, **kwargs)
    else:
        model = cls.from_pretrained(spec["path"], **kwargs)
    _child.touch_all(model)
    loaded = time.time()
lazy = sys.modules.get("ms_loadpatch.lazy_import")
report = sys.modules["ms_loadpatch"].last_report()
result = {
    "report": report.as_dict() if report is not None else None,
    "interpreter_seconds": started - spawned,
    "import_mindspore_seconds": imported_mindspore - started,
    "import_mindone_seconds": imported_mindone - imported_mindspore,
    "load_seconds": loaded - load_start,
    "plugin_enabled": "ms_loadpatch" in sys.modules and sys.modules["ms_loadpatch"].is_enabled(),
    "lazy_import": type(sys.modules.get("mindone.transformers")).__name__ == "LazyPackage",
    "modules": len(sys.modules),
}
result["seconds"] = imported_mindone - spawned + result["load_seconds"]
json.dump(result, open(task["result"], "w"))
"""


def measure_time_to_model(
    spec: LoadSpec, mode: str, timeout=None, prime: int = 0, env_extra: dict | None = None
) -> dict:
    """A fresh interpreter running a user's script (imports, then
    from_pretrained and touching every weight). Keys: seconds (interpreter
    start to the touched model, the untimed harness imports left out),
    interpreter_seconds, import_mindspore_seconds (patched: with `import
    ms_loadpatch`), import_mindone_seconds (the model class), load_seconds."""
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-") as tmp:
        task = {
            "spec": dataclasses.asdict(spec),
            "prime_bytes": prime,
            "package_parent": _PACKAGE_PARENT,
            "result": os.path.join(tmp, "result.json"),
        }
        if ":" not in spec.class_name:
            task["spec"]["library"] = spec.library or "transformers"
        task_file = os.path.join(tmp, "task.json")
        with open(task_file, "w") as f:
            json.dump(task, f)
        spawned = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _TIME_TO_MODEL_SCRIPT, repr(spawned), mode, task_file],
                env={**child_env(mode), **(env_extra or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ChildError(f"time to model ({mode}) did not finish within {timeout} s") from exc
        if proc.returncode != 0 or not os.path.isfile(task["result"]):
            raise ChildError(f"time to model ({mode}) failed with exit code {proc.returncode}", stderr=proc.stderr)
        with open(task["result"]) as f:
            return json.load(f)


def measure_storage(files, timeout=None, prime: int = 0) -> dict:
    """The parallel read of `files` into fresh memory in a fresh process
    (cold.parallel_read). Keys: seconds, threads."""
    return run_child({"task": "storage", "paths": list(files), "prime_bytes": prime}, "unpatched", timeout=timeout)


def summarize_time_to_model(runs: dict) -> dict:
    """Medians per side and part of {"unpatched": [...], "patched": [...]} runs."""
    parts = ("seconds", "interpreter_seconds", "import_mindspore_seconds", "import_mindone_seconds", "load_seconds")
    out = {
        mode: {part: statistics.median(r[part] for r in mode_runs) for part in parts}
        for mode, mode_runs in runs.items()
    }
    for mode, mode_runs in runs.items():
        out[mode]["all_seconds"] = [r["seconds"] for r in mode_runs]
        out[mode]["lazy_import"] = all(r["lazy_import"] for r in mode_runs)
    out["ratio"] = out["unpatched"]["seconds"] / out["patched"]["seconds"]
    return out
