"""Hooks the loading strategy into mindone.transformers: its from_pretrained
stays the driver, and inside a TransformersLoad the costly pieces it calls
are the strategy's. Outside one, each wrapper calls straight through."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import mindspore as ms
import wrapt

from .. import fingerprints
from ..calls import argument, handles
from ..strategy import building, cellpasses
from ..strategy.assign import assign, cast_parameters, cell_to_keeping_lazy, check_and_pair
from ..strategy.building import draws, init_pass, window
from ..strategy.building.construction import initialize_unloaded, refresh_parameter_names, state_index
from ..strategy.keys import prefixed_keys
from ..strategy.prefetch import read_file
from ..strategy.safetensors_header import exception_naming_file, file_named_in_errors, safe_open_error_naming_file
from ..strategy.tensors import to_tensor
from . import common

logger = logging.getLogger("ms_loadpatch")
_MODULE = "mindone.transformers.modeling_utils"
_LOADING_PATH = ("_load_pretrained_model", "init_weights")  # overridden in a subclass: it took over the load
_SAFE_METADATA_FORMATS = ("pt", "tf", "flax", "np")


def _modeling_utils():
    return sys.modules[_MODULE]


class TransformersLoad(common.LibraryLoad):
    """An accelerated from_pretrained; per model, by id: state_dict keys, _get_pt2ms_mappings, state_index."""

    library = "transformers"
    technique = "lazy construction, set_data from owned read buffer, set_dtype cast"

    def __init__(self, model_class):
        super().__init__(model_class)
        self.model_keys: dict[int, set] = {}
        self.pt2ms_mappings: dict[int, dict] = {}
        self.assign_index: dict[int, dict] = {}
        self.window = contextlib.ExitStack()  # the construction window, closed by close_construction
        self.construction_root = None  # the outermost model built, once its build began
        self.constructing = False
        self.ledger = None  # its lazy parameters' random draws (building.draws.Ledger), where taken

    @staticmethod
    def requested_dtype(kwargs):
        # mindone's own precedence: `dtype`, then the deprecated `mindspore_dtype`
        return kwargs.get("dtype") if kwargs.get("dtype") is not None else kwargs.get("mindspore_dtype")

    @staticmethod
    def candidates(root, subfolder, named):
        """The files mindone's _get_resolved_checkpoint_files looks for, in its order."""
        return [os.path.join(root, subfolder, named(n)) for n in ("model.safetensors", "model.safetensors.index.json")]

    @staticmethod
    def progress_bars() -> bool:
        from transformers.utils import logging as hf_logging  # mindone's shard bar follows transformers' switch

        return hf_logging.is_progress_bar_enabled()

    def open_construction(self, root, ledger=None) -> None:
        """The construction window for `root`, the outermost model, open until close_construction; its lazy
        parameters take their draws in `ledger` (draws.Ledger, kept until the load ends), if given."""
        if ledger is not None:
            self.ledger = ledger
            self.cleanup.enter_context(draws.giving_back(ledger))
        self.construction_root = root
        self.window.enter_context(self.construction(ledger))
        self.constructing = True

    def run_init_pass(self, run) -> None:
        """`run(ledger, counts)`, an init pass over the lazily built model, with parameters filled on touch
        (init_pass.filling_on_touch), counted in the report."""
        report = self.report
        with report.phase("init-pass"), init_pass.filling_on_touch(self.ledger) as counts:
            run(self.ledger, counts)
        report.filled_in_init_pass += counts.filled
        report.writes_deferred += counts.deferred
        report.init_calls_replayed += counts.replayed

    def fill_missing(self, model) -> None:
        """What the checkpoint lacked initialised as the unpatched load leaves it; the load done."""
        report = self.report
        with report.phase("init-missing"):
            report.missing_initialised = initialize_unloaded(model, self.ledger)
        if self.ledger is not None:
            report.draws_taken, report.initializers_run_in_full = self.ledger.draws, self.ledger.run_in_full
        self.done = True

    def close_construction(self) -> None:
        if self.constructing:
            self.constructing = False
            self.window.close()  # the window's figures were noted before its lock was released

    def assign(self, index, state_dict, model_class: str) -> None:
        """`state_dict` into the parameters `index` (construction.state_index) lists, checked first (shapes,
        names) with the file read last named in errors."""
        try:
            pairs = check_and_pair(index, state_dict, model_class)
        except RuntimeError as exc:
            if self.last_file is None:
                raise
            raise RuntimeError(f"{exc}\n\t(checkpoint file: {self.last_file})") from None
        try:
            with file_named_in_errors(self.last_file):
                assign(pairs, self.report, self.cast_at_read)
        finally:
            self.cast_at_read.clear()  # tensors the library dropped (unexpected keys) are freed

    # -- calls of mindone's loading path this load handles (targets.TARGETS rows naming its methods;
    # calls.on_load looks the load up and checks the call form each declares)

    @handles()
    def on_model_init(self, call):
        """PreTrainedModel.__init__: the outermost model opens the lazy window; its draws are the plain build's."""
        if self.construction_root is None:
            self.open_construction(call.instance, ledger=draws.Ledger())
        return call()

    @handles(accepts=lambda load, call: call.count == 0, fingerprint="transformers.tie_weights")
    def on_tie_weights(self, call):
        """PreTrainedModel.tie_weights: the same walk and calls, its per-cell `hasattr` answered by cellpasses."""
        if not cellpasses.active():
            return call()
        base = _modeling_utils().PreTrainedModel
        for _, module in call.instance.cells_and_names():
            if isinstance(module, base):
                module.tie_embeddings_and_encoder_decoder()
            if cellpasses.has_attribute(module, "_tie_weights"):
                module._tie_weights()

    @handles(accepts=lambda load, call: call.count == 1)
    def on_cell_to(self, call):
        """nn.Cell.to on the lazily built model: its result without reading (and crashing on) lazy parameters."""
        dtype = call.args[0] if call.args else call.kwargs.get("dtype")  # Cell.to(*args, **kwargs): its to(dtype)
        # other dtypes: Cell.to raises (or warns, for complex) before reading anything
        if dtype not in ms.common.dtype.float_type or not any(p.has_init for p in call.instance.get_parameters()):
            return call()
        return cell_to_keeping_lazy(call.instance, dtype)

    @handles(
        accepts=lambda load, call: (
            call.count <= 1 and not set(call.kwargs) - {"mode"} and type(call.argument("mode", True)) is bool
        )
    )
    def on_cell_set_train(self, call):
        """nn.Cell.set_train on the loaded model: cellpasses.set_train, the same flags on the same cells."""
        if not cellpasses.active():
            return call()
        cellpasses.set_train(call.instance, call.argument("mode", True))
        return call.instance

    @handles()
    def on_load_pretrained_model(self, call):
        self.close_construction()  # a model whose __init__ never reached post_init
        files = call.argument("resolved_archive_file")
        result = call()
        sharded_metadata = call.argument("sharded_metadata")
        if sharded_metadata and isinstance(files, list):  # mindone leaves a weight no shard holds random
            listed = sharded_metadata.get("all_checkpoint_keys", ())
            self.check_index_against_shards(files, listed, lambda: sharded_metadata.get("weight_map") or {})
        self.fill_missing(result[0])
        return result

    @handles(accepts=lambda load, call: call.count == 1)
    def on_get_pt2ms_mappings(self, call):
        """_get_pt2ms_mappings(model), walked once per model: _load_pretrained_model and the key conversion
        both ask, read it only, and nothing between them changes the cell names and classes it reads."""
        model = call.argument("m")
        if id(model) not in self.pt2ms_mappings:
            self.pt2ms_mappings[id(model)] = call()
        return self.pt2ms_mappings[id(model)]

    @handles()
    def on_convert_state_dict(self, call):
        """mindone's _convert_state_dict with the per-model walks done once per load, not once per shard."""
        model = call.argument("m")
        state_dict_pt = call.argument("state_dict_pt")
        if not state_dict_pt:
            return state_dict_pt
        with self.report.phase("convert-keys"):
            mappings = _modeling_utils()._get_pt2ms_mappings(model)  # walked once per model (on_get_pt2ms_mappings)
            keys = self.model_keys.get(id(model))  # from the key check's walk
            if keys is None:
                keys = self.model_keys[id(model)] = set(model.state_dict().keys())
            return prefixed_keys(state_dict_pt, mappings, keys, call.argument("prefix", ""), self.mapped_as_unpatched)

    @handles()
    def on_load_state_dict_into_model(self, call):
        model = call.argument("model_to_load")
        with self.report.phase("assign"):
            if id(model) not in self.assign_index:
                self.assign_index[id(model)] = state_index(model)
            self.assign(self.assign_index[id(model)], call.argument("state_dict"), type(model).__name__)
            if len(call.argument("start_prefix", "")) > 0:
                for name, param in model.parameters_and_names():
                    param.name = name
        return []

    @handles(accepts=lambda load, call: call.argument("model") is not None)
    def on_find_missing_and_unexpected_keys(self, call):
        """mindone's key check, unchanged; the state_dict keys it builds are kept for on_convert_state_dict."""
        return call.with_argument("model", _KeepsStateKeys(call.argument("model"), self.model_keys))()

    def finish(self, result) -> None:
        """A lazily built model must have been loaded."""
        if not self.done:
            model = result[0] if isinstance(result, tuple) else result
            raise RuntimeError(
                f"ms_loadpatch: {type(model).__name__} was built lazily but mindone's loading path did not run; "
                "refusing to return a model with uninitialised weights"
            )


def _fallback_reason(cls, kwargs) -> str | None:
    if kwargs.get("from_tf") or kwargs.get("from_flax"):
        return "TF / Flax checkpoints"
    if kwargs.get("state_dict") is not None:
        return "a state_dict passed by the caller (its tensors must not be aliased)"
    base = _modeling_utils().PreTrainedModel
    return common.overridden_method(cls, base, _LOADING_PATH) or fingerprints.library_problem("transformers")


# -- entry points (targets.TARGETS; from_config, half and float are common's)


def from_pretrained(wrapped, instance, args, kwargs):
    return common.from_pretrained(wrapped, instance, args, kwargs, _fallback_reason, _accelerated)


def _accelerated(wrapped, instance, args, kwargs):
    cellpasses.active()  # its probe, once per process, before the build's window opens
    try:
        return common.accelerated_load(TransformersLoad(instance.__name__), wrapped, args, kwargs, _modeling_utils())
    except Exception as exc:
        # mindone checks a single file with safe_open and its metadata, in errors that do not name it
        code = getattr(getattr(wrapped, "__func__", wrapped), "__code__", None)  # never raise over `exc`
        path = common.traceback_local(exc, "resolved_archive_file", code) if code is not None else None
        better = safe_open_error_naming_file(exc, path) if path is not None else None
        if better is None and path is not None and isinstance(exc, ValueError) and "safetensors file" in str(exc):
            better = exception_naming_file(exc, path)  # "Incompatible safetensors file..."
        if better is None:
            raise
        raise better from exc


def to(wrapped, instance, args, kwargs):
    dtype = argument(wrapped, args, kwargs, "dtype")
    if dtype is None or len(args) > 1 or set(kwargs) - {"dtype"} or fingerprints.changed("transformers.to"):
        return wrapped(*args, **kwargs)
    cast_parameters(instance, dtype)
    return instance


def load_state_dict(wrapped, instance, args, kwargs):
    checkpoint_file = argument(wrapped, args, kwargs, "checkpoint_file")
    if fingerprints.changed("transformers.load_state_dict"):
        return wrapped(*args, **kwargs)
    if len(args) + len(kwargs) != 1 or not os.fspath(checkpoint_file).endswith(".safetensors"):
        logger.debug("ms_loadpatch: %s is not safetensors: left to mindone's load_state_dict", checkpoint_file)
        return wrapped(*args, **kwargs)
    load = TransformersLoad.current()
    arrays, metadata, cast_at_read = load.read(checkpoint_file) if load else read_file(checkpoint_file)
    if metadata is not None and metadata.get("format") not in _SAFE_METADATA_FORMATS:
        raise OSError(
            f"The safetensors archive passed at {checkpoint_file} does not contain the valid metadata. Make sure "
            "you save your model with the `save_pretrained` method."
        )
    if load is None:  # a direct call: mindone returns Parameters
        return {name: ms.Parameter(to_tensor(array), name=name) for name, array in arrays.items()}
    return load.tensors_of(arrays, cast_at_read)


# -- internals of mindone's loading path with work outside a load too (targets.TARGETS, "internal" rows)


def init_weights(wrapped, instance, args, kwargs):
    """post_init's init pass over a lazily built model: the same calls in the same order, parameters kept lazy
    where they only get a new initializer; its tie_weights skipped (from_pretrained ties later)."""
    load, enabled = TransformersLoad.current(), _modeling_utils()._init_weights
    if load is None or not load.constructing:
        if enabled or not window.in_builder() or fingerprints.changed("transformers.init_weights"):
            return wrapped(*args, **kwargs)
        refresh_parameter_names(instance)  # a lazy build with mindone's init pass off: what init_weights does then
        return None
    if enabled:
        load.run_init_pass(lambda ledger, counts: _init_pass(instance, ledger, counts))
    refresh_parameter_names(instance)
    if instance is load.construction_root:
        load.close_construction()
    return None


def _init_pass(owner, ledger, counts):
    """owner.apply(owner._initialize_weights): mindone's own (its flag's `hasattr` answered by cellpasses, calls
    on copied cells replayed), or a model's override as it is."""
    if type(owner)._initialize_weights is not _modeling_utils().PreTrainedModel._initialize_weights:
        init_pass.run(owner, owner._initialize_weights)
        return
    if cellpasses.active():
        flags = {"flag": cellpasses.PlainFlag("_is_hf_initialized")}
    else:
        flags = {
            "is_done": lambda cell: getattr(cell, "_is_hf_initialized", False),
            "mark_done": lambda cell: setattr(cell, "_is_hf_initialized", True),
        }
    recipes = building.copied_from_by_id()
    init_pass.run(
        owner, owner._init_weights, **flags, ledger=ledger, recipe_by_id=recipes, counts=counts, owe_draws=True
    )


class _KeepsStateKeys(wrapt.ObjectProxy):
    """The model, whose argument-less state_dict() also records its key set in `model_keys` (by id)."""

    def __init__(self, model, model_keys: dict):
        super().__init__(model)
        self._self_model_keys = model_keys

    def state_dict(self, *args, **kwargs):
        result = self.__wrapped__.state_dict(*args, **kwargs)
        if not args and not kwargs:
            self._self_model_keys[id(self.__wrapped__)] = set(result)
        return result


class GcWithoutPerShardCollect(wrapt.ObjectProxy):
    """modeling_utils' gc module, whose per-shard collect() is skipped inside a load (shard dicts hold no cycles)."""

    def collect(self, *args, **kwargs):
        if TransformersLoad.current() is not None:
            return 0
        return self.__wrapped__.collect(*args, **kwargs)
