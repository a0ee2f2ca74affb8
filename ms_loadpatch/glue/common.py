"""What the transformers and diffusers glue do alike: the accelerated load's
skeleton, reading a file into the load, the index check, the Conv1d re-read,
and the wrappers of the dtype-changing methods they share."""

from __future__ import annotations

import contextlib
import json
import logging
import os

import mindspore as ms

from .. import core, fingerprints
from ..strategy import context
from ..strategy.assign import cast_parameters
from ..strategy.building import fast_construction
from ..strategy.castread import CastPlan, CastRegistry
from ..strategy.building.lazy import CONSTRUCTION_LOCK
from ..strategy.building.gc_pause import collection_paused
from ..strategy.prefetch import CheckpointFiles, local_checkpoint_files, read_file, start_prefetch, take_or_read
from ..strategy.safetensors_header import CheckpointError
from ..strategy.tensors import to_tensor

logger = logging.getLogger("ms_loadpatch")


def overridden_method(cls, base, names) -> str | None:
    """ "X overrides m" for the first class between `cls` and `base` that
    defines one of `names` itself (it took over the loading path), else None."""
    for klass in cls.__mro__:
        if klass is base:
            break
        for name in names:
            if name in vars(klass):
                return f"{klass.__name__} overrides {name}"
    return None


# -- from_pretrained


def from_pretrained(wrapped, instance, args, kwargs, fallback_reason, accelerated):
    """mindone's from_pretrained as it is, under the construction lock, when
    `fallback_reason(cls, kwargs)` gives a reason or ms_loadpatch is being
    disabled; else `accelerated(wrapped, instance, args, kwargs)`."""
    with core.accelerated_load() as allowed:
        reason = fallback_reason(instance, kwargs) if allowed else "ms_loadpatch is being disabled"
        if reason is not None:
            logger.debug(
                "ms_loadpatch: %s.from_pretrained unpatched: %s", getattr(instance, "__name__", instance), reason
            )
            with CONSTRUCTION_LOCK:
                return wrapped(*args, **kwargs)
        return accelerated(wrapped, instance, args, kwargs)


def accelerated_load(wrapped, args, kwargs, report, dtype, checkpoint_files, finish, progress_bars=None):
    """mindone's from_pretrained as one accelerated load, reported in `report`:
    its load context current and gc paused, `checkpoint_files()` read ahead,
    cast while reading to `dtype` (the dtype asked for, or None) where the
    cast is exact; `finish(ctx, result)` then does the library's last part.
    `progress_bars()`: whether the library shows progress bars."""
    with index_named_in_errors(), context.activate(report) as ctx, collection_paused() as report.gc_paused:
        plan = CastPlan.for_dtype(dtype)
        if plan is not None:
            report.technique += f", cast to {plan.target} while reading"
        ctx.state.cast_at_read = CastRegistry()
        start_prefetch(ctx, checkpoint_files(), plan, progress_bars)  # closed with the load context
        result = wrapped(*args, **kwargs)
        finish(ctx, result)
    return result


@contextlib.contextmanager
def index_named_in_errors():
    """A JSONDecodeError escaping the block names the shard index it was
    parsing: both libraries read it with json.loads into a local
    `index_filename`, and their error says only where in the text it broke."""
    try:
        yield
    except json.JSONDecodeError as exc:
        tb, index = exc.__traceback__, None
        while tb is not None:
            index = tb.tb_frame.f_locals.get("index_filename", index)
            tb = tb.tb_next
        if not isinstance(index, (str, os.PathLike)) or os.fspath(index) in exc.msg:
            raise
        raise json.JSONDecodeError(f"{exc.msg} in the shard index {os.fspath(index)}", exc.doc, exc.pos) from exc


def checkpoint_files(args, kwargs, add_variant, lookup) -> CheckpointFiles:
    """The safetensors files from_pretrained(*args, **kwargs) will read from a
    local directory (prefetch.local_checkpoint_files, with the count its index
    lists), none for anything else.
    `lookup(root, subfolder, named)` gives the paths mindone looks for, in its
    order; `named(file)` is the file name with mindone's `add_variant`."""
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if not isinstance(path, (str, os.PathLike)) or kwargs.get("use_safetensors") is False:
        return CheckpointFiles()
    variant = kwargs.get("variant")
    return local_checkpoint_files(
        lookup(os.fspath(path), kwargs.get("subfolder") or "", lambda name: add_variant(name, variant))
    )


def from_config(wrapped, instance, args, kwargs):
    # never inside another thread's lazy-construction window; cells built the fast way (same objects)
    with CONSTRUCTION_LOCK, fast_construction(lazy_parameters=False):
        return wrapped(*args, **kwargs)


def half(wrapped, instance, args, kwargs):
    if args or kwargs or _changed("half"):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, ms.float16)
    return instance


def float_(wrapped, instance, args, kwargs):
    if args or kwargs or _changed("float"):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, ms.float32)
    return instance


def _changed(method) -> str | None:
    """Why either library's `method` (the same source in both) is not the code cast_parameters repeats."""
    return fingerprints.changed(f"transformers.{method}") or fingerprints.changed(f"diffusers.{method}")


# -- inside an accelerated load


def read_checkpoint(ctx, path, separate=False):
    """(arrays, metadata, cast_at_read) of one file: within the load `ctx`,
    the prefetched read if there is one, counted in its report, its keys and
    name kept for the index check and errors; outside a load, read now
    (`separate`: a buffer per tensor)."""
    if ctx is None:
        return read_file(path, separate=separate)
    with ctx.report.phase("read"):
        arrays, metadata, cast_at_read = take_or_read(ctx, path)
    ctx.report.tensors_read += len(arrays)
    ctx.report.shards += 1
    ctx.state.keys_read.update(arrays)
    ctx.state.last_file = os.fspath(path)
    return arrays, metadata, cast_at_read


def tensors_of(ctx, arrays, cast_at_read) -> dict:
    """name -> Tensor sharing each array; those cast while reading listed in the load's registry."""
    tensors = {name: to_tensor(array) for name, array in arrays.items()}
    ctx.state.cast_at_read.add(tensors, cast_at_read)
    return tensors


def check_index_against_shards(ctx, files, listed_keys, weight_map) -> None:
    """A tensor the index lists but no shard read holds (an index mapping it
    to the wrong file): mindone leaves that weight as randomly initialised,
    without a word. Refuse, naming the file the index points to and the key.
    `weight_map()` (key -> shard file name) is read only then."""
    read = ctx.state.keys_read
    key = next((key for key in listed_keys if key not in read), None)
    if key is None:
        return
    shard = weight_map().get(key)
    path = next((f for f in files if os.path.basename(os.fspath(f)) == shard), shard or files[0])
    raise CheckpointError(path, "the checkpoint's index lists this tensor in this file, but no shard holds it", key=key)


def mapped_as_unpatched(ctx, mapping, tensor, name):
    """`mapping(tensor)`, a key's pt -> ms mapping; one that transforms the
    values (Conv1d) of a tensor cast while reading is given the file's values
    (read again), as unpatched mindone maps them before any cast."""
    mapped = _mapped(mapping, tensor, name)
    if mapped is not tensor:
        in_file = ctx.state.cast_at_read.as_in_file(tensor, ctx.report)
        mapped = mapped if in_file is tensor else _mapped(mapping, in_file, name)
    return mapped


def _mapped(mapping, tensor, name):
    try:
        return mapping(tensor)
    except AttributeError:  # Conv1d mappings read `.name`, which only a Parameter has
        return mapping(ms.Parameter(tensor, name=name))
