"""The one place that knows versions: supported ranges, feature probes and
which technique each installed mindspore gets.

Versions are read from package metadata, so the gate never imports
mindspore or mindone itself; probes run only once mindspore is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Ranges run by the version matrix (.ci/matrix); README lists what each gets.
SUPPORTED: dict[str, SpecifierSet] = {
    "mindspore": SpecifierSet(">=2.7.0,<2.8"),
    "mindone": SpecifierSet(">=0.5.0,<0.6"),
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
            problems.append(f"{distribution} {version} is outside the supported range {specifier}")
    return GateResult(versions, "; ".join(problems) or None)


def requirement_met(requires: dict[str, str]) -> str | None:
    """None when every `distribution -> specifier` in `requires` holds, else the reason."""
    for distribution, specifier in requires.items():
        version = installed_version(distribution)
        if version is None:
            return f"{distribution} is not installed"
        if not SpecifierSet(specifier).contains(version, prereleases=True):
            return f"needs {distribution}{specifier}, found {version}"
    return None


# --- techniques, chosen per installed mindspore (call only after it is imported)


@dataclasses.dataclass(frozen=True)
class Techniques:
    # How a Parameter gets new storage without a copy: "swap" assigns the
    # C-level `_data` setter (aliases the tensor), "set_data" copies.
    assign: str
    # Tensor-level cast: "set_dtype" is the cheapest per call on 2.7 CPU.
    cast: str
    # Lazy init under no_init_parameters is available.
    no_init: bool


@functools.lru_cache(maxsize=None)
def techniques() -> Techniques:
    import mindspore as ms
    from mindspore.nn import utils as nn_utils

    has_swap = isinstance(getattr(ms.Parameter, "_data", None), property) or hasattr(ms.Parameter, "_data")
    return Techniques(
        assign="swap" if has_swap else "set_data",
        cast="set_dtype" if hasattr(ms.Parameter, "set_dtype") else "astype",
        no_init=hasattr(nn_utils, "no_init_parameters"),
    )
