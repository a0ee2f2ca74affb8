"""MS_LOADPATCH_TECHNIQUES_OFF: speed techniques switched off by name.

Its own module so that every technique, whatever its kind, reads the switch
without importing another technique's code.
"""

from __future__ import annotations

import os

ENV_VAR = "MS_LOADPATCH_TECHNIQUES_OFF"
ALL = "all"


def named_off() -> set[str]:
    """The names the variable lists, as written (`all` included): comma-separated."""
    return {part.strip() for part in os.environ.get(ENV_VAR, "").split(",") if part.strip()}


def is_off(name: str) -> bool:
    names = named_off()
    return name in names or ALL in names


def reason_off() -> str:
    return f"switched off by {ENV_VAR}"
