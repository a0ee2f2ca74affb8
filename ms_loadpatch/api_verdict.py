"""What the installed mindspore allows, per library and per target: the
API probes' verdict (`api_verdict()`, once per process, after mindspore is
imported) and each patch target's unmet requirement (`unmet_requirement`,
read by core when it applies the targets). versions.py decides which
versions are supported; this module, what a supported one can do.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from . import versions
from .strategy.probe_cache import ProbeCache

logger = logging.getLogger("ms_loadpatch")


@dataclasses.dataclass(frozen=True)
class Unmet:
    """Why a target is not patched; `needed` False: this mindspore lacks the
    feature the target exists for, so mindone's own code is already right."""

    reason: str
    needed: bool = True
    blocker: str = "mindspore"  # what blocks it: VERSION (a distribution's version) or this mindspore's API


VERSION = "version"


def unmet_requirement(requires: dict[str, str], library: str | None = None, feature: str | None = None) -> Unmet | None:
    """Why a target is skipped (the first requirement it does not meet), or
    None when it may be patched.

    Every `distribution -> specifier` in `requires` must hold, and, once
    mindspore is imported (always the case when a mindone module is, which is
    when targets are applied), it must have every feature `library`'s
    techniques use: a mindspore that lacks one gets mindone's own loading path
    for that library, not a guess. A target tied to a `feature` of mindspore
    is not needed (`Unmet.needed` False) where that mindspore does not have it."""
    for distribution, specifier in requires.items():
        version = versions.installed_version(distribution)
        if version is None:
            return Unmet(f"{distribution} is not installed")
        if not versions.meets(distribution, version, specifier):
            return Unmet(f"needs {distribution}{specifier}, found {version}", blocker=VERSION)
    if "mindspore" in sys.modules:
        chosen = api_verdict()
        if library is not None and chosen.refusal_for(library):
            return Unmet(chosen.refusal_for(library))
        if feature is not None and not chosen.features.get(feature):
            return Unmet(FEATURES[feature], needed=False)
    return None


# Optional mindspore features a target exists for: name -> what lacking it means.
FEATURES = {
    "cell_to": "this mindspore's nn.Cell has no `to`; models resolve mindone's ModuleUtilsMixin.to",
}


#
# The strategy uses exactly these mindspore features. The matrix found all of
# them, with the same behaviour, on 2.7.0, 2.7.1, 2.7.2, 2.8.0, 2.9.0 and
# 2.10.0, so every supported version gets the same technique. Observed
# differences that the strategy deliberately does not depend on:
#   - `Tensor.to(device=...)` is missing on 2.7.0 (and slow per call everywhere);
#   - `Parameter.data` is settable only from 2.8 (and, like `Parameter._data`
#     swaps, leaves a lazy parameter lazy: its initializer would win);
#   - 2.9+ docstrings announce the deprecation of `no_init_parameters`; it
#     still works on 2.10 (no runtime warning). When a release drops it, the
#     API probe (api_probes.py) reports it and targets are skipped, not half-applied.
# 2.10 adds `nn.Cell.to`, which mindone.transformers models resolve before
# mindone's ModuleUtilsMixin.to (PreTrainedModel lists nn.Cell first) and
# which segfaults on a lazily built parameter: the transformers glue wraps it
# too (targets.py, feature "cell_to"), checked by api_probes._probe_cell_to.
# The diffusers glue casts a checkpoint straight to the final dtype where
# mindone's two steps through the construction dtype give the same values
# (strategy/assign.py EXACT_WIDENING): for fp16 <-> bf16 checked exhaustively
# (all 65536 values) on 2.7.1 CPU. Keep-in-fp32 module lists
# are empty in mindone 0.5.0's diffusers models; the glue honours them anyway.
# Fast construction (strategy/building/) reproduces nn.Cell.__init__ and
# nn.Cell.update_parameters_name from the global names they refer to on
# 2.7.0 - 2.10.0 (cell-init-template's and flat-name-walk's KNOWN_NAMES); a
# mindspore referring to another name fails that technique's probe.


@dataclasses.dataclass(frozen=True)
class ApiVerdict:
    """What the API probes found on the imported mindspore: the techniques
    every load uses, what skips the fast path everywhere, per library or per
    technique (verdict.Problem), and the optional features present."""

    mindspore: str
    # How a checkpoint tensor becomes a parameter's storage: `Parameter.set_data`
    # (aliases the tensor and clears a lazy parameter's initializer).
    assign: str
    # Tensor-level cast: `Tensor.set_dtype`, mindone's own cast, cheapest per call.
    cast: str
    # Lazy construction: the flag `no_init_parameters` sets (Parameter.init_param),
    # scoped to the building thread (strategy/building/construction.py).
    construct: str
    # Checkpoint arrays to tensors without a copy: `Tensor.from_numpy`, with
    # bf16 read as `mindspore.common.np_dtype.bfloat16`.
    to_tensor: str
    # verdict.Problem: why this mindspore cannot take the fast path at all (empty when it can).
    problems: tuple = ()
    # verdict.Problem: a technique that cannot be used on this mindspore, and the libraries it gates
    # (none for adopted-parameters and lazy-assign: the calls that build then fill copy instead).
    library_problems: tuple = ()
    # optional mindspore features (FEATURES) present in this mindspore
    features: dict = dataclasses.field(default_factory=dict)

    def problem_of(self, technique: str) -> str | None:
        """Why `technique` (api_probes' names) cannot be used here, or None."""
        return "; ".join(p.reason for p in self.library_problems if p.technique == technique) or None

    @property
    def draws_problem(self) -> str | None:
        """Why lazy parameters cannot take their random draws when made, or None."""
        from .api_probes import RANDOM_DRAWS

        return self.problem_of(RANDOM_DRAWS)

    @property
    def adopts(self) -> bool:
        """Whether a checkpoint array may become a Parameter over its own buffer here."""
        from .api_probes import ADOPTED_PARAMETERS

        return not self.problems and self.problem_of(ADOPTED_PARAMETERS) is None

    @property
    def assigns_lazily(self) -> bool:
        """Whether a copy into a lazy parameter (assign_value) may skip its fill here."""
        from .api_probes import LAZY_ASSIGN

        return not self.problems and self.problem_of(LAZY_ASSIGN) is None

    @property
    def refusal(self) -> str | None:
        if not self.problems:
            return None
        return f"mindspore {self.mindspore} cannot take the fast path: {'; '.join(p.reason for p in self.problems)}"

    def rows(self) -> list:
        """The techniques with their probe results, for status() (strategy.verdict.TechniqueRow)."""
        from .api_probes import ADOPTED_PARAMETERS, CELL_TO, LAZY_ASSIGN, RANDOM_DRAWS
        from .strategy.verdict import ACTIVE, SKIPPED, TechniqueRow

        everywhere = "; ".join(p.reason for p in self.problems)

        def row(name, description, own=None, libraries=versions.LIBRARIES):
            reason = own or everywhere
            return TechniqueRow(name, description, SKIPPED if reason else ACTIVE, reason, libraries)

        rows = [
            row("lazy-construction", self.construct),
            row("to-tensor", self.to_tensor),
            row("assign", self.assign),
            row("cast", self.cast),
            row(
                RANDOM_DRAWS,
                "a lazily built parameter takes, when made, the numpy draws of the initializer "
                "the unpatched build runs; one the checkpoint lacks is filled with them "
                "(probed against plain builds)",
                self.draws_problem,
            ),
            row(
                ADOPTED_PARAMETERS,
                "a single-file checkpoint read inside from_single_file becomes Parameters over "
                "the read buffer, not copies (probed against Parameter(array))",
                self.problem_of(ADOPTED_PARAMETERS),
                ("diffusers",),
            ),
            row(
                LAZY_ASSIGN,
                "inside a call that builds then fills, assign_value into a lazy parameter "
                "(Cell.load_state_dict) takes a copy without the random fill it overwrites "
                "(probed against assign_value on a plain parameter; else filled, then assigned)",
                self.problem_of(LAZY_ASSIGN),
            ),
        ]
        if self.features.get("cell_to"):
            rows.append(
                row(
                    CELL_TO,
                    "nn.Cell.to inside an accelerated load leaves lazy parameters unread (probed against nn.Cell.to)",
                    self.problem_of(CELL_TO),
                    ("transformers",),
                )
            )
        return rows

    def refusal_for(self, library: str) -> str | None:
        """Why `library`'s targets are skipped on this mindspore, or None."""
        reasons = tuple(p.reason for p in self.problems + self.library_problems if library in p.libraries)
        if not reasons:
            return None
        return f"mindspore {self.mindspore} cannot take the mindone.{library} fast path: {'; '.join(reasons)}"


def api_verdict() -> ApiVerdict:
    """The API probes' verdict on the imported mindspore (one per process)."""
    return _verdicts.get("api", _probe, exclusive=False)  # asked from import hooks


_verdicts = ProbeCache()


def _probe() -> ApiVerdict:
    import mindspore as ms

    from . import api_probes
    from .strategy import randomstate

    with randomstate.kept():  # the probes fill parameters from random initializers
        problems, library_problems, features = api_probes.probe(ms)
    result = ApiVerdict(
        mindspore=str(getattr(ms, "__version__", versions.installed_version("mindspore"))),
        assign="Parameter.set_data (transformers: then its lazy initializer dropped, as Parameter.init_data does)",
        cast="Tensor.set_dtype",
        construct="Parameter.init_param scoped to the building thread (no_init_parameters' flag)",
        to_tensor="Tensor.from_numpy (bf16 via np_dtype.bfloat16)",
        problems=problems,
        library_problems=library_problems,
        features=features,
    )
    if result.refusal:
        logger.warning("ms_loadpatch: targets are skipped: %s", result.refusal)
    else:
        for library in versions.LIBRARIES:
            if result.refusal_for(library):
                logger.warning("ms_loadpatch: mindone.%s targets are skipped: %s", library, result.refusal_for(library))
    return result
