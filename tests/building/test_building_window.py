"""The construction window (ms_loadpatch/strategy/building/window.py): what
it installs and restores, where a build starts taking the fast paths
(MS_LOADPATCH_FAST_CONSTRUCTION_FROM, the checkpoint's size), a build that
fails inside it, and the parameter-name refresh of init_weights inside a
fast window and outside.
"""

import json
import os

import mindone.transformers as mt
import mindspore as ms
import pytest
import transformers as hf
from _building_helpers import (
    checkpoints,  # noqa: F401  (a fixture)
    ms_factory,
    sibling_clone_technique,
)
from mindspore import nn

import ms_loadpatch
from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.building import window
from ms_loadpatch.strategy.building.construction import lazy_construction
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
from ms_loadpatch.testing import cpu_kernel_fallbacks

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


# -- what a window installs, and restores when it closes


def test_window_installs_and_restores():
    import gc
    import inspect

    from mindspore.ops.operations.other_ops import Load
    from mindspore.ops.primitive import Primitive

    originals = {k: vars(nn.Cell)[k] for k in ("__init__", "update_parameters_name")}
    linear_init, relu_has_init = vars(ms.mint.nn.Linear)["__init__"], "__init__" in vars(nn.ReLU)
    primitive_init, load_init = vars(Primitive)["__init__"], vars(Load)["__init__"]
    count = nn.Cell.total_instance_count
    primitive_module = ms.ops.prim_attr_register.__globals__
    factories = {name: ms_factory(name) for name in ("mint.ones", "mint.zeros", "mint.empty", "ops.ones", "ops.zeros")}
    with CONSTRUCTION_LOCK, lazy_construction(fast=True):
        assert all(ms_factory(name) is not f for name, f in factories.items())
        assert all(vars(nn.Cell)[k] is not v for k, v in originals.items())
        assert primitive_module["inspect"] is not inspect
        assert not gc.isenabled()
        built = [ms.mint.nn.Linear(2, 2) for _ in range(4)] + [nn.ReLU() for _ in range(2)]
        assert vars(ms.mint.nn.Linear)["__init__"] is not linear_init  # hooked for sibling-clone
        assert vars(Primitive)["__init__"] is not primitive_init and vars(Load)["__init__"] is not load_init
    assert vars(Primitive)["__init__"] is primitive_init and vars(Load)["__init__"] is load_init
    assert all(vars(nn.Cell)[k] is v for k, v in originals.items())
    assert all(ms_factory(name) is f for name, f in factories.items())
    assert vars(ms.mint.nn.Linear)["__init__"] is linear_init and ("__init__" in vars(nn.ReLU)) == relu_has_init
    assert primitive_module["inspect"] is inspect and gc.isenabled()
    assert nn.Cell.total_instance_count == count + 6  # the deferred count is added when the window closes
    del built


# -- where a build starts taking the fast paths


_START_CHILD = r"""
import json, os, sys
import mindspore as ms
import transformers as hf
import mindone.transformers as mt
import ms_loadpatch
from ms_loadpatch.strategy import building, switch
from ms_loadpatch.strategy.building import probe, state, window
from ms_loadpatch.strategy.building.construction import lazy_construction
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both

config = lambda: hf.MixtralConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=16, num_local_experts=8)
clone = next(t for t in building.TECHNIQUES if t.name == "sibling-clone")
with cpu_kernel_fallbacks():
    with lazy_construction(fast=True):
        fast = mt.MixtralForCausalLM(config())
    out = {"start": window.start_after_cells(), "probed": building._probe_results.as_dict(),
           "engaged_at": window.state.engaged_at, "cloned": clone.cloned, "leftovers": building.leftovers(),
           "cells": sum(1 for _ in fast.cells_and_names())}
    with lazy_construction(fast=False):
        plain = mt.MixtralForCausalLM(config())
    expected, actual = state.model_state(plain), state.model_state(fast)
    out["same_state"] = expected == actual or state.first_difference(expected, actual)
    with lazy_construction(fast=True):
        mt.MixtralForCausalLM(config())
    building.technique_status()  # runs the probes now if the build did not
    out["engaged_after_probes"] = window.state.engaged_at
    if sys.argv[1:]:  # and a load from the checkpoint, against an unpatched one
        cls = mt.MixtralForCausalLM
        reference, accelerated = load_both(lambda: cls.from_pretrained(sys.argv[1]))
        assert_same_model(reference, accelerated)
        out["loaded_same"] = True
        out["leftovers_after_load"] = building.leftovers()
        out["report_from"] = ms_loadpatch.last_report().fast_construction_from
        out["summary"] = ms_loadpatch.last_report().summary()
print("RESULT " + json.dumps(out))
"""


def _start_child(python_proc, start, *args):
    env = {} if start is None else {window.START_ENV_VAR: str(start)}
    proc = python_proc(["-c", _START_CHILD, *args], env_extra=env, env_drop=(window.START_ENV_VAR,))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_default_start_builds_a_small_model_plainly(python_proc, checkpoints):
    """Unset, a model of fewer cells than DEFAULT_START never runs the shared
    probes nor installs a technique but the early one (host-factories, on its
    own small probe), built or loaded; the load report says so."""
    out = _start_child(python_proc, None, checkpoints["mixtral"][1])
    assert out["start"] == window.DEFAULT_START and out["cells"] < window.DEFAULT_START
    assert out["probed"] == {"host-factories": None} and out["engaged_at"] is None and out["cloned"] == 0
    assert out["engaged_after_probes"] is None  # the probes' own windows do not count as the build's
    assert out["same_state"] is True and out["leftovers"] == []
    assert out["loaded_same"] and out["report_from"] is None and "fast construction" not in out["summary"]


def test_techniques_engage_mid_build_same_model(python_proc, checkpoints):
    """With the start inside the build, the probes run there (first in this
    process), the techniques take over the rest of it, and the model built
    and the model loaded equal plain / unpatched ones."""
    out = _start_child(python_proc, 40, checkpoints["mixtral"][1])
    assert out["start"] == 40 and out["cells"] > 40
    assert out["probed"] and all(reason is None for reason in out["probed"].values()), out["probed"]
    assert out["engaged_at"] == 40 and out["engaged_after_probes"] == 40
    assert out["cloned"] > 0  # experts after the start were copied
    assert out["same_state"] is True, out["same_state"]
    assert out["loaded_same"] and out["leftovers"] == [] and out["leftovers_after_load"] == []
    assert out["report_from"] == 40 and "fast construction from cell 40" in out["summary"]


def test_start_from_the_checkpoint_size(monkeypatch):
    """Unset, a build for a checkpoint of EARLY_START_TENSORS or more
    tensors engages at its first cell (its model passes DEFAULT_START
    cells); a smaller or unknown one at DEFAULT_START; a value set wins."""
    monkeypatch.delenv(window.START_ENV_VAR, raising=False)
    early = window.EARLY_START_TENSORS
    assert window.start_after_cells() == window.DEFAULT_START
    assert window.start_after_cells(checkpoint_tensors=early - 1) == window.DEFAULT_START
    assert window.start_after_cells(checkpoint_tensors=early) == 0
    monkeypatch.setenv(window.START_ENV_VAR, "40")
    assert window.start_after_cells(checkpoint_tensors=10 * early) == 40


_LARGE_CHILD = r"""
import json, sys
import mindone.transformers as mt
import ms_loadpatch
from ms_loadpatch.strategy import building
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both

with cpu_kernel_fallbacks():
    reference, accelerated = load_both(lambda: mt.MixtralForCausalLM.from_pretrained(sys.argv[1]))
    assert_same_model(reference, accelerated)
report = ms_loadpatch.last_report()
print("RESULT " + json.dumps({"report_from": report.fast_construction_from, "cells_copied": report.cells_copied,
                              "tensors": report.tensors_read, "leftovers": building.leftovers()}))
"""


@pytest.fixture(scope="module")
def large_checkpoints(tmp_path_factory):
    """A Mixtral of more than EARLY_START_TENSORS tensors (2 layers x 100
    experts), as one file and sharded (an index listing them)."""
    root = tmp_path_factory.mktemp("large")
    config = hf.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=8,
        num_local_experts=100,
        num_experts_per_tok=2,
    )
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        ms.set_seed(0)
        model = mt.MixtralForCausalLM(config)
        model.save_pretrained(str(root / "single"))
        model.save_pretrained(str(root / "sharded"), max_shard_size="200KB")
    return {"single": str(root / "single"), "sharded": str(root / "sharded")}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_large_checkpoint_engages_from_the_first_cell(python_proc, large_checkpoints, layout):
    """With the start unset, loading a checkpoint of more than
    EARLY_START_TENSORS tensors (counted from the single file mindone reads
    before building, or from the index) takes the fast paths from the
    build's first cell, and the model equals an unpatched load."""
    path = large_checkpoints[layout]
    assert (layout == "sharded") == os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    proc = python_proc(["-c", _LARGE_CHILD, path], env_drop=(window.START_ENV_VAR,))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["tensors"] >= window.EARLY_START_TENSORS
    assert out["report_from"] == 0 and out["cells_copied"] > 0 and out["leftovers"] == []


def test_bad_start_value_is_ignored(monkeypatch, caplog):
    from ms_loadpatch import activation

    monkeypatch.setattr(activation, "_warned", set())
    monkeypatch.setenv(window.START_ENV_VAR, "many")
    assert window.start_after_cells() == window.DEFAULT_START
    assert window.START_ENV_VAR in caplog.text
    monkeypatch.setenv(window.START_ENV_VAR, "0")
    assert window.start_after_cells() == 0


# -- a build failing inside the window


def test_an_exception_in_the_window_leaves_nothing_behind():
    """A build that fails after cells were copied: every class __init__, nn.Cell
    method, gc and the cell count are back, and the next build is plain again."""
    import gc

    class Failing(nn.Cell):
        def __init__(self):
            super().__init__()
            raise RuntimeError("failing on purpose")

    count = nn.Cell.total_instance_count
    linear_init = vars(ms.mint.nn.Linear)["__init__"]
    technique = sibling_clone_technique()
    before = technique.cloned
    with pytest.raises(RuntimeError, match="on purpose") as caught:
        with lazy_construction(fast=True):
            built = [ms.mint.nn.Linear(2, 2) for _ in range(6)]
            Failing()
    assert technique.cloned > before  # the failure came after copies were made
    assert building.leftovers() == []
    assert vars(ms.mint.nn.Linear)["__init__"] is linear_init
    del caught  # its traceback holds the failed cell
    gc.collect()
    assert nn.Cell.total_instance_count == count + 6  # the failed cell is gone again, the six are counted
    del built
    gc.collect()
    assert nn.Cell.total_instance_count == count


# -- init_weights' parameter-name refresh, inside a fast window and outside


def test_refresh_parameter_names_visits_each_cell_first(monkeypatch):
    """init_weights' flag pass rides on the refresh's walk: `each_cell` sees
    the cells cells_and_names() gives (shared once, an empty CellList not),
    in its order, before any name is set; inside a fast window and outside."""
    from ms_loadpatch.strategy.building.construction import refresh_parameter_names

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            shared = nn.Dense(2, 2)
            self.inner = shared
            self.items = nn.CellList([nn.Dense(2, 2), shared, nn.CellList()])

    monkeypatch.setenv(window.START_ENV_VAR, "0")
    for fast in (False, True):
        with CONSTRUCTION_LOCK, lazy_construction(fast=fast):
            block = Block()
            block.items[0].weight.name = "stale"
            seen = []
            refresh_parameter_names(block, lambda cell: seen.append((cell, block.items[0].weight.name)))  # noqa: B023
        assert [id(c) for c, _ in seen] == [id(c) for _, c in block.cells_and_names()]
        assert {name for _, name in seen} == {"stale"}
        assert block.items[0].weight.name == "items.0.weight"
    assert building.leftovers() == []


def test_refresh_parameter_names_sets_only_what_differs(monkeypatch):
    """What init_weights does besides init: every parameter named by its path
    (through flat-name-walk's walk inside a fast window); a wrong name is set,
    a right one is not set again."""
    from ms_loadpatch.strategy.building.construction import refresh_parameter_names

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = nn.Dense(2, 2)
            self.items = nn.CellList([nn.Dense(2, 2), nn.Dense(2, 2)])

    monkeypatch.setenv(window.START_ENV_VAR, "0")
    param_class = type(Block().inner.weight)
    real = param_class.name
    for fast in (False, True):
        with CONSTRUCTION_LOCK, lazy_construction(fast=fast):
            block = Block()
            expected = [n for n, _ in block.parameters_and_names()]
            walked = building.named_parameters(block)
            assert (walked is None) is not fast  # the flat walk serves only the builder of a fast window
            if fast:
                assert [(n, id(p)) for n, p in walked] == [(n, id(p)) for n, p in block.parameters_and_names()]
            block.items[1].weight.name = "stale"
            calls = []
            setter = lambda p, v: (calls.append(v), real.fset(p, v))  # noqa: B023, E731 - used in this iteration
            monkeypatch.setattr(param_class, "name", property(real.fget, setter))
            try:
                refresh_parameter_names(block)
            finally:
                monkeypatch.setattr(param_class, "name", real)
        assert calls == ["items.1.weight"]
        assert [p.name for _, p in block.parameters_and_names()] == expected
    assert building.leftovers() == []
