"""Put on PYTHONPATH by `ms-loadpatch run`: enables the plugin in the child
process even where the .pth hook is not installed, then runs any
sitecustomize that this one shadows (as opentelemetry-instrument does)."""

import importlib.machinery
import importlib.util
import os
import sys

import ms_loadpatch  # noqa: F401  (import enables; MS_LOADPATCH is on here)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
