"""mindone's calls that build a model (or layers into one) with every initializer run, then fill it (targets.py):
each runs as it is, inside a lazy build whose parameters take their draws when made; what stays lazy is filled
as the plain build fills it (docs/architecture.md, "Calls that build then fill")."""

from __future__ import annotations

import logging

from mindspore import nn

from .. import core
from ..api_verdict import api_verdict
from ..strategy import reports
from ..strategy.building.construction import built_with_draws
from ..strategy.building.lazy import CONSTRUCTION_LOCK
from ..strategy.lane import entered, lane

logger = logging.getLogger("ms_loadpatch")

_TECHNIQUE = "lazy construction with each parameter's draws taken when made, then mindone's own copies"


class BuildThenFillCall:
    """What calls inside these see: `building`, the outermost call building a model (a nested one fills into
    its build), and whether a pipeline's from_single_file runs around them."""

    def __init__(self, building: str | None, pipeline_file: bool):
        self.building = building
        self.pipeline_file = pipeline_file

    @staticmethod
    def current() -> BuildThenFillCall | None:
        return lane.build_then_fill

    def adopts_checkpoint(self) -> bool:
        """Whether a checkpoint read now may become Parameters over the read tensors (tensors.adopted_parameter,
        probed): inside a model's or a pipeline's from_single_file, whose set_data copies alias them."""
        inside = self.building == "from_single_file" or self.pipeline_file
        return inside and api_verdict().adopts


def adopting_pipeline_file(wrapped, instance, args, kwargs):
    """A pipeline's from_single_file: the call as it is, its file read for adoption."""
    outer = lane.build_then_fill
    with entered("build_then_fill", BuildThenFillCall(outer.building if outer else None, True)):
        return wrapped(*args, **kwargs)


def _source_parameters(args, kwargs, into=None) -> set:
    """ids of parameters this build does not make: the source models', and those of the model built into."""
    cells = [value for value in (*args, *kwargs.values()) if isinstance(value, nn.Cell)]
    return {id(p) for cell in (*cells, *([into] if into is not None else [])) for p in cell.get_parameters()}


def built_then_filled(wrapped, instance, args, kwargs):
    """A call that builds a model and fills it: the call as it is, on a lazy build with its draws."""
    return _accelerated(wrapped, getattr(instance, "__name__", wrapped.__name__), args, kwargs)


def built_into_model(wrapped, instance, args, kwargs):
    """A model's method that builds layers into it and fills them (IP adapters, LoRA)."""
    return _accelerated(wrapped, type(instance).__name__, args, kwargs, into=instance)


def _accelerated(wrapped, model_class, args, kwargs, into=None):
    def call():
        return wrapped(*args, **kwargs)

    outer = lane.build_then_fill
    if outer is not None and outer.building:  # called by another such call: filled before the outer copies them
        foreign, fast_assign = _source_parameters(args, kwargs, into), api_verdict().assigns_lazily
        return built_with_draws(call, foreign=foreign, fast_assign=fast_assign, into=into)[0]
    with core.accelerated_load() as allowed:
        reason = "ms_loadpatch is being disabled" if not allowed else api_verdict().draws_problem
        if reason is not None:
            logger.debug("ms_loadpatch: %s.%s unpatched: %s", model_class, wrapped.__name__, reason)
            with CONSTRUCTION_LOCK:
                return call()
        report = reports.LoadReport(model_class, wrapped.__module__.split(".")[1])
        report.technique = f"{wrapped.__name__}: {_TECHNIQUE}"
        foreign, fast_assign = _source_parameters(args, kwargs, into), api_verdict().assigns_lazily
        with entered("build_then_fill", BuildThenFillCall(wrapped.__name__, outer.pipeline_file if outer else False)):
            with report.phase("build and fill"):
                result, report.missing_initialised = built_with_draws(
                    call, when_built=report.note_construction, foreign=foreign, fast_assign=fast_assign, into=into
                )
        report.total = report.phases["build and fill"]
        reports.emit(report)
        return result
