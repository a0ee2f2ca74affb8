"""Run in a subprocess by test_core.py: imports in the order given on the
command line, then enable/disable cycles, and prints a JSON verdict per target.

argv[1]: "plugin-first" or "mindone-first"."""

import importlib
import json
import sys

ORDER = sys.argv[1]
MINDONE_MODULES = [
    "mindone.transformers.modeling_utils",
    "mindone.diffusers.models.model_loading_utils",
    "mindone.diffusers.models.modeling_utils",
    "mindone.diffusers.loaders.lora_base",
    "mindone.diffusers.loaders.single_file_utils",
    "mindone.diffusers.models.controlnets.controlnet",
    "mindone.diffusers.models.controlnets.controlnet_sparsectrl",
    "mindone.diffusers.models.controlnets.controlnet_flux",
    "mindone.diffusers.models.unets.unet_motion_model",
    "mindone.diffusers.loaders.single_file_model",
    "mindone.diffusers.loaders.single_file",
    "mindone.diffusers.loaders.unet",
    "mindone.diffusers.loaders.transformer_flux",
    "mindone.diffusers.loaders.peft",
    "mindone.diffusers.models.controlnets.controlnet_union",
    "mindone.diffusers.models.controlnets.controlnet_xs",
    "mindone.diffusers.models.controlnets.controlnet_sd3",
    "mindone.diffusers.models.controlnets.controlnet_hunyuan",
    "mindone.diffusers.models.controlnets.controlnet_qwenimage",
    "mindone.transformers.integrations.peft",
    "mindone.peft.peft_model",
]


def import_mindone():
    for name in MINDONE_MODULES:
        importlib.import_module(name)


if ORDER == "mindone-first":
    import_mindone()
import wrapt  # noqa: E402

import ms_loadpatch  # noqa: E402
from ms_loadpatch.targets import TARGETS  # noqa: E402

report = {"mindspore_imported_by_plugin": ORDER == "plugin-first" and "mindspore" in sys.modules}
if ORDER == "plugin-first":
    import_mindone()


ABSENT = "absent"  # a row for a mindspore feature this version lacks (nn.Cell.to before 2.10)


def current(target):
    try:
        return wrapt.resolve_path(sys.modules[target.module], target.path)[2]
    except AttributeError:
        return ABSENT


def is_ours(obj):
    return ms_loadpatch.core._PATCHER.is_handle(obj)


def original_of(obj):
    # peel only our own wrapper: classmethods and functools.wraps also carry __wrapped__
    return obj.__wrapped__ if is_ours(obj) else obj


missing = sorted({t.module for t in TARGETS} - set(sys.modules))
assert not missing, f"MINDONE_MODULES does not import {missing}"
originals = {t.key: original_of(current(t)) for t in TARGETS}
rows = {}
for t in TARGETS:
    rows[t.key] = {"patched_after_import": is_ours(current(t))}
ms_loadpatch.disable()
ms_loadpatch.disable()  # twice is harmless
for t in TARGETS:
    rows[t.key]["original_after_disable"] = current(t) is originals[t.key]
ms_loadpatch.enable()
ms_loadpatch.enable()  # twice is harmless
for t in TARGETS:
    obj = current(t)
    rows[t.key]["patched_after_enable"] = is_ours(obj) and obj.__wrapped__ is originals[t.key]
with ms_loadpatch.disabled():
    for t in TARGETS:
        rows[t.key]["original_inside_disabled"] = current(t) is originals[t.key]
for t in TARGETS:
    rows[t.key]["patched_after_disabled_scope"] = is_ours(current(t))
ms_loadpatch.disable()
with ms_loadpatch.enabled():
    for t in TARGETS:
        rows[t.key]["patched_inside_enabled"] = is_ours(current(t))
for t in TARGETS:
    rows[t.key]["original_after_enabled_scope"] = current(t) is originals[t.key]
# a row that is "not needed" here must never be patched, and is left as it was
needed_states = {}
with ms_loadpatch.enabled():
    needed_states = {row["target"]: row["state"] for row in ms_loadpatch.status()["targets"]}
for key, state in needed_states.items():
    if state == "not needed":
        target = next(t for t in TARGETS if t.key == key)
        rows[key] = {
            "not_needed_left_alone": not any(r for name, r in rows[key].items() if name.startswith("patched"))
            and current(target) is originals[key]
        }
report["targets"] = rows
report["states"] = {row["target"]: row["state"] for row in ms_loadpatch.status()["targets"]}
print("REPORT " + json.dumps(report))
