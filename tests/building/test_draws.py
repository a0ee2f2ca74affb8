"""Lazy parameters take the random draws of a plain build (strategy/building/draws.py)
and a model's init pass runs over them (strategy/building/init_pass.py): the
draws, the values of weights a checkpoint lacks, the order of the pass, and
what they patch, only in the accounting thread and only while they run."""

import contextlib
import os
import random
import threading

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
import transformers as hf
from _helpers import tiny_qwen2_config
from mindspore import nn
from mindspore.common.initializer import Initializer, Normal, initializer
from safetensors.numpy import load_file, save_file

from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.building import batched_draws, draws, init_pass, replays
from ms_loadpatch.strategy.building.lazy import lazy_parameters
from ms_loadpatch.strategy.probe_cache import ProbeCache
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.mark.matrix  # mindspore's initializers and Parameter internals, per version
def test_probe_passes_and_confirms_the_tables():
    assert draws.probe() is None
    no_draw, one_draw, _ = draws.verified_classes()
    assert {k.__name__ for k in no_draw} == set(draws.NO_DRAW)
    assert {k.__name__ for k in one_draw} == set(draws.ONE_DRAW)


class TwoDraws(Initializer):
    """An initializer the tables do not know: it draws twice from numpy's global RandomState."""

    def _initialize(self, arr):
        arr[...] = np.random.standard_normal(arr.shape) * 0.02 + np.random.rand()


def _build(ledger=None):
    """Three parameters: a known one-draw initializer, one the tables do not know, a no-draw one."""
    return [
        ms.Parameter(initializer(init, (4, 3), ms.float32), name=f"p{i}")
        for i, init in enumerate((Normal(0.5), TwoDraws(), "zeros"))
    ]


@pytest.mark.matrix  # mindspore's initializers and Parameter internals, per version
def test_lazy_build_draws_and_fills_as_a_plain_build():
    np.random.seed(5)
    plain = [p.asnumpy().tobytes() for p in _build()]
    plain_after = np.random.get_state()[1].copy()
    np.random.seed(5)
    ledger = draws.Ledger()
    with lazy_parameters(), draws.accounting(ledger):
        lazy = _build()
    assert all(p.has_init for p in lazy)
    assert np.array_equal(np.random.get_state()[1], plain_after)
    assert (ledger.draws, ledger.run_in_full) == (1, 1)
    np.random.rand(3)  # later draws do not change what a fill gives back
    with draws.giving_back(ledger):
        for param in reversed(lazy):  # in any order
            param.init_data()
    assert [p.asnumpy().tobytes() for p in lazy] == plain and not ledger.seeds
    assert draws.leftovers() == []


def test_other_threads_build_plainly_while_a_ledger_accounts():
    np.random.seed(9)
    expected = ms.Parameter(initializer(Normal(0.5), (8,), ms.float32), name="x").asnumpy().tobytes()
    seen, ready, done = {}, threading.Event(), threading.Event()

    def other():
        ready.wait()
        np.random.seed(9)  # numpy's global state is shared: nothing of ours draws meanwhile
        seen["value"] = ms.Parameter(initializer(Normal(0.5), (8,), ms.float32), name="x").asnumpy().tobytes()
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    ledger = draws.Ledger()
    with draws.accounting(ledger):
        ready.set()
        done.wait(60)
    worker.join()
    assert seen["value"] == expected and not ledger.seeds and draws.leftovers() == []


class _Tree(nn.Cell):
    def __init__(self):
        super().__init__()
        self.shared = nn.Dense(2, 2)
        self.a = nn.SequentialCell([nn.Dense(2, 2), self.shared])
        self.b = nn.CellList([self.shared, nn.ReLU()])
        self.none = None
        self.own = _OwnApply()


class _OwnApply(nn.Cell):
    """Walks its children its own way: its subtree goes to its apply."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.ReLU(), nn.Tanh()

    def apply(self, fn):
        fn(self.second)
        fn(self)
        return self


def test_cells_in_apply_order_is_cell_apply_order():
    tree = _Tree()
    expected = []
    tree.apply(lambda cell: expected.append(id(cell)))
    got = []
    init_pass.run(tree, lambda cell: got.append(id(cell)))
    assert got == expected


@pytest.mark.matrix  # mindspore's initializers and Parameter internals, per version
def test_filling_on_touch_fills_lazy_parameters_with_their_own_draws_and_restores_parameter():
    before = dict(vars(ms.Parameter))
    np.random.seed(2)
    plain = ms.Parameter(initializer(Normal(0.5), (4, 3), ms.float32), name="p")
    plain[0] = 1.0
    np.random.seed(2)
    ledger = draws.Ledger()
    with lazy_parameters(), draws.accounting(ledger):
        lazy = ms.Parameter(initializer(Normal(0.5), (4, 3), ms.float32), name="p")
        with init_pass.filling_on_touch() as filled:
            lazy[0] = 1.0  # indexing into a lazy parameter fills it first
            _ = lazy.data  # already filled: nothing more
        assert filled.filled == 1
    assert not lazy.has_init and lazy.asnumpy().tobytes() == plain.asnumpy().tobytes()
    assert dict(vars(ms.Parameter)) == before and init_pass.leftovers() == [] and draws.leftovers() == []


class _OwnInitQwen2(mt.Qwen2ForCausalLM):
    """An `_init_weights` with an initializer the tables do not know, a write
    into a weight (recorded: deferred_writes), then an in-place op the
    recorder does not model (which fills the weight first), and a new known one."""

    def _init_weights(self, module):
        if isinstance(module, nn.Dense):
            module.weight.set_data(initializer(TwoDraws(), module.weight.shape, module.weight.dtype))
            module.weight[0] = 0.25
            module.weight.data.add_(0.5)  # not a recorded write: filled, the write above replayed, then run
            if module.bias is not None:
                module.bias.set_data(initializer(Normal(0.3), module.bias.shape, module.bias.dtype))
        elif isinstance(module, nn.Embedding):
            module.embedding_table.set_data(
                initializer(Normal(0.1), module.embedding_table.shape, module.embedding_table.dtype)
            )


def _saved(tmp_path_factory, name, build):
    """The directory where `build()`'s model, built from seed 0, was saved."""
    root = str(tmp_path_factory.mktemp(name))
    with cpu_kernel_fallbacks():
        ms.set_seed(0)
        build().save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def lacking_checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint without some weights of several kinds."""
    root = _saved(tmp_path_factory, "draws", lambda: mt.Qwen2ForCausalLM(tiny_qwen2_config()))
    return _without(
        root,
        (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.1.mlp.down_proj.weight",
            "model.embed_tokens.embedding_table",
        ),
    )


def _without(root, keys):
    """`root`, its model.safetensors saved again without `keys`."""
    path = os.path.join(root, "model.safetensors")
    tensors = load_file(path)
    for key in keys:
        del tensors[key]
    save_file(tensors, path, metadata={"format": "np"})
    return root


@pytest.mark.matrix  # mindspore's initializers and Parameter internals, per version
@pytest.mark.parametrize("dtype", [None, ms.bfloat16], ids=["as-stored", "bf16"])
def test_own_init_weights_identical_to_unpatched(lacking_checkpoint, dtype):
    kwargs = {} if dtype is None else {"mindspore_dtype": dtype}
    ms.set_seed(11)
    ref, acc = load_both(lambda: _OwnInitQwen2.from_pretrained(lacking_checkpoint, **kwargs))  # also the draws
    assert_same_model(ref, acc)
    report = last_report()
    assert report.model_class == "_OwnInitQwen2" and report.missing_initialised == 4
    assert report.initializers_run_in_full > 0 and report.filled_in_init_pass > 0 and report.draws_taken > 0
    assert report.writes_deferred > 0
    assert building.leftovers() == []


class _FailingInitQwen2(mt.Qwen2ForCausalLM):
    def _init_weights(self, module):
        if isinstance(module, nn.Dense):
            module.weight.set_data(initializer(Normal(0.1), module.weight.shape, module.weight.dtype))
            raise ValueError("init failed")


def test_init_pass_failure_raises_as_unpatched_and_leaves_nothing(lacking_checkpoint):
    with pytest.raises(ValueError, match="init failed"):
        _FailingInitQwen2.from_pretrained(lacking_checkpoint)
    assert building.leftovers() == []
    import ms_loadpatch

    with ms_loadpatch.disabled(), pytest.raises(ValueError, match="init failed"):
        _FailingInitQwen2.from_pretrained(lacking_checkpoint)


def _mixtral(experts=8):
    return hf.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=16,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )


def _drawing_python_random_too(init_weights):
    """An `_init_weights` that also draws from Python's random on every expert
    weight: a replay would skip those draws, so those calls are never replayed."""

    def _init_weights(self, module):
        init_weights(self, module)
        if isinstance(module, ms.mint.nn.Linear) and module.weight.shape == (16, 32):
            random.random()

    return _init_weights


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    return _saved(tmp_path_factory, "draws-mixtral", lambda: mt.MixtralForCausalLM(_mixtral()))


def test_init_pass_replays_copied_cells_only_when_exact(mixtral_checkpoint, monkeypatch):
    """Experts copied by sibling-clone (the suite builds from the first cell)
    get their init-pass call replayed once three real calls agreed; not the
    calls that also draw from Python's random. The model, numpy's and
    Python's random state are the unpatched ones either way."""
    replayed = []
    for python_random in (False, True):
        if python_random:
            base = mt.MixtralPreTrainedModel
            monkeypatch.setattr(base, "_init_weights", _drawing_python_random_too(base._init_weights))
        ms.set_seed(3)
        random.seed(3)
        ref, acc = load_both(lambda: mt.MixtralForCausalLM.from_pretrained(mixtral_checkpoint))  # the generators too
        assert_same_model(ref, acc)
        assert last_report().cells_copied > 0
        replayed.append(last_report().init_calls_replayed)
    # w1 and w3 of every copied expert draw from Python's random in the second: called, not replayed
    assert replayed[0] > replayed[1] > 0


def _expert_weight(cell):
    return isinstance(cell, ms.mint.nn.Linear) and cell.weight.shape == (16, 32)


def _expert(cell):
    return type(cell).__name__ == "MixtralBlockSparseTop2MLP"


def _real_values(cell):
    cell.weight.set_data(ms.Tensor(np.full(cell.weight.shape, 0.5), dtype=cell.weight.dtype))


def _marked(cell):
    cell.weight.requires_grad = False
    cell.weight.marked_by_init = True


# what a replayed call would miss: (which copied cells, the extra effect of their _init_weights call)
_UNREPLAYABLE = {
    "set-data-real-tensor": (_expert_weight, _real_values),
    "parameter-attribute": (_expert_weight, _marked),
    "buffer-write": (_expert, lambda cell: cell.scale.fill_(2.0)),
    "mindspore-draw": (_expert_weight, lambda cell: ms.mint.randn(2)),
}


@pytest.mark.parametrize("case", sorted(_UNREPLAYABLE))
def test_init_pass_never_replays_a_call_with_effects_beyond_its_draws(case, mixtral_checkpoint, monkeypatch):
    """Copied experts whose init-pass call also sets a real tensor, sets a
    parameter's attribute, writes a buffer or draws from mindspore's generator
    are called, not replayed: the model (buffers and parameter attributes
    included) and the three generators are the unpatched ones."""
    which, effect = _UNREPLAYABLE[case]
    base = mt.MixtralPreTrainedModel._init_weights

    def _init_weights(self, module):
        base(self, module)
        if which(module):
            effect(module)

    monkeypatch.setattr(mt.MixtralPreTrainedModel, "_init_weights", _init_weights)
    if case == "buffer-write":
        from mindone.transformers.models.mixtral import modeling_mixtral

        expert_init = modeling_mixtral.MixtralBlockSparseTop2MLP.__init__

        def __init__(self, config):
            expert_init(self, config)
            self.register_buffer("scale", ms.Tensor(np.ones(4, np.float32)), persistent=False)

        monkeypatch.setattr(modeling_mixtral.MixtralBlockSparseTop2MLP, "__init__", __init__)
    ms.set_seed(3)
    random.seed(3)
    ref, acc = load_both(lambda: mt.MixtralForCausalLM.from_pretrained(mixtral_checkpoint))  # the generators too
    assert_same_model(ref, acc)
    assert last_report().cells_copied > 0
    for model in (ref, acc):
        touched = [cell for _, cell in model.cells_and_names() if which(cell)]
        assert len(touched) >= 2 * 8 * (2 if which is _expert_weight else 1)  # w1, w3 (k_proj, v_proj too)
        if case == "parameter-attribute":
            assert all(cell.weight.marked_by_init and not cell.weight.requires_grad for cell in touched)
        if case == "buffer-write":
            assert all(cell.scale.asnumpy().tolist() == [2.0] * 4 for cell in touched)


def test_batched_draws_are_checked_and_a_changed_numpy_seed_is_refused(monkeypatch):
    """One randint of size n equals n of mindspore's draws on this numpy; a
    `_numpy_seed` that is not the known one-line draw turns batching off."""
    from mindspore.common import initializer as module

    assert batched_draws.problem() is None
    monkeypatch.setattr(batched_draws, "_checks", ProbeCache())
    monkeypatch.setattr(module, "_numpy_seed", lambda: np.random.randint(low=1, high=(1 << 62), dtype=np.int64))
    assert "_numpy_seed is not" in batched_draws.problem()
    row = init_pass.batched_draws_row()
    assert row.state == "skipped" and "_numpy_seed" in row.reason


@pytest.mark.matrix  # numpy's MT19937 words and legacy randint, per installed numpy
@pytest.mark.parametrize("n", [1, 3, 311, 1000])
def test_seeds_from_the_global_words_are_randints_draws(n):
    """Owed draws made from the global MT19937's words give the numbers,
    types and state of n `_numpy_seed` calls, across refills, and from a
    state whose next word pair lies above the range (randint draws again)."""
    assert batched_draws.words_usable()
    outer = np.random.get_state()
    try:
        for start in (lambda: np.random.seed(n), lambda: np.random.set_state(batched_draws.rejecting_state())):
            start()
            singles = [np.random.randint(low=1, high=1 << 63, dtype=np.int64) for _ in range(n)]
            after = np.random.get_state()
            start()
            seeds = batched_draws.seeds_from_words(batched_draws._global_mt19937(), n)
            assert seeds == singles
            assert batched_draws.same_numpy_state(after, np.random.get_state())
        np.random.set_state(batched_draws.rejecting_state())  # the crafted pair is the first value's, above the range
        assert batched_draws._global_mt19937().random_raw(2).tolist() == [0x7FFFFFFF, 0xFFFFFFFF]
    finally:
        np.random.set_state(outer)


def test_owed_draws_take_randint_when_the_words_are_not_usable(monkeypatch):
    """A failed words check (or a global generator that is not MT19937)
    leaves batching on with one randint: the same seeds and state either way."""

    def owed_seeds():
        ledger = draws.Ledger()
        made = [initializer(Normal(0.1), (2, 3), ms.float32) for _ in range(5)]
        np.random.seed(11)
        with draws.accounting(ledger):
            ledger.take(made[0])
            with draws.owing():
                for tensor in made[1:]:
                    ledger.take(tensor)
        return [int(ledger.seeds[id(t)][1]) for t in made], np.random.get_state()

    words = owed_seeds()
    taken = []
    monkeypatch.setattr(batched_draws, "seeds_from_words", lambda generator, n: taken.append(n) or [0] * n)
    monkeypatch.setattr(batched_draws, "_checks", ProbeCache())
    assert batched_draws.problem() is None and not batched_draws.words_usable()
    assert "the words give other numbers" in batched_draws._check_raw_words()
    randint = owed_seeds()
    assert taken and words[0] == randint[0] and batched_draws.same_numpy_state(words[1], randint[1])
    monkeypatch.setattr(batched_draws, "_checks", ProbeCache({"checks": (None, True)}))
    monkeypatch.setattr(batched_draws, "_global_mt19937", lambda: None)  # e.g. np.random.set_bit_generator(PCG64())
    taken.clear()
    other = owed_seeds()
    assert not taken and other[0] == words[0]


def test_owing_with_templates_the_ledger_knows_takes_no_keys_and_the_same_draws(monkeypatch):
    """A copy whose parameters' templates (initializer, shape) the ledger
    knows draw once or never owes each draw without looking its key up: the
    same seeds and numpy state as the keyed path. A template whose key never
    reached a draw keeps the keyed path."""
    from mindspore.common.initializer import HeUniform, Zero

    keys = []
    draw_key = draws._draw_key
    monkeypatch.setattr(draws, "_draw_key", lambda *args: keys.append(args[0]) or draw_key(*args))

    def owed(templates):
        ledger = draws.Ledger()
        first = [initializer(Normal(0.1), (2, 3), ms.float32), initializer(HeUniform(), (4, 2), ms.float32)]
        made = [
            made
            for _ in range(2)
            for made in (
                initializer(Normal(0.1), (2, 3), ms.float32),
                initializer(Zero(), (3,), ms.float32),
                initializer(HeUniform(), (4, 2), ms.float32),
            )
        ]
        np.random.seed(13)
        with draws.accounting(ledger):
            for tensor in first:
                ledger.take(tensor)
            keys.clear()
            with draws.owing(templates):
                for tensor in made:
                    ledger.take(tensor)
        seeds = [None if ledger.seeds.get(id(t)) is None else int(ledger.seeds[id(t)][1]) for t in made]
        return seeds, np.random.get_state(), len(keys)

    templates = ((Normal(0.1), (2, 3)), (Zero(), (3,)), (HeUniform(), (4, 2)))
    keyed, known, unknown = owed(None), owed(templates), owed(templates + ((Normal(0.2), (2, 3)),))
    assert keyed[0].count(None) == 2 and len(set(keyed[0])) == 5  # the zeros draw nothing; four seeds
    for other in (known, unknown):
        assert other[0] == keyed[0] and batched_draws.same_numpy_state(other[1], keyed[1])
    assert (keyed[2], known[2], unknown[2]) == (4, 2, 3 + 4)  # known: the templates' check alone


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (1 << 16, 1 << 15)])
def test_a_draw_captured_from_an_initializer_is_the_plain_draw_without_allocating(shape):
    """Each class the tables confirm is stopped at its draw on an array over
    one element: the seed is the draw the plain build's fill makes (or the
    same error), and for a tensor of 8 GiB, the classes that draw before
    they allocate anything of their own allocate nothing on the way."""
    import tracemalloc

    from mindspore.common import initializer as module

    one_draw = draws.verified_classes()[1]
    assert one_draw
    for kind in one_draw:
        ledger = draws.Ledger()
        tensor = initializer(kind(), shape, ms.float32)
        np.random.seed(14)
        expected = np.random.randint(low=1, high=1 << 63, dtype=np.int64)
        if shape[:1] != (1 << 16,):  # small: the plain fill's draw, or its error
            np.random.seed(14)
            try:
                module.initializer(kind(), shape, ms.float32).init_data()
                plain_error = None
            except Exception as exc:  # noqa: BLE001 - compared with the capture's
                plain_error = type(exc)
            np.random.seed(14)
        else:
            plain_error = None
            np.random.seed(14)
        tracemalloc.start()
        try:
            with draws.accounting(ledger):
                ledger.take(tensor)
            peak = tracemalloc.get_traced_memory()[1]
            captured_error = None
        except Exception as exc:  # noqa: BLE001 - compared with the plain fill's
            captured_error, peak = type(exc), 0
        finally:
            tracemalloc.stop()
        assert captured_error == plain_error, kind
        if plain_error is None:
            assert int(ledger.seeds[id(tensor)][1]) == expected and ledger.run_in_full == 0, kind
            if kind.__name__ in ("Normal", "Uniform", "HeUniform", "HeNormal", "XavierUniform"):
                assert peak < 1 << 20, (kind, peak)


def test_a_large_batch_is_one_randint(monkeypatch):
    """A batch over WORDS_UP_TO (an init pass's replayed draws) is one randint,
    cheaper there than the words; a small one is made from the words. Both
    give the numbers and state of as many `_numpy_seed` calls."""
    assert batched_draws.words_usable()
    taken = []
    seeds_from_words = batched_draws.seeds_from_words
    monkeypatch.setattr(batched_draws, "seeds_from_words", lambda g, n: taken.append(n) or seeds_from_words(g, n))
    outer = np.random.get_state()
    try:
        for n in (batched_draws.WORDS_UP_TO, batched_draws.WORDS_UP_TO + 1, 5000):
            np.random.seed(n)
            singles = [np.random.randint(low=1, high=1 << 63, dtype=np.int64) for _ in range(n)]
            after = np.random.get_state()
            np.random.seed(n)
            assert [int(v) for v in batched_draws.take(n)] == singles
            assert batched_draws.same_numpy_state(after, np.random.get_state())
    finally:
        np.random.set_state(outer)
    assert taken == [batched_draws.WORDS_UP_TO]


def test_a_seed_made_from_words_reaches_the_initializer_as_randint_gives_it(monkeypatch):
    """Owed seeds are kept as Python ints; the initializer filling a lazy
    tensor gets its seed back as the np.int64 `_numpy_seed` returns."""
    from mindspore.common import initializer as module

    assert batched_draws.words_usable()
    got = []
    random_normal = module._random_normal
    monkeypatch.setattr(module, "_random_normal", lambda seed, *a: got.append(seed) or random_normal(seed, *a))
    ledger = draws.Ledger()
    made = [initializer(Normal(0.1), (2, 3), ms.float32) for _ in range(3)]
    np.random.seed(12)
    with draws.accounting(ledger):
        ledger.take(made[0])
        with draws.owing():
            ledger.take(made[1])
            ledger.take(made[2])
    assert type(ledger.seeds[id(made[2])][1]) is int  # made from the words
    with draws.giving_back(ledger):
        filled = made[2].init_data().asnumpy()
    np.random.seed(12)
    plain = [initializer(Normal(0.1), (2, 3), ms.float32).init_data().asnumpy() for _ in range(3)]
    assert [type(seed) for seed in got] == [np.int64] * 4 and got[0] == got[3]
    assert np.array_equal(filled, plain[2])


@pytest.fixture(scope="module")
def mixtral_lacking_experts(tmp_path_factory):
    """A tiny Mixtral checkpoint without the weights of several copied experts."""
    root = _saved(tmp_path_factory, "draws-mixtral-lacking", lambda: mt.MixtralForCausalLM(_mixtral()))
    return _without(
        root,
        (
            "model.layers.0.block_sparse_moe.experts.5.w1.weight",
            "model.layers.1.block_sparse_moe.experts.6.w2.weight",
            "model.layers.1.block_sparse_moe.experts.7.w3.weight",
        ),
    )


@pytest.mark.parametrize("mode", ["copies-and-replays", "replays", "one-by-one"])
def test_replayed_draws_in_batches_give_the_unpatched_model_and_state(mixtral_lacking_experts, monkeypatch, mode):
    """Copies and replayed calls owe their draws, taken as one batch before
    anything else runs (one mode with copies drawing one by one): the experts the checkpoint lacks get the unpatched
    values, and numpy's, Python's and mindspore's generators end where
    unpatched ones do, as with every draw taken on its own (batched-draws
    switched off)."""
    owed, owing = [], []
    take, owing_context = draws.Ledger.take_owed_draws, draws.owing

    def counting(ledger):
        owed.append(len(ledger.owed))
        take(ledger)

    def counting_owing(*args):
        owing.append(1)
        return owing_context(*args)

    monkeypatch.setattr(draws.Ledger, "take_owed_draws", counting)
    monkeypatch.setattr(draws, "owing", counting_owing)
    if mode == "replays":
        monkeypatch.setattr(draws, "owing", lambda *args: contextlib.nullcontext())
    if mode == "one-by-one":
        monkeypatch.setenv("MS_LOADPATCH_TECHNIQUES_OFF", init_pass.BATCHED_DRAWS)
    ms.set_seed(5)
    ref, acc = load_both(lambda: mt.MixtralForCausalLM.from_pretrained(mixtral_lacking_experts))
    assert_same_model(ref, acc)
    assert last_report().init_calls_replayed > 0 and last_report().cells_copied > 0
    assert (max(owed, default=0) > 1) is (mode != "one-by-one"), owed
    assert owing or mode != "copies-and-replays"  # copies owed their draws


def test_a_copy_whose_subtree_is_over_the_limit_is_called_not_replayed(mixtral_lacking_experts, monkeypatch):
    """A recipe's cell with more cells under it than SUBTREE_LIMIT (the
    experts here, with the limit lowered) is never learnt: its copies get
    real calls, fewer calls are replayed, and the model and generators are
    the unpatched ones either way."""
    replayed, default = {}, replays.SUBTREE_LIMIT
    for limit in (default, 2):
        monkeypatch.setattr(replays, "SUBTREE_LIMIT", limit)
        ms.set_seed(6)
        ref, acc = load_both(lambda: mt.MixtralForCausalLM.from_pretrained(mixtral_lacking_experts))
        assert_same_model(ref, acc)
        replayed[limit] = last_report().init_calls_replayed
    expert = acc.model.layers[0].block_sparse_moe.experts[1]
    assert replays.subtree_state(expert) is None  # 5 cells, limit 2
    assert 0 < replayed[2] < replayed[default], replayed


def test_owed_draws_come_before_a_draw_taken_at_once():
    """While a copy owes its draws, a parameter whose draw is not owed (its
    initializer not seen drawing yet) takes the owed ones first: the seeds
    follow the order in which the parameters were made, as one by one."""

    def seeds(owe):
        ledger = draws.Ledger()
        made = [
            initializer(Normal(0.1), (2, 3), ms.float32),
            initializer(Normal(0.1), (2, 3), ms.float32),
            initializer(Normal(0.2), (4, 5), ms.float32),
            initializer(Normal(0.1), (2, 3), ms.float32),
        ]
        np.random.seed(7)
        with draws.accounting(ledger):
            ledger.take(made[0])  # Normal(0.1), (2, 3) seen drawing
            with draws.owing() if owe else contextlib.nullcontext():
                for tensor in made[1:]:
                    ledger.take(tensor)
            assert not ledger.owed
        return [int(ledger.seeds[id(t)][1]) for t in made], np.random.get_state()[1].copy()

    assert batched_draws.problem() is None
    (owed, owed_state), (single, single_state) = seeds(True), seeds(False)
    assert owed == single and np.array_equal(owed_state, single_state)


class _OneWeight(nn.Cell):
    def __init__(self, shape=(4, 3), dtype=ms.float32):
        super().__init__()
        self.weight = ms.Parameter(initializer(Normal(0.5), shape, dtype), name="weight")


@pytest.mark.parametrize("copy", ["agreed", "other-dtype", "other-shape"])
def test_a_replay_applies_only_where_the_parameter_has_the_agreed_shape_and_dtype(copy):
    """An agreed effect (a new Normal(0.02) for a (4, 3) float32 weight) is
    replayed on a copy whose weight has that shape and dtype: the weight's
    tensor gets that initializer, and the one draw taken is the next of
    numpy's. On a copy whose weight has another dtype or shape, the replay
    refuses and changes nothing, numpy's state included."""
    shape, dtype = {
        "agreed": ((4, 3), ms.float32),
        "other-dtype": ((4, 3), ms.float16),
        "other-shape": ((3, 4), ms.float32),
    }[copy]
    agreed = Normal(0.02)
    state = [(k, dict(v) if type(v) is dict else v) for k, v in vars(agreed).items()]
    compiled = replays._compiled([(replays._INIT, "weight", Normal, state, (4, 3), ms.float32, True)])
    ledger = draws.Ledger()
    with lazy_parameters(), draws.accounting(ledger):
        cell = _OneWeight(shape, dtype)
        tensor, before = cell.weight.init_mode, cell.weight.init_mode.init
        np.random.seed(11)
        applied = replays.Replays(ledger, init_pass.PassCounts())._replay(cell, compiled)
        after = np.random.get_state()[1].copy()
    expected = np.random.RandomState(11)
    if copy == "agreed":
        seed = expected.randint(low=1, high=1 << 63, dtype=np.int64)
        assert applied and cell.weight.init_mode is tensor
        assert type(tensor.init) is Normal and vars(tensor.init) == vars(agreed) and tensor.init is not before
        assert ledger.seeds[id(tensor)][1] == seed
    else:
        assert not applied and tensor.init is before and id(tensor) not in ledger.writes
    assert np.array_equal(after, expected.get_state()[1])


def test_a_load_runs_on_its_own_build_session(lacking_checkpoint, monkeypatch):
    """While a load runs, the lane's build session is the load's own
    (`Load.build`), started from the fields of the session it was entered
    from; after it, that session is current again with its fields as they
    were, and the load's draws went to the load's ledger only."""
    from ms_loadpatch.glue import transformers as tf_glue
    from ms_loadpatch.strategy.building import lazy_writes
    from ms_loadpatch.strategy.lane import lane

    seen = {}
    fill_missing = tf_glue.TransformersLoad.fill_missing

    def recording(load, model):
        seen.update(own=lane.build is load.build, fast_assign=load.build.fast_assign, ledger=load.build.ledger)
        return fill_missing(load, model)

    monkeypatch.setattr(tf_glue.TransformersLoad, "fill_missing", recording)
    outer_ledger = draws.Ledger()
    with draws.accounting(outer_ledger), lazy_writes.assigning(True, frozenset({1})):
        outer = lane.build
        mt.Qwen2ForCausalLM.from_pretrained(lacking_checkpoint)
        assert lane.build is outer and outer.ledger is outer_ledger and outer.fast_assign is True
        assert outer.foreign == frozenset({1})
    assert seen["own"] and seen["fast_assign"] is True  # inherited from the session it was entered from
    assert seen["ledger"] is not None and seen["ledger"] is not outer_ledger  # the load's own, giving back
    assert outer_ledger.draws == 0 and not outer_ledger.seeds
    assert last_report().draws_taken > 0
    assert lane.build.ledger is None and lane.build.fast_assign is None
