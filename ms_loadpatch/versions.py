"""The one place that knows versions: supported ranges, the versions the
matrix runs, feature probes and the technique each installed mindspore gets.

Versions are read from package metadata, so the gate never imports
mindspore or mindone itself; feature probes run only once mindspore is
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
    "mindspore": SpecifierSet(">=2.7.0,<2.10"),
    "mindone": SpecifierSet(">=0.5.0,<0.6"),
}

# Why versions beyond a range are refused, where the matrix showed it:
# (distribution, versions it applies to, reason), appended to the refusal.
REFUSED_BECAUSE: tuple[tuple[str, SpecifierSet, str], ...] = (
    ("mindspore", SpecifierSet(">=2.10"),
     "mindspore 2.10 adds nn.Cell.to, which mindone.transformers models resolve before the "
     "ModuleUtilsMixin.to the fast path patches: it would cast lazily built parameters and crash"),
)

# The versions `.ci/matrix` runs by default (it reads this literal), each
# mindspore with the one mindone. 2.10.0 is run to check the refusal.
TESTED: dict[str, tuple[str, ...]] = {
    "mindspore": ("2.7.0", "2.7.1", "2.8.0", "2.9.0", "2.10.0"),
    "mindone": ("0.5.0",),
}


def installed_version(distribution: str) -> Version | None:
    """The installed version of `distribution`, or None if it is not installed."""
    try:
        return Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        return None
    except InvalidVersion:
        return None


@dataclasses.dataclass(frozen=True)
class GateResult:
    versions: dict[str, str | None]
    refusal: str | None  # None when every present distribution is supported

    @property
    def ok(self) -> bool:
        return self.refusal is None


def check() -> GateResult:
    """Compare the installed versions against SUPPORTED.

    A distribution that is not installed is not a refusal: its targets simply
    never get imported. A present but unsupported one refuses the whole plugin,
    because a half-patched mindone mixes two loading paths.
    """
    versions: dict[str, str | None] = {}
    problems = []
    for distribution, specifier in SUPPORTED.items():
        version = installed_version(distribution)
        versions[distribution] = str(version) if version is not None else None
        if version is not None and not specifier.contains(version, prereleases=True):
            because = [reason for name, where, reason in REFUSED_BECAUSE
                       if name == distribution and where.contains(version, prereleases=True)]
            suffix = f" ({'; '.join(because)})" if because else ""
            problems.append(f"{distribution} {version} is outside the supported range {specifier}{suffix}")
    return GateResult(versions, "; ".join(problems) or None)


def requirement_met(requires: dict[str, str]) -> str | None:
    """None when a target may be patched, else the reason it is skipped.

    Every `distribution -> specifier` in `requires` must hold, and, once
    mindspore is imported (always the case when a mindone module is, which is
    when targets are applied), it must have every feature the strategy uses:
    a mindspore that lacks one gets mindone's own loading path, not a guess."""
    for distribution, specifier in requires.items():
        version = installed_version(distribution)
        if version is None:
            return f"{distribution} is not installed"
        if not SpecifierSet(specifier).contains(version, prereleases=True):
            return f"needs {distribution}{specifier}, found {version}"
    if "mindspore" in sys.modules:
        return techniques().refusal
    return None


# --- techniques, chosen per installed mindspore (call only after it is imported)
#
# The strategy uses exactly these mindspore features. The matrix found all of
# them, with the same behaviour, on 2.7.0, 2.7.1, 2.8.0, 2.9.0 and 2.10.0, so
# every supported version gets the same technique. Observed differences that
# the strategy deliberately does not depend on:
#   - `Tensor.to(device=...)` is missing on 2.7.0 (and slow per call everywhere);
#   - `Parameter.data` is settable only from 2.8 (and, like `Parameter._data`
#     swaps, leaves a lazy parameter lazy: its initializer would win);
#   - 2.9+ docstrings announce the deprecation of `no_init_parameters`; it
#     still works on 2.10 (no runtime warning). When a release drops it, the
#     probe below reports it and targets are skipped, not half-applied.
# What does break the fast path is a mindspore `nn.Cell` method shadowing one
# of mindone's ModuleUtilsMixin methods that targets.py patches (2.10 adds
# `Cell.to`): the probe reports that too, for any version the range admits.


@dataclasses.dataclass(frozen=True)
class Techniques:
    mindspore: str
    # How a checkpoint tensor becomes a parameter's storage: `Parameter.set_data`
    # (aliases the tensor and clears a lazy parameter's initializer).
    assign: str
    # Tensor-level cast: `Tensor.set_dtype`, mindone's own cast, cheapest per call.
    cast: str
    # Lazy construction: the flag `no_init_parameters` sets (Parameter.init_param),
    # scoped to the building thread (strategy/construct.py).
    construct: str
    # Checkpoint arrays to tensors without a copy: `Tensor.from_numpy`, with
    # bf16 read as `mindspore.common.np_dtype.bfloat16`.
    to_tensor: str
    # Why this mindspore cannot take the fast path (empty when it can).
    problems: tuple[str, ...] = ()

    @property
    def refusal(self) -> str | None:
        if not self.problems:
            return None
        return f"mindspore {self.mindspore} cannot take the fast path: {'; '.join(self.problems)}"


# mindone's ModuleUtilsMixin methods that targets.py patches; PreTrainedModel
# lists nn.Cell first among its bases, so a Cell method of the same name wins.
_MIXIN_METHODS = ("to", "half", "float")


def _probe_bfloat16(ms) -> str | None:
    """None when a numpy array of np_dtype.bfloat16 becomes a BFloat16 tensor."""
    try:
        import numpy as np
        from mindspore.common import np_dtype

        bf16 = np_dtype.bfloat16
        if hasattr(np_dtype, "np_dtype_valid") and not np_dtype.np_dtype_valid(False):
            return "lacks a usable mindspore.common.np_dtype.bfloat16"
        tensor = ms.Tensor.from_numpy(np.zeros(2, dtype=bf16))
        if tensor.dtype != ms.bfloat16:
            return f"Tensor.from_numpy(np_dtype.bfloat16 array) gives {tensor.dtype}, not BFloat16"
    except Exception as exc:  # ImportError, AttributeError, a refused dtype...
        return f"lacks mindspore.common.np_dtype.bfloat16 with Tensor.from_numpy ({type(exc).__name__}: {exc})"
    return None


def probe(ms) -> tuple[str, ...]:
    """Why `ms` (the mindspore module) cannot take the fast path; empty when it can."""
    problems = []
    for owner, attribute in (("Parameter", "set_data"), ("Parameter", "init_data"),
                             ("Tensor", "set_dtype"), ("Tensor", "from_numpy")):
        if not callable(getattr(getattr(ms, owner, None), attribute, None)):
            problems.append(f"lacks {owner}.{attribute}")
    try:
        from mindspore.nn import utils as nn_utils

        if not callable(getattr(nn_utils, "no_init_parameters", None)):
            problems.append("lacks mindspore.nn.utils.no_init_parameters")
    except ImportError:
        problems.append("lacks mindspore.nn.utils.no_init_parameters")
    if "lacks Tensor.from_numpy" not in problems:
        bf16 = _probe_bfloat16(ms)
        if bf16 is not None:
            problems.append(bf16)
    cell = getattr(getattr(ms, "nn", None), "Cell", None)
    for name in _MIXIN_METHODS:
        if cell is not None and name in vars(cell):
            problems.append(f"nn.Cell.{name} shadows mindone's ModuleUtilsMixin.{name}, which the fast path patches")
    return tuple(problems)


@functools.lru_cache(maxsize=None)
def techniques() -> Techniques:
    """The technique for the imported mindspore (one per process)."""
    import mindspore as ms

    result = Techniques(
        mindspore=str(getattr(ms, "__version__", installed_version("mindspore"))),
        assign="Parameter.set_data",
        cast="Tensor.set_dtype",
        construct="Parameter.init_param scoped to the building thread (no_init_parameters' flag)",
        to_tensor="Tensor.from_numpy (bf16 via np_dtype.bfloat16)",
        problems=probe(ms),
    )
    if result.refusal:
        logger.warning("ms_loadpatch: targets are skipped: %s", result.refusal)
    return result
