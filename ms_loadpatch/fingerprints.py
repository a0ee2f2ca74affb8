"""mindone code the glue repeats instead of calling, and the loading entry
points it wraps: for each such function, the hash of its source as the glue
was written against (mindone 0.5.0).

A wrapper that does a function's work itself (key conversion, the init
pass, tie_weights, casts, reads, assignment) is right only while mindone's
function is the code it repeats. Where the installed source differs (a
post release, a patched install, mindone built from source), that library's
loads run mindone's own path, the wrappers call the original, and status()
names the function.
Checked once per process, at the first use after its module is imported.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

from .strategy.probe_cache import ProbeCache

_TF = "mindone.transformers.modeling_utils"
_DF = "mindone.diffusers.models.modeling_utils"
_DF_LOADING = "mindone.diffusers.models.model_loading_utils"

# name -> (library, module, qualified name, sha256 of its source, first 16 hex digits)
REPEATED = {
    "transformers.init_weights": ("transformers", _TF, "PreTrainedModel.init_weights", "49f0cd04178b768c"),
    "transformers.initialize_weights": ("transformers", _TF, "PreTrainedModel._initialize_weights", "d10d3f8322629b63"),
    "transformers.tie_weights": ("transformers", _TF, "PreTrainedModel.tie_weights", "82c28d7d7151676a"),
    "transformers.convert_state_dict": ("transformers", _TF, "_convert_state_dict", "84fdfef36f4f71de"),
    "transformers.load_state_dict": ("transformers", _TF, "load_state_dict", "687a371713fe0324"),
    "transformers.load_state_dict_into_model": ("transformers", _TF, "_load_state_dict_into_model", "f0226e89bb0f66ed"),
    "transformers.half": ("transformers", _TF, "ModuleUtilsMixin.half", "0cc14b4ce54dc82e"),
    "transformers.float": ("transformers", _TF, "ModuleUtilsMixin.float", "2d26d49d40efb2a2"),
    "transformers.to": ("transformers", _TF, "ModuleUtilsMixin.to", "89b80facc895c437"),
    "diffusers.half": ("diffusers", _DF, "ModelMixin.half", "0cc14b4ce54dc82e"),
    "diffusers.float": ("diffusers", _DF, "ModelMixin.float", "2d26d49d40efb2a2"),
    "diffusers.to": ("diffusers", _DF, "ModelMixin.to", "89b80facc895c437"),
    "diffusers.convert_state_dict": ("diffusers", _DF, "_convert_state_dict", "42044b9d362c272e"),
    "diffusers.load_shard_file": ("diffusers", _DF_LOADING, "_load_shard_file", "3412531322c2645b"),
    "diffusers.load_state_dict": ("diffusers", _DF_LOADING, "load_state_dict", "30fc298fc89f953b"),
    # wrapped, not repeated: the glue relies on what they do around the calls it makes
    "transformers.from_pretrained": ("transformers", _TF, "PreTrainedModel.from_pretrained", "5bb3b8b03c328245"),
    "transformers.load_pretrained_model": (
        "transformers",
        _TF,
        "PreTrainedModel._load_pretrained_model",
        "0ebbf33630045bb0",
    ),
    "transformers.init": ("transformers", _TF, "PreTrainedModel.__init__", "65a361e58bcb29fc"),
    "transformers.find_missing_and_unexpected_keys": (
        "transformers",
        _TF,
        "_find_missing_and_unexpected_keys",
        "39fc82b57e0cfec9",
    ),
    "diffusers.from_pretrained": ("diffusers", _DF, "ModelMixin.from_pretrained", "5a570c18083696bb"),
    "diffusers.load_pretrained_model": ("diffusers", _DF, "ModelMixin._load_pretrained_model", "8b4481da968104e8"),
    "diffusers.init": ("diffusers", _DF, "ModelMixin.__init__", "3c0af390a0e6b4e9"),
}

_checks = ProbeCache()  # name -> why it differs, None when it is the code repeated


def source_hash(function) -> str:
    """The first 16 hex digits of the sha256 of `function`'s source (its wrappers and a classmethod's or
    staticmethod's binding unwrapped: Python 3.9's classmethod has no __wrapped__)."""
    function = inspect.unwrap(function)
    if isinstance(function, (classmethod, staticmethod)):
        function = inspect.unwrap(function.__func__)
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def _original(module_name, qualname):
    owner = sys.modules[module_name]  # imported already: no import (nor its lock) under the cache's lock
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)


def changed(name: str) -> str | None:
    """Why the installed mindone function `name` (a REPEATED key) is not the
    code its wrapper repeats, or None when it is. Checked once per process."""
    if REPEATED[name][1] not in sys.modules:  # nothing of it has run: checked once it is imported
        return None
    return _checks.get(name, lambda: _check(name))


def _check(name: str) -> str | None:
    library, module_name, qualname, expected = REPEATED[name]
    try:
        found = source_hash(_original(module_name, qualname))
    except Exception as exc:  # noqa: BLE001 - a function gone or without source: not the code repeated
        return f"{module_name}.{qualname} cannot be checked ({type(exc).__name__}: {exc})"
    if found == expected:
        return None
    return (
        f"{module_name}.{qualname} is not the code ms_loadpatch repeats (source {found}, "
        f"expected {expected}): mindone.{library} loads run mindone's own path"
    )


def library_problem(library: str) -> str | None:
    """Why `library`'s accelerated loads cannot repeat mindone's code here (every function it repeats), or None."""
    reasons = [changed(name) for name, row in REPEATED.items() if row[0] == library]
    return "; ".join(r for r in reasons if r) or None


def rows() -> list:
    """status()'s row: whether the mindone code each library's glue repeats is unchanged here."""
    from .strategy.verdict import ACTIVE, SKIPPED, TechniqueRow

    libraries = ("transformers", "diffusers")
    parts, skipped = [], []
    for library in libraries:
        names = [name for name, row in REPEATED.items() if row[0] == library]
        problem = library_problem(library)
        if problem is not None:
            skipped.append(library)
            parts.append(f"{library}: {problem}")
        elif any(REPEATED[name][1] not in sys.modules for name in names):
            parts.append(f"{library}: checked when its modules are imported")
        else:
            parts.append(f"{library}: the {len(names)} functions' source as repeated")
    return [
        TechniqueRow(
            "repeated-mindone-code",
            "mindone functions the glue repeats instead of calling (key conversion, init pass, "
            "tie_weights, casts, reads), checked by the hash of their source; a library whose "
            "code differs loads on mindone's own path",
            SKIPPED if skipped else ACTIVE,
            "; ".join(parts),
            libraries,
        )
    ]


def forget() -> None:
    """Check again at the next use (tests)."""
    _checks.forget()
