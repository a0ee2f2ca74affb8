"""Activation without code changes: the MS_LOADPATCH environment variable.

Unset: `import ms_loadpatch` enables the plugin. On ("1", "true", "on",
"yes"): the `.pth` hook imports ms_loadpatch in every Python process of the
environment. Off ("0", "false", "off", "no"): `import ms_loadpatch` is a
no-op, for runs that must load unpatched (an explicit `enable()` still works).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("ms_loadpatch")
ENV_VAR = "MS_LOADPATCH"
ON_VALUES = frozenset({"1", "true", "on", "yes"})
OFF_VALUES = frozenset({"0", "false", "off", "no"})


def env_value(name: str = ENV_VAR) -> str:
    return os.environ.get(name, "").strip().lower()


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to an on value."""
    return env_value(name) in ON_VALUES


_warned: set[tuple[str, str]] = set()


def env_int(name: str, minimum: int = 1) -> int | None:
    """Environment variable `name` as an integer of at least `minimum`; None
    when unset or not one (warned about once: it is read at every load)."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        if (name, text) not in _warned:
            _warned.add((name, text))
            kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            logger.warning("ms_loadpatch: ignoring %s=%r (not %s)", name, text, kind)
        return None
    return value


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name` as one of `choices` (case-insensitive);
    the first choice when unset or another value (warned about once)."""
    value = env_value(name)
    if value in choices:
        return value
    if value and (name, value) not in _warned:
        _warned.add((name, value))
        logger.warning("ms_loadpatch: ignoring %s=%r (not one of %s)", name, value, ", ".join(choices))
    return choices[0]


def switched_off() -> bool:
    return env_value() in OFF_VALUES


def switched_on() -> bool:
    return env_flag(ENV_VAR)
