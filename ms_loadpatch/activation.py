"""Activation without code changes: the MS_LOADPATCH environment variable.

Unset: `import ms_loadpatch` enables the plugin. On ("1", "true", "on",
"yes"): the `.pth` hook imports ms_loadpatch in every Python process of the
environment. Off ("0", "false", "off", "no"): `import ms_loadpatch` is a
no-op, for runs that must load unpatched (an explicit `enable()` still works).
"""

from __future__ import annotations

import os

ENV_VAR = "MS_LOADPATCH"
ON_VALUES = frozenset({"1", "true", "on", "yes"})
OFF_VALUES = frozenset({"0", "false", "off", "no"})


def env_value(name: str = ENV_VAR) -> str:
    return os.environ.get(name, "").strip().lower()


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to an on value."""
    return env_value(name) in ON_VALUES


def switched_off() -> bool:
    return env_value() in OFF_VALUES


def switched_on() -> bool:
    return env_flag(ENV_VAR)
