"""The one place that knows versions: supported ranges, the versions the
matrix runs, and the technique each installed mindspore gets (from the
probes of api_probes.py).

Versions are read from package metadata, so the gate never imports
mindspore or mindone itself; the probes run only once mindspore is
imported (when a target module is, since mindone imports mindspore).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger("ms_loadpatch")

# What the gate accepts: what the version matrix (.ci/matrix) passed.
# README "Supported versions" lists what each version gets.
SUPPORTED: dict[str, SpecifierSet] = {
    "mindspore": SpecifierSet(">=2.7.0,<2.11"),
    "mindone": SpecifierSet(">=0.5.0,<0.6"),
}

# The versions `.ci/matrix` runs by default (it reads this literal), each
# mindspore with the one mindone. Post and local releases inside a supported
# minor (2.7.1.post1, 2.7.1+cpu) pass the gate like their release.
TESTED: dict[str, tuple[str, ...]] = {
    "mindspore": ("2.7.0", "2.7.1", "2.7.1.post1", "2.7.2", "2.8.0", "2.9.0", "2.10.0"),
    "mindone": ("0.5.0",),
}

# The Pythons the tests run on (pyproject's requires-python: >=3.9,<3.13;
# mindspore publishes no wheel for 3.13). The README test command runs the
# whole suite on the CI machine's python3 (3.11); `.ci/matrix` (it reads
# these literals, without importing anything) runs each mindspore in TESTED
# on MATRIX_PYTHONS' Python, MATRIX_DEFAULT_PYTHON for the others.
SUPPORTED_PYTHON = SpecifierSet(">=3.9,<3.13")
TESTED_PYTHONS: tuple[str, ...] = ("3.9", "3.10", "3.11", "3.12")
MATRIX_DEFAULT_PYTHON: str = "3.11"
MATRIX_PYTHONS: dict[str, str] = {
    "2.7.0": "3.9",  # the oldest pair: the lowest mindspore on the lowest Python (2.7.0-2.9.0 have 3.9 wheels)
    "2.9.0": "3.10",  # every admitted Python runs somewhere
    "2.10.0": "3.12",  # the newest pair (3.12 wheels from 2.7.2); 2.10.0 on 3.11 is the README suite's
}
# The cell whose every other dependency is pinned to its declared floor
# (pyproject `name>=X` -> `name==X`): the oldest mindspore, on the oldest Python.
FLOORS_CELL: str = "2.7.0"
# Test files whose matrix tests depend on mindone's version rather than
# mindspore's (the lazy packages are mindone's): in the matrix they run on the
# oldest and the newest mindspore only (FLOORS_CELL and the last of TESTED);
# the README test command runs them whole on the suite's mindspore.
MATRIX_EDGE_ONLY: tuple[str, ...] = ("tests/test_lazy_import.py",)
# Floors that cell raises, because mindspore's or mindone's own requirements
# ask for more (the declared floor is what this package's code needs):
# name -> (version installed instead, why).
FLOORS_RAISED: dict[str, tuple[str, str]] = {
    "safetensors": ("0.4.3", "transformers 4.57.1, pinned by mindone 0.5.0, requires safetensors>=0.4.3"),
}

# Policy for versions outside SUPPORTED (older, or newer than anything the
# matrix ran): refused, nothing patched. Setting this variable to an on value
# accepts them at the user's own risk; every probe still runs, so a mindspore
# lacking what a technique needs still gets mindone's own path for it.
ALLOW_UNTESTED_ENV_VAR = "MS_LOADPATCH_ALLOW_UNTESTED"

LIBRARIES = ("transformers", "diffusers")


def installed_version(distribution: str) -> Version | None:
    """The installed version of `distribution`, or None if it is not installed."""
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return None
    except InvalidVersion:
        return None


def tested_versions(distribution: str) -> str:
    return ", ".join(TESTED[distribution])


def python_status() -> dict:
    """The running Python against the declared and the tested ones (status())."""
    running = "{}.{}.{}".format(*sys.version_info[:3])
    return {
        "version": running,
        "supported": str(SUPPORTED_PYTHON),
        "tested": list(TESTED_PYTHONS),
        "tested_here": "{}.{}".format(*sys.version_info[:2]) in TESTED_PYTHONS,
    }


@dataclasses.dataclass(frozen=True)
class GateResult:
    versions: dict[str, str | None]
    refusal: str | None  # None when every present distribution is accepted
    # versions outside SUPPORTED accepted by ALLOW_UNTESTED_ENV_VAR (empty otherwise)
    untested: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.refusal is None


def _allow_untested() -> bool:
    from .activation import env_flag

    return env_flag(ALLOW_UNTESTED_ENV_VAR)


def check() -> GateResult:
    """Compare the installed versions against SUPPORTED.

    A distribution that is not installed is not a refusal: its targets simply
    never get imported. A present but unsupported one refuses the whole plugin
    (an unknown mindone mixes two loading paths; a mindspore the matrix never
    ran may build different objects), unless ALLOW_UNTESTED_ENV_VAR is on.
    """
    versions: dict[str, str | None] = {}
    problems, untested = [], []
    for distribution, specifier in SUPPORTED.items():
        version = installed_version(distribution)
        versions[distribution] = str(version) if version is not None else None
        if version is not None and not specifier.contains(version, prereleases=True):
            newest = max(Version(v) for v in TESTED[distribution])
            where = f"newer than the newest tested ({newest})" if version > newest else "outside"
            problem = (f"{distribution} {version} is {where} the supported range {specifier} "
                       f"(tested: {tested_versions(distribution)})")
            (untested if _allow_untested() else problems).append(problem)
    refusal = None
    if problems:
        refusal = "; ".join(problems) + (
            f"; to try it at your own risk set {ALLOW_UNTESTED_ENV_VAR}=1 (every probe still runs)")
    return GateResult(versions, refusal, tuple(untested))


@dataclasses.dataclass(frozen=True)
class Unmet:
    """Why a target is not patched; `needed` False: this mindspore lacks the
    feature the target exists for, so mindone's own code is already right."""

    reason: str
    needed: bool = True


def unmet_requirement(requires: dict[str, str], library: str | None = None, feature: str | None = None) -> Unmet | None:
    """Why a target is skipped (the first requirement it does not meet), or
    None when it may be patched.

    Every `distribution -> specifier` in `requires` must hold, and, once
    mindspore is imported (always the case when a mindone module is, which is
    when targets are applied), it must have every feature `library`'s
    techniques use: a mindspore that lacks one gets mindone's own loading path
    for that library, not a guess. A target tied to a `feature` of mindspore
    is NOT_NEEDED where that mindspore does not have it."""
    for distribution, specifier in requires.items():
        version = installed_version(distribution)
        if version is None:
            return Unmet(f"{distribution} is not installed")
        if not SpecifierSet(specifier).contains(version, prereleases=True):
            return Unmet(f"needs {distribution}{specifier}, found {version}")
    if "mindspore" in sys.modules:
        chosen = techniques()
        if library is not None and chosen.refusal_for(library):
            return Unmet(chosen.refusal_for(library))
        if feature is not None and not chosen.features.get(feature):
            return Unmet(FEATURES[feature], needed=False)
    return None


# Optional mindspore features a target exists for: name -> what lacking it means.
FEATURES = {
    "cell_to": "this mindspore's nn.Cell has no `to`; models resolve mindone's ModuleUtilsMixin.to",
}


# --- lazy import of mindone.transformers (lazy_import.py)
#
# mindone 0.5's `mindone/transformers/__init__.py` and `models/__init__.py`
# import every public class with plain relative imports (no lazy scheme of
# their own): these packages are made lazy, on the mindone versions below.
LAZY_IMPORT_PACKAGES = ("mindone.transformers", "mindone.transformers.models")
LAZY_IMPORT_MINDONE = SpecifierSet(">=0.5.0,<0.6")
# The audit of mindone 0.5.0 (tests/test_lazy_import.py re-runs it on the
# installed mindone): modules whose import writes into another module's
# registry, by the module that reads it. When the reader is imported, its
# writers are too, as the eager import of the package would have done.
# Modules the eager import loads on the way whose being imported changes how
# other modules behave, imported with the lazy package (by package). Hugging
# Face's auto_docstring (decorating many mindone classes at import) reads
# `transformers.models.auto.modeling_auto`, which that lazy package gives as a
# torch-only placeholder until the module was really imported; mindone's
# eager import does (blip_2's configuration), so a direct import of e.g.
# `mindone.transformers.models.llama4` works only after it.
LAZY_IMPORT_ALONG: dict[str, tuple[str, ...]] = {
    "mindone.transformers": ("transformers.models.auto.modeling_auto",),
}
_MT = "mindone.transformers.models."
LAZY_IMPORT_SIDE_EFFECTS: dict[str, tuple[str, ...]] = {
    # ALL_LAYERNORM_LAYERS.append(<model's norm class>), read by Trainer for weight decay
    "mindone.transformers.trainer": tuple(_MT + m for m in (
        "chameleon.modeling_chameleon", "granitemoe.modeling_granitemoe", "idefics.modeling_idefics",
        "llama.modeling_llama", "longt5.modeling_longt5", "minicpm4.modeling_minicpm", "moshi.modeling_moshi",
        "nemotron.modeling_nemotron", "olmoe.modeling_olmoe", "phi3.modeling_phi3", "pix2struct.modeling_pix2struct",
        "pop2piano.modeling_pop2piano", "recurrent_gemma.modeling_recurrent_gemma",
        "switch_transformers.modeling_switch_transformers", "zamba.modeling_zamba")),
    # AutoImageProcessor.register / AutoFeatureExtractor.register
    "mindone.transformers.models.auto": tuple(_MT + m for m in (
        "minicpmv_4_5.image_processing_minicpmv", "phi4_multimodal.processing_phi4_multimodal")),
}


# --- techniques, chosen per installed mindspore (call only after it is imported)
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
class Techniques:
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
    # Why this mindspore cannot take the fast path at all (empty when it can).
    problems: tuple[str, ...] = ()
    # verdict.Problem: a technique that cannot be used on this mindspore, and the libraries it gates.
    library_problems: tuple = ()
    # optional mindspore features (FEATURES) present in this mindspore
    features: dict = dataclasses.field(default_factory=dict)
    # why a checkpoint array cannot become a Parameter over its own buffer here (None: it can)
    adoption_problem: str | None = None
    # why a copy into a lazy parameter (assign_value) cannot skip its fill here (None: it can)
    lazy_assign_problem: str | None = None

    def problem_of(self, technique: str) -> str | None:
        """Why `technique` (api_probes' names) cannot be used here, or None."""
        return "; ".join(p.reason for p in self.library_problems if p.technique == technique) or None

    @property
    def draws_problem(self) -> str | None:
        """Why lazy parameters cannot take their random draws when made, or None."""
        from .api_probes import RANDOM_DRAWS

        return self.problem_of(RANDOM_DRAWS)

    @property
    def refusal(self) -> str | None:
        if not self.problems:
            return None
        return f"mindspore {self.mindspore} cannot take the fast path: {'; '.join(self.problems)}"

    def rows(self) -> list[dict]:
        """The techniques with their probe results, for status() (strategy.verdict's row shape)."""
        from .strategy.verdict import ACTIVE, SKIPPED

        everywhere = "; ".join(self.problems)
        rows = [
            {"name": "lazy-construction", "libraries": list(LIBRARIES), "description": self.construct},
            {"name": "to-tensor", "libraries": list(LIBRARIES), "description": self.to_tensor},
            {"name": "assign", "libraries": list(LIBRARIES), "description": self.assign},
            {"name": "cast", "libraries": list(LIBRARIES), "description": self.cast},
        ]
        for row in rows:
            row.update(state=SKIPPED if everywhere else ACTIVE, reason=everywhere)
        from .api_probes import CELL_TO, RANDOM_DRAWS

        own = self.draws_problem
        rows.append({"name": RANDOM_DRAWS, "libraries": list(LIBRARIES),
                     "description": "a lazily built parameter takes, when made, the numpy draws of the initializer "
                                    "the unpatched build runs; one the checkpoint lacks is filled with them "
                                    "(probed against plain builds)",
                     "state": SKIPPED if own or everywhere else ACTIVE, "reason": own or everywhere})
        rows.append({"name": "adopted-parameters", "libraries": ["diffusers"],
                     "description": "a single-file checkpoint read inside from_single_file becomes Parameters over "
                                    "the read buffer, not copies (probed against Parameter(array))",
                     "state": SKIPPED if self.adoption_problem or everywhere else ACTIVE,
                     "reason": self.adoption_problem or everywhere})
        rows.append({"name": "lazy-assign", "libraries": list(LIBRARIES),
                     "description": "inside a call that builds then fills, assign_value into a lazy parameter "
                                    "(Cell.load_state_dict) takes a copy without the random fill it overwrites "
                                    "(probed against assign_value on a plain parameter; else filled, then assigned)",
                     "state": SKIPPED if self.lazy_assign_problem or everywhere else ACTIVE,
                     "reason": self.lazy_assign_problem or everywhere})
        if self.features.get("cell_to"):
            own = self.problem_of(CELL_TO)
            rows.append({"name": CELL_TO, "libraries": ["transformers"],
                         "description": "nn.Cell.to inside an accelerated load leaves lazy parameters unread "
                                        "(probed against nn.Cell.to)",
                         "state": SKIPPED if own or everywhere else ACTIVE, "reason": own or everywhere})
        return rows

    def refusal_for(self, library: str) -> str | None:
        """Why `library`'s targets are skipped on this mindspore, or None."""
        own = tuple(problem.reason for problem in self.library_problems if library in problem.libraries)
        if not self.problems and not own:
            return None
        return (f"mindspore {self.mindspore} cannot take the mindone.{library} fast path: "
                f"{'; '.join(self.problems + own)}")


@functools.lru_cache(maxsize=None)
def techniques() -> Techniques:
    """The technique for the imported mindspore (one per process)."""
    import mindspore as ms

    from . import api_probes
    from .strategy import randomstate

    with randomstate.kept():  # the probes fill parameters from random initializers
        problems, library_problems, features = api_probes.probe(ms)
        adoption_problem = api_probes.probe_adoption(ms) if not problems else None
        lazy_assign_problem = api_probes.probe_lazy_assign(ms) if not problems else None
    result = Techniques(
        mindspore=str(getattr(ms, "__version__", installed_version("mindspore"))),
        assign="Parameter.set_data (transformers: then its lazy initializer dropped, as Parameter.init_data does)",
        cast="Tensor.set_dtype",
        construct="Parameter.init_param scoped to the building thread (no_init_parameters' flag)",
        to_tensor="Tensor.from_numpy (bf16 via np_dtype.bfloat16)",
        problems=problems,
        library_problems=library_problems,
        features=features,
        adoption_problem=adoption_problem,
        lazy_assign_problem=lazy_assign_problem,
    )
    if result.refusal:
        logger.warning("ms_loadpatch: targets are skipped: %s", result.refusal)
    else:
        for library in LIBRARIES:
            if result.refusal_for(library):
                logger.warning("ms_loadpatch: mindone.%s targets are skipped: %s", library, result.refusal_for(library))
    return result
