"""The child side of `bench` and `verify`: one task per fresh interpreter.

Run by bench.run_child as `python -c "...main()" TASK.json`; writes its
result as JSON to task["result"]. MS_LOADPATCH in the environment decides
whether `import ms_loadpatch` (this package) enabled the plugin.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback

import numpy as np

import ms_loadpatch

from .spec import LoadSpec, UsageError, distribution_version


def _max_rss_bytes() -> int:
    """Peak RSS since start, or since the last _reset_peak_rss()."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _reset_peak_rss() -> bool:
    """Set the peak to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _versions() -> dict:
    return {name: distribution_version(name) for name in ("mindspore", "mindone", "ms-loadpatch")}


def import_model_class(spec: LoadSpec):
    """(class, "transformers" | "diffusers") for spec.class_name."""
    import importlib

    name = spec.class_name
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot import --class {name}: {exc}") from exc
    else:
        library = spec.library or "transformers"
        cls = getattr(importlib.import_module(f"mindone.{library}"), name, None)
        if cls is None:
            raise UsageError(f"mindone.{library} has no class {name!r}; pass --class (a name or module:Class)")
    for klass in getattr(cls, "__mro__", ()):
        if klass.__name__ == "PreTrainedModel" and klass.__module__ == "mindone.transformers.modeling_utils":
            return cls, "transformers"
        if klass.__name__ == "ModelMixin" and klass.__module__ == "mindone.diffusers.models.modeling_utils":
            return cls, "diffusers"
    raise UsageError(f"{name} is not a mindone.transformers or mindone.diffusers model class")


def _on_cpu() -> bool:
    import mindspore as ms

    return ms.get_context("device_target") == "CPU"


def _fallbacks(on_cpu: bool):
    import contextlib

    from ..testing import cpu_kernel_fallbacks

    return cpu_kernel_fallbacks() if on_cpu else contextlib.nullcontext()


def touch_all(model) -> int:
    """Read one byte of every page of every parameter and buffer: lazy or
    mmap-backed weights are really in memory afterwards."""
    total = 0
    tensors = [p for p in model.get_parameters()]
    named_buffers = getattr(model, "named_buffers", None)
    if named_buffers is not None:
        tensors += [b for _, b in named_buffers()]
    for tensor in tensors:
        flat = np.ascontiguousarray(tensor.asnumpy()).reshape(-1).view(np.uint8)
        total += int(flat[::4096].sum())
    return total


def prime_memory(nbytes: int) -> None:
    """Fault in, then free, `nbytes` of memory: the allocations right after
    reuse pages the host still backs. On a VM that hands freed memory back
    to the host (free page reporting), first touch costs more than the read,
    an artefact of the machine that would otherwise swamp every load time
    (docs/benchmarks.md, "How `ms-loadpatch bench` measures")."""
    if nbytes <= 0:
        return
    if not _reset_peak_rss():
        raise UsageError(
            "--memory primed needs /proc/self/clear_refs (Linux) to keep priming out of peak RSS; use --memory as-is"
        )
    from concurrent.futures import ThreadPoolExecutor

    from ..strategy.threaded_read import read_threads

    buffer = np.empty(nbytes, dtype=np.uint8)
    step = -(-nbytes // read_threads())
    pages = [buffer[lo : lo + step : 4096] for lo in range(0, nbytes, step)]
    with ThreadPoolExecutor(max_workers=len(pages)) as pool:  # faults run in parallel (no GIL)
        list(pool.map(lambda view: view.fill(1), pages))
    del pages, buffer
    _reset_peak_rss()  # the priming is not part of any load's peak


def _wait_for_parties(directory: str, parties: int, timeout: float = 600.0) -> None:
    """A start line for processes loading at once: each leaves a file in
    `directory`, then waits until `parties` files are there."""
    with open(os.path.join(directory, f"ready-{os.getpid()}"), "w"):
        pass
    deadline = time.monotonic() + timeout
    while len([n for n in os.listdir(directory) if n.startswith("ready-")]) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{parties} processes were not ready within {timeout} s")
        time.sleep(0.01)


def _task_load(task: dict) -> dict:
    spec = LoadSpec(**task["spec"])
    refusal = None
    if ms_loadpatch.activation.switched_on():  # the patched child: must not silently run unpatched
        if not ms_loadpatch.enable():
            refusal = ms_loadpatch.status()["refusal"]
    else:
        ms_loadpatch.disable()
    import mindspore as ms

    cls, library = import_model_class(spec)
    kwargs = {}
    if spec.subfolder and not spec.single_file:
        kwargs["subfolder"] = spec.subfolder
    if spec.dtype:
        kwargs["dtype" if library == "transformers" else "mindspore_dtype"] = getattr(ms, spec.dtype)
    on_cpu = _on_cpu()
    from ..strategy import reports

    reports._last_reports.clear()
    with _fallbacks(on_cpu):
        if task.get("warm"):
            warm_page_cache(spec.weight_files())
        prime_memory(task.get("prime_bytes", 0))
        if task.get("barrier"):
            _wait_for_parties(**task["barrier"])
        _reset_peak_rss()  # peak RSS from here on: the load's, over the RSS it starts from
        rss_before = _max_rss_bytes()
        start = time.perf_counter()
        if spec.single_file:  # mindone.diffusers' from_single_file, its config from the model's directory
            model = cls.from_single_file(
                os.path.join(spec.model_dir, spec.single_file), config=spec.model_dir, **kwargs
            )
        else:
            model = cls.from_pretrained(spec.path, **kwargs)
        touch_all(model)
        seconds = time.perf_counter() - start
    peak = _max_rss_bytes()
    report = reports.last_report()
    result = {
        "seconds": seconds,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "class_name": type(model).__name__,
        "library": library,
        "device": ms.get_context("device_target"),
        "cpu_kernel_fallbacks": on_cpu,
        "plugin_enabled": ms_loadpatch.is_enabled(),
        "plugin_refusal": refusal,
        "report": report.as_dict() if report is not None else None,
        "versions": _versions(),
    }
    named_buffers = getattr(model, "named_buffers", None)
    result["tensors"] = len(list(model.parameters_and_names(expand=True))) + (
        len(list(named_buffers())) if named_buffers is not None else 0
    )
    if task.get("snapshot"):
        from ..testing import snapshot
        from .verify import write_snapshot

        snap = snapshot(model)
        del model  # the snapshot holds copies; free the model before writing
        write_snapshot(snap, task["snapshot"])
    return result


def warm_page_cache(files) -> None:
    """Every byte of `files` read once through the page cache."""
    chunk = np.empty(8 << 20, dtype=np.uint8)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(chunk):
                pass


def _task_floors(task: dict) -> dict:
    from ..strategy.threaded_read import read_into

    spec = LoadSpec(**task["spec"])
    ms_loadpatch.disable()
    files = spec.weight_files()
    warm_page_cache(files)  # the loads after this one find the files cached: so does the floor
    prime = task.get("prime_bytes", 0)
    prime_memory(prime)
    start = time.perf_counter()
    total, buffers = 0, []
    for path in files:  # into fresh memory, held to the end as a loader holds it: page faults included
        buffers.append(np.empty(os.path.getsize(path), dtype=np.uint8))
        with open(path, "rb", buffering=0) as f:
            total += read_into(f.fileno(), buffers[-1], 0)  # as fast as this machine reads: all cores
    read_seconds = time.perf_counter() - start
    del buffers

    from mindspore.nn.utils import no_init_parameters

    from ..strategy.building.swaps import Swaps

    cls, library = import_model_class(spec)
    on_cpu = _on_cpu()
    with _fallbacks(on_cpu):
        if library == "transformers":
            import mindone.transformers.modeling_utils as modeling_utils

            config = cls.config_class.from_pretrained(spec.model_dir)
            with Swaps([(modeling_utils, "_init_weights", False)]):  # no init pass
                prime_memory(prime)
                start = time.perf_counter()
                with no_init_parameters():
                    cls(config)
                construct_seconds = time.perf_counter() - start
        else:
            config = cls.load_config(spec.model_dir)
            prime_memory(prime)
            start = time.perf_counter()
            with no_init_parameters():
                cls.from_config(config)
            construct_seconds = time.perf_counter() - start
    return {
        "read_seconds": read_seconds,
        "read_bytes": total,
        "files": len(files),
        "construct_seconds": construct_seconds,
        "cast_seconds": _cast_floor(files, spec.dtype, prime),
    }


def _cast_floor(files, dtype_name, prime_bytes: int = 0) -> float:
    """One cast pass: every checkpoint tensor whose dtype differs from the
    requested one, cast once with mindspore's kernel (from memory already read)."""
    if not dtype_name:
        return 0.0
    import mindspore as ms

    from ..strategy.reader import read_arrays
    from ..strategy.tensors import cast, to_tensor

    dtype = getattr(ms, dtype_name)
    seconds = 0.0
    for path in files:
        tensors = [to_tensor(array) for array in read_arrays(path)[0].values()]
        prime_memory(min(prime_bytes, os.path.getsize(path)))  # the cast's output: fresh memory
        start = time.perf_counter()
        for tensor in tensors:
            if tensor.dtype != dtype and tensor.is_floating_point():
                cast(tensor, dtype).asnumpy()  # asnumpy: the cast has really run
        seconds += time.perf_counter() - start
    return seconds


def _task_generate(task: dict) -> dict:
    ms_loadpatch.disable()
    import mindspore as ms

    cls, library = import_model_class(LoadSpec(path="", class_name=task["class_name"], library=task["library"]))
    ms.set_seed(task.get("seed", 0))
    np.random.seed(task.get("seed", 0))
    save_kwargs = {"max_shard_size": task["max_shard_size"]} if task.get("max_shard_size") else {}
    with _fallbacks(_on_cpu()):
        if library == "transformers":
            model = cls(cls.config_class(**task["config"]))
        else:
            model = cls.from_config(task["config"])
        model.save_pretrained(task["out"], **save_kwargs)
    return {"out": task["out"], "library": library}


def _task_storage(task: dict) -> dict:
    """The storage's parallel read of the checkpoint into fresh memory, in a
    process primed as the loads are (the parent evicted the files, if cold)."""
    from . import cold

    ms_loadpatch.disable()
    prime_memory(task.get("prime_bytes", 0))
    return {"seconds": cold.parallel_read(task["paths"], fresh=True), "threads": cold.PARALLEL_THREADS}


TASKS = {"load": _task_load, "floors": _task_floors, "generate": _task_generate, "storage": _task_storage}


def main() -> None:
    with open(sys.argv[1]) as f:
        task = json.load(f)
    try:
        result = TASKS[task["task"]](task)
        code = 0
    except UsageError as exc:
        result, code = {"error": str(exc), "usage": True}, 2
    except BaseException as exc:  # reported to the parent, which decides
        result, code = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, 1
    with open(task["result"], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: mindspore's can take seconds
