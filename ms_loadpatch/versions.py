"""The one place that knows versions: supported ranges, the versions the
matrix runs, and the gate that accepts or refuses the installed ones (what
a supported mindspore can do is api_verdict.py's).

Versions are read from package metadata, so the gate never imports
mindspore or mindone itself; the probes run only once mindspore is
imported (when a target module is, since mindone imports mindspore).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

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
MATRIX_EDGE_ONLY: tuple[str, ...] = ("tests/plugin/test_lazy_import.py",)
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
    # development builds of a supported release (mindone from source), accepted while the code the glue
    # repeats or wraps is that release's (fingerprints.py): what status says of each
    development: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.refusal is None


def development_release(version: Version) -> Version | None:
    """The release a development build leads to (0.5.0.dev0+g1a2b -> 0.5.0), None for a release."""
    return Version(version.base_version) if version.is_devrelease else None


def meets(distribution: str, version: Version, specifier: str) -> bool:
    """Whether `version` of `distribution` meets `specifier` as the gate judges it: inside it, a development
    build of a release inside it (the fingerprints then decide), or any version under ALLOW_UNTESTED_ENV_VAR
    (the gate's one check of the range, not one per target)."""
    spec = SpecifierSet(specifier)
    if spec.contains(version, prereleases=True) or _allow_untested():
        return True
    release = development_release(version)
    return release is not None and spec.contains(release)


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
    problems, untested, development = [], [], []
    for distribution, specifier in SUPPORTED.items():
        version = installed_version(distribution)
        versions[distribution] = str(version) if version is not None else None
        if version is None or specifier.contains(version, prereleases=True):
            continue
        release = development_release(version)
        if release is not None and specifier.contains(release):
            development.append(
                f"{distribution} {version} is a development build of {release}: accepted while the code "
                "ms_loadpatch repeats or wraps is that release's (status: repeated-mindone-code)"
            )
            continue
        newest = max(Version(v) for v in TESTED[distribution])
        newer = f", newer than the newest tested ({newest})" if version > newest else ""
        problem = (
            f"{distribution} {version} is outside the supported range {specifier}{newer} "
            f"(tested: {tested_versions(distribution)})"
        )
        (untested if _allow_untested() else problems).append(problem)
    refusal = None
    if problems:
        refusal = "; ".join(problems) + (
            f"; to try it at your own risk set {ALLOW_UNTESTED_ENV_VAR}=1 (every probe still runs)"
        )
    return GateResult(versions, refusal, tuple(untested), tuple(development))


# --- lazy import of mindone.transformers (lazy_import.py)
#
# mindone 0.5's `mindone/transformers/__init__.py` and `models/__init__.py`
# import every public class with plain relative imports (no lazy scheme of
# their own): these packages are made lazy, on the mindone versions below.
LAZY_IMPORT_PACKAGES = ("mindone.transformers", "mindone.transformers.models")
LAZY_IMPORT_MINDONE = SpecifierSet(">=0.5.0,<0.6")
# The audit of mindone 0.5.0 (tests/plugin/test_lazy_import.py re-runs it on the
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
    "mindone.transformers.trainer": tuple(
        _MT + m
        for m in (
            "chameleon.modeling_chameleon",
            "granitemoe.modeling_granitemoe",
            "idefics.modeling_idefics",
            "llama.modeling_llama",
            "longt5.modeling_longt5",
            "minicpm4.modeling_minicpm",
            "moshi.modeling_moshi",
            "nemotron.modeling_nemotron",
            "olmoe.modeling_olmoe",
            "phi3.modeling_phi3",
            "pix2struct.modeling_pix2struct",
            "pop2piano.modeling_pop2piano",
            "recurrent_gemma.modeling_recurrent_gemma",
            "switch_transformers.modeling_switch_transformers",
            "zamba.modeling_zamba",
        )
    ),
    # AutoImageProcessor.register / AutoFeatureExtractor.register
    "mindone.transformers.models.auto": tuple(
        _MT + m for m in ("minicpmv_4_5.image_processing_minicpmv", "phi4_multimodal.processing_phi4_multimodal")
    ),
}
