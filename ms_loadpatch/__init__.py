"""ms_loadpatch: fast, bit-identical model loading for mindone.

`import ms_loadpatch` enables the plugin unless MS_LOADPATCH is set to an off
value. Importing it never imports mindspore or mindone: targets in modules not
yet imported are patched when they are.
"""

from . import activation
from .core import disable, disabled, enable, enabled, is_enabled, status

__version__ = "0.1.0"
__all__ = ["enable", "disable", "is_enabled", "status", "enabled", "disabled", "last_report", "__version__"]


def last_report():
    """The LoadReport of the most recent accelerated `from_pretrained` in this
    process (phases with seconds, tensor counts, technique; `.summary()`,
    `.as_dict()`), or None if there was none."""
    import sys

    # Only loaded once a load ran; looking it up keeps this free of imports.
    reports = sys.modules.get("ms_loadpatch.strategy.reports")
    return reports.last_report() if reports is not None else None


if not activation.switched_off():
    enable()
