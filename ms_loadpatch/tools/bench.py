"""Benchmark harness: unpatched vs patched `from_pretrained`, each load in a
fresh process; also the engine under `ms-loadpatch verify`.

Reusable from scripts (benchmarks/*.py)::

    from ms_loadpatch.tools import bench

    path = bench.cached_checkpoint("my-moe", "MixtralForCausalLM", {...config...})
    spec = bench.LoadSpec.resolve(path)              # class inferred from config.json
    results = bench.run_bench(spec, repeats=3)
    print(bench.format_table(results))

This module imports no mindspore: every mindspore / mindone import happens in
the child processes (`ms_loadpatch.tools._child`), so each load starts cold and the
parent's memory does not count in the children's peak RSS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DTYPES = ("float16", "bfloat16", "float32")
CACHE_ENV_VAR = "MS_LOADPATCH_CACHE"
FALLBACK_NOTE = ("; testing.cpu_kernel_fallbacks() applied to both loads "
                 "(kernels missing from mindspore's CPU wheel routed to equivalent ops)")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Built-in checkpoints (Qwen2ForCausalLM, fp32, random weights, generated
# locally). "default" is sized so the whole bench takes well under a minute on
# 2 cores, most of it process start-up, while the gap shows; it is sharded
# like real checkpoints. "tiny" is for tests.
SIZES: dict[str, dict] = {
    "tiny": {
        "class_name": "Qwen2ForCausalLM",
        "config": {
            "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64,
        },
        "max_shard_size": None,
    },
    "default": {
        "class_name": "Qwen2ForCausalLM",
        "config": {
            "vocab_size": 16384, "hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
            "num_key_value_heads": 2, "intermediate_size": 1536,
        },
        "max_shard_size": "100MB",
    },
}


class UsageError(Exception):
    """Bad input from the user (path, class, option): the commands exit 2."""


class ChildError(RuntimeError):
    """A child process failed; `result` is what it reported (may be empty)."""

    def __init__(self, message: str, result: dict | None = None, stderr: str = ""):
        super().__init__(message)
        self.result = result or {}
        self.stderr = stderr


# -- what to load


@dataclasses.dataclass
class LoadSpec:
    """A checkpoint and how to call from_pretrained on it.

    class_name: a class of mindone.transformers / mindone.diffusers, or
    "module:Class" for a subclass of one (imported in the child).
    library: "transformers" or "diffusers" as read from config.json; the
    child decides from the class itself.
    """

    path: str
    class_name: str
    library: str
    subfolder: str = ""
    dtype: str | None = None
    single_file: str = ""  # a diffusers model's file in model_dir, loaded with from_single_file

    @property
    def model_dir(self) -> str:
        return os.path.join(self.path, self.subfolder) if self.subfolder else self.path

    @classmethod
    def resolve(cls, path, class_name=None, subfolder=None, dtype=None, single_file=None) -> "LoadSpec":
        """Check the path and infer the class from config.json (no mindspore import).
        Raises UsageError with a message for the user."""
        path = os.path.abspath(os.fspath(path))
        subfolder = subfolder or ""
        if dtype is not None and dtype not in DTYPES:
            raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if not os.path.isdir(path):
            raise UsageError(f"{path}: not a directory (a local checkpoint directory is needed)")
        model_dir = os.path.join(path, subfolder) if subfolder else path
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(config_path):
            index = os.path.join(path, "model_index.json")
            if not subfolder and os.path.isfile(index):
                components = sorted(k for k, v in _read_json(index).items() if isinstance(v, list) and not k.startswith("_"))
                raise UsageError(
                    f"{path} is a diffusers pipeline; pass one model with --subfolder (components: {', '.join(components)})"
                )
            raise UsageError(f"{model_dir}: no config.json")
        config = _read_json(config_path)
        if "_class_name" in config or "_diffusers_version" in config:
            library = "diffusers"
            inferred = config.get("_class_name")
        else:
            library = "transformers"
            architectures = config.get("architectures") or []
            inferred = architectures[0] if architectures else None
        name = class_name or inferred
        if not name:
            key = "_class_name" if library == "diffusers" else "architectures"
            raise UsageError(f"{config_path} names no model class ({key!r} is missing); pass --class")
        if single_file:
            if library != "diffusers":
                raise UsageError(f"--single-file loads a mindone.diffusers model; {config_path} is a {library} one")
            if not os.path.isfile(os.path.join(model_dir, single_file)):
                raise UsageError(f"{os.path.join(model_dir, single_file)}: no such file")
        return cls(path=path, class_name=name, library=library, subfolder=subfolder, dtype=dtype,
                   single_file=single_file or "")

    def weight_files(self) -> list[str]:
        """The safetensors files the load reads (the single file; else the index's, else every file)."""
        if self.single_file:
            return [os.path.join(self.model_dir, self.single_file)]
        try:
            names = sorted(os.listdir(self.model_dir))
        except OSError:
            return []
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if indexes:
            files = set()
            for index in indexes:
                files.update(_read_json(os.path.join(self.model_dir, index)).get("weight_map", {}).values())
            return [os.path.join(self.model_dir, f) for f in sorted(files)]
        return [os.path.join(self.model_dir, n) for n in names if n.endswith(".safetensors")]

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.weight_files() if os.path.exists(f))


def _read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{path}: not a JSON object")
    return value


# -- built-in and cached checkpoints


def cache_dir() -> str:
    """$MS_LOADPATCH_CACHE, else ~/.cache/ms_loadpatch."""
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "ms_loadpatch")


def distribution_version(distribution: str) -> str:
    """The installed version of `distribution`, or "" when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def cached_checkpoint(name: str, class_name: str, config: dict, max_shard_size=None, seed: int = 0,
                      library: str = "transformers", progress: "Progress | None" = None) -> str:
    """A checkpoint of `class_name` (in mindone.`library`, or "module:Class")
    built from `config` (random weights, fixed seed; save_pretrained layout),
    generated in a child process on first use and kept in cache_dir().
    The directory name carries a hash of everything that shapes the files."""
    key_data = {"class": class_name, "library": library, "config": config, "shard": max_shard_size, "seed": seed,
                "mindone": distribution_version("mindone"), "mindspore": distribution_version("mindspore"), "format": 1}
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:12]
    target = os.path.join(cache_dir(), f"{name}-{key}")
    if os.path.isfile(os.path.join(target, ".complete")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-{key}-", dir=cache_dir())
    try:
        task = {"task": "generate", "class_name": class_name, "library": library, "config": config, "out": staging,
                "max_shard_size": max_shard_size, "seed": seed}
        with _step(progress, f"generating checkpoint {name} (once; cached in {cache_dir()})"):
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
    return cached_checkpoint(f"bench-{size}", entry["class_name"], entry["config"], entry["max_shard_size"],
                             progress=progress)


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
        bootstrap = f"import sys; sys.path.append({_PACKAGE_PARENT!r}); from ms_loadpatch.tools._child import main; main()"
        try:
            proc = subprocess.run([sys.executable, "-c", bootstrap, task_file], env={**child_env(mode), **(env_extra or {})},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
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


def prime_bytes(spec: LoadSpec, memory: str) -> int:
    """Enough for the largest load: the checkpoint read plus a cast copy of it."""
    if memory not in MEMORY_MODES:
        raise UsageError(f"--memory must be one of {', '.join(MEMORY_MODES)}")
    return 2 * spec.checkpoint_bytes() + (256 << 20) if memory == "primed" else 0


def load_task(spec: LoadSpec, snapshot: str | None = None, prime: int = 0, barrier: dict | None = None) -> dict:
    """`barrier` ({"directory", "parties"}): the load starts when that many
    processes are ready (ranks of a job loading at the same moment)."""
    return {"task": "load", "spec": dataclasses.asdict(spec), "snapshot": snapshot, "prime_bytes": prime,
            "barrier": barrier}


def measure_load(spec: LoadSpec, mode: str, snapshot: str | None = None, timeout=None, prime: int = 0,
                 barrier: dict | None = None, env_extra: dict | None = None) -> dict:
    """One from_pretrained in a fresh process ("patched" or "unpatched"),
    timed up to the last weight touched. Keys: seconds, peak_rss_bytes,
    rss_before_bytes, report (patched: LoadReport.as_dict()), device, ..."""
    return run_child(load_task(spec, snapshot, prime, barrier), mode=mode, timeout=timeout, env_extra=env_extra)


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
result = {
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


def measure_time_to_model(spec: LoadSpec, mode: str, timeout=None, prime: int = 0) -> dict:
    """A fresh interpreter running a user's script (imports, then
    from_pretrained and touching every weight). Keys: seconds (interpreter
    start to the touched model, the untimed harness imports left out),
    interpreter_seconds, import_mindspore_seconds (patched: with `import
    ms_loadpatch`), import_mindone_seconds (the model class), load_seconds."""
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-") as tmp:
        task = {"spec": dataclasses.asdict(spec), "prime_bytes": prime, "package_parent": _PACKAGE_PARENT,
                "result": os.path.join(tmp, "result.json")}
        if ":" not in spec.class_name:
            task["spec"]["library"] = spec.library or "transformers"
        task_file = os.path.join(tmp, "task.json")
        with open(task_file, "w") as f:
            json.dump(task, f)
        spawned = time.time()
        try:
            proc = subprocess.run([sys.executable, "-c", _TIME_TO_MODEL_SCRIPT, repr(spawned), mode, task_file],
                                  env=child_env(mode), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ChildError(f"time to model ({mode}) did not finish within {timeout} s") from exc
        if proc.returncode != 0 or not os.path.isfile(task["result"]):
            raise ChildError(f"time to model ({mode}) failed with exit code {proc.returncode}", stderr=proc.stderr)
        with open(task["result"]) as f:
            return json.load(f)


def summarize_time_to_model(runs: dict) -> dict:
    """Medians per side and part of {"unpatched": [...], "patched": [...]} runs."""
    parts = ("seconds", "interpreter_seconds", "import_mindspore_seconds", "import_mindone_seconds", "load_seconds")
    out = {mode: {part: statistics.median(r[part] for r in mode_runs) for part in parts}
           for mode, mode_runs in runs.items()}
    for mode, mode_runs in runs.items():
        out[mode]["all_seconds"] = [r["seconds"] for r in mode_runs]
        out[mode]["lazy_import"] = all(r["lazy_import"] for r in mode_runs)
    out["ratio"] = out["unpatched"]["seconds"] / out["patched"]["seconds"]
    return out


# -- progress


class Progress:
    """One status line on a terminal with a running clock; silent otherwise."""

    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (sys.stdout.isatty() and self.stream.isatty()) if enabled is None else enabled

    def step(self, label: str):
        return _Step(self, label)


class _Step:
    def __init__(self, progress: Progress, label: str):
        self.progress, self.label = progress, label
        self._stop = threading.Event()
        self._thread = None
        self.seconds = 0.0

    def _draw(self, end=""):
        elapsed = time.perf_counter() - self._start
        self.progress.stream.write(f"\r\x1b[2K  {self.label} ... {elapsed:5.1f}s{end}")
        self.progress.stream.flush()

    def _tick(self):
        while not self._stop.wait(0.25):
            self._draw()

    def __enter__(self):
        self._start = time.perf_counter()
        if self.progress.enabled:
            self._draw()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self.seconds = time.perf_counter() - self._start
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._draw(end=" failed\n" if exc_type else "\n")
        return False


def _step(progress, label):
    return (progress or Progress(enabled=False)).step(label)


# -- the benchmark


def _median_run(runs: list[dict]) -> dict:
    """The run whose time is the (low) median: its phases are shown."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2]


def run_bench(spec: LoadSpec, repeats: int = 3, floors: bool = True, progress: Progress | None = None,
              timeout=None, memory: str = "primed", time_to_model: bool = True, cold: bool = False) -> dict:
    """Time unpatched vs patched from_pretrained (alternating, one fresh process
    per load), plus the floors, plus (time_to_model) a user's whole script in
    a fresh process per side; `cold`: the checkpoint's pages evicted before
    each timed part, and the storage's cold floors measured. Returns a
    JSON-ready dict (see format_table)."""
    if repeats < 1:
        raise UsageError("--repeats must be at least 1")
    from . import cold as cold_runs  # numpy, mincore: only for a run

    prime = prime_bytes(spec, memory)
    runs = {"unpatched": [], "patched": []}
    files = spec.weight_files()
    left_cached = []

    def evicted():
        if cold:
            left_cached.append(cold_runs.evict(files))

    floor = storage = None
    if floors:  # first: it also brings the files into the page cache for every load after it
        with _step(progress, "floors: read every checkpoint byte, construct without init"):
            floor = measure_floors(spec, timeout=timeout, prime=prime)
    if cold:
        with _step(progress, "storage floors: read the files cold, sequentially and with "
                             f"{cold_runs.PARALLEL_THREADS} threads"):
            storage = cold_runs.storage_floors(files)
        left_cached.append(storage["resident_after_evict"])
    ttm_runs = {"unpatched": [], "patched": []}
    for i in range(repeats):
        for mode in ("unpatched", "patched"):  # alternating: slow drift of the machine hits both
            with _step(progress, f"{mode} load {i + 1}/{repeats}"):
                evicted()
                runs[mode].append(measure_load(spec, mode, timeout=timeout, prime=prime))
        if time_to_model:
            for mode in ("unpatched", "patched"):
                with _step(progress, f"{mode} time to model {i + 1}/{repeats}"):
                    evicted()
                    ttm_runs[mode].append(measure_time_to_model(spec, mode, timeout=timeout, prime=prime))
    sides = {}
    for mode, mode_runs in runs.items():
        median_run = _median_run(mode_runs)
        sides[mode] = {
            "seconds": [r["seconds"] for r in mode_runs],
            "median_seconds": statistics.median(r["seconds"] for r in mode_runs),
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in mode_runs],
            "rss_before_bytes": [r["rss_before_bytes"] for r in mode_runs],
            "median_run": median_run,
        }
    if not sides["patched"]["median_run"].get("plugin_enabled"):
        raise ChildError("the patched child could not enable ms_loadpatch: "
                         + str(sides["patched"]["median_run"].get("plugin_refusal")))
    first = runs["patched"][0]
    patched_median = sides["patched"]["median_seconds"]
    return {
        "checkpoint": {
            "path": spec.path, "subfolder": spec.subfolder, "single_file": spec.single_file,
            "class_name": first["class_name"],
            "library": first["library"], "dtype": spec.dtype, "files": len(spec.weight_files()),
            "bytes": spec.checkpoint_bytes(), "tensors": first["tensors"],
        },
        "device": first["device"],
        "cpu_kernel_fallbacks": first["cpu_kernel_fallbacks"],
        "versions": first["versions"],
        "repeats": repeats,
        "memory": memory,
        "unpatched": sides["unpatched"],
        "patched": dict(sides["patched"], report=sides["patched"]["median_run"].get("report")),
        "ratio": sides["unpatched"]["median_seconds"] / patched_median if patched_median > 0 else None,
        "floors": floor,
        "time_to_model": summarize_time_to_model(ttm_runs) if time_to_model else None,
        "cold": None if not cold else {
            "storage_floors": storage,
            # the most of the checkpoint any eviction left cached (None: not measurable here)
            "resident_after_evict": max((x for x in left_cached if x is not None), default=None),
        },
    }


def _mb(n) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.0f} KB"
    return f"{n / 2**20:,.0f} MB"


def _while_reading(report: dict) -> str:
    from ..strategy.context import cast_detail

    return cast_detail(report.get("tensors_cast_while_reading") or 0, report.get("tensors_read_again") or 0)


def _s(x) -> str:
    return f"{x:.3f} s"


def format_table(results: dict, title: str | None = None) -> str:
    ckpt = results["checkpoint"]
    unp, pat, floors = results["unpatched"], results["patched"], results.get("floors") or {}
    report = pat.get("report") or {}
    lines = []
    where = ckpt["path"] + (f" (subfolder {ckpt['subfolder']})" if ckpt["subfolder"] else "")
    if ckpt.get("single_file"):
        where += f", from_single_file of {ckpt['single_file']}"
    lines.append(title or f"ms-loadpatch bench: {ckpt['class_name']} (mindone.{ckpt['library']})")
    lines.append(f"  checkpoint  {where}")
    lines.append(f"              {_mb(ckpt['bytes'])} in {ckpt['files']} file(s), {ckpt['tensors']} tensors, "
                 f"dtype {ckpt['dtype'] or 'as from_pretrained defaults'}")
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    fallback = FALLBACK_NOTE if results["cpu_kernel_fallbacks"] else ""
    lines.append(f"  device      {results['device']}{fallback}")
    lines.append(f"  versions    {versions}")
    call = "from_single_file" if ckpt.get("single_file") else "from_pretrained"
    lines.append(f"  method      each load in a fresh process, median of {results['repeats']}; timed: "
                 f"{call} + touching every weight")
    memory = results.get("memory", "as-is")
    lines.append(f"  memory      {memory}" + (": each process faults in and frees memory before every timed part, "
                                              "so first-touch costs of the VM do not count" if memory == "primed" else
                                              ": fresh memory as the machine gives it (first-touch costs count)"))
    cold = results.get("cold")
    if cold:
        left = cold["resident_after_evict"]
        lines.append("  cache       cold: the checkpoint's pages given back to the OS before each timed part"
                     + (f" ({left:.0%} of its bytes stayed cached)" if left else
                        " (none stayed cached)" if left == 0 else " (not measurable here: no mincore)"))
    lines.append("")
    lines.append(f"  {'':24}{'unpatched':>12}{'patched':>12}")
    ratio = results["ratio"]
    ratio_text = ""
    if ratio:
        ratio_text = f"   {ratio:.1f}x faster" if ratio >= 1 else f"   {1 / ratio:.1f}x slower"
    lines.append(f"  {call:24}{_s(unp['median_seconds']):>12}{_s(pat['median_seconds']):>12}{ratio_text}")
    lines.append(f"  {'peak RSS':24}{_mb(max(unp['peak_rss_bytes'])):>12}{_mb(max(pat['peak_rss_bytes'])):>12}")
    lines.append(f"  {'  of which before load':24}{_mb(min(unp['rss_before_bytes'])):>12}"
                 f"{_mb(min(pat['rss_before_bytes'])):>12}   (interpreter + imports)")
    if results["repeats"] > 1:
        lines.append(f"  all runs (s): unpatched {' '.join(f'{x:.2f}' for x in unp['seconds'])}; "
                     f"patched {' '.join(f'{x:.2f}' for x in pat['seconds'])}")
    storage = (cold or {}).get("storage_floors")
    if storage:
        size = ckpt["bytes"]
        parallel = storage["parallel_seconds"]
        lines.append(f"  storage, cold: sequential read {_s(storage['sequential_seconds'])} "
                     f"({size / 2**20 / storage['sequential_seconds']:,.0f} MB/s), "
                     f"{storage['parallel_threads']} threads x {_mb(storage['request_bytes'])} requests "
                     f"{_s(parallel)} ({size / 2**20 / parallel:,.0f} MB/s); "
                     f"patched load = {pat['median_seconds'] / parallel:.2f}x of the parallel read")
    ttm = results.get("time_to_model")
    if ttm:
        lines.append("")
        lines.append("  time to model: a fresh process from interpreter start to the loaded, touched model")
        lazy = "lazy import" if ttm["patched"]["lazy_import"] else "eager import"
        rows = (("interpreter start", "interpreter_seconds", "   patched: with the .pth hook, if installed"),
                ("import mindspore", "import_mindspore_seconds", "   patched: after `import ms_loadpatch`"),
                ("import the model class", "import_mindone_seconds", f"   from mindone (patched: {lazy})"),
                (f"{call} + touch", "load_seconds", ""))
        for label, key, note in rows:
            lines.append(f"    {label:22}{_s(ttm['unpatched'][key]):>12}{_s(ttm['patched'][key]):>12}{note}")
        ratio = ttm["ratio"]
        ratio_text = f"   {ratio:.1f}x faster" if ratio >= 1 else f"   {1 / ratio:.1f}x slower"
        lines.append(f"    {'total':22}{_s(ttm['unpatched']['seconds']):>12}{_s(ttm['patched']['seconds']):>12}"
                     + ratio_text)
    lines.append("")
    phases = dict(report.get("phases") or {})
    if phases:
        lines.append("  patched load, by phase (median run):")
        floor_of = {
            "construct": ("construct (mindspore no_init_parameters)", floors.get("construct_seconds")),
            "read": ("read every checkpoint byte", floors.get("read_seconds")),
            "assign": ("one cast pass", floors.get("cast_seconds")),
        }
        for name, seconds in phases.items():
            label = "cast/assign" if name == "assign" else name
            floor_label, floor_value = floor_of.get(name, (None, None))
            note = f"   floor: {floor_label} {_s(floor_value)}" if floor_value is not None else ""
            if name == "construct" and floor_value:
                note += f" (patched = {seconds / floor_value:.2f}x of it)"
            if name == "read" and report.get("tensors_cast_while_reading"):
                note += " (the cast is done while reading)"
            lines.append(f"    {label:20}{_s(seconds):>10}{note}")
        other = pat["median_run"]["seconds"] - sum(phases.values())
        lines.append(f"    {'other':20}{_s(max(other, 0.0)):>10}   mindone's own bookkeeping, touching the weights")
        lines.append(f"  tensors: {report.get('tensors_read')} read from {report.get('shards')} file(s) with "
                     f"{report.get('read_workers')} worker(s) of up to {report.get('read_threads')} thread(s), "
                     f"{report.get('tensors_assigned')} assigned, "
                     f"{report.get('tensors_cast')} cast{_while_reading(report)}, "
                     f"{report.get('missing_initialised')} parameters initialised "
                     "for missing weights")
        start = report.get("fast_construction_from")
        lines.append(f"  technique: {report.get('technique')}"
                     + (f", fast construction from cell {start}" if start is not None else
                        " (cells built plainly)")
                     + (f", {report['host_tensors']} factory tensors made on the host"
                        if report.get("host_tensors") else "")
                     + (", gc paused" if report.get("gc_paused") else ""))
    else:
        lines.append("  patched load: no load report (mindone's own path ran, e.g. a class that overrides its loading)")
        for key, label in (("construct_seconds", "construct floor"), ("read_seconds", "read floor")):
            if floors.get(key) is not None:
                lines.append(f"    {label:20}{_s(floors[key]):>10}")
    return "\n".join(lines)


# -- the command


def main(args) -> int:
    """`ms-loadpatch bench` (args from cli.build_parser)."""
    progress = Progress()
    try:
        if args.path:
            spec = LoadSpec.resolve(args.path, args.class_name, args.subfolder, args.dtype,
                                    getattr(args, "single_file", None))
            title = None
        else:
            if args.class_name or args.subfolder or getattr(args, "single_file", None):
                raise UsageError("--class, --subfolder and --single-file need a PATH")
            path = builtin_checkpoint(args.size, progress=progress)
            spec = LoadSpec.resolve(path, dtype=args.dtype)
            title = f"ms-loadpatch bench: built-in {args.size} checkpoint, {spec.class_name} (mindone.{spec.library})"
        results = run_bench(spec, repeats=args.repeats, progress=progress, memory=args.memory,
                            cold=getattr(args, "cold", False))
    except UsageError as exc:
        print(f"ms-loadpatch bench: {exc}", file=sys.stderr)
        return 2
    except ChildError as exc:
        print(f"ms-loadpatch bench: {exc}", file=sys.stderr)
        if exc.result.get("traceback") or exc.stderr:
            print(exc.result.get("traceback") or exc.stderr[-3000:], file=sys.stderr)
        return 1
    if not args.path:
        results["checkpoint"]["builtin_size"] = args.size
    print(format_table(results, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nresults written to {args.json}")
    return 0
