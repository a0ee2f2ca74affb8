"""sibling-clone (ms_loadpatch/strategy/building/sibling_clone.py): what it
copies (MoE experts of every family, cells holding computed tensors, rotary
tables) and what it leaves to __init__ (bf16 tensors, cells that differ
between builds, a config changed between builds); what the load report and
status() say about it.
"""

import re

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
import transformers as hf
from _building_helpers import (
    MOE_FAMILIES,
    TF_ARCHS,
    assert_same_state,
    checkpoints,  # noqa: F401  (a fixture)
    sibling_clone_technique,
    techniques_off,
)
from mindspore import nn

import ms_loadpatch
from ms_loadpatch import techniques
from ms_loadpatch.strategy import building, reports
from ms_loadpatch.strategy.building.construction import lazy_construction

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


def test_moe_experts_are_copied_and_same_objects():
    cls, config = TF_ARCHS["mixtral"]
    technique = sibling_clone_technique()
    before = technique.cloned
    ms.set_seed(1)
    with techniques_off("sibling-clone"), lazy_construction(fast=True):
        plain = cls(config())
    with lazy_construction(fast=True):
        fast = cls(config())
    assert technique.cloned - before >= 10  # 2 layers x 8 experts: all but the first builds copied
    assert_same_state(plain, fast)
    names = [n for n, _ in fast.parameters_and_names()]
    assert names == [n for n, _ in plain.parameters_and_names()] and len(set(names)) == len(names)
    assert len({id(p) for p in fast.get_parameters()}) == len(list(plain.get_parameters()))


def _expert_classes(model):
    return {type(cell).__name__ for name, cell in model.cells_and_names() if re.search(r"\.experts\.\d+$", name)}


def _built_plain_and_fast(cls, config, monkeypatch):
    """(plain build with sibling-clone off, its build report, fast build, its build report) of one config."""
    # the init pass is not construction (and runs kernels a lazy build has no values for)
    monkeypatch.setattr(mt.modeling_utils, "_init_weights", False)
    ms.set_seed(1)
    with techniques_off("sibling-clone"), lazy_construction(fast=True):
        plain = cls(config())
    plain_build = techniques.last_build()
    with lazy_construction(fast=True):
        fast = cls(config())
    return plain, plain_build, fast, techniques.last_build()


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_every_moe_family_copies_its_experts(arch, monkeypatch):
    plain, plain_build, fast, build = _built_plain_and_fast(*TF_ARCHS[arch], monkeypatch)
    assert plain_build["cells_copied"] == 0
    experts = _expert_classes(fast)
    assert experts and not any(name.rsplit(".", 1)[-1] in experts for name in build["not_copied"]), build
    assert build["cells_copied"] >= 2 * (8 - 3)  # 2 layers x 8 experts, all but the first three of a layer
    assert_same_state(plain, fast)
    # a copy refers to what the plain build refers to: the model's own config where it keeps one
    for (name, p), (_, f) in zip(plain.cells_and_names(), fast.cells_and_names()):
        if "config" in vars(p):
            assert (vars(p)["config"] is plain.config) == (vars(f)["config"] is fast.config), name


class _Rotary(nn.Cell):
    """A rotary table computed by ops in __init__ and held twice, as mindone's per-attention rotary embeddings do."""

    def __init__(self, dim, bf16=False):
        super().__init__()
        self.inv_freq = (1.0 / (10000 ** (ms.ops.ones(dim // 2).cumsum(0) / dim))).astype(
            ms.bfloat16 if bf16 else ms.float32
        )
        self.original_inv_freq = self.inv_freq
        self.register_buffer("positions", ms.Tensor(np.arange(4, dtype=np.int64)) * 2, persistent=False)
        self.proj = ms.mint.nn.Linear(dim, dim)


_Rotary.__module__ = "mindone.ms_loadpatch_test_cells"  # stands for a library cell, as _Counted below


def test_cells_holding_computed_tensors_are_copied_with_their_own():
    technique = sibling_clone_technique()
    ms.set_seed(1)
    with techniques_off("sibling-clone"), lazy_construction(fast=True):
        plain = nn.CellList([_Rotary(8) for _ in range(6)])
    before = technique.cloned
    with lazy_construction(fast=True):
        fast = nn.CellList([_Rotary(8) for _ in range(6)])
    # the first build hooks the class, the second is noted, the next two teach the recipe
    assert technique.cloned - before == 2
    assert_same_state(plain, fast)  # values, dtype, shape, device; the second reference is the same tensor
    copies = list(fast)[3:]  # the last real build and the two copies
    assert all(c.original_inv_freq is c.inv_freq for c in copies)
    assert len({id(c.inv_freq) for c in fast}) == 6 and len({id(c._buffers["positions"]) for c in fast}) == 6
    copies[0].inv_freq[0] = 5.0  # each copy's memory is its own
    assert [c.inv_freq.asnumpy()[0] for c in copies] == [5.0] + [plain[0].inv_freq.asnumpy()[0]] * 2


def test_bf16_tensors_leave_the_build_to_init():
    technique = sibling_clone_technique()
    with lazy_construction(fast=True):
        built = [_Rotary(8, bf16=True) for _ in range(6)]
        assert technique.reasons[_Rotary] == "not copyable: a BFloat16 tensor"
        assert technique.builds[_Rotary][1] == 0  # none copied (its Linear is, from the fourth build)
    assert all(c.inv_freq.dtype == ms.bfloat16 for c in built)


ROTARY_PER_ATTENTION = {  # families that build a rotary embedding in every attention layer: copies from the fourth
    "jetmoe": (
        mt.JetMoeForCausalLM,
        lambda: hf.JetMoeConfig(
            vocab_size=128,
            hidden_size=32,
            num_key_value_heads=2,
            kv_channels=8,
            num_hidden_layers=6,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "dbrx": (
        mt.DbrxForCausalLM,
        lambda: hf.DbrxConfig(
            vocab_size=128,
            d_model=32,
            n_heads=4,
            n_layers=6,
            attn_config={"kv_n_heads": 2},
            ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
        ),
    ),
}


@pytest.mark.parametrize("arch", list(ROTARY_PER_ATTENTION))
def test_rotary_tables_are_copied_and_same_objects(arch, monkeypatch):
    plain, _, fast, build = _built_plain_and_fast(*ROTARY_PER_ATTENTION[arch], monkeypatch)
    assert not any(name.endswith("RotaryEmbedding") for name in build["not_copied"]), build
    assert build["cells_copied"] >= 2
    assert_same_state(plain, fast)
    rotary = [cell for _, cell in fast.cells_and_names() if type(cell).__name__.endswith("RotaryEmbedding")]
    assert len(rotary) == 6 and len({id(cell.inv_freq) for cell in rotary}) == 6


def test_load_report_and_status_say_what_was_copied_and_why_not(checkpoints):
    cls, path = checkpoints["qwen3_moe"]
    with ms_loadpatch.enabled():
        cls.from_pretrained(path)
    report = reports.last_report()
    assert report.cells_copied > 0 and f"({report.cells_copied} cells copied)" in report.summary()
    # every norm's weight (Parameter(mint.ones(n))): 2 layers x 4 norms and the final one
    assert report.host_tensors >= 9 and f"{report.host_tensors} factory tensors made on the host" in report.summary()
    # norms hold parameters made from tensors (never lazy): built by __init__, and said so
    norm = next(name for name in report.not_copied if name.endswith("Qwen3MoeRMSNorm"))
    assert "not lazy" in report.not_copied[norm]
    build = ms_loadpatch.status()["last_build"]
    assert build == {
        "engaged_at": 0,
        "cells_copied": report.cells_copied,
        "not_copied": report.not_copied,
        "host_tensors": report.host_tensors,
    }


class _Inner(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.proj = ms.mint.nn.Linear(width, width)


class _Outer(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.inner = _Inner(width)


_Inner.__module__ = _Outer.__module__ = "mindone.ms_loadpatch_test_cells"


def test_the_report_says_a_class_was_copied_only_within_its_parents():
    with lazy_construction(fast=True):
        nn.CellList([_Outer(4) for _ in range(6)])
    not_copied = techniques.last_build()["not_copied"]
    # _Outer's fifth and sixth builds are copies, its _Inner copied with them; _Inner alone never was
    assert not_copied[f"{_Inner.__module__}._Inner"] == "copied only within the cells that hold it", not_copied
    assert f"{_Outer.__module__}._Outer" not in not_copied


def test_a_block_of_copied_experts_gets_no_recipe_of_its_own():
    experts = building.SiblingClone.COPIES_INSIDE_LIMIT + 4

    def config():
        return hf.MixtralConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=16,
            num_local_experts=experts,
            num_experts_per_tok=2,
        )

    technique = sibling_clone_technique()
    ms.set_seed(1)
    with techniques_off("sibling-clone"), lazy_construction(fast=True):
        plain = mt.MixtralForCausalLM(config())
    before = technique.cloned
    with lazy_construction(fast=True):
        fast = mt.MixtralForCausalLM(config())
        learnt = {key[0].__name__: entry[0] for key, entry in technique.entries.items()}
    assert learnt["MixtralSparseMoeBlock"] == "never"  # built by its own __init__ in every layer
    assert learnt["MixtralBlockSparseTop2MLP"] == "recipe"
    assert technique.cloned - before >= 4 * experts - 3  # every expert after the first three still copied
    assert_same_state(plain, fast)


class _Counted(nn.Cell):
    """Each build differs (a class-level counter): never copied."""

    builds = 0

    def __init__(self, width):
        super().__init__()
        _Counted.builds += 1
        self.index = _Counted.builds
        self.proj = ms.mint.nn.Linear(width, width)


class _Sized(nn.Cell):
    """Reads its config at build time."""

    def __init__(self, config):
        super().__init__()
        self.proj = ms.mint.nn.Linear(config.width, config.width)


# these stand for library cells (sibling-clone copies only mindspore's and mindone's)
_Counted.__module__ = _Sized.__module__ = "mindone.ms_loadpatch_test_cells"


def test_cells_that_differ_between_builds_are_not_copied():
    with lazy_construction(fast=True):
        built = [_Counted(3) for _ in range(6)]
    assert [c.index for c in built] == [c.index for c in sorted(built, key=lambda c: c.index)]
    assert len({c.index for c in built}) == 6


def test_a_config_changed_between_builds_is_seen():
    class Config:
        width = 2

    config = Config()
    config.width = 2
    widths = [2, 2, 2, 2, 3, 3, 2]
    with lazy_construction(fast=True):
        built = []
        for width in widths:
            config.width = width
            built.append(_Sized(config))
    assert [c.proj.weight.shape[0] for c in built] == widths
