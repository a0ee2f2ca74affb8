"""Child of tests/plugin/test_lazy_import.py: imports mindone.transformers (eager or
lazy, as the environment says) and prints, as one REPORT line, what a user
can observe: names, what each resolves to, dir() before and after, the Auto
mappings and the registries written at import.

    python _lazy_probe.py [names|auto|registries|dir|access|load]... [--model=DIR]

`dir` may be given more than once (each snapshot is kept, in order).
"""

import json
import sys

if "--plugin" in sys.argv:
    import ms_loadpatch  # noqa: F401  (MS_LOADPATCH decides whether it enables)

import importlib  # noqa: E402
import types  # noqa: E402


def describe(obj):
    """What an object is, comparable across processes: a module by name, a
    class or function by module and qualified name, anything else by type and repr."""
    if isinstance(obj, types.ModuleType):
        return ["module", obj.__name__]
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and not isinstance(obj, (str, int, float)):
        return [module, qualname]
    text = repr(obj)
    if " at 0x" in text:
        text = text.split(" at 0x")[0]
    return [type(obj).__qualname__, text[:200]]


def canonical(obj):
    """Is obj the very object its module and qualified name lead to (identity)?"""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(obj, types.ModuleType):
        return sys.modules.get(obj.__name__) is obj
    if not (isinstance(module, str) and isinstance(qualname, str)) or "<" in qualname:
        return True
    try:
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception:
        return True  # not reachable by name (e.g. a re-bound alias): identity not checkable
    return target is obj


def names_report():
    import mindone.transformers as mt
    import mindone.transformers.models as models

    report = {"type": type(mt).__name__, "dir_before": dir(mt), "models_dir_before": dir(models)}
    resolved, not_canonical, hasattr_missing = {}, [], []
    for package in (mt, models, mt, models):  # twice: the first pass binds submodules as a side effect
        for name in dir(package):
            if not hasattr(package, name):
                hasattr_missing.append(f"{package.__name__}.{name}")
                continue
            value = getattr(package, name)
            resolved[f"{package.__name__}.{name}"] = describe(value)
            if not canonical(value):
                not_canonical.append(f"{package.__name__}.{name}")
    report.update(
        resolved=resolved,
        not_canonical=not_canonical,
        hasattr_missing=hasattr_missing,
        dir_after=dir(mt),
        models_dir_after=dir(models),
        has_all=[hasattr(mt, "__all__"), hasattr(models, "__all__")],
        missing=[hasattr(mt, "NoSuchName_xyz"), hasattr(models, "no_such_model_xyz")],
    )
    namespace = {}
    exec("from mindone.transformers import *", namespace)
    report["star"] = sorted(k for k in namespace if k != "__builtins__")
    report["modules"] = sorted(m for m in sys.modules if m.startswith("mindone.transformers"))
    return report


def _scanned():
    """Has the lazy import predicted what the eager import binds (done on
    the first dir() of a lazy package, never at import)?"""
    module = sys.modules.get("ms_loadpatch.eager_import_scan")
    return bool(module is not None and module._eager_bound)


def dir_report():
    """dir() of both packages, as it is now (the models package is imported,
    which the eager import does anyway)."""
    scanned = _scanned()
    import mindone.transformers as mt
    import mindone.transformers.models as models

    return {"mt": dir(mt), "models": dir(models), "scanned_before": scanned}


def access_report():
    """What a from_pretrained script resolves first."""
    import mindone.transformers as mt

    return {name: describe(getattr(mt, name)) for name in ("AutoModelForCausalLM", "Qwen2ForCausalLM")}


def load_report():
    """`AutoModelForCausalLM.from_pretrained(--model)`, right after the import."""
    from ms_loadpatch.testing import cpu_kernel_fallbacks

    directory = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--model="))
    from mindone.transformers import AutoModelForCausalLM

    with cpu_kernel_fallbacks():
        model = AutoModelForCausalLM.from_pretrained(directory)
    return {"class": describe(type(model)), "parameters": len(list(model.get_parameters())), "scanned": _scanned()}


def _entry(mapping, key):
    try:
        return describe(mapping[key])
    except Exception as exc:  # an entry mindone lists but cannot resolve: the same error both ways
        return ["error", type(exc).__name__, str(exc)[:200]]


def auto_report():
    from mindone.transformers.models.auto import configuration_auto, modeling_auto

    report = {}
    for module in (configuration_auto, modeling_auto):
        for name, value in sorted(vars(module).items()):
            if name.endswith("_NAMES") and isinstance(value, dict):
                report[f"{module.__name__}.{name}"] = {k: describe(v) for k, v in value.items()}
    mappings = {}
    for name, value in sorted(vars(modeling_auto).items()):
        if type(value).__name__ == "_LazyAutoMapping":
            entries = {}
            for config_class in value.keys():
                entries[describe(config_class)[1]] = _entry(value, config_class)
            mappings[name] = entries
    report["lazy_auto_mappings"] = mappings
    import mindone.transformers as mt

    # AutoTokenizer: not exported by mindone 0.5.0 (absent both ways is the same)
    report["auto_classes"] = {
        name: describe(getattr(mt, name, None))
        for name in (
            "AutoConfig",
            "AutoModel",
            "AutoModelForCausalLM",
            "AutoProcessor",
            "AutoTokenizer",
            "AutoImageProcessor",
        )
    }
    report["config_mapping"] = {
        k: _entry(configuration_auto.CONFIG_MAPPING, k) for k in configuration_auto.CONFIG_MAPPING.keys()
    }
    return report


def registries_report():
    import mindone.transformers.trainer  # noqa: F401  (the reader of ALL_LAYERNORM_LAYERS)
    from mindone.transformers import AutoFeatureExtractor, AutoImageProcessor  # noqa: F401
    from mindone.transformers.mindspore_utils import ALL_LAYERNORM_LAYERS
    from mindone.transformers.models.auto import feature_extraction_auto, image_processing_auto

    return {
        "ALL_LAYERNORM_LAYERS": sorted(describe(c)[0] + ":" + describe(c)[1] for c in ALL_LAYERNORM_LAYERS),
        "image_processor_extra": {
            str(k): describe(v) for k, v in image_processing_auto.IMAGE_PROCESSOR_MAPPING._extra_content.items()
        },
        "feature_extractor_extra": {
            str(k): describe(v) for k, v in feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING._extra_content.items()
        },
    }


def hf_report():
    """Right after `import mindone.transformers`: what of Hugging Face's lazy
    packages is bound to a real object although its backend (torch) is
    missing; such a binding changes what HF code reading it gets."""
    import mindone.transformers  # noqa: F401
    from transformers.utils.import_utils import _LazyModule

    bound = {}
    for name, module in sorted(sys.modules.items()):
        if isinstance(module, _LazyModule):
            missing = getattr(module, "_object_missing_backend", {})
            hits = sorted(k for k in missing if k in vars(module) and type(vars(module)[k]).__name__ != "DummyObject")
            if hits:
                bound[name] = hits
    return bound


def reverse_report():
    """Every model package imported first thing, in reverse order (not the
    eager import's): what fails."""
    import mindone.transformers.models as models

    failed = {}
    for name in sorted((n for n in dir(models) if not n.startswith("_")), reverse=True):
        full = f"mindone.transformers.models.{name}"
        if name not in vars(models) or getattr(vars(models)[name], "__name__", None) == full:
            try:
                importlib.import_module(full)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return failed


def reverse_root_report():
    """Every submodule of mindone.transformers (but models) imported first
    thing, in reverse order: what fails."""
    import pkgutil

    import mindone.transformers as mt

    failed = {}
    for name in sorted({m.name for m in pkgutil.iter_modules(mt.__path__)} - {"models"}, reverse=True):
        try:
            importlib.import_module(f"mindone.transformers.{name}")
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return failed


if __name__ == "__main__":
    out = {}
    for part in [a for a in sys.argv[1:] if not a.startswith("--")]:
        result = {
            "names": names_report,
            "auto": auto_report,
            "registries": registries_report,
            "hf": hf_report,
            "reverse": reverse_report,
            "reverse-root": reverse_root_report,
            "dir": dir_report,
            "access": access_report,
            "load": load_report,
        }[part]()
        if part == "dir":
            out.setdefault(part, []).append(result)
        else:
            out[part] = result
    if "ms_loadpatch" in sys.modules:
        out["lazy_import"] = sys.modules["ms_loadpatch"].status()["lazy_import"]
    print("REPORT " + json.dumps(out))
