"""mindone's calls that build a model (or layers of one) with every
initializer run and then fill it (targets.py lists them):
- from another model: the ControlNets' `from_unet` / `from_transformer`,
  `UNetMotionModel.from_unet2d`;
- from one checkpoint file: `FromOriginalModelMixin.from_single_file` for
  every model class it serves, and the CLIP / T5 text encoders a pipeline's
  from_single_file builds;
- into a loaded model: IP adapters, LoRA (`load_lora_adapter`,
  `load_adapter`), and `PeftModel.from_pretrained`.

Each builds with `cls(...)` or `cls.from_config(...)`, then copies weights
with `ms.load_param_into_net` (the copies alias the source's tensors, or the
checkpoint's Parameters) or `Cell.load_state_dict`, and zeroes some blocks
with `set_data(initializer("zeros", ...))`. Accelerated, the call runs as it
is inside a lazy build whose parameters take their random draws when made
(construction.built_with_draws): copies, casts (`set_dtype`) and zeros land
on lazy parameters, and only what stays lazy is filled, as the plain build
fills it (in its creation dtype, then cast, as mindspore's init_data does).
The same model, aliasing and global random state; no random fill of what is
overwritten.
"""

from __future__ import annotations

import logging
import threading

from mindspore import nn

from .. import core
from ..api_verdict import api_verdict
from ..strategy import context
from ..strategy.building.construction import built_with_draws
from ..strategy.building.lazy import CONSTRUCTION_LOCK

logger = logging.getLogger("ms_loadpatch")

_TECHNIQUE = "lazy construction with each parameter's draws taken when made, then mindone's own copies"
_inside = threading.local()


def adopting_checkpoint() -> bool:
    """Whether a checkpoint read in this thread now may become Parameters over
    the read tensors (strategy.tensors.adopted_parameter): inside an
    accelerated from_single_file of a model, or a pipeline's from_single_file
    (which reads the file once for every component), on a mindspore where
    the adoption probe passed. mindone copies each into the model's
    parameters by set_data, which aliases it: the read tensor is the model's."""
    inside = getattr(_inside, "call", None) == "from_single_file" or getattr(_inside, "pipeline_file", False)
    return inside and api_verdict().adoption_problem is None


def adopting_pipeline_file(wrapped, instance, args, kwargs):
    """The wrapper of a pipeline's from_single_file: the call as it is, its
    file read for adoption (adopting_checkpoint); each component's own
    from_single_file is accelerated by built_then_filled."""
    outer, _inside.pipeline_file = getattr(_inside, "pipeline_file", False), True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _inside.pipeline_file = outer


def _source_parameters(args, kwargs, into=None) -> set:
    """ids of parameters this build does not make: the source models' own
    (a cell the call shares into its model), and those the model built into
    has before the call."""
    cells = [value for value in (*args, *kwargs.values()) if isinstance(value, nn.Cell)]
    return {id(p) for cell in (*cells, *([into] if into is not None else [])) for p in cell.get_parameters()}


def _fast_assign() -> bool:
    return api_verdict().lazy_assign_problem is None


def built_then_filled(wrapped, instance, args, kwargs):
    """The wrapper of every call that builds a model and fills it (targets.py): the call as it is, on a lazy build
    with its draws."""
    return _accelerated(wrapped, getattr(instance, "__name__", wrapped.__name__), args, kwargs)


def built_into_model(wrapped, instance, args, kwargs):
    """The wrapper of a model's method that builds layers into it and fills them (IP adapters, LoRA)."""
    return _accelerated(wrapped, type(instance).__name__, args, kwargs, into=instance)


def _accelerated(wrapped, model_class, args, kwargs, into=None):
    def call():
        return wrapped(*args, **kwargs)

    if getattr(_inside, "call", None):  # called by another such call: its layers filled before the outer copies them
        return built_with_draws(
            call, foreign=_source_parameters(args, kwargs, into), fast_assign=_fast_assign(), into=into
        )[0]
    with core.accelerated_load() as allowed:
        reason = "ms_loadpatch is being disabled" if not allowed else api_verdict().draws_problem
        if reason is not None:
            logger.debug("ms_loadpatch: %s.%s unpatched: %s", model_class, wrapped.__name__, reason)
            with CONSTRUCTION_LOCK:
                return call()
        report = context.LoadReport(model_class, wrapped.__module__.split(".")[1])
        report.technique = f"{wrapped.__name__}: {_TECHNIQUE}"
        foreign = _source_parameters(args, kwargs, into)
        _inside.call = wrapped.__name__
        try:
            with report.phase("build and fill"):
                result, report.missing_initialised = built_with_draws(
                    call, when_built=report.note_construction, foreign=foreign, fast_assign=_fast_assign(), into=into
                )
        finally:
            _inside.call = None
        report.total = report.phases["build and fill"]
        context.emit(report)
        return result
