"""What the transformers and diffusers glue do alike: the accelerated load's
skeleton, and the wrappers of the methods they share."""

from __future__ import annotations

import contextlib
import json
import logging
import os

import mindspore as ms

from .. import core, fingerprints
from ..calls import argument
from ..strategy.assign import cast_parameters
from ..strategy.building import fast_construction
from ..strategy.building.gc_pause import collection_paused
from ..strategy.building.lazy import CONSTRUCTION_LOCK
from ..strategy.castread import CastPlan
from ..strategy.load import Load
from ..strategy.prefetch import CheckpointFiles, local_checkpoint_files

logger = logging.getLogger("ms_loadpatch")


class LibraryLoad(Load):
    """A library's accelerated from_pretrained. Each kind gives what accelerated_load asks of it:
    `requested_dtype(kwargs)` (None: as stored); `candidates(root, subfolder, named)`, the files the library
    looks for in a local directory, in its order (`named`: with the variant); `progress_bars()`, the library's
    switch; `finish(result)`, its last part of the load."""

    def finish(self, result) -> None:
        pass


def overridden_method(cls, base, names) -> str | None:
    """ "X overrides m" for the first class between `cls` and `base` that defines one of `names`, else None."""
    for klass in cls.__mro__:
        if klass is base:
            break
        for name in names:
            if name in vars(klass):
                return f"{klass.__name__} overrides {name}"
    return None


def from_pretrained(wrapped, instance, args, kwargs, fallback_reason, accelerated):
    """mindone's from_pretrained as it is (under the construction lock) when `fallback_reason(cls, kwargs)`
    gives a reason or ms_loadpatch is being disabled; else `accelerated(wrapped, instance, args, kwargs)`."""
    with core.accelerated_load() as allowed:
        reason = fallback_reason(instance, kwargs) if allowed else "ms_loadpatch is being disabled"
        if reason is not None:
            logger.debug(
                "ms_loadpatch: %s.from_pretrained unpatched: %s", getattr(instance, "__name__", instance), reason
            )
            with CONSTRUCTION_LOCK:
                return wrapped(*args, **kwargs)
        return accelerated(wrapped, instance, args, kwargs)


def accelerated_load(load: LibraryLoad, wrapped, args, kwargs, modeling_utils):
    """mindone's from_pretrained as the accelerated `load`: current, gc paused, its checkpoint files read ahead
    and cast while reading where exact."""
    with index_named_in_errors(), load.running(), collection_paused() as load.report.gc_paused:
        plan = CastPlan.for_dtype(load.requested_dtype(kwargs))
        if plan is not None:
            load.report.technique += f", cast to {plan.target} while reading"
        load.start_reading(checkpoint_files(load, wrapped, args, kwargs, modeling_utils), plan, load.progress_bars)
        result = wrapped(*args, **kwargs)
        load.finish(result)
    return result


def checkpoint_files(load: LibraryLoad, wrapped, args, kwargs, modeling_utils) -> CheckpointFiles:
    """The safetensors files from_pretrained(*args, **kwargs) will read from a local directory (with the count
    its index lists), none for anything else."""
    path = argument(wrapped, args, kwargs, "pretrained_model_name_or_path")
    if not isinstance(path, (str, os.PathLike)) or kwargs.get("use_safetensors") is False:
        return CheckpointFiles()
    variant = kwargs.get("variant")
    named = lambda name: modeling_utils._add_variant(name, variant)  # noqa: E731
    return local_checkpoint_files(load.candidates(os.fspath(path), kwargs.get("subfolder") or "", named))


@contextlib.contextmanager
def index_named_in_errors():
    """A JSONDecodeError escaping the block names the shard index it was
    parsing (both libraries json.loads it into a local `index_filename`)."""
    try:
        yield
    except json.JSONDecodeError as exc:
        index = traceback_local(exc, "index_filename")
        if index is None or os.fspath(index) in exc.msg:
            raise
        raise json.JSONDecodeError(f"{exc.msg} in the shard index {os.fspath(index)}", exc.doc, exc.pos) from exc


def traceback_local(exc, name, code=None):
    """The path in local `name` of the innermost frame `exc` went through (running `code`, if given), or None."""
    path, tb = None, exc.__traceback__
    while tb is not None:
        if code is None or tb.tb_frame.f_code is code:
            path = tb.tb_frame.f_locals.get(name, path)
        tb = tb.tb_next
    return path if isinstance(path, (str, os.PathLike)) else None


def from_config(wrapped, instance, args, kwargs):
    # never inside another thread's lazy-construction window; cells built the fast way (same objects)
    with CONSTRUCTION_LOCK, fast_construction(lazy_parameters=False):
        return wrapped(*args, **kwargs)


def half(wrapped, instance, args, kwargs):
    return _cast(wrapped, instance, args, kwargs, "half", ms.float16)


def float_(wrapped, instance, args, kwargs):
    return _cast(wrapped, instance, args, kwargs, "float", ms.float32)


def _cast(wrapped, instance, args, kwargs, method, dtype):
    if args or kwargs or _changed(method):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, dtype)
    return instance


def _changed(method) -> str | None:
    """Why either library's `method` (the same source in both) is not the code cast_parameters repeats."""
    return fingerprints.changed(f"transformers.{method}") or fingerprints.changed(f"diffusers.{method}")
