"""cell-passes (strategy/cellpasses.py): the per-cell passes after a
transformers build (the init flag, tie_weights' hasattr, set_train) answered
and written where mindspore would, without its per-cell exception. Checked
against mindspore's own methods on trees with every case, through its probe,
and in whole loads against unpatched mindone (object state compared)."""

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_qwen2_config
from mindspore import nn

import ms_loadpatch
from ms_loadpatch.strategy import building, cellpasses
from ms_loadpatch.strategy.building import state
from ms_loadpatch.strategy.probe_cache import ProbeCache
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks

pytestmark = pytest.mark.usefixtures("cpu_kernels")

_MINDSPORE_SET_TRAIN = getattr(vars(nn.Cell)["set_train"], "__wrapped__", vars(nn.Cell)["set_train"])


class _OwnLookup(nn.Cell):
    def __getattr__(self, name):
        if name == "_tie_weights":
            return "found by its own __getattr__"
        return super().__getattr__(name)


class _OwnFlags(nn.Cell):
    def add_flags_recursive(self, **flags):
        self.recursed = sorted(flags)
        return super().add_flags_recursive(**flags)


class _ClassFlag(nn.Cell):
    _is_hf_initialized = True

    @property
    def _func_graph_flags(self):
        return self.__dict__.setdefault("_own_flags", {})


def _tree():
    shared = nn.Dense(2, 2)
    root = nn.Cell()
    root.first = nn.SequentialCell([shared, nn.ReLU(), shared])
    root.second = nn.CellList([shared, nn.CellList(), _OwnLookup(), _OwnFlags(), _ClassFlag()])
    root.second[3].inner = nn.Dense(2, 2)
    root.gone = nn.Dense(2, 2)
    root.gone = None
    root.register_buffer("_tie_weights", ms.Tensor(np.zeros(1, np.float32)))  # found by nn.Cell.__getattr__
    root.first.add_flags(training=True)
    return root


def test_probe_passes_and_status_lists_it():
    assert cellpasses.probe() is None
    rows = {r["name"]: r for r in ms_loadpatch.status()["techniques"]}
    row = rows[cellpasses.NAME]
    assert row["state"] == "active" and row["kind"] == "cell-passes", row


@pytest.mark.parametrize("name", cellpasses.NAMES + ("_params", "weight", "missing", "construct", "cls_name"))
def test_has_attribute_answers_as_hasattr(name):
    for _, cell in _tree().cells_and_names():
        assert cellpasses.has_attribute(cell, name) == hasattr(cell, name), (type(cell).__name__, name)


@pytest.mark.parametrize("mode", [False, True])
def test_set_train_leaves_the_tree_as_mindspore_does(mode):
    """Shared and repeated children, a None child, an empty CellList, classes
    with their own lookup, recursion or flag property: whole state equal."""
    real, fast = _tree(), _tree()
    _MINDSPORE_SET_TRAIN(real, mode)
    cellpasses.set_train(fast, mode)
    assert state.model_state(fast) == state.model_state(real)
    assert fast.second[3].recursed == ["training"]


def test_set_plain_writes_as_setattr():
    real, fast = _tree(), _tree()
    for (_, a), (_, b) in zip(real.cells_and_names(), fast.cells_and_names()):
        a._is_hf_initialized = True
        cellpasses.set_plain(b, "_is_hf_initialized", True)
    assert state.model_state(fast) == state.model_state(real)


def _flagged_tree():
    """_tree() with a parameter and a cell named like the flag, and one cell already flagged."""
    root = _tree()
    root.first[1]._is_hf_initialized = True
    root.named = nn.Cell()
    root.named._is_hf_initialized = ms.Parameter(ms.Tensor(np.ones(1, np.float32)), name="flag")
    root.holder = nn.Cell()
    root.holder._is_hf_initialized = nn.ReLU()
    return root


def test_plain_flag_state_answers_as_getattr_and_set_writes_as_setattr():
    """PlainFlag.plain_state: True where getattr finds the flag set, the instance dict where it is unset and
    setattr would only write it there, None where mindspore's own lookup must tell (a class with its own
    __getattr__ or flag, a parameter or cell of that name); marking the unset ones through that dict leaves
    the tree as setattr does."""
    flag = cellpasses.PlainFlag("_is_hf_initialized")
    real, fast = _flagged_tree(), _flagged_tree()
    answers = set()
    for (_, a), (_, b) in zip(real.cells_and_names(), fast.cells_and_names()):
        found = flag.plain_state(b)
        answers.add(type(found).__name__)
        if found is True:
            assert getattr(a, "_is_hf_initialized", False) is True
            continue
        if found is not None:
            assert not hasattr(a, "_is_hf_initialized") and found is b.__dict__
            found[flag.name] = flag.value
        else:
            assert not cellpasses._plain_for(type(b), flag.name) or hasattr(b, flag.name)
        raised = []
        for cell, mark in ((a, lambda c: setattr(c, "_is_hf_initialized", True)), (b, flag.set)):
            try:
                if cell is a or found is None:
                    mark(cell)
            except TypeError as exc:  # a bool over a parameter of that name: mindspore refuses it
                raised.append(str(exc))
        assert len(raised) in (0, 2) and len(set(raised)) <= 1, raised
    assert answers == {"bool", "dict", "NoneType"}
    assert state.model_state(fast) == state.model_state(real)


def test_probe_fails_on_a_set_train_that_misses_a_flag(monkeypatch):
    """A fast path reaching children by truthiness (missing an empty CellList) fails the probe."""
    real_set_train = cellpasses.set_train

    def truthy_children_only(root, mode):
        real_set_train(root, mode)
        for _, cell in root.cells_and_names():
            for child in cell._cells.values():
                if child is not None and not child:  # an empty CellList
                    del child.__dict__["_func_graph_flags"]

    monkeypatch.setattr(cellpasses, "set_train", truthy_children_only)
    monkeypatch.setattr(cellpasses, "_verdicts", ProbeCache())
    reason = cellpasses.probe()
    assert reason is not None and "set_train(False)" in reason, reason


def test_probe_fails_when_getattr_reads_another_dict(monkeypatch):
    monkeypatch.setattr(cellpasses, "GETATTR_DICTS", ("_params", "_buffers", "_cells"))
    monkeypatch.setattr(cellpasses, "_verdicts", ProbeCache())
    reason = cellpasses.probe()
    assert reason is not None and "_params_list" in reason, reason


def test_switched_off_leaves_mindspore_to_it(monkeypatch):
    monkeypatch.setenv("MS_LOADPATCH_TECHNIQUES_OFF", cellpasses.NAME)
    assert cellpasses.lookups() == (hasattr, setattr)
    rows = {r["name"]: r for r in ms_loadpatch.status()["techniques"]}
    assert rows[cellpasses.NAME]["state"] == "off"


def test_probe_runs_before_the_build_not_inside_its_window(tmp_path, monkeypatch):
    """Its probe trees built inside a load's construction window would be made
    by the window's techniques and counted in the build's report: a load
    probes before its build, and a window never starts the probe."""
    from ms_loadpatch.strategy.building import window

    with cpu_kernel_fallbacks():
        ms.set_seed(0)
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(str(tmp_path))
    depths = []
    real_probe = cellpasses._probe
    monkeypatch.setattr(cellpasses, "_probe", lambda: (depths.append(window.state.depth), real_probe())[1])
    monkeypatch.setattr(cellpasses, "_verdicts", ProbeCache())
    monkeypatch.setenv(window.START_ENV_VAR, "0")
    with window.open_window(list):
        assert cellpasses.probe() is not None and depths == []  # not inside a window
    mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path))
    assert depths == [0] and cellpasses.probe() is None
    assert not any(name.startswith("mindspore.") for name in ms_loadpatch.status()["last_build"]["not_copied"])


class _CustomTieQwen2(mt.Qwen2ForCausalLM):
    """A model with its own `_tie_weights` (tie_weights calls it on every cell that has one)."""

    def _tie_weights(self):
        self.__dict__.setdefault("_ties", []).append(len(self.__dict__.get("_ties", [])))


@pytest.mark.parametrize("off", [False, True], ids=["cell-passes", "cell-passes-off"])
def test_loads_match_unpatched_object_state(tmp_path, monkeypatch, off):
    """A whole load with the fast passes (and with them switched off): the
    same cells' state as unpatched mindone, the model's own `_tie_weights`
    called by both from_pretrained passes, the fast set_train used only when on."""
    config = tiny_qwen2_config(tie_word_embeddings=True)
    with cpu_kernel_fallbacks():
        ms.set_seed(0)
        _CustomTieQwen2(config).save_pretrained(str(tmp_path))
    if off:
        monkeypatch.setenv("MS_LOADPATCH_TECHNIQUES_OFF", cellpasses.NAME)
    calls = []
    fast_set_train = cellpasses.set_train
    monkeypatch.setattr(cellpasses, "set_train", lambda root, mode: (calls.append(mode), fast_set_train(root, mode)))
    with ms_loadpatch.disabled():
        ref = _CustomTieQwen2.from_pretrained(str(tmp_path))
    acc = _CustomTieQwen2.from_pretrained(str(tmp_path))
    assert last_report().tensors_assigned > 0
    assert calls == ([] if off else [False])
    # from_pretrained's two tie_weights passes on both sides; unpatched also post_init's init pass ties,
    # and the accelerated load skips that pass whole (from_pretrained ties after it anyway)
    assert len(acc._ties) == 2 and len(ref._ties) == 3
    assert acc.training is False and ref.training is False
    assert_same_model(ref, acc)
    skip = (building.CellInitTemplate.PER_INSTANCE_TIME, "init_tensor", "_ties")  # _ties: counted above
    assert state.model_state(acc, skip) == state.model_state(ref, skip)
