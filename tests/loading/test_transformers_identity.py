"""Bit identity of the accelerated mindone.transformers load against the
unpatched one, in the same process: every parameter and buffer (names,
shapes, dtypes, bits, requires_grad, Parameter.name, ties), the loading
info, the config, and a forward pass where the CPU backend can run it.

Architectures: Qwen2 (tied embeddings), Llama (untied), Mixtral (experts,
a buffer), T5 (`_keep_in_fp32_modules`), BERT. Forward passes run for Qwen2
only: the CPU wheel lacks kernels the others call (Llama: "Not implement";
Mixtral: TopkExt; T5: Clone; BERT: LayerNormExt).
"""

import json
import os

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
import transformers as hf
from _helpers import tiny_transformers
from safetensors.numpy import load_file, save_file

import ms_loadpatch
from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.building import state
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both

ARCHS = tiny_transformers("qwen2", "llama", "mixtral", "t5", "bert")
# (file dtype, sharded)
LAYOUTS = {
    "fp32": (None, False),
    "fp32-sharded": (None, True),
    "fp16": (ms.float16, False),
    "bf16-sharded": (ms.bfloat16, True),
}
TARGETS = {"none": None, "float16": ms.float16, "bfloat16": ms.bfloat16, "float32": ms.float32}


pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> layout -> directory, each written by mindone's save_pretrained."""
    root = tmp_path_factory.mktemp("tf_ckpts")
    out = {}
    with cpu_kernel_fallbacks():
        for arch, (cls, make_config) in ARCHS.items():
            ms.set_seed(0)
            model = cls(make_config())
            out[arch] = {}
            for layout, (dtype, sharded) in LAYOUTS.items():
                if dtype is not None:
                    model.to(dtype)
                directory = root / f"{arch}-{layout}"
                model.save_pretrained(str(directory), **({"max_shard_size": "24KB"} if sharded else {}))
                out[arch][layout] = str(directory)
    return out


def _load(cls, path, **kwargs):
    return cls.from_pretrained(path, output_loading_info=True, **kwargs)


def _assert_identical_loads(cls, path, **kwargs):
    (ref, ref_info), (acc, acc_info) = load_both(lambda: _load(cls, path, **kwargs))
    report = last_report()
    assert report is not None and report.model_class == cls.__name__ and report.tensors_assigned > 0, (
        "the patched load did not go through the accelerated path"
    )
    assert acc_info == ref_info
    assert_same_model(ref, acc)
    assert acc.config.to_dict() == ref.config.to_dict()
    assert not any(p.has_init for p in acc.get_parameters()), "a parameter was left lazy"
    return ref, acc, report


def _matrix_subset(arch, layout):
    # .ci/matrix runs one architecture in every target dtype on every mindspore version
    marks = [pytest.mark.matrix] if (arch, layout) in {("qwen2", "fp32"), ("qwen2", "bf16-sharded")} else []
    return pytest.param(arch, layout, marks=marks, id=f"{arch}-{layout}")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("arch,layout", [_matrix_subset(arch, layout) for arch in ARCHS for layout in LAYOUTS])
def test_identical_to_unpatched(checkpoints, arch, layout, target):
    cls = ARCHS[arch][0]
    kwargs = {} if TARGETS[target] is None else {"mindspore_dtype": TARGETS[target]}
    ref, acc, report = _assert_identical_loads(cls, checkpoints[arch][layout], **kwargs)
    expected_files = len([f for f in os.listdir(checkpoints[arch][layout]) if f.endswith(".safetensors")])
    assert report.shards == expected_files
    file_dtype = LAYOUTS[layout][0] or ms.float32
    model_dtype = TARGETS[target] or ms.float32
    # cast exactly when some dtype differs (T5 keeps `wo` in fp32): no round trip through fp32
    assert (report.tensors_cast > 0) == any(p.dtype != file_dtype for p in acc.get_parameters())
    assert model_dtype in {p.dtype for p in acc.get_parameters()}


def test_dtype_keyword(checkpoints):
    _assert_identical_loads(mt.LlamaForCausalLM, checkpoints["llama"]["fp32"], dtype=ms.bfloat16)


def test_keep_in_fp32_modules_stay_fp32(checkpoints):
    _, acc, _ = _assert_identical_loads(
        mt.T5ForConditionalGeneration, checkpoints["t5"]["fp32"], mindspore_dtype=ms.float16
    )
    dtypes = {name: p.dtype for name, p in acc.parameters_and_names()}
    assert {d for n, d in dtypes.items() if ".wo." in n} == {ms.float32}
    assert ms.float16 in set(dtypes.values())


def test_tied_weights_are_one_parameter(checkpoints):
    _, acc, _ = _assert_identical_loads(mt.Qwen2ForCausalLM, checkpoints["qwen2"]["fp32"])
    assert acc.lm_head.weight is acc.model.embed_tokens.embedding_table


def test_parallel_shard_loading(checkpoints, monkeypatch):
    monkeypatch.setenv("HF_ENABLE_PARALLEL_LOADING", "1")
    monkeypatch.setenv("HF_PARALLEL_LOADING_WORKERS", "3")
    _, _, report = _assert_identical_loads(
        mt.MixtralForCausalLM, checkpoints["mixtral"]["bf16-sharded"], mindspore_dtype=ms.float32
    )
    assert report.read_workers == 3 and report.shards > 3


def test_forward_pass_identical(checkpoints):
    ids = ms.Tensor(np.arange(12).reshape(1, 12) % 100, ms.int32)
    for layout in ("fp32", "bf16-sharded"):
        ref, acc = load_both(lambda: mt.Qwen2ForCausalLM.from_pretrained(checkpoints["qwen2"][layout]))  # noqa: B023
        expected, actual = ref(ids)[0].asnumpy(), acc(ids)[0].asnumpy()
        assert np.array_equal(expected.view(np.uint32), actual.view(np.uint32))


def _edit_checkpoint(src, dst, edit):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".json"):
            with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(edit(tensors), os.path.join(dst, "model.safetensors"), metadata={"format": "np"})
    return dst


def test_missing_and_unexpected_keys(checkpoints, tmp_path):
    """Weights the checkpoint lacks get exactly the unpatched values (their
    initializers' draws, taken in the unpatched order), as fp32 and cast."""
    dropped = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"]

    def edit(tensors):
        for key in dropped:
            del tensors[key]
        tensors["model.extra_head.weight"] = np.ones((4, 4), np.float32)
        return tensors

    path = _edit_checkpoint(checkpoints["qwen2"]["fp32"], str(tmp_path / "qwen2-missing"), edit)
    for kwargs in ({}, {"mindspore_dtype": ms.bfloat16}):
        (ref, ref_info), (acc, acc_info) = load_both(lambda: _load(mt.Qwen2ForCausalLM, path, **kwargs))  # noqa: B023
        assert acc_info == ref_info
        assert set(dropped) <= set(acc_info["missing_keys"]) and acc_info["unexpected_keys"] == [
            "model.extra_head.weight"
        ]
        assert_same_model(ref, acc)
        # the norm's weight is made from a tensor (never lazy): the other two are filled
        assert last_report().missing_initialised == 2 and last_report().draws_taken > 0
        params = dict(acc.parameters_and_names())
        assert not any(p.has_init for p in params.values())
        # initialised as mindone does: Normal(0, initializer_range) weights, zero bias, ones norm
        weight = params["model.layers.1.mlp.up_proj.weight"].astype(ms.float32).asnumpy()
        assert abs(weight.std() - acc.config.initializer_range) < 0.25 * acc.config.initializer_range
        assert not params["model.layers.0.self_attn.q_proj.bias"].astype(ms.float32).asnumpy().any()
        assert np.array_equal(params["model.norm.weight"].astype(ms.float32).asnumpy(), np.ones(32, np.float32))


def test_mismatched_sizes_ignored(checkpoints, tmp_path):
    def edit(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"] = np.ones((32, 32), np.float32)  # model has (32, 64)
        return tensors

    path = _edit_checkpoint(checkpoints["llama"]["fp32"], str(tmp_path / "llama-mismatch"), edit)
    key = "model.layers.0.mlp.down_proj.weight"
    (ref, ref_info), (acc, acc_info) = load_both(lambda: _load(mt.LlamaForCausalLM, path, ignore_mismatched_sizes=True))
    assert acc_info == ref_info and [k[0] for k in acc_info["mismatched_keys"]] == [key]
    assert_same_model(ref, acc)  # the mismatched weight too: its initializer's unpatched draw
    weight = dict(acc.parameters_and_names())[key]
    assert not weight.has_init and weight.shape == (32, 64)
    with ms_loadpatch.disabled(), pytest.raises(RuntimeError, match="size mismatch"):
        mt.LlamaForCausalLM.from_pretrained(path)
    with pytest.raises(RuntimeError, match="size mismatch"):
        mt.LlamaForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("method,args", [("half", ()), ("float", ()), ("to", (ms.bfloat16,)), ("to", (ms.float32,))])
def test_half_float_to_in_place(checkpoints, method, args):
    ref, acc = load_both(lambda: mt.T5ForConditionalGeneration.from_pretrained(checkpoints["t5"]["fp16"]))
    with ms_loadpatch.disabled():
        ref_out = getattr(ref, method)(*args)
    acc_params = {id(p) for p in acc.get_parameters()}
    acc_out = getattr(acc, method)(*args)
    assert ref_out is ref and acc_out is acc
    assert {id(p) for p in acc.get_parameters()} == acc_params, "cast must keep the Parameter objects"
    assert_same_model(ref, acc)


def test_load_state_dict_direct_call(checkpoints):
    from mindone.transformers.modeling_utils import load_state_dict

    path = os.path.join(checkpoints["llama"]["fp16"], "model.safetensors")
    with ms_loadpatch.disabled():
        expected = load_state_dict(path)
    actual = load_state_dict(path)
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert isinstance(actual[key], ms.Parameter)
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape
        assert np.array_equal(actual[key].asnumpy().view(np.uint16), value.asnumpy().view(np.uint16))


def test_from_config_uses_fast_cast(checkpoints):
    with open(os.path.join(checkpoints["llama"]["fp32"], "config.json")) as f:
        config = hf.LlamaConfig(**json.load(f))
    model = mt.LlamaForCausalLM._from_config(config, dtype=ms.bfloat16)
    assert {p.dtype for p in model.get_parameters()} == {ms.bfloat16}
    assert not any(p.has_init for p in model.get_parameters())


def _walks_of_both_loads(checkpoints, monkeypatch, method, counts):
    """Patch nn.Cell.`method` to record the class of each call `counts(args,
    kwargs, caller)` accepts; load a sharded Qwen2 unpatched, then patched.
    Returns (shards, unpatched walks, patched walks, (ref, ref_info), (acc, acc_info))."""
    import sys

    walks = []
    original = getattr(ms.nn.Cell, method)

    def counting(self, *args, **kwargs):
        if counts(args, kwargs, sys._getframe(1).f_code.co_name):
            walks.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ms.nn.Cell, method, counting)
    path = checkpoints["qwen2"]["fp32-sharded"]
    shards = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
    assert shards > 1
    with ms_loadpatch.disabled():
        unpatched = _load(mt.Qwen2ForCausalLM, path)
    unpatched_walks = list(walks)
    walks.clear()
    patched = _load(mt.Qwen2ForCausalLM, path)
    assert last_report().tensors_assigned > 0
    assert patched[1] == unpatched[1]
    assert_same_model(unpatched[0], patched[0])
    return shards, unpatched_walks, walks, unpatched, patched


def test_one_state_dict_walk_per_load(checkpoints, monkeypatch):
    """mindone's missing-key check and the key conversion share one
    model.state_dict() walk; the cells are left as an unpatched load leaves
    them (mindspore makes its hook dicts on first read)."""
    # not the recursion into child cells
    shards, unpatched, patched, (ref, _), (acc, _) = _walks_of_both_loads(
        checkpoints, monkeypatch, "state_dict", lambda args, kwargs, _: not args and kwargs.get("destination") is None
    )
    assert unpatched == ["Qwen2ForCausalLM"] * (1 + shards)  # the key check, then one per shard
    assert patched == ["Qwen2ForCausalLM"]
    skip = (building.CellInitTemplate.PER_INSTANCE_TIME, "init_tensor")  # per instance; never drawn lazily (README)
    assert state.model_state(acc, skip) == state.model_state(ref, skip)


def test_one_pt2ms_walk_per_load(checkpoints, monkeypatch):
    """mindone's _get_pt2ms_mappings walks the model for _load_pretrained_model
    and again per shard's key conversion; an accelerated load walks once."""
    shards, unpatched, patched, _, _ = _walks_of_both_loads(
        checkpoints, monkeypatch, "cells_and_names", lambda args, kwargs, caller: caller == "_get_pt2ms_mappings"
    )
    assert unpatched == ["Qwen2ForCausalLM"] * (1 + shards)
    assert patched == ["Qwen2ForCausalLM"]


class _LateCellQwen2(mt.Qwen2ForCausalLM):
    """Adds a cell after post_init: its init pass never visits it, so the cell
    keeps its own initializer (ones / zeros here, not Qwen2's `_init_weights`
    normal draw) and gets no `_is_hf_initialized`."""

    def __init__(self, config):
        super().__init__(config)
        self.late = ms.nn.Dense(4, 4, weight_init="ones", bias_init="zeros")


class _NoPostInitQwen2(mt.Qwen2ForCausalLM):
    """A model that never reaches post_init itself: only the inner
    Qwen2Model's init pass runs; its own cells keep their initializers."""

    def __init__(self, config):
        super(mt.Qwen2ForCausalLM, self).__init__(config)  # skips Qwen2ForCausalLM.__init__ and its post_init
        self.model = mt.Qwen2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = ms.nn.Dense(config.hidden_size, config.vocab_size, has_bias=False, weight_init="ones")
        self.extra = ms.nn.Dense(4, 4, weight_init="ones", bias_init="zeros")


# (model, parameters built lazily and then filled): the late cell is built after the window closed;
# of no-post-init's three missing weights, lm_head's is tied to the loaded embedding
@pytest.mark.parametrize("cls,filled", [(_LateCellQwen2, 0), (_NoPostInitQwen2, 2)], ids=["late-cell", "no-post-init"])
def test_cells_no_init_pass_visited_left_as_unpatched(checkpoints, cls, filled):
    """Weights the checkpoint lacks, in cells post_init's init pass never
    visited, get their own initializers' values (bit-identical to an
    unpatched load), and the cells' state is the unpatched one."""
    path = checkpoints["qwen2"]["fp32"]
    (ref, ref_info), (acc, acc_info) = load_both(lambda: _load(cls, path))
    assert last_report().tensors_assigned > 0 and last_report().missing_initialised == filled
    assert acc_info == ref_info and ref_info["missing_keys"]
    assert_same_model(ref, acc)
    skip = (building.CellInitTemplate.PER_INSTANCE_TIME, "init_tensor")
    assert state.model_state(acc, skip) == state.model_state(ref, skip)


class _StrictFp32Qwen2(mt.Qwen2ForCausalLM):
    """Keeps its MLPs in fp32 when loaded as bf16: the cast guessed while
    reading (bf16) does not fit them."""

    _keep_in_fp32_modules_strict = ["mlp"]


class _FloatBufferQwen2(mt.Qwen2ForCausalLM):
    """A persistent float buffer, written to the checkpoint by the test
    (save_pretrained leaves buffers out): Cell.load_state_dict copies
    buffers its own way, from the file's values."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("scale", ms.Tensor(np.linspace(-3, 3, 8).astype(np.float32) / 7))


class _Conv1dQwen2(mt.Qwen2ForCausalLM):
    """An nn.Conv1d, whose weight mindone's key mapping reshapes (expand_dims),
    written by the test as a torch checkpoint holds it (out, in, kernel)."""

    def __init__(self, config):
        super().__init__(config)
        self.conv = ms.nn.Conv1d(4, 4, 3, has_bias=True, weight_init="normal", bias_init="normal")


@pytest.mark.parametrize(
    "cls",
    [_StrictFp32Qwen2, _FloatBufferQwen2, _Conv1dQwen2],
    ids=["keep-fp32-strict", "float-buffer", "conv1d-mapping"],
)
def test_cast_while_reading_gives_way_to_the_file_values(tmp_path, cls):
    """A load asked for bf16 casts fp32 tensors to bf16 while reading them.
    Where that guess does not fit (a parameter kept in fp32, a buffer, a
    tensor a key mapping transforms) the file's values are read again and go
    mindone's way: bit-identical to an unpatched load, same cells' state."""
    with cpu_kernel_fallbacks():
        ms.set_seed(0)
        cls(ARCHS["qwen2"][1]()).save_pretrained(str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    if cls is _FloatBufferQwen2:
        assert "scale" not in tensors
        tensors["scale"] = np.linspace(5, -5, 8).astype(np.float32) / 3
    if cls is _Conv1dQwen2:
        tensors["conv.weight"] = tensors["conv.weight"].squeeze(-2)
    save_file(tensors, path, metadata={"format": "np"})
    ref, acc, report = _assert_identical_loads(cls, str(tmp_path), mindspore_dtype=ms.bfloat16)
    assert report.tensors_cast_while_reading > 0 and report.tensors_read_again > 0, report.summary()
    assert "while reading" in report.technique
    skip = (building.CellInitTemplate.PER_INSTANCE_TIME, "init_tensor")
    assert state.model_state(acc, skip) == state.model_state(ref, skip)
