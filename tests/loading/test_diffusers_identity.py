"""Patched mindone.diffusers from_pretrained returns the same model as the
unpatched one: every parameter compared (name, shape, dtype, bits), plus
loading info, errors, a forward pass, and pipelines (Stable Diffusion, CogVideoX).

Checkpoints are generated once per module from tiny configs with random
weights; CONFIGS keys are class names, `:tag` telling configs of one class
apart. CogVideoX and Wan build on the CPU backend under
`cpu_kernel_fallbacks()`, HunyuanVideo without; CosmosTransformer3DModel stands in as the model
with `_keep_in_fp32_modules`.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
D = pytest.importorskip("mindone.diffusers")

from _helpers import (  # noqa: E402
    flux_cpu_routes,
    tiny_cogvideox,
    tiny_cogvideox_vae,
    tiny_hunyuan_video,
    tiny_hunyuan_video_vae,
    tiny_t5_tokenizer,
    tiny_unet,
    tiny_vae,
    tiny_wan,
    tiny_wan_vae,
)
from mindspore import mint  # noqa: E402

import ms_loadpatch  # noqa: E402
from ms_loadpatch.glue import diffusers as glue  # noqa: E402
from ms_loadpatch.strategy import load as strategy_load  # noqa: E402
from ms_loadpatch.strategy import reports  # noqa: E402
from ms_loadpatch.strategy.prefetch import read_file  # noqa: E402
from ms_loadpatch.testing import assert_same_model, compare, cpu_kernel_fallbacks, load_both, snapshot  # noqa: E402

FP32, FP16, BF16 = ms.float32, ms.float16, ms.bfloat16
DTYPE_NAMES = {None: "none", FP32: "fp32", FP16: "fp16", BF16: "bf16"}

CONFIGS = {
    "UNet2DConditionModel": tiny_unet(),
    "AutoencoderKL": tiny_vae(),
    "FluxTransformer2DModel": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ),
    "UNet3DConditionModel": dict(
        block_out_channels=(4, 8),
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        cross_attention_dim=8,
        attention_head_dim=2,
    ),
    "AutoencoderKLCogVideoX": tiny_cogvideox_vae(),
    "CosmosTransformer3DModel": dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=2,
        mlp_ratio=2,
        text_embed_dim=16,
        adaln_lora_dim=4,
        max_size=(4, 32, 32),
        patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0),
        concat_padding_mask=True,
        extra_pos_embed_type="learnable",
    ),
    "CogVideoXTransformer3DModel": tiny_cogvideox("2b"),
    "CogVideoXTransformer3DModel:5b": tiny_cogvideox("5b"),
    "WanTransformer3DModel": tiny_wan(),
    "AutoencoderKLWan": tiny_wan_vae(),
    "HunyuanVideoTransformer3DModel": tiny_hunyuan_video(),
    "AutoencoderKLHunyuanVideo": tiny_hunyuan_video_vae(),
}
SHARD = "12KB"  # several shards even for the smallest model


# -- checkpoint generation (module scope: once per run)


def _random_weights(model, seed):
    """Random values of varied magnitude for every parameter (norm weights and
    biases included), so each cast really rounds."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, param in model.parameters_and_names():
        shape = tuple(param.shape)
        arrays[name] = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2, shape)).astype(np.float32)
    return arrays


def _set_weights(model, arrays, dtype):
    for name, param in model.parameters_and_names():
        tensor = ms.Tensor.from_numpy(arrays[name].copy())
        if dtype != FP32:
            tensor.set_dtype(dtype)
        param.set_dtype(dtype)
        param.set_data(tensor)


class Checkpoints:
    def __init__(self, root):
        self.root = root
        self.made = {}

    def path(self, name, dtype, sharded=False):
        return os.path.join(self.root, name, f"{DTYPE_NAMES[dtype]}{'-sharded' if sharded else ''}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = Checkpoints(str(tmp_path_factory.mktemp("diffusers-ckpts")))
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        for seed, (name, config) in enumerate(CONFIGS.items()):
            model = getattr(D, _class_name(name))(**config)
            arrays = _random_weights(model, seed)
            for dtype in (FP32, FP16, BF16):
                _set_weights(model, arrays, dtype)
                model.save_pretrained(made.path(name, dtype))
                model.save_pretrained(made.path(name, dtype, sharded=True), max_shard_size=SHARD)
            # an fp32 file with an fp16 variant beside it
            variant_dir = os.path.join(made.root, name, "with-variant")
            _set_weights(model, arrays, FP32)
            model.save_pretrained(variant_dir)
            _set_weights(model, arrays, FP16)
            model.save_pretrained(variant_dir, variant="fp16")
            made.made[name] = len(arrays)
    return made


# -- helpers


def _class_name(name):
    """The mindone.diffusers class of a CONFIGS key."""
    return name.partition(":")[0]


def _reports(monkeypatch):
    """Every load report emitted from now on (nested loads included)."""
    seen = []
    emit = reports.emit

    def spy(report):
        seen.append(report)
        emit(report)

    monkeypatch.setattr(reports, "emit", spy)
    return seen


def _assert_fast_path(name, n_params=None):
    report = reports.last_report()
    assert report is not None and report.library == "diffusers" and report.model_class == _class_name(name), report
    assert report.technique.split(", cast to ")[0] == glue.DiffusersLoad.technique, (
        report.technique
    )  # not a silent fallback
    if n_params is not None:
        assert report.tensors_assigned == n_params
    return report


# families whose build needs no kernel the CPU wheel lacks: compared on the plain wheel
PLAIN_WHEEL = ("HunyuanVideoTransformer3DModel", "AutoencoderKLHunyuanVideo")


def _load_pair(name, path, **kwargs):
    cls = getattr(D, _class_name(name))
    reports._last_reports.clear()  # a fallback must not pass on an earlier load's report
    with contextlib.nullcontext() if name in PLAIN_WHEEL else cpu_kernel_fallbacks():
        reference, accelerated = load_both(lambda: cls.from_pretrained(path, **kwargs))
    return reference, accelerated


def _final_dtypes(model):
    return {name: param.dtype for name, param in model.parameters_and_names()}


# -- the dtype matrix on UNet2DConditionModel


@pytest.mark.parametrize("target", [None, FP16, BF16, FP32], ids=lambda d: f"as-{DTYPE_NAMES[d]}")
@pytest.mark.parametrize(
    "ckpt,sharded",
    # .ci/matrix runs fp32 and bf16-sharded, in every target dtype, on every mindspore version
    [
        pytest.param(FP32, False, marks=pytest.mark.matrix),
        (FP32, True),
        (FP16, False),
        (FP16, True),
        (BF16, False),
        pytest.param(BF16, True, marks=pytest.mark.matrix),
    ],
    ids=["fp32", "fp32-sharded", "fp16", "fp16-sharded", "bf16", "bf16-sharded"],
)
def test_unet2d_dtype_matrix(ckpts, ckpt, sharded, target):
    name = "UNet2DConditionModel"
    reference, accelerated = _load_pair(name, ckpts.path(name, ckpt, sharded), mindspore_dtype=target)
    report = _assert_fast_path(name, ckpts.made[name])
    assert_same_model(reference, accelerated)
    expected = target or FP32
    assert set(_final_dtypes(accelerated).values()) == {expected}
    if sharded:
        assert report.shards > 1
    if ckpt == (target or FP32):
        assert report.tensors_cast == 0  # own dtype: aliased, not copied or round-tripped
    else:
        assert report.tensors_cast == report.tensors_assigned  # one cast each, not two


# -- every architecture


MODEL_CASES = [
    (FP32, False, None),
    (FP32, False, BF16),
    (BF16, True, BF16),
    (FP16, False, FP32),
]


@pytest.mark.parametrize(
    "ckpt,sharded,target", MODEL_CASES, ids=["fp32-as-none", "fp32-as-bf16", "bf16-sharded-as-bf16", "fp16-as-fp32"]
)
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "UNet2DConditionModel"])
def test_architectures(ckpts, name, ckpt, sharded, target):
    reference, accelerated = _load_pair(name, ckpts.path(name, ckpt, sharded), mindspore_dtype=target)
    _assert_fast_path(name, ckpts.made[name])
    assert_same_model(reference, accelerated)
    assert _final_dtypes(accelerated) == _final_dtypes(reference)


def test_cpu_fallback_repeat_interleave_repeats_as_numpy():
    """The stand-in for RepeatInterleaveInt/Tensor (CogVideoX's and Wan's
    positional tables) gives np.repeat's values, in the input's dtype."""
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    with cpu_kernel_fallbacks():
        for dtype in (FP32, ms.float64, BF16):
            tensor = ms.Tensor(values).astype(dtype)
            for dim in (0, 1):
                got = tensor.repeat_interleave(2, dim=dim, output_size=values.shape[dim] * 2)
                assert got.dtype == dtype
                want = np.repeat(tensor.astype(FP32).asnumpy(), 2, axis=dim)
                assert np.array_equal(got.astype(FP32).asnumpy(), want), (dtype, dim)
        flat = ms.Tensor(values).repeat_interleave(ms.Tensor([1, 0, 2] * 4))
        assert np.array_equal(flat.asnumpy(), np.repeat(values.reshape(-1), [1, 0, 2] * 4))
        with pytest.raises(ValueError, match="output_size"):
            ms.Tensor(values).repeat_interleave(2, dim=0, output_size=5)


def test_keep_in_fp32_modules_final_dtypes(ckpts):
    """mindone 0.5.0 disables keep-in-fp32 (its list is hard-coded empty) and
    model.to(dtype) casts everything: the patched load must match that, not
    what upstream diffusers would do."""
    name = "CosmosTransformer3DModel"
    assert getattr(D, name)._keep_in_fp32_modules
    reference, accelerated = _load_pair(name, ckpts.path(name, BF16), mindspore_dtype=BF16)
    kept = {k: v for k, v in _final_dtypes(accelerated).items() if "learnable_pos_embed" in k}
    assert kept, "the keep-in-fp32 module has parameters"
    assert _final_dtypes(accelerated) == _final_dtypes(reference)
    assert_same_model(reference, accelerated)


# -- loading options


@pytest.mark.parametrize("variant,target", [("fp16", None), ("fp16", BF16), (None, None)])
def test_variant(ckpts, variant, target):
    name = "UNet2DConditionModel"
    path = os.path.join(ckpts.root, name, "with-variant")
    reference, accelerated = _load_pair(name, path, variant=variant, mindspore_dtype=target)
    _assert_fast_path(name, ckpts.made[name])
    assert_same_model(reference, accelerated)
    file_dtype = FP16 if variant else FP32
    assert set(_final_dtypes(accelerated).values()) == {target or FP32}
    if target is None:  # the variant file was really read: fp16 values widened to fp32
        bits = snapshot(accelerated)["tensors"]["conv_in.weight"].bits.view(np.float32)
        assert np.array_equal(bits.astype(np.float16).astype(np.float32), bits) == (file_dtype == FP16)


def test_subfolder_use_safetensors_low_cpu_mem_usage(ckpts, tmp_path):
    name = "UNet2DConditionModel"
    shutil.copytree(ckpts.path(name, BF16, sharded=True), tmp_path / "unet")
    for kwargs in (
        dict(subfolder="unet", mindspore_dtype=BF16),
        dict(subfolder="unet", use_safetensors=True),
        dict(subfolder="unet", low_cpu_mem_usage=True, mindspore_dtype=FP16),
    ):
        reference, accelerated = _load_pair(name, str(tmp_path), **kwargs)
        _assert_fast_path(name, ckpts.made[name])
        assert_same_model(reference, accelerated)


@pytest.mark.parametrize(
    "layout,kwargs",
    [
        ("single", dict()),
        ("sharded", dict()),
        ("variant", dict(variant="fp16")),
        ("subfolder", dict(subfolder="unet")),
        ("subfolder-sharded", dict(subfolder="unet")),
    ],
)
def test_files_read_ahead(ckpts, tmp_path, monkeypatch, layout, kwargs):
    """The background reader predicts the files mindone resolves: every file
    the load asks for was given to the prefetcher (one whose read had not
    started yet is read by the caller, which never waits behind reads it has
    not asked for), at least one came from the read-ahead, and the model is
    identical."""
    name = "UNet2DConditionModel"
    sources = {
        "single": ckpts.path(name, BF16),
        "sharded": ckpts.path(name, BF16, sharded=True),
        "variant": os.path.join(ckpts.root, name, "with-variant"),
        "subfolder": ckpts.path(name, FP16),
        "subfolder-sharded": ckpts.path(name, FP16, sharded=True),
    }
    path = sources[layout]
    if layout.startswith("subfolder"):
        shutil.copytree(path, tmp_path / "unet")
        path = str(tmp_path)
    with ms_loadpatch.disabled():
        reference = D.UNet2DConditionModel.from_pretrained(path, **kwargs)

    read_ahead = []

    def only_predicted_files(prefetcher, file, cast_plan, reads):
        if prefetcher is None or not prefetcher.predicted(file):
            raise AssertionError(f"{file} was not predicted by the read-ahead")
        taken = prefetcher.take(file)
        if taken is None:  # its read had not started: read here, as take_or_read does
            return read_file(file, cast_plan)
        read_ahead.append(file)
        return taken

    monkeypatch.setattr(strategy_load, "take_or_read", only_predicted_files)
    with ms_loadpatch.enabled():
        accelerated = D.UNet2DConditionModel.from_pretrained(path, **kwargs)
    assert read_ahead, "no file came from the read-ahead"
    _assert_fast_path(name, ckpts.made[name])
    assert_same_model(reference, accelerated)


class _MixedDtypes(D.ModelMixin, D.ConfigMixin):
    """Parameters built in fp16 and int32 and one from a Tensor (never lazy):
    mindone casts the checkpoint to the construction dtype first, then to the
    target; where that first step rounds, the patched load must round too."""

    @D.configuration_utils.register_to_config
    def __init__(self, width: int = 8):
        super().__init__()
        from mindspore.common.initializer import Normal, initializer

        self.proj = mint.nn.Linear(width, width)
        self.in_fp16 = ms.Parameter(initializer(Normal(), (width, width), ms.float16), name="in_fp16")
        self.steps = ms.Parameter(initializer("zeros", (width,), ms.int32), name="steps", requires_grad=False)
        self.fixed = ms.Parameter(ms.Tensor(np.ones(width, np.float32)), name="fixed")


@pytest.mark.parametrize("ckpt", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("target", [None, FP32, BF16, FP16], ids=lambda d: f"as-{DTYPE_NAMES[d]}")
def test_construction_dtypes_other_than_fp32(tmp_path, ckpt, target):
    with ms_loadpatch.disabled():
        model = _MixedDtypes()
        rng = np.random.default_rng(7)
        for name, param in model.parameters_and_names():
            values = rng.standard_normal(tuple(param.shape)) * 1000.0
            if name == "steps":
                values = rng.integers(-(2**20), 2**20, tuple(param.shape))
            tensor = ms.Tensor(values.astype(np.float32 if name != "steps" else np.int32))
            if name != "steps":
                tensor.set_dtype(ckpt)
                param.set_dtype(ckpt)
            param.set_data(tensor)
        model.save_pretrained(str(tmp_path))
    reference, accelerated = load_both(lambda: _MixedDtypes.from_pretrained(str(tmp_path), mindspore_dtype=target))
    report = _assert_fast_path("_MixedDtypes", 5)
    assert_same_model(reference, accelerated)
    if target not in (None, ckpt):  # cast while reading, except in_fp16, whose lossy first step needs the file values
        assert report.tensors_cast_while_reading >= 2, report.summary()
        assert report.tensors_read_again == (1 if target != FP16 else 0), report.summary()


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint directory, editing its tensors."""
    from mindone.safetensors.mindspore import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "diffusion_pytorch_model.safetensors")
    tensors = dict(load_file(file))
    edit(tensors)
    save_file(tensors, file, metadata={"format": "np"})


# per family, weights a checkpoint may lack: an input projection and one deep in a block
MISSING = {
    "UNet2DConditionModel": ["conv_in.weight", "down_blocks.0.resnets.0.norm1.weight"],
    "CogVideoXTransformer3DModel:5b": ["patch_embed.proj.weight", "transformer_blocks.1.norm1.linear.weight"],
    "WanTransformer3DModel": ["scale_shift_table", "blocks.1.attn1.to_q.weight"],
}


@pytest.mark.parametrize("target", [None, BF16], ids=["as-none", "as-bf16"])
@pytest.mark.parametrize("name", list(MISSING))
def test_missing_and_unexpected_keys(ckpts, tmp_path, name, target):
    missing = MISSING[name]

    def edit(tensors):
        for key in missing:
            del tensors[key]
        tensors["not_in_model.weight"] = ms.Parameter(ms.Tensor(np.ones(3, np.float32)), name="not_in_model.weight")

    _rewrite(ckpts.path(name, FP16), tmp_path / "ckpt", edit)
    (reference, ref_info), (accelerated, acc_info) = _load_pair(
        name, str(tmp_path / "ckpt"), output_loading_info=True, mindspore_dtype=target
    )
    _assert_fast_path(name, ckpts.made[name] - len(missing))
    params = dict(accelerated.parameters_and_names())
    ref_params = dict(reference.parameters_and_names())
    # before any snapshot: reading a lazy parameter initialises it
    assert params[missing[-1]].has_init, f"{missing[-1]}: mindone leaves a weight with an initializer lazy"
    for key in missing:  # a table drawn at construction (Wan's scale_shift_table) is not lazy, unpatched either
        assert params[key].has_init == ref_params[key].has_init, key
        assert params[key].dtype == ref_params[key].dtype == (target or FP32)
    assert acc_info == ref_info
    assert sorted(acc_info["missing_keys"]) == sorted(missing)
    assert acc_info["unexpected_keys"] == ["not_in_model.weight"]
    _assert_same_after_first_use(reference, accelerated)
    for key in missing:
        values = params[key].asnumpy().astype(np.float32)
        assert np.isfinite(values).all() and np.count_nonzero(values) > 0, f"{key} not initialised"


def _assert_same_after_first_use(reference, accelerated):
    """Both models read from the same global random state: a parameter left
    lazy gets its values (its initializer's draw) on that first read."""
    state = np.random.get_state()
    expected = snapshot(reference)
    after = np.random.get_state()
    np.random.set_state(state)
    problems = compare(expected, snapshot(accelerated))
    assert not problems, problems[:20]
    assert np.array_equal(np.random.get_state()[1], after[1]) and np.random.get_state()[2] == after[2]


def test_mismatched_sizes(ckpts, tmp_path):
    name = "UNet2DConditionModel"
    key = "conv_out.bias"

    def edit(tensors):
        tensors[key] = ms.Parameter(ms.Tensor(np.ones(7, np.float32)), name=key)

    _rewrite(ckpts.path(name, FP32), tmp_path / "ckpt", edit)
    cls = getattr(D, name)
    errors = []
    for scope in (ms_loadpatch.disabled, ms_loadpatch.enabled):
        with scope(), pytest.raises(RuntimeError) as caught:
            cls.from_pretrained(str(tmp_path / "ckpt"))
        errors.append(str(caught.value))
    assert key in errors[1] and "shape" in errors[1]
    (reference, ref_info), (accelerated, acc_info) = _load_pair(
        name, str(tmp_path / "ckpt"), output_loading_info=True, ignore_mismatched_sizes=True
    )
    assert (
        dict(accelerated.parameters_and_names())[key].has_init == dict(reference.parameters_and_names())[key].has_init
    )
    assert acc_info == ref_info and [m[0] for m in acc_info["mismatched_keys"]] == [key]
    _assert_same_after_first_use(reference, accelerated)


def test_non_safetensors_behaves_as_unpatched(ckpts, tmp_path):
    """mindone 0.5.0 writes `.bin` (a MindSpore checkpoint) with
    safe_serialization=False and then cannot read it: both loads must fail alike."""
    name = "AutoencoderKL"
    with ms_loadpatch.disabled():
        model = D.AutoencoderKL(**CONFIGS[name])
        model.save_pretrained(str(tmp_path), safe_serialization=False)
    outcomes = []
    for scope in (ms_loadpatch.disabled, ms_loadpatch.enabled):
        with scope():
            try:
                D.AutoencoderKL.from_pretrained(str(tmp_path), use_safetensors=False)
                outcomes.append("loaded")
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]


def test_direct_load_state_dict(ckpts):
    """model_loading_utils.load_state_dict outside from_pretrained: Parameters named by key, as mindone."""
    from mindone.diffusers.models import model_loading_utils

    file = os.path.join(ckpts.path("FluxTransformer2DModel", BF16), "diffusion_pytorch_model.safetensors")
    reference, accelerated = load_both(lambda: model_loading_utils.load_state_dict(file))
    assert not reference.keys() - accelerated.keys()
    assert list(accelerated) == list(reference)
    for key, value in reference.items():
        other = accelerated[key]
        assert isinstance(other, ms.Parameter) and other.name == value.name == key
        assert other.dtype == value.dtype and other.shape == value.shape
        assert np.array_equal(other.asnumpy().view(np.uint16), value.asnumpy().view(np.uint16)), key


def test_half_float_to(ckpts):
    name = "FluxTransformer2DModel"
    results = []
    for scope in (ms_loadpatch.disabled, ms_loadpatch.enabled):
        with scope():
            model = D.FluxTransformer2DModel.from_pretrained(ckpts.path(name, FP32))
            steps = []
            for step in (lambda m: m.half(), lambda m: m.to(BF16), lambda m: m.float(), lambda m: m.to(dtype=FP16)):
                assert step(model) is model
                steps.append(snapshot(model))
            results.append(steps)
    for expected, actual in zip(*results):
        assert not compare(expected, actual)


# -- parallel shard loading


def test_parallel_loading_read_at_call_time(ckpts, monkeypatch):
    """HF_ENABLE_PARALLEL_LOADING set after import: shards read by a pool.
    The reference loads unpatched without the flag (mindone raises with it)."""
    name = "UNet2DConditionModel"
    path = ckpts.path(name, BF16, sharded=True)
    with ms_loadpatch.disabled():
        reference = D.UNet2DConditionModel.from_pretrained(path, mindspore_dtype=BF16)
    monkeypatch.setenv("HF_ENABLE_PARALLEL_LOADING", "yes")
    monkeypatch.setenv("HF_PARALLEL_LOADING_WORKERS", "2")
    with ms_loadpatch.enabled():
        accelerated = D.UNet2DConditionModel.from_pretrained(path, mindspore_dtype=BF16)
    report = _assert_fast_path(name, ckpts.made[name])
    assert report.read_workers == 2 and report.shards > 2
    assert_same_model(reference, accelerated)


def test_parallel_flag_set_at_import(ckpts):
    """Set before mindone is imported: unpatched raises NotImplementedError, patched loads."""
    code = textwrap.dedent(
        f"""
        import json, mindspore as ms, ms_loadpatch
        from mindone.diffusers import UNet2DConditionModel
        from ms_loadpatch.strategy import reports
        from ms_loadpatch.testing import assert_same_model
        path = {ckpts.path("UNet2DConditionModel", FP16, sharded=True)!r}
        with ms_loadpatch.disabled():
            try:
                UNet2DConditionModel.from_pretrained(path)
                unpatched = "loaded"
            except NotImplementedError:
                unpatched = "NotImplementedError"
        model = UNet2DConditionModel.from_pretrained(path, mindspore_dtype=ms.float16)
        report = reports.last_report()
        print("REPORT", json.dumps({{"unpatched": unpatched, "workers": report.read_workers,
              "assigned": report.tensors_assigned, "lazy": sum(p.has_init for p in model.get_parameters()),
              "dtypes": sorted({{str(p.dtype) for p in model.get_parameters()}})}}))
        """
    )
    env = dict(os.environ, HF_ENABLE_PARALLEL_LOADING="1", HF_PARALLEL_LOADING_WORKERS="3")
    env.pop("MS_LOADPATCH", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("REPORT ")), None)
    assert line, proc.stderr[-3000:]
    result = json.loads(line[len("REPORT ") :])
    assert result == {
        "unpatched": "NotImplementedError",
        "workers": 3,
        "assigned": ckpts.made["UNet2DConditionModel"],
        "lazy": 0,
        "dtypes": ["Float16"],
    }


# -- threads


def test_concurrent_loads_and_construction(ckpts):
    """Two patched loads in two threads, plus a plain construction in a third:
    each gets its own weights, and the plain one is not left lazy."""
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        expected_unet = snapshot(
            D.UNet2DConditionModel.from_pretrained(ckpts.path("UNet2DConditionModel", BF16), mindspore_dtype=BF16)
        )
        expected_vae = snapshot(D.AutoencoderKL.from_pretrained(ckpts.path("AutoencoderKL", FP32, sharded=True)))
    results, errors = {}, []

    def run(key, load):
        try:
            for _ in range(2):
                results[key] = load()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with ms_loadpatch.enabled(), cpu_kernel_fallbacks():
        threads = [
            threading.Thread(
                target=run,
                args=(
                    "unet",
                    lambda: D.UNet2DConditionModel.from_pretrained(
                        ckpts.path("UNet2DConditionModel", BF16), mindspore_dtype=BF16
                    ),
                ),
            ),
            threading.Thread(
                target=run,
                args=("vae", lambda: D.AutoencoderKL.from_pretrained(ckpts.path("AutoencoderKL", FP32, sharded=True))),
            ),
            threading.Thread(
                target=run,
                args=(
                    "plain",
                    lambda: D.AutoencoderKL.from_config(D.AutoencoderKL.load_config(ckpts.path("AutoencoderKL", FP32))),
                ),
            ),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert not compare(expected_unet, snapshot(results["unet"]))
    assert not compare(expected_vae, snapshot(results["vae"]))
    assert not any(p.has_init for p in results["plain"].get_parameters())


# -- a forward pass


def test_flux_forward(ckpts):
    name = "FluxTransformer2DModel"
    reference, accelerated = _load_pair(name, ckpts.path(name, BF16, sharded=True), mindspore_dtype=FP32)
    _assert_fast_path(name, ckpts.made[name])
    rng = np.random.default_rng(0)

    def tensor(*shape):
        return ms.Tensor(rng.standard_normal(shape).astype(np.float32))

    inputs = dict(
        hidden_states=tensor(1, 16, 4),
        encoder_hidden_states=tensor(1, 8, 32),
        pooled_projections=tensor(1, 32),
        img_ids=tensor(16, 3),
        txt_ids=tensor(8, 3),
        timestep=ms.Tensor([1.0]),
    )
    outputs = []
    with flux_cpu_routes():
        for model in (reference, accelerated):
            outputs.append(model(**inputs)[0].asnumpy())
    assert np.isfinite(outputs[0]).all()
    assert np.array_equal(outputs[0].view(np.uint32), outputs[1].view(np.uint32))


# -- a pipeline


def _tiny_clip_tokenizer(directory):
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for suffix in ("", "</w>"):
        for letter in letters:
            vocab[letter + suffix] = len(vocab)
    merges = ["#version: 0.2"]
    for first, second in (("t", "h"), ("th", "e</w>"), ("a", "n</w>")):
        merges.append(f"{first} {second}")
        vocab[first + second] = len(vocab)
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("\n".join(merges) + "\n")
    return CLIPTokenizer(
        os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"), model_max_length=16
    )


@pytest.fixture(scope="module")
def pipeline_dir(ckpts, tmp_path_factory):
    from mindone.transformers import CLIPTextModel
    from transformers import CLIPTextConfig

    root = tmp_path_factory.mktemp("pipeline")
    tokenizer = _tiny_clip_tokenizer(str(root))
    with ms_loadpatch.disabled():
        unet = D.UNet2DConditionModel.from_pretrained(ckpts.path("UNet2DConditionModel", FP32))
        vae = D.AutoencoderKL.from_pretrained(ckpts.path("AutoencoderKL", FP32))
        config = CLIPTextConfig(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=8,
            intermediate_size=16,
            num_attention_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=8,
        )
        text_encoder = CLIPTextModel(config)
        pipe = D.StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=D.PNDMScheduler(skip_prk_steps=True, steps_offset=1),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipe.save_pretrained(str(root / "sd"))
    return str(root / "sd")


@pytest.mark.parametrize("target", [None, BF16], ids=["as-none", "as-bf16"])
@pytest.mark.parametrize("entry", ["DiffusionPipeline", "StableDiffusionPipeline"])
def test_pipeline(pipeline_dir, monkeypatch, entry, target):
    reports = _reports(monkeypatch)
    reference, accelerated = load_both(lambda: getattr(D, entry).from_pretrained(pipeline_dir, mindspore_dtype=target))
    assert type(accelerated) is type(reference) is D.StableDiffusionPipeline
    compared = 0
    for component in ("unet", "vae", "text_encoder"):
        assert_same_model(getattr(reference, component), getattr(accelerated, component))
        compared += len(list(getattr(accelerated, component).get_parameters()))
    assert compared > 300
    assert accelerated.tokenizer("the an cat").input_ids == reference.tokenizer("the an cat").input_ids
    assert accelerated.scheduler.config == reference.scheduler.config
    fast = {
        (r.library, r.model_class)
        for r in reports
        if r.technique.split(", cast to ")[0] == glue.DiffusersLoad.technique
    }
    assert {("diffusers", "UNet2DConditionModel"), ("diffusers", "AutoencoderKL")} <= fast, [
        r.summary() for r in reports
    ]
    assert ("transformers", "CLIPTextModel") in {(r.library, r.model_class) for r in reports}


@pytest.fixture(scope="module")
def cogvideox_pipeline_dir(tmp_path_factory):
    """CogVideoX's pipeline, tiny: its transformer (2b layout), its VAE, a T5
    encoder and tokenizer, its DDIM scheduler."""
    from mindone.transformers import T5EncoderModel
    from transformers import T5Config

    root = tmp_path_factory.mktemp("cogvideox-pipeline")
    tokenizer = tiny_t5_tokenizer()
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer),
                d_model=8,
                d_kv=4,
                d_ff=16,
                num_layers=1,
                num_heads=2,
                relative_attention_num_buckets=4,
            )
        )
        D.CogVideoXPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=D.AutoencoderKLCogVideoX(**tiny_cogvideox_vae()),
            transformer=D.CogVideoXTransformer3DModel(**tiny_cogvideox("2b")),
            scheduler=D.CogVideoXDDIMScheduler(),
        ).save_pretrained(str(root))
    return str(root)


@pytest.mark.parametrize("target", [None, BF16], ids=["as-none", "as-bf16"])
def test_cogvideox_pipeline(cogvideox_pipeline_dir, monkeypatch, target):
    reports = _reports(monkeypatch)
    with cpu_kernel_fallbacks():
        reference, accelerated = load_both(
            lambda: D.DiffusionPipeline.from_pretrained(cogvideox_pipeline_dir, mindspore_dtype=target)
        )
    assert type(accelerated) is type(reference) is D.CogVideoXPipeline
    for component in ("transformer", "vae", "text_encoder"):
        assert_same_model(getattr(reference, component), getattr(accelerated, component))
    assert accelerated.tokenizer("a cat walks").input_ids == reference.tokenizer("a cat walks").input_ids
    assert accelerated.scheduler.config == reference.scheduler.config
    fast = {
        (r.library, r.model_class)
        for r in reports
        if r.technique.split(", cast to ")[0] == glue.DiffusersLoad.technique
    }
    assert {("diffusers", "CogVideoXTransformer3DModel"), ("diffusers", "AutoencoderKLCogVideoX")} <= fast, [
        r.summary() for r in reports
    ]
    assert ("transformers", "T5EncoderModel") in {(r.library, r.model_class) for r in reports}
