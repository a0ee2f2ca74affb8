"""Hooks the loading strategy into mindone.diffusers: ModelMixin.from_pretrained
stays the driver, and inside a DiffusersLoad the pieces it calls are the
strategy's. Outside one, each wrapper calls straight through."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import mindspore as ms
import wrapt

from .. import fingerprints
from ..calls import argument, handles
from ..strategy.assign import assign_in_final_dtype, cast_parameters, parameter_index
from ..strategy.building.construction import lazy_construction
from ..strategy.building.lazy import CONSTRUCTION_LOCK
from ..strategy.keys import mapped_keys
from ..strategy.prefetch import read_file, shard_weight_map
from ..strategy.safetensors_header import CheckpointError, file_named_in_errors
from ..strategy.tensors import adopted_parameter
from . import common
from .build_then_fill import BuildThenFillCall

logger = logging.getLogger("ms_loadpatch")
_MODULE = "mindone.diffusers.models.modeling_utils"
_LOADING_MODULE = "mindone.diffusers.models.model_loading_utils"
# overridden in a subclass, these change what the loading path produces
_LOADING_PATH = ("_load_pretrained_model", "_fix_state_dict_keys_on_load", "to", "half", "float")
# kwargs mindone hands to other code paths, or that the fast path does not model
_FALLBACK_KWARGS = ("from_flax", "dduf_entries", "device_map", "quantization_config", "state_dict")
_FILE = "diffusion_pytorch_model.safetensors"
_SHARD_ARGS = "shard_file model model_state_dict loaded_keys ignore_mismatched_sizes dtype keep_in_fp32_modules".split()


def _modeling_utils():
    return sys.modules[_MODULE]


class DiffusersLoad(common.LibraryLoad):
    """An accelerated from_pretrained: why mindone's loader loads it, if so; (model, name -> (parameter, dtype))."""

    library = "diffusers"
    technique = "lazy construction, set_dtype on lazy params, set_data from owned read buffer, one set_dtype cast"

    def __init__(self, model_class):
        super().__init__(model_class)
        self.fallback_reason: str | None = None
        self.parameter_index: tuple | None = None

    @classmethod
    def accelerating(cls) -> DiffusersLoad | None:
        """The current load, unless it fell back to mindone's loader."""
        load = cls.current()
        return load if load is not None and not load.fallback_reason else None

    @staticmethod
    def requested_dtype(kwargs):
        requested = kwargs.get("mindspore_dtype")
        return requested if isinstance(requested, ms.Type) else None

    @staticmethod
    def candidates(root, subfolder, named):
        """mindone's order: the index in the subfolder, a single file at the root, then in the subfolder."""
        index, single = named(f"{_FILE}.index.json"), named(_FILE)
        in_subfolder = os.path.join(root, subfolder, single) if subfolder else None
        return [os.path.join(root, subfolder, index), os.path.join(root, single), in_subfolder]

    @staticmethod
    def progress_bars() -> bool:
        from mindone.diffusers.utils import logging as df_logging

        return df_logging.is_progress_bar_enabled()

    def assign_in_final_dtype(self, index, state_dict, dtype, keep_in_fp32_modules) -> None:
        """assign.assign_in_final_dtype of `state_dict`; what it leaves (unexpected keys) freed."""
        try:
            assign_in_final_dtype(index, state_dict, dtype, keep_in_fp32_modules, self.report, self.cast_at_read)
        finally:
            self.cast_at_read.clear()

    def as_parameters_of_file(self, state_dict: dict) -> dict:
        """`state_dict` with each tensor read by this load a Parameter of the file's values (as the library's
        own loader reads them: none cast while reading)."""
        return {
            k: v if isinstance(v, ms.Parameter) else ms.Parameter(self.cast_at_read.as_in_file(v, self.report), name=k)
            for k, v in state_dict.items()
        }

    # -- calls of mindone's loading path this load handles, unless it fell back (targets.TARGETS rows naming
    # its methods; calls.on_load looks the load up and checks the call form each declares)

    @handles(active="accelerating")
    def on_load_pretrained_model(self, call):
        """ModelMixin._load_pretrained_model: fast path or fallback, decided once per load."""
        model = call.argument("model")
        files = call.argument("resolved_model_file")
        paths = [f for f in (files or []) if not isinstance(f, dict)]
        not_safetensors = (f"{f} is not a safetensors file" for f in paths if not os.fspath(f).endswith(".safetensors"))
        reason = next(not_safetensors, None)
        index = None
        if reason is None:
            with self.report.phase("index"):
                index = parameter_index(model)
            if index is None:
                reason = "parameter names differ from their structural names"
        if reason is not None:
            logger.debug("ms_loadpatch: %s loads unpatched: %s", type(model).__name__, reason)
            self.fallback_reason = reason
            state_dict = call.argument("state_dict")
            if state_dict:  # read by our load_state_dict as tensors; mindone's loader wants Parameters of the file
                call = call.with_argument("state_dict", self.as_parameters_of_file(state_dict))
            return call()
        self.parameter_index = (model, index)
        result = call()
        loaded_keys = call.argument("loaded_keys")
        if len(paths) > 1:  # mindone leaves a weight no shard holds lazy, to be randomly initialised
            self.check_index_against_shards(paths, loaded_keys or (), lambda: shard_weight_map(paths))
        self.done = True
        return result

    @handles(
        accepts=lambda load, call: (
            load.parameter_index is not None and load.parameter_index[0] is call.argument("model")
        ),
        active="accelerating",
    )
    def on_load_shard_file(self, call):
        """`_load_shard_file`: the (prefetched) shard assigned with O(1) bookkeeping, not load_param_into_net."""
        shard_file, model, model_state_dict, loaded_keys, ignore_sizes, dtype, keep_in_fp32 = call.arguments(
            *_SHARD_ARGS
        )
        if isinstance(shard_file, dict):  # a single file, read by load_state_dict
            state_dict, path = shard_file, self.last_file
        else:
            arrays, _metadata, cast_at_read = self.read(shard_file)
            state_dict, path = self.tensors_of(arrays, cast_at_read), shard_file
        with file_named_in_errors(path):  # whatever fails with this file's tensors names it
            find_mismatched_keys = sys.modules[_LOADING_MODULE]._find_mismatched_keys
            mismatched_keys = find_mismatched_keys(state_dict, model_state_dict, loaded_keys, ignore_sizes)
            with self.report.phase("assign"):
                self.assign_in_final_dtype(self.parameter_index[1], state_dict, dtype, keep_in_fp32)
        return (*call.arguments("offload_index", "state_dict_index"), mismatched_keys, [])

    @handles(active="accelerating")
    def on_convert_state_dict(self, call):
        """mindone's _convert_state_dict, tolerating plain tensors (a Conv1d mapping reads `.name`)."""
        state_dict_pt = call.argument("state_dict_pt")
        if not state_dict_pt:
            return state_dict_pt
        mappings = _modeling_utils()._get_pt2ms_mappings(call.argument("m"))
        return mapped_keys(state_dict_pt, mappings, self.mapped_as_unpatched)

    def finish(self, result) -> None:
        """Report a fallback; what the checkpoint lacked stays lazy, as mindone leaves it."""
        if self.fallback_reason:
            self.report.technique = f"fallback to mindone: {self.fallback_reason}"
        elif not self.done:
            self.report.technique = "fallback to mindone: its loading path did not run"


def _fallback_reason(cls, kwargs) -> str | None:
    for name in _FALLBACK_KWARGS:
        if kwargs.get(name):
            return f"{name} is passed"
    base = _modeling_utils().ModelMixin
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return "not called on a ModelMixin class"
    return common.overridden_method(cls, base, _LOADING_PATH) or fingerprints.library_problem("diffusers")


# -- entry points (targets.TARGETS; from_config, half and float are common's)


def from_pretrained(wrapped, instance, args, kwargs):
    return common.from_pretrained(wrapped, instance, args, kwargs, _fallback_reason, _accelerated)


def _accelerated(wrapped, instance, args, kwargs):
    return common.accelerated_load(DiffusersLoad(instance.__name__), wrapped, args, kwargs, _modeling_utils())


def no_init_parameters(wrapped, instance, args, kwargs):
    """The same lazy window, scoped to the building thread and under the construction lock (mindone's flips a
    class flag for every thread), timed inside a load."""
    if args or kwargs:
        return _locked(wrapped(*args, **kwargs))
    load = DiffusersLoad.accelerating()
    return lazy_construction() if load is None else load.construction()


def to(wrapped, instance, args, kwargs):
    dtype = argument(wrapped, args, kwargs, "dtype")
    if not isinstance(dtype, ms.Type) or len(args) + len(kwargs) != 1 or fingerprints.changed("diffusers.to"):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, dtype)
    return instance


def load_state_dict(wrapped, instance, args, kwargs):
    """A safetensors file read by the fast reader: plain tensors inside a load, else Parameters named by key,
    as mindone returns them. Anything else, or a file the reader refuses, is mindone's."""
    checkpoint_file = argument(wrapped, args, kwargs, "checkpoint_file")
    dduf_entries = argument(wrapped, args, kwargs, "dduf_entries")
    modelled = len(args) <= 3 and not set(kwargs) - {"checkpoint_file", "dduf_entries", "disable_mmap"}
    safetensors = isinstance(checkpoint_file, (str, os.PathLike)) and os.fspath(checkpoint_file).endswith(
        ".safetensors"
    )
    if not modelled or dduf_entries or not safetensors or fingerprints.changed("diffusers.load_state_dict"):
        return wrapped(*args, **kwargs)
    load = DiffusersLoad.accelerating()
    # Parameters over the read tensors, each in a buffer of its own: what the model does not keep is freed
    call = BuildThenFillCall.current()
    adopting = load is None and call is not None and call.adopts_checkpoint()
    try:
        read = load.read(checkpoint_file) if load else read_file(checkpoint_file, separate=adopting)
        arrays, _metadata, cast_at_read = read
    except CheckpointError as refused:
        logger.debug("ms_loadpatch: %s left to mindone: %s", checkpoint_file, refused)
        # mindone's error, with the file, tensor and reason its message lacks (git-lfs: even the file)
        with file_named_in_errors(checkpoint_file, reason=refused):
            return wrapped(*args, **kwargs)
    if load is None:
        make = adopted_parameter if adopting else ms.Parameter
        return {name: make(array, name=name) for name, array in arrays.items()}
    return load.tensors_of(arrays, cast_at_read)


# -- internals of mindone's loading path (targets.TARGETS, diffusers "internal" rows)


class ParallelLoadingFlag(wrapt.ObjectProxy):
    """HF_ENABLE_PARALLEL_LOADING as mindone read it at import (it raises when true): False inside a load,
    which reads the environment at call time itself."""

    def __bool__(self):
        return DiffusersLoad.current() is None and bool(self.__wrapped__)


@contextlib.contextmanager
def _locked(manager):
    with CONSTRUCTION_LOCK, manager:
        yield
