"""Hooks the loading strategy into mindone.diffusers.

mindone's `ModelMixin.from_pretrained` stays the driver (file resolution,
variants, key fixes, missing / unexpected / mismatched bookkeeping, warnings,
the final `model.to(dtype)`). Inside an accelerated call, the pieces it calls
are swapped for the strategy's:

- construction: the same lazy `no_init_parameters` window, under the
  construction lock;
- reading: one owned buffer per file, tensors are zero-copy views; files
  read in background threads while the model is built (more threads when
  HF_ENABLE_PARALLEL_LOADING is set at call time; mindone raises instead);
- assignment: one dict lookup per checkpoint key (mindone rescans every
  parameter per shard and removes keys from a list); each tensor is cast at
  most once, straight to the final dtype, and the lazy parameter's dtype is
  set first (metadata only) so `set_data` aliases it. A bf16 file loaded as
  bf16 is never copied; mindone goes bf16 -> fp32 -> bf16.
- the final `model.to(dtype)` then skips every parameter already in dtype.

Parameters the checkpoint did not fill stay lazy, as in mindone: filled at
first use, taking their draws then. Each wrapper calls straight through
when no accelerated diffusers load is active in the calling thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import mindspore as ms
import wrapt

from . import build_then_fill, common
from .. import fingerprints
from .calls import argument, inside_load, with_argument
from ..strategy import context
from ..strategy.assign import assign_in_final_dtype, cast_parameters, parameter_index
from ..strategy.building.construction import lazy_construction
from ..strategy.building.lazy import CONSTRUCTION_LOCK
from ..strategy.safetensors_header import CheckpointError, file_named_in_errors
from ..strategy.tensors import adopted_parameter

logger = logging.getLogger("ms_loadpatch")
_MODULE = "mindone.diffusers.models.modeling_utils"
_LOADING_MODULE = "mindone.diffusers.models.model_loading_utils"
_LIBRARY = "diffusers"
# Methods that, overridden in a subclass, change what the loading path produces.
_LOADING_PATH = ("_load_pretrained_model", "_fix_state_dict_keys_on_load", "to", "half", "float")
# kwargs mindone hands to other code paths, or that the fast path does not model
_FALLBACK_KWARGS = ("from_flax", "dduf_entries", "device_map", "quantization_config", "state_dict")
_TECHNIQUE = "lazy construction, set_dtype on lazy params, set_data from owned read buffer, one set_dtype cast"


def _modeling_utils():
    return sys.modules[_MODULE]


def _active():
    """The current load context if it is an accelerated diffusers load."""
    ctx = context.current()
    if ctx is not None and ctx.report.library == _LIBRARY and not ctx.state.fallback_reason:
        return ctx
    return None


def _fallback_reason(cls, kwargs) -> str | None:
    for name in _FALLBACK_KWARGS:
        if kwargs.get(name):
            return f"{name} is passed"
    base = _modeling_utils().ModelMixin
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return "not called on a ModelMixin class"
    return common.overridden_method(cls, base, _LOADING_PATH) or fingerprints.library_problem(_LIBRARY)


# -- entry points (targets.TARGETS; from_config, half and float are common's)


def from_pretrained(wrapped, instance, args, kwargs):
    return common.from_pretrained(wrapped, instance, args, kwargs, _fallback_reason, _accelerated_from_pretrained)


def _accelerated_from_pretrained(wrapped, instance, args, kwargs):
    report = context.LoadReport(instance.__name__, _LIBRARY)
    report.technique = _TECHNIQUE
    requested = kwargs.get("mindspore_dtype")
    dtype = requested if isinstance(requested, ms.Type) else None
    return common.accelerated_load(
        wrapped, args, kwargs, report, dtype, lambda: _local_checkpoint_files(args, kwargs), _finish, _progress_bars
    )


def _progress_bars() -> bool:
    from mindone.diffusers.utils import logging as df_logging

    return df_logging.is_progress_bar_enabled()


def _finish(ctx, result) -> None:
    """Report a fallback. What the checkpoint lacked stays lazy, as mindone
    leaves it: filled (its draw taken) at first use, as unpatched."""
    report = ctx.report
    if ctx.state.fallback_reason:
        report.technique = f"fallback to mindone: {ctx.state.fallback_reason}"
    elif not ctx.state.load_done:
        report.technique = "fallback to mindone: its loading path did not run"


def no_init_parameters(wrapped, instance, args, kwargs):
    """modeling_utils' `no_init_parameters`: the same lazy window, scoped to
    the building thread and under the construction lock (mindone's flips a
    class flag for every thread: a model built elsewhere meanwhile came out
    lazy), and timed inside an accelerated load."""
    if args or kwargs:
        return _locked(wrapped(*args, **kwargs))
    ctx = _active()
    if ctx is None:
        return lazy_construction()
    return _timed_construction(ctx)


def to(wrapped, instance, args, kwargs):
    dtype = argument(wrapped, args, kwargs, "dtype")
    if not isinstance(dtype, ms.Type) or len(args) + len(kwargs) != 1 or fingerprints.changed("diffusers.to"):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, dtype)
    return instance


def load_state_dict(wrapped, instance, args, kwargs):
    """Read a safetensors file with the fast reader. Inside an accelerated
    load: plain tensors (assigned by load_shard_file); otherwise Parameters
    named by key, as mindone returns. Anything else, or a file the reader
    refuses, goes to mindone, so errors are mindone's own."""
    checkpoint_file = argument(wrapped, args, kwargs, "checkpoint_file")
    dduf_entries = argument(wrapped, args, kwargs, "dduf_entries")
    if (
        len(args) > 3
        or set(kwargs) - {"checkpoint_file", "dduf_entries", "disable_mmap"}
        or dduf_entries
        or not isinstance(checkpoint_file, (str, os.PathLike))
        or not os.fspath(checkpoint_file).endswith(".safetensors")
        or fingerprints.changed("diffusers.load_state_dict")
    ):
        return wrapped(*args, **kwargs)
    ctx = _active()
    # Parameters over the read tensors, each in a buffer of its own: what the model does not keep is freed
    adopting = ctx is None and build_then_fill.adopting_checkpoint()
    try:
        arrays, _metadata, cast_at_read = common.read_checkpoint(ctx, checkpoint_file, separate=adopting)
    except CheckpointError as refused:
        logger.debug("ms_loadpatch: %s left to mindone: %s", checkpoint_file, refused)
        # mindone's error, with the file, tensor and reason its message lacks (git-lfs: even the file)
        with file_named_in_errors(checkpoint_file, reason=refused):
            return wrapped(*args, **kwargs)
    if ctx is None:
        make = adopted_parameter if adopting else ms.Parameter
        return {name: make(array, name=name) for name, array in arrays.items()}
    return common.tensors_of(ctx, arrays, cast_at_read)


# -- internals of mindone's loading path (targets.TARGETS, diffusers "internal" rows)


@inside_load(_active)
def load_pretrained_model(ctx, wrapped, instance, args, kwargs):
    """ModelMixin._load_pretrained_model: decide fast path or fallback once per
    load, index the model's parameters, start the parallel reader."""
    model = argument(wrapped, args, kwargs, "model")
    files = argument(wrapped, args, kwargs, "resolved_model_file")
    paths = [f for f in (files or []) if not isinstance(f, dict)]
    reason = next((f"{f} is not a safetensors file" for f in paths if not os.fspath(f).endswith(".safetensors")), None)
    index = None
    if reason is None:
        with ctx.report.phase("index"):
            index = parameter_index(model)
        if index is None:
            reason = "parameter names differ from their structural names"
    if reason is not None:
        logger.debug("ms_loadpatch: %s loads unpatched: %s", type(model).__name__, reason)
        ctx.state.fallback_reason = reason
        state_dict = argument(wrapped, args, kwargs, "state_dict")
        if state_dict:  # read by our load_state_dict as tensors; mindone's loader wants Parameters of the file's values
            registry = ctx.state.cast_at_read
            state_dict = {
                k: v if isinstance(v, ms.Parameter) else ms.Parameter(registry.as_in_file(v, ctx.report), name=k)
                for k, v in state_dict.items()
            }
            args, kwargs = with_argument(wrapped, args, kwargs, "state_dict", state_dict)
        return wrapped(*args, **kwargs)
    ctx.state.parameter_index = (model, index)
    result = wrapped(*args, **kwargs)
    loaded_keys = argument(wrapped, args, kwargs, "loaded_keys")
    if len(paths) > 1:  # mindone leaves a weight no shard holds lazy, to be randomly initialised
        common.check_index_against_shards(ctx, paths, loaded_keys or (), lambda: _weight_map(paths))
    ctx.state.load_done = True
    return result


def _weight_map(paths) -> dict:
    """key -> shard of the index files beside `paths` (mindone does not hand
    its index on; every variant's is read, a later one winning), kept where
    the shard is one of `paths`."""
    directory = os.path.dirname(os.fspath(paths[0]))
    weight_map = {}
    for name in os.listdir(directory):
        if name.endswith(".json") and ".safetensors.index" in name:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(directory, name)) as f:
                    weight_map.update(json.load(f)["weight_map"])
    shards = {os.path.basename(os.fspath(p)) for p in paths}
    return {key: shard for key, shard in weight_map.items() if isinstance(shard, str) and shard in shards}


def load_shard_file(wrapped, instance, args, kwargs):
    """modeling_utils' `_load_shard_file`: read (or take the prefetched) shard
    and assign it with O(1) bookkeeping instead of load_param_into_net."""
    ctx = _active()
    if ctx is None or ctx.state.parameter_index is None:
        return wrapped(*args, **kwargs)
    shard_file = argument(wrapped, args, kwargs, "shard_file")
    model = argument(wrapped, args, kwargs, "model")
    owner, index = ctx.state.parameter_index
    if owner is not model:
        return wrapped(*args, **kwargs)
    if isinstance(shard_file, dict):  # a single file, read by load_state_dict
        state_dict, path = shard_file, ctx.state.last_file
    else:
        arrays, _metadata, cast_at_read = common.read_checkpoint(ctx, shard_file)
        state_dict = common.tensors_of(ctx, arrays, cast_at_read)
        path = shard_file
    with file_named_in_errors(path):  # whatever fails with this file's tensors names it
        mismatched_keys = sys.modules[_LOADING_MODULE]._find_mismatched_keys(
            state_dict,
            argument(wrapped, args, kwargs, "model_state_dict"),
            argument(wrapped, args, kwargs, "loaded_keys"),
            argument(wrapped, args, kwargs, "ignore_mismatched_sizes", False),
        )
        with ctx.report.phase("assign"):
            try:
                assign_in_final_dtype(
                    index,
                    state_dict,
                    argument(wrapped, args, kwargs, "dtype"),
                    argument(wrapped, args, kwargs, "keep_in_fp32_modules"),
                    ctx.report,
                    ctx.state.cast_at_read,
                )
            finally:
                ctx.state.cast_at_read.clear()  # tensors not assigned (unexpected keys) are freed
    return (
        argument(wrapped, args, kwargs, "offload_index"),
        argument(wrapped, args, kwargs, "state_dict_index"),
        mismatched_keys,
        [],
    )


@inside_load(_active)
def convert_state_dict(ctx, wrapped, instance, args, kwargs):
    """mindone's _convert_state_dict, tolerating plain tensors (a Conv1d mapping reads `.name`)."""
    model = argument(wrapped, args, kwargs, "m")
    state_dict_pt = argument(wrapped, args, kwargs, "state_dict_pt")
    if not state_dict_pt:
        return state_dict_pt
    mappings = _modeling_utils()._get_pt2ms_mappings(model)
    converted = {}
    while state_dict_pt:  # same popitem order as mindone: loaded_keys order matches
        name_pt, data_pt = state_dict_pt.popitem()
        mapping = mappings.get(name_pt)
        name_ms = name_pt
        if mapping is not None:
            name_ms, function = mapping
            data_pt = common.mapped_as_unpatched(ctx, function, data_pt, name_pt)
        if name_ms is not None:
            converted[name_ms] = data_pt
    return converted


class ParallelLoadingFlag(wrapt.ObjectProxy):
    """modeling_utils' HF_ENABLE_PARALLEL_LOADING (read once at import; mindone
    raises NotImplementedError when it is true). False inside an accelerated
    load, which reads the environment at call time itself; elsewhere the
    original value, so unpatched behaviour is unchanged."""

    def __bool__(self):
        ctx = context.current()
        if ctx is not None and ctx.report.library == _LIBRARY:
            return False
        return bool(self.__wrapped__)


# -- helpers


@contextlib.contextmanager
def _locked(manager):
    with CONSTRUCTION_LOCK, manager:
        yield


@contextlib.contextmanager
def _timed_construction(ctx):
    with (
        ctx.report.phase("construct"),
        lazy_construction(checkpoint_tensors=ctx.checkpoint_tensors(), when_built=ctx.report.note_construction),
    ):
        yield


def _local_checkpoint_files(args, kwargs) -> common.CheckpointFiles:
    """The safetensors files mindone will resolve for a local directory, in its
    lookup order: the index in the subfolder, then a single file at the root,
    then in the subfolder."""
    return common.checkpoint_files(
        args,
        kwargs,
        _modeling_utils()._add_variant,
        lambda root, subfolder, named: [
            os.path.join(root, subfolder, named("diffusion_pytorch_model.safetensors.index.json")),
            os.path.join(root, named("diffusion_pytorch_model.safetensors")),
            os.path.join(root, subfolder, named("diffusion_pytorch_model.safetensors")) if subfolder else None,
        ],
    )
