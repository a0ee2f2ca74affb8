"""Layers built into a loaded model and filled (glue/build_then_fill.py):
IP adapters (UNet and Flux `_load_ip_adapter_weights`, what
`load_ip_adapter` calls once the image encoder is loaded), LoRA in
mindone.diffusers (`load_lora_adapter`, the deprecated `load_attn_procs`)
and mindone.transformers (`load_adapter`), and mindone.peft's
`PeftModel.from_pretrained`. Patched and unpatched calls in one process,
from the same random state (load_both: numpy's, Python's and mindspore's
generators): the same model, what the adapter file lacks included."""

from __future__ import annotations

import mindone.diffusers as md
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_unet

import ms_loadpatch
from ms_loadpatch.testing import assert_same_model, load_both

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


def _values(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _parameters(state: dict) -> dict:
    """Fresh Parameters, as mindone's adapter loaders read them (mindone casts them in place)."""
    return {key: ms.Parameter(ms.Tensor(value), name=key) for key, value in state.items()}


def _unet():
    with ms_loadpatch.disabled():
        np.random.seed(5)  # the same base weights every time: the comparison is about the adapter
        return md.UNet2DConditionModel(**{k: list(v) if isinstance(v, tuple) else v for k, v in tiny_unet().items()})


def _unet_ip_adapter(unet, projection: str) -> dict:
    """An IP-Adapter file's two state dicts for `unet`, as load_ip_adapter hands them on."""
    cross, channels = unet.config.cross_attention_dim, unet.config.block_out_channels
    attention, key = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        block = int(name.split(".")[1]) if not name.startswith("mid_block") else None
        hidden = (
            channels[-1]
            if block is None
            else (list(reversed(channels))[block] if name.startswith("up_blocks") else channels[block])
        )
        attention[f"{key}.to_k_ip.weight"] = _values((hidden, cross), key)
        attention[f"{key}.to_v_ip.weight"] = _values((hidden, cross), key + 1)
        key += 2
    clip = 6
    if projection == "image":  # ImageProjection
        image_proj = {
            "proj.weight": _values((cross * 4, clip), 0),
            "proj.bias": _values((cross * 4,), 1),
            "norm.weight": _values((cross,), 2),
            "norm.bias": _values((cross,), 3),
        }
    else:  # IPAdapterFullImageProjection
        image_proj = {
            "proj.0.weight": _values((clip, clip), 0),
            "proj.0.bias": _values((clip,), 1),
            "proj.2.weight": _values((cross, clip), 2),
            "proj.2.bias": _values((cross,), 3),
            "proj.3.weight": _values((cross,), 4),
            "proj.3.bias": _values((cross,), 5),
        }
    return {"image_proj": image_proj, "ip_adapter": attention}


def _flux():
    with ms_loadpatch.disabled():
        np.random.seed(5)
        return md.FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=8,
            pooled_projection_dim=8,
            axes_dims_rope=(2, 2, 4),
        )


def _flux_ip_adapter(flux) -> dict:
    joint, inner, clip = flux.config.joint_attention_dim, flux.inner_dim, 6
    attention = {}
    for block in range(flux.config.num_layers):
        for kind in ("k", "v"):
            attention[f"{block}.to_{kind}_ip.weight"] = _values((inner, joint), block)
            attention[f"{block}.to_{kind}_ip.bias"] = _values((inner,), block + 1)
    image_proj = {
        "proj.weight": _values((joint * 4, clip), 0),
        "proj.bias": _values((joint * 4,), 1),
        "norm.weight": _values((joint,), 2),
        "norm.bias": _values((joint,), 3),
    }
    return {"image_proj": image_proj, "ip_adapter": attention}


def _with_ip_adapter(make_model, make_state):
    def load():
        model = make_model()
        model._load_ip_adapter_weights({part: _parameters(state) for part, state in make_state(model).items()})
        return model

    return load


def _lora_state(unet, rank=2, without=()) -> dict:
    """A PEFT LoRA state dict for some of the UNet's attention projections;
    `without`: key endings left out (their layers keep their initial values)."""
    state = {}
    for name, cell in unet.cells_and_names():
        if name.endswith(("attn1.to_q", "attn1.to_k", "attn2.to_v", "attn2.to_out.0")):
            out_features, in_features = cell.weight.shape
            state[f"{name}.lora_A.weight"] = _values((rank, in_features), len(state))
            state[f"{name}.lora_B.weight"] = _values((out_features, rank), len(state) + 1)
    return {key: value for key, value in state.items() if not key.endswith(tuple(without))}


def _with_lora(attn_procs=False, **options):
    def load():
        unet = _unet()
        state = _parameters(_lora_state(unet, **options))
        if attn_procs:  # the deprecated entry point, keys under the UNet's name
            unet.load_attn_procs({f"unet.{key}": value for key, value in state.items()}, adapter_name="first")
        else:
            unet.load_lora_adapter(state, prefix=None, adapter_name="first")
        return unet

    return load


CASES = {
    "unet-ip-adapter": _with_ip_adapter(_unet, lambda unet: _unet_ip_adapter(unet, "image")),
    "unet-ip-adapter-full": _with_ip_adapter(_unet, lambda unet: _unet_ip_adapter(unet, "full")),
    "flux-ip-adapter": _with_ip_adapter(_flux, _flux_ip_adapter),
    "lora": _with_lora(),
    # lora_A is absent from the file: it keeps the kaiming draw reset_lora_parameters gives it
    "lora-without-down": _with_lora(without=("lora_A.weight",)),
    "lora-attn-procs": _with_lora(attn_procs=True),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param("unet-ip-adapter", marks=pytest.mark.matrix), *(case for case in CASES if case != "unet-ip-adapter")],
)
def test_same_model_as_unpatched(case):
    reference, accelerated = load_both(CASES[case])  # raises if the random state ends elsewhere
    assert_same_model(reference, accelerated)
    report = ms_loadpatch.last_report()
    assert report is not None and report.model_class == type(accelerated).__name__
    assert "draws taken when made" in report.technique
    assert (report.missing_initialised > 0) is (case == "lora-without-down")
    if case.startswith("lora"):  # the layers are there, with the file's values
        up = [p for n, p in accelerated.parameters_and_names() if "lora_B" in n]
        assert up and all(p.asnumpy().std() > 0 for p in up)
    for (name, ref), (_, acc) in zip(reference.parameters_and_names(), accelerated.parameters_and_names()):
        assert ("init_param" in vars(acc)) == ("init_param" in vars(ref)), name
        assert getattr(acc, "init_mode", None) is None and not acc.has_init, name


def test_lora_layers_lacking_from_the_file_keep_their_draws():
    """What the file lacks is not zeros: the down projections get
    reset_lora_parameters' kaiming draws, the same patched and unpatched."""
    reference, accelerated = load_both(CASES["lora-without-down"])
    for model in (reference, accelerated):
        down = [p.asnumpy() for n, p in model.parameters_and_names() if n.endswith("lora_A.first.weight")]
        assert down and all(values.std() > 0 for values in down)


def test_bad_adapter_file_leaves_the_process_as_it_was():
    """A LoRA tensor of the wrong shape: the unpatched error, and nothing of the plugin left behind."""
    from _process_state import raised_alike

    def load(unet):
        state = _lora_state(unet)
        first = next(iter(state))
        state[first] = state[first][:, :-1]
        unet.load_lora_adapter(_parameters(state), prefix=None, adapter_name="first")

    unets = _unet(), _unet()  # made before: their builds toggle the plugin
    raised_alike(lambda: load(unets[0]), lambda: load(unets[1]))


def _qwen2():
    import mindone.transformers as mt
    import transformers as hf

    with ms_loadpatch.disabled():
        np.random.seed(5)
        return mt.Qwen2ForCausalLM(
            hf.Qwen2Config(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
            )
        )


def _qwen2_lora_state(base) -> dict:
    state = {}
    for name, cell in base.cells_and_names():
        if name.endswith(("q_proj", "v_proj")):
            out_features, in_features = cell.weight.shape
            state[f"base_model.model.{name}.lora_A.weight"] = _values((4, in_features), len(state))
            state[f"base_model.model.{name}.lora_B.weight"] = _values((out_features, 4), len(state) + 1)
    return state


def test_transformers_load_adapter_same_model_as_unpatched():
    from mindone.peft import LoraConfig

    state = _qwen2_lora_state(_qwen2())

    def load():
        model = _qwen2()
        model.load_adapter(
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), adapter_state_dict=_parameters(state)
        )
        return model

    reference, accelerated = load_both(load)
    assert_same_model(reference, accelerated)
    report = ms_loadpatch.last_report()
    assert report.technique.startswith("load_adapter:") and report.library == "transformers"


def test_peft_model_from_pretrained_same_model_as_unpatched(tmp_path):
    """An adapter directory as PeftModel.save_pretrained writes it (config and
    safetensors; its model card needs Jinja2, which is not a dependency)."""
    from mindone.peft import LoraConfig, PeftModel
    from safetensors.numpy import save_file

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    config.save_pretrained(str(tmp_path))
    state = _qwen2_lora_state(_qwen2())
    save_file(state, str(tmp_path / "adapter_model.safetensors"))

    reference, accelerated = load_both(lambda: PeftModel.from_pretrained(_qwen2(), str(tmp_path)))
    assert_same_model(reference, accelerated)
    loaded = {name.replace(".default", ""): p for name, p in accelerated.parameters_and_names() if "lora_" in name}
    assert loaded.keys() == state.keys()  # the file's values, not initial ones
    assert all(np.array_equal(loaded[key].asnumpy(), value) for key, value in state.items())
    report = ms_loadpatch.last_report()
    assert report.technique.startswith("from_pretrained:") and report.model_class == "PeftModel"
