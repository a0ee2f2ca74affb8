"""ms_loadpatch: fast, bit-identical model loading for mindone.

`import ms_loadpatch` enables the plugin unless MS_LOADPATCH is set to an off
value. Importing it never imports mindspore or mindone: targets in modules not
yet imported are patched when they are.
"""

from . import activation
from .core import disable, disabled, enable, enabled, is_enabled, status

__version__ = "0.1.0"
__all__ = ["enable", "disable", "is_enabled", "status", "enabled", "disabled", "__version__"]

if not activation.switched_off():
    enable()
