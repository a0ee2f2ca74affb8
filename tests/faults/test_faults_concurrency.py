"""Faults inside the patched path, loads from several threads, disable()
while loads run, and the hand-over to mindone for what the fast path does
not handle.

After a fault the process must be as before (_process_state's
`assert_state_restored`) and the next load bit-identical to unpatched.
Concurrent patched loads are compared with sequential unpatched ones.
"""

import contextlib
import logging
import os
import threading
import time

import mindone.diffusers as md
import mindone.transformers as mt
import mindone.transformers.modeling_utils as tf_utils
import mindspore as ms
import pytest
import transformers as hf
from _helpers import tiny_qwen2_config, tiny_unet, tiny_vae
from _process_state import assert_state_restored, process_state, raised

import ms_loadpatch
from ms_loadpatch.glue import diffusers as df_glue
from ms_loadpatch.glue import transformers as tf_glue
from ms_loadpatch.glue.build_then_fill import BuildThenFillCall
from ms_loadpatch.strategy import load as strategy_load
from ms_loadpatch.strategy import prefetch, reader, reports
from ms_loadpatch.strategy.building.draws import Ledger
from ms_loadpatch.strategy.building.lazy import CONSTRUCTION_LOCK
from ms_loadpatch.strategy.building.session import session
from ms_loadpatch.strategy.lane import lane
from ms_loadpatch.strategy.load import Load
from ms_loadpatch.testing import assert_same_model, compare, cpu_kernel_fallbacks, load_both, snapshot

# name -> (class, config, file dtype, max shard size, dtype asked at load)
SPECS = {
    "qwen2": (mt.Qwen2ForCausalLM, tiny_qwen2_config, None, "40KB", None),
    "llama": (
        mt.LlamaForCausalLM,
        lambda: hf.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
        ),
        None,
        None,
        ms.bfloat16,
    ),
    "bert": (
        mt.BertModel,
        lambda: hf.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
        ),
        ms.float16,
        None,
        None,
    ),
    "gpt2": (
        mt.GPT2LMHeadModel,
        lambda: hf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4),
        None,
        "30KB",
        ms.float16,
    ),
    "t5": (
        mt.T5ForConditionalGeneration,
        lambda: hf.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4),
        ms.bfloat16,
        None,
        ms.float32,
    ),
    "vae": (md.AutoencoderKL, tiny_vae, None, None, ms.float16),
    "unet": (md.UNet2DConditionModel, tiny_unet, ms.bfloat16, "12KB", None),
}
TRANSFORMERS = ["qwen2", "llama", "bert", "gpt2", "t5"]


pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (load function, snapshot of the sequential unpatched load)."""
    root = tmp_path_factory.mktemp("faults")
    out = {}
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        for name, (cls, config, file_dtype, shard, dtype) in SPECS.items():
            config = config()
            model = cls(**config) if isinstance(config, dict) else cls(config)
            if file_dtype is not None:
                model.to(file_dtype)
            model.save_pretrained(str(root / name), **({"max_shard_size": shard} if shard else {}))
            kwargs = {"mindspore_dtype": dtype} if dtype is not None else {}

            def load(cls=cls, path=str(root / name), kwargs=kwargs):
                return cls.from_pretrained(path, **kwargs)

            out[name] = (load, snapshot(load()))
    out["root"] = root
    return out


def _assert_matches(reference_snapshot, model, label=""):
    problems = compare(reference_snapshot, snapshot(model))
    assert not problems, f"{label}: " + "\n".join(problems[:10])


# -- 2. faults inside the patched path


def _assert_next_load_identical(models, name="qwen2"):
    load, _ = models[name]
    reference, accelerated = load_both(load)
    assert_same_model(reference, accelerated)


def test_fault_during_construction(models, tmp_path):
    """A bad config value raises inside the lazy-construction window."""
    import json
    import shutil

    shutil.copytree(models["root"] / "qwen2", tmp_path / "qwen2")
    config_path = tmp_path / "qwen2" / "config.json"
    config = json.loads(config_path.read_text())
    config["hidden_act"] = "no_such_activation"
    config_path.write_text(json.dumps(config))
    load = lambda: mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "qwen2"))  # noqa: E731
    with ms_loadpatch.disabled():
        unpatched = raised(load)
    before = process_state()
    patched = raised(load)
    assert_state_restored(before)
    assert type(patched) is type(unpatched) is KeyError and str(patched) == str(unpatched)
    _assert_next_load_identical(models)


@pytest.mark.parametrize("parallel", [False, True], ids=["one-reader", "parallel-readers"])
def test_fault_during_reading(models, monkeypatch, parallel):
    """Reading one shard (the last of three) fails."""
    real = reader.read_arrays
    victim = sorted(p.name for p in (models["root"] / "qwen2").iterdir() if p.name.endswith(".safetensors"))[-1]

    def failing(path, *args):
        if os.path.basename(path) == victim:
            raise OSError(f"injected read failure: {path}")
        return real(path, *args)

    # files are read ahead by the prefetcher, or read on demand by prefetch.take_or_read
    monkeypatch.setattr(prefetch, "read_arrays", failing)
    if parallel:
        monkeypatch.setenv("HF_ENABLE_PARALLEL_LOADING", "1")
        monkeypatch.setenv("HF_PARALLEL_LOADING_WORKERS", "2")
    load, _ = models["qwen2"]
    before = process_state()
    error = raised(load)
    assert_state_restored(before)
    assert isinstance(error, OSError) and "injected read failure: " in str(error) and victim in str(error)
    assert not [t for t in threading.enumerate() if t.name.startswith("ms_loadpatch-read")]
    monkeypatch.undo()
    _assert_next_load_identical(models)


class _Abort(BaseException):
    """Not an Exception: cleanup must be in `finally`, not in `except Exception`."""


@pytest.mark.parametrize("exception", [RuntimeError, _Abort])
def test_fault_during_assignment(models, monkeypatch, exception):
    """assign() fails after putting the first tensor of a shard in place."""
    real = tf_glue.assign

    def failing(pairs, report, cast_at_read):
        real(pairs[:1], report, cast_at_read)
        raise exception("injected assignment failure")

    monkeypatch.setattr(tf_glue, "assign", failing)
    load, _ = models["qwen2"]
    before = process_state()
    with pytest.raises(exception, match="injected assignment failure"):
        load()
    assert_state_restored(before)
    monkeypatch.undo()
    _assert_next_load_identical(models)


def test_fault_while_initialising_missing_weights(models, monkeypatch):
    """The last step of a load, after every tensor is assigned."""

    def failing(*args, **kwargs):
        raise RuntimeError("injected init failure")

    monkeypatch.setattr(tf_glue, "initialize_unloaded", failing)
    load, _ = models["llama"]
    before = process_state()
    with pytest.raises(RuntimeError, match="injected init failure"):
        load()
    assert_state_restored(before)
    monkeypatch.undo()
    _assert_next_load_identical(models, "llama")


def test_state_check_detects_leaks():
    """assert_state_restored itself fails when something leaks."""
    before = process_state()
    for leak, undo in [
        (lambda: setattr(ms.Parameter, "init_param", False), lambda: setattr(ms.Parameter, "init_param", True)),
        (CONSTRUCTION_LOCK.acquire, CONSTRUCTION_LOCK.release),
        (lambda: os.environ.__setitem__("MS_LOADPATCH_LEAK", "1"), lambda: os.environ.pop("MS_LOADPATCH_LEAK")),
        (lambda: setattr(lane, "load", Load("Leak")), lambda: setattr(lane, "load", None)),
        (
            lambda: setattr(lane, "build_then_fill", BuildThenFillCall("from_unet", False)),
            lambda: setattr(lane, "build_then_fill", None),
        ),
        (lambda: setattr(session(), "ledger", Ledger(classes=((), ()))), lambda: setattr(session(), "ledger", None)),
        (lambda: setattr(session(), "fast_assign", True), lambda: setattr(session(), "fast_assign", None)),
    ]:
        leak()
        try:
            with pytest.raises(AssertionError):
                assert_state_restored(before)
        finally:
            undo()
        assert_state_restored(before)
    ms_loadpatch.disable()  # re-enabling installs new handles: not the same process state
    ms_loadpatch.enable()
    with pytest.raises(AssertionError):
        assert_state_restored(before)


# -- 3. concurrency

# 7 x 20 = 140 concurrent loads in CI; MS_LOADPATCH_STRESS_ROUNDS=60 for a longer local run
THREADS, ROUNDS = 7, int(os.environ.get("MS_LOADPATCH_STRESS_ROUNDS", "20"))


def _run_rounds(models, names, threads, rounds):
    """In round r, thread i loads names[(i + r) % len(names)]; all threads start each round together."""
    barrier = threading.Barrier(threads)
    results, errors = [], []

    def worker(i):
        try:
            for r in range(rounds):
                name = names[(i + r) % len(names)]
                barrier.wait(timeout=120)
                results.append((name, models[name][0]()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((i, exc))
            barrier.abort()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=600)
    assert not errors, errors
    return results


def test_concurrent_loads_identical_to_sequential_unpatched(models):
    names = list(SPECS)
    before = process_state()
    results = _run_rounds(models, names, THREADS, ROUNDS)
    assert_state_restored(before)
    assert len(results) == THREADS * ROUNDS
    for name, model in results:
        _assert_matches(models[name][1], model, name)
    assert {name for name, _ in results} == set(SPECS)


def test_lazy_window_stays_in_its_thread(models, monkeypatch):
    """While a patched load builds its model lazily, a model another thread
    builds directly (say, a fresh model to train) is built as usual: with
    mindspore's no_init_parameters (a class-level flag) it would be lazy, and
    an unpatched load of it would keep random values."""
    inside, go_on = threading.Event(), threading.Event()
    real = strategy_load.lazy_construction

    @contextlib.contextmanager
    def pausing(**kwargs):
        with real(**kwargs):
            inside.set()
            go_on.wait(30)
            yield

    monkeypatch.setattr(strategy_load, "lazy_construction", pausing)
    load, reference = models["llama"]
    result = {}
    loader = threading.Thread(target=lambda: result.update(model=load()))
    loader.start()
    try:
        assert inside.wait(30)
        built = {}

        def build():  # no CONSTRUCTION_LOCK here: user code does not take it
            built["dense"] = ms.nn.Dense(4, 3)
            built["bert"] = mt.BertModel(SPECS["bert"][1]())

        builder = threading.Thread(target=build)
        builder.start()
        builder.join(60)
    finally:
        go_on.set()
        loader.join(60)
    assert {name: [p.name for p in m.get_parameters() if p.has_init] for name, m in built.items()} == {
        "dense": [],
        "bert": [],
    }
    _assert_matches(reference, result["model"], "the lazy load")


@pytest.mark.parametrize("name", ["qwen2", "unet"])
def test_report_reads_its_build_under_the_construction_lock(models, monkeypatch, name):
    """The window's figures (engaged_at, notes) are module state that the next
    build overwrites: the report copies them while this load still holds
    CONSTRUCTION_LOCK, once its window has closed. A build another thread runs
    right after the lock is released then cannot put its figures into this
    load's report."""
    from ms_loadpatch.strategy.building import window

    seen = []
    real = reports.LoadReport.note_construction

    def note(report):
        seen.append((CONSTRUCTION_LOCK._is_owned(), window.window_open(), window.state.engaged_at))
        real(report)

    monkeypatch.setattr(reports.LoadReport, "note_construction", note)
    load, reference = models[name]
    _assert_matches(reference, load(), name)
    assert seen == [(True, False, 0)]  # conftest: fast construction engages from the first cell
    report = reports.last_report()
    assert report.fast_construction_from == 0
    with ms_loadpatch.disabled():  # an unpatched build in between changes nothing in the report
        load()
    assert reports.last_report() is report and report.fast_construction_from == 0


@pytest.mark.parametrize(
    "name, pause_at",
    [("qwen2", (tf_glue, "assign")), ("unet", (df_glue, "assign_in_final_dtype"))],
    ids=["transformers", "diffusers"],
)
def test_disable_during_in_flight_load(models, monkeypatch, name, pause_at):
    """disable() from another thread while a load is between two shards: the
    load completes with the right model, and the next load is unpatched.
    transformers: disable() waits for the load (it holds core.accelerated_load).
    The diffusers glue does not hold it yet: disable() returns at once and
    mindone's own code loads the remaining shards."""
    inside, go_on = threading.Event(), threading.Event()
    real = getattr(*pause_at)

    def pausing(*args, **kwargs):
        inside.set()
        go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(*pause_at, pausing)
    load, reference = models[name]
    result, disabled_at, finished_at = {}, [], []

    def loader():
        try:
            result["model"] = load()
        finally:
            finished_at.append(time.perf_counter())

    def disabler():
        ms_loadpatch.disable()
        disabled_at.append(time.perf_counter())

    threads = [threading.Thread(target=loader)]
    threads[0].start()
    try:
        assert inside.wait(30)
        threads.append(threading.Thread(target=disabler))
        threads[1].start()
        time.sleep(0.3)  # disable() has been called and is acting (or waiting)
    finally:
        go_on.set()
        for thread in threads:
            thread.join(60)
    try:
        assert "model" in result, "the in-flight load failed"
        _assert_matches(reference, result["model"], "in-flight load")
        if name == "qwen2":
            assert disabled_at[0] >= finished_at[0], "disable() returned while the load was still running"
        assert not ms_loadpatch.is_enabled()
        assert {row["state"] for row in ms_loadpatch.status()["targets"]} == {"skipped"}
        monkeypatch.undo()
        last = reports.last_report()
        _assert_matches(reference, load(), "load after disable()")
        assert reports.last_report() is last, "a load after disable() was accelerated"
    finally:
        ms_loadpatch.enable()


def test_disable_enable_while_loads_run(models):
    """disable()/enable() toggled from another thread while threads load: every
    load, patched or not, equals the unpatched one."""
    stop = threading.Event()
    toggles = []

    def toggler():
        while not stop.is_set():
            ms_loadpatch.disable()
            time.sleep(0.03)
            ms_loadpatch.enable()
            toggles.append(1)
            time.sleep(0.03)

    thread = threading.Thread(target=toggler)
    thread.start()
    try:
        results = _run_rounds(models, TRANSFORMERS, 4, 10)
    finally:
        stop.set()
        thread.join(60)
        ms_loadpatch.enable()
    assert len(toggles) >= 3, "the toggler barely ran: the test proves nothing"
    for name, model in results:
        _assert_matches(models[name][1], model, name)


# -- 5. hand-over to mindone for what the fast path does not handle


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="ms_loadpatch")
    return caplog


def _no_new_report(call):
    last = reports.last_report()
    result = call()
    assert reports.last_report() is last, "the fast path ran"
    return result


class OverridingQwen2(mt.Qwen2ForCausalLM):
    @classmethod
    def _load_pretrained_model(cls, *args, **kwargs):
        return super()._load_pretrained_model(*args, **kwargs)


class OverridingVae(md.AutoencoderKL):
    @classmethod
    def _load_pretrained_model(cls, *args, **kwargs):
        return super()._load_pretrained_model(*args, **kwargs)


@pytest.mark.parametrize("cls, name", [(OverridingQwen2, "qwen2"), (OverridingVae, "vae")])
def test_fallback_subclass_overrides_loading(models, debug_log, cls, name):
    path = str(models["root"] / name)
    kwargs = {"mindspore_dtype": ms.float16} if name == "vae" else {}
    with ms_loadpatch.disabled():
        reference = cls.from_pretrained(path, **kwargs)
    accelerated = _no_new_report(lambda: cls.from_pretrained(path, **kwargs))
    assert_same_model(reference, accelerated)
    assert f"{cls.__name__} overrides _load_pretrained_model" in debug_log.text


def test_fallback_user_state_dict(models, debug_log):
    path = str(models["root"] / "llama")
    with ms_loadpatch.disabled():
        state_dict = tf_utils.load_state_dict(os.path.join(path, "model.safetensors"))
        config = hf.LlamaConfig.from_pretrained(path)
        reference = mt.LlamaForCausalLM.from_pretrained(None, config=config, state_dict=dict(state_dict))
    accelerated = _no_new_report(
        lambda: mt.LlamaForCausalLM.from_pretrained(None, config=config, state_dict=dict(state_dict))
    )
    assert_same_model(reference, accelerated)
    assert "a state_dict passed by the caller" in debug_log.text


@pytest.mark.parametrize("library", ["tf", "df"])
def test_fallback_non_safetensors_file(models, debug_log, tmp_path, library):
    """A PyTorch .bin checkpoint: mindone's own load_state_dict decides (it refuses this one)."""
    import shutil

    name, cls, weights = (
        ("llama", mt.LlamaForCausalLM, "pytorch_model.bin")
        if library == "tf"
        else ("vae", md.AutoencoderKL, "diffusion_pytorch_model.bin")
    )
    shutil.copy(models["root"] / name / "config.json", tmp_path / "config.json")
    (tmp_path / weights).write_bytes(b"not a checkpoint")
    load = lambda: cls.from_pretrained(str(tmp_path))  # noqa: E731
    with ms_loadpatch.disabled():
        unpatched = raised(load)
    patched = raised(load)
    assert (type(patched), str(patched)) == (type(unpatched), str(unpatched))
    if library == "tf":  # the diffusers glue hands it over without a log line (reported)
        assert f"{weights} is not safetensors: left to mindone" in debug_log.text
