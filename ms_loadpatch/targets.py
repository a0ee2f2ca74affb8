"""The table of everything ms_loadpatch patches.

One row per binding: a function imported by name into another module
(`from .x import load_state_dict`) is a separate row, because patching the
defining module does not change the other module's name.
Wrappers are named as "module:attribute" and imported only when their target
module is, so `import ms_loadpatch` imports neither mindspore nor mindone.
"""

from __future__ import annotations

import dataclasses

from .versions import SUPPORTED

_SUPPORTED_MINDONE = {"mindone": str(SUPPORTED["mindone"])}

_TF = "mindone.transformers.modeling_utils"
_DF = "mindone.diffusers.models.modeling_utils"
_DF_LOADING = "mindone.diffusers.models.model_loading_utils"
_TF_GLUE = "ms_loadpatch.glue.transformers"
_DF_GLUE = "ms_loadpatch.glue.diffusers"
_GLUE = "ms_loadpatch.glue.common"  # wrappers both libraries share
_BUILD_THEN_FILL = "ms_loadpatch.glue.build_then_fill:built_then_filled"
_BUILD_INTO_MODEL = "ms_loadpatch.glue.build_then_fill:built_into_model"


@dataclasses.dataclass(frozen=True)
class Target:
    module: str
    path: str  # attribute path inside the module, e.g. "PreTrainedModel.from_pretrained"
    # "module:function" taking (wrapped, instance, args, kwargs), or "module:Kind.method" for a
    # method of a load kind declared with calls.handles (its wrapper: calls.on_load)
    wrapper: str
    requires: dict = dataclasses.field(default_factory=lambda: dict(_SUPPORTED_MINDONE))
    # "function": wrapt.FunctionWrapper(original, wrapper); "proxy": `wrapper` is a
    # factory returning a wrapt.ObjectProxy of the original (for a non-callable)
    kind: str = "function"
    # the optional mindspore feature (api_verdict.FEATURES) this row exists for:
    # "not needed" on a mindspore without it
    feature: str | None = None
    # an entry point users call (listed first in status), or an internal of the loading path
    public: bool = False
    # the mindone library it is gated and listed with, where its module is in neither (mindone.peft)
    owner: str | None = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.path}"

    @property
    def library(self) -> str:
        """The mindone library whose loading path this row belongs to: its
        targets are gated together (api_verdict.ApiVerdict.refusal_for)."""
        return self.owner or self.module.split(".")[1]


TARGETS: tuple[Target, ...] = (
    # mindone.transformers
    Target(_TF, "PreTrainedModel.from_pretrained", f"{_TF_GLUE}:from_pretrained", public=True),
    Target(_TF, "PreTrainedModel._from_config", f"{_GLUE}:from_config", public=True),
    Target(_TF, "ModuleUtilsMixin.half", f"{_GLUE}:half", public=True),
    Target(_TF, "ModuleUtilsMixin.float", f"{_GLUE}:float_", public=True),
    Target(_TF, "ModuleUtilsMixin.to", f"{_TF_GLUE}:to", public=True),
    Target(_TF, "load_state_dict", f"{_TF_GLUE}:load_state_dict", public=True),
    # nn.Cell.to (a mindspore feature, api_verdict.FEATURES), which models resolve before ModuleUtilsMixin.to
    # (reached through modeling_utils' `nn`, so it is applied once mindone is imported);
    # it acts only inside an accelerated transformers load
    Target(_TF, "nn.Cell.to", f"{_TF_GLUE}:TransformersLoad.on_cell_to", feature="cell_to"),
    # nn.Cell.set_train, which from_pretrained calls last (also through modeling_utils' `nn`);
    # it acts only inside an accelerated transformers load
    Target(_TF, "nn.Cell.set_train", f"{_TF_GLUE}:TransformersLoad.on_cell_set_train"),
    # internals of its loading path, active only inside an accelerated from_pretrained
    Target(_TF, "PreTrainedModel.__init__", f"{_TF_GLUE}:TransformersLoad.on_model_init"),
    Target(_TF, "PreTrainedModel.init_weights", f"{_TF_GLUE}:init_weights"),
    Target(_TF, "PreTrainedModel.tie_weights", f"{_TF_GLUE}:TransformersLoad.on_tie_weights"),
    Target(_TF, "PreTrainedModel._load_pretrained_model", f"{_TF_GLUE}:TransformersLoad.on_load_pretrained_model"),
    Target(_TF, "_convert_state_dict", f"{_TF_GLUE}:TransformersLoad.on_convert_state_dict"),
    Target(_TF, "_get_pt2ms_mappings", f"{_TF_GLUE}:TransformersLoad.on_get_pt2ms_mappings"),
    Target(
        _TF,
        "_find_missing_and_unexpected_keys",
        f"{_TF_GLUE}:TransformersLoad.on_find_missing_and_unexpected_keys",
    ),
    Target(_TF, "_load_state_dict_into_model", f"{_TF_GLUE}:TransformersLoad.on_load_state_dict_into_model"),
    # its `gc` name only (not the gc module): a full gc.collect() per shard walks every live object
    Target(_TF, "gc", f"{_TF_GLUE}:GcWithoutPerShardCollect", kind="proxy"),
    # mindone.diffusers
    Target(_DF, "ModelMixin.from_pretrained", f"{_DF_GLUE}:from_pretrained", public=True),
    Target(_DF, "ModelMixin.half", f"{_GLUE}:half", public=True),
    Target(_DF, "ModelMixin.float", f"{_GLUE}:float_", public=True),
    Target(_DF, "ModelMixin.to", f"{_DF_GLUE}:to", public=True),
    Target(_DF_LOADING, "load_state_dict", f"{_DF_GLUE}:load_state_dict", public=True),
    # ...and every module that binds diffusers' load_state_dict by name
    Target(_DF, "load_state_dict", f"{_DF_GLUE}:load_state_dict"),
    Target("mindone.diffusers.loaders.lora_base", "load_state_dict", f"{_DF_GLUE}:load_state_dict"),
    Target("mindone.diffusers.loaders.single_file_utils", "load_state_dict", f"{_DF_GLUE}:load_state_dict"),
    # construction outside from_pretrained waits for any lazy-construction window
    Target("mindone.diffusers.configuration_utils", "ConfigMixin.from_config", f"{_GLUE}:from_config", public=True),
    # calls that build with every initializer run, then fill (glue/build_then_fill.py); each has an identity
    # test (tests/loading/test_build_then_fill.py), with the CPU wheel's missing kernels routed (testing.cpu_kernel_fallbacks)
    *(
        Target(f"mindone.diffusers.models.{module}", f"{cls}.{method}", _BUILD_THEN_FILL, public=True)
        for module, cls, method in (
            ("controlnets.controlnet", "ControlNetModel", "from_unet"),
            ("controlnets.controlnet_sparsectrl", "SparseControlNetModel", "from_unet"),
            ("controlnets.controlnet_union", "ControlNetUnionModel", "from_unet"),
            ("controlnets.controlnet_xs", "ControlNetXSAdapter", "from_unet"),
            ("controlnets.controlnet_xs", "UNetControlNetXSModel", "from_unet"),
            ("controlnets.controlnet_flux", "FluxControlNetModel", "from_transformer"),
            ("controlnets.controlnet_sd3", "SD3ControlNetModel", "from_transformer"),
            ("controlnets.controlnet_hunyuan", "HunyuanDiT2DControlNetModel", "from_transformer"),
            ("controlnets.controlnet_qwenimage", "QwenImageControlNetModel", "from_transformer"),
            ("unets.unet_motion_model", "UNetMotionModel", "from_unet2d"),
        )
    ),
    Target(
        "mindone.diffusers.loaders.single_file_model",
        "FromOriginalModelMixin.from_single_file",
        _BUILD_THEN_FILL,
        public=True,
    ),
    Target(
        "mindone.diffusers.loaders.single_file",
        "FromSingleFileMixin.from_single_file",
        "ms_loadpatch.glue.build_then_fill:adopting_pipeline_file",
        public=True,
    ),
    # the transformers text encoders a pipeline's from_single_file builds from the file (as its module calls them)
    *(
        Target("mindone.diffusers.loaders.single_file", function, _BUILD_THEN_FILL, public=True)
        for function in ("create_diffusers_clip_model_from_ldm", "create_diffusers_t5_model_from_checkpoint")
    ),
    # a model's methods that build layers into it and fill them: IP adapters (load_ip_adapter's), LoRA
    *(
        Target(f"mindone.diffusers.loaders.{module}", path, _BUILD_INTO_MODEL, public=True)
        for module, path in (
            ("unet", "UNet2DConditionLoadersMixin._load_ip_adapter_weights"),
            ("transformer_flux", "FluxTransformer2DLoadersMixin._load_ip_adapter_weights"),
            ("unet", "UNet2DConditionLoadersMixin.load_attn_procs"),
            ("peft", "PeftAdapterMixin.load_lora_adapter"),
        )
    ),
    Target("mindone.transformers.integrations.peft", "PeftAdapterMixin.load_adapter", _BUILD_INTO_MODEL, public=True),
    Target("mindone.peft.peft_model", "PeftModel.from_pretrained", _BUILD_THEN_FILL, public=True, owner="transformers"),
    # internals of its loading path, active only inside an accelerated from_pretrained
    Target(_DF, "no_init_parameters", f"{_DF_GLUE}:no_init_parameters"),
    Target(_DF, "ModelMixin._load_pretrained_model", f"{_DF_GLUE}:DiffusersLoad.on_load_pretrained_model"),
    Target(_DF, "_load_shard_file", f"{_DF_GLUE}:DiffusersLoad.on_load_shard_file"),
    Target(_DF, "_convert_state_dict", f"{_DF_GLUE}:DiffusersLoad.on_convert_state_dict"),
    # read once at import and raising when true: inside an accelerated load the
    # environment is read at call time instead
    Target(_DF, "HF_ENABLE_PARALLEL_LOADING", f"{_DF_GLUE}:ParallelLoadingFlag", kind="proxy"),
)

# the load each library's status verdict is about: pending until its module is imported
FROM_PRETRAINED = {
    "transformers": f"{_TF}:PreTrainedModel.from_pretrained",
    "diffusers": f"{_DF}:ModelMixin.from_pretrained",
}
