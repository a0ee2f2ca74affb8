"""In-place writes of an init pass on lazy parameters are recorded, not run
(strategy/building/deferred_writes.py): the families whose `_init_weights`
writes in place load with nothing filled in the init pass, bit-identical to
the unpatched load, numpy's, Python's and mindspore's generators where the
unpatched load leaves them (testing.load_both), also where the checkpoint
lacks weights (then filled and the writes replayed).

Families: Qwen3-MoE and Qwen2-MoE (`.data.normal_()`, `.data.zero_()`,
`.data[pad].zero_()`), Gemma2 with a padding token, NLLB-MoE (`.data.fill_`
as well), Llama with a padding row (`weight[pad] = 0` after `set_data`).
"""

import os
import sys

import mindspore as ms
import numpy as np
import pytest
from _helpers import TESTS_DIR
from _in_place_families import FAMILIES, WRITES_IN_PLACE, save_family

import ms_loadpatch
from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.building import deferred_writes
from ms_loadpatch.strategy.probe_cache import ProbeCache
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks, load_both


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deferred_writes")
    out = {}
    for family, (cls, config) in FAMILIES.items():
        for kind in ("complete", "lacking"):
            out[family, kind] = save_family(cls, config(), str(root / f"{family}-{kind}"), drop=kind == "lacking")
    return out


@pytest.mark.parametrize("kind", ["complete", "lacking"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_identical_to_unpatched_with_writes_recorded(checkpoints, family, kind):
    cls = FAMILIES[family][0]
    with cpu_kernel_fallbacks():
        for call in range(2):  # the first load of the process (probes) and a later one
            ms.set_seed(5 + call)
            ref, acc = load_both(lambda: cls.from_pretrained(checkpoints[family, kind]))  # and the generators
            assert_same_model(ref, acc)
            report = last_report()
            assert report.model_class == cls.__name__
            assert report.filled_in_init_pass == 0, report.summary()
            assert (report.writes_deferred > 0) == (family in WRITES_IN_PLACE), report.summary()
            if kind == "lacking":
                assert report.missing_initialised > 0
    assert building.leftovers() == []


_PLAIN_WHEEL_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import numpy as np
from safetensors.numpy import load_file
import ms_loadpatch
from ms_loadpatch.strategy import building
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.testing import compare, cpu_kernel_fallbacks, snapshot
from _in_place_families import FAMILIES, save_family

cls, config = FAMILIES[{family!r}]
directory = save_family(cls, config(pad_token_id=None), {directory!r})
stored = load_file(os.path.join(directory, "model.safetensors"))

def outcome(load):
    # a kernel's error may surface inside mindone's own handler, re-raised as another type: the chain's first lines
    try:
        return load(), None
    except Exception as exc:
        chain = []
        while exc is not None:
            chain.append(f"{{type(exc).__name__}}: {{(str(exc).splitlines() or [''])[0]}}")
            exc = exc.__cause__ or exc.__context__
        return None, " <- ".join(chain)

# patched first, read before the unpatched load: a failed kernel's error surfaces at a later sync
with cpu_kernel_fallbacks(in_place=False):
    acc, acc_error = outcome(lambda: snapshot(cls.from_pretrained(directory)))
    report = last_report()
    result = dict(acc_error=acc_error, leftovers=building.leftovers())
    if acc is not None:
        result.update(filled=report.filled_in_init_pass, deferred=report.writes_deferred,
                      differing=[n for n, a in stored.items()
                                 if not np.array_equal(acc["tensors"][n].bits, a.view(acc["tensors"][n].bits.dtype))])
    with ms_loadpatch.disabled():
        ref, result["ref_error"] = outcome(lambda: snapshot(cls.from_pretrained(directory)))
if acc is not None and ref is not None:
    result["problems"] = compare(ref, acc)
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("family", ["qwen3-moe", "gemma2", "nllb-moe"])
def test_without_in_place_fallbacks_patched_loads_as_unpatched(tmp_path, family):
    """The wheel's own in-place kernels (CPU lacks InplaceNormal, InplaceZero,
    InplaceFillScalar; only the build's missing kernels routed), in a fresh
    process each (a failed kernel's error surfaces at some later sync): the
    unpatched load raises on them; the patched load of a complete checkpoint
    runs none where the init pass writes only into lazy parameters
    (Qwen3-MoE, Gemma2 without a padding row) and gives the checkpoint's
    values, and raises alike where a write reaches a parameter made from a
    tensor (NLLB-MoE's LayerNorm `fill_`)."""
    import json
    import subprocess

    code = _PLAIN_WHEEL_CHILD.format(tests=TESTS_DIR, family=family, directory=str(tmp_path / family))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, "GLOG_v": "3"}
    )
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT ") :])
    assert result["leftovers"] == []
    if result["ref_error"] is None:
        assert result["acc_error"] is None and result["problems"] == [], result
    if family == "nllb-moe":
        assert result["ref_error"] and result["acc_error"] and "Inplace" in result["acc_error"], result
    else:
        assert result["acc_error"] is None, result
        assert result["filled"] == 0 and result["deferred"] > 0 and result["differing"] == [], result


def test_cpu_fallback_normal_moves_the_generator_and_derives_values_from_it():
    with cpu_kernel_fallbacks():
        ms.set_seed(3)
        before = ms.get_rng_state().asnumpy().copy()
        first = ms.Parameter(ms.Tensor(np.zeros((4, 3), np.float32)), name="a")
        first.data.normal_(0.0, 1.0)
        moved = ms.get_rng_state().asnumpy().copy()
        second = ms.Parameter(ms.Tensor(np.zeros((4, 3), np.float32)), name="b")
        second.data.normal_(0.0, 1.0)
        ms.set_rng_state(ms.Tensor(before))
        again = ms.Parameter(ms.Tensor(np.zeros((4, 3), np.float32)), name="c")
        again.data.normal_(0.0, 1.0)
        viewed = ms.Parameter(ms.Tensor(np.ones((4, 3), np.float32)), name="d")
        viewed.data[2].zero_()
    assert not np.array_equal(before, moved)
    assert not np.array_equal(first.asnumpy(), second.asnumpy())
    assert np.array_equal(first.asnumpy(), again.asnumpy())
    expected = np.ones((4, 3), np.float32)
    expected[2] = 0
    assert np.array_equal(viewed.asnumpy(), expected)


def test_next_use_reads_what_the_code_does_with_data():
    seen = []

    class Anything:
        def __getattr__(self, name):
            return lambda *args: None

        def __getitem__(self, index):
            return self

        def __setitem__(self, index, value):
            pass

    class Holder:
        @property
        def data(self):
            seen.append(deferred_writes.next_use(sys._getframe(1), "data"))
            return Anything()

    h, i = Holder(), 3

    def method():
        return h.data.normal_

    def subscript():
        return h.data[i]

    def store():
        h.data[i] = 0

    def escapes():
        kept = h.data
        return kept

    def other_method():
        return h.data.sum

    for use in (method, subscript, store, escapes, other_method):
        use()
    getattr(h, "data")  # noqa: B009 - a load not made by a LOAD_ATTR instruction: the value may go anywhere
    assert seen == [("method", "normal_"), ("subscript",), ("store",), None, None, None]


class _ProbeBreaks:
    """deferred_writes' table pointed at a kernel that does something else for normal_."""

    def __enter__(self):
        self.saved = deferred_writes.RANDOM_WRITES["normal_"], deferred_writes._verdicts
        deferred_writes.RANDOM_WRITES["normal_"] = ("inplace_uniform_op", ("mean", "std"), (0, 1))
        deferred_writes._verdicts = ProbeCache()
        return self

    def __exit__(self, *exc):
        deferred_writes.RANDOM_WRITES["normal_"], deferred_writes._verdicts = self.saved


def test_a_write_whose_replay_differs_is_filled_then_run_and_status_names_it(checkpoints):
    cls = FAMILIES["qwen3-moe"][0]
    with cpu_kernel_fallbacks(), _ProbeBreaks():
        kinds, problems = deferred_writes.verified()
        assert "normal_" not in kinds and "zero_" in kinds and "normal_" in problems
        row = deferred_writes.status_row()
        assert row.state == "active" and "normal_" in row.reason and "filled, then run" in row.reason
        ms.set_seed(9)
        ref, acc = load_both(lambda: cls.from_pretrained(checkpoints["qwen3-moe", "lacking"]))
        assert_same_model(ref, acc)
        report = last_report()
        assert report.filled_in_init_pass > 0, report.summary()
    assert "normal_" in deferred_writes.verified()[0]  # the real table passes again
    assert building.leftovers() == []


def test_status_lists_the_deferred_writes_row():
    with cpu_kernel_fallbacks():
        rows = {row["name"]: row for row in ms_loadpatch.status()["techniques"]}
    assert rows["deferred-writes"]["state"] == "active", rows["deferred-writes"]


@pytest.fixture(scope="module")
def qwen3_moe_lacking_late_experts(tmp_path_factory):
    """A Qwen3-MoE of 16 experts a layer without weights of experts whose
    init calls are replayed (the later copies of each layer)."""
    from safetensors.numpy import load_file, save_file

    cls, config = FAMILIES["qwen3-moe"]
    sixteen = config()
    sixteen.num_experts = 16
    directory = save_family(cls, sixteen, str(tmp_path_factory.mktemp("replayed-writes") / "ckpt"))
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    dropped = ("model.layers.0.mlp.experts.14.up_proj.weight", "model.layers.1.mlp.experts.15.gate_proj.weight")
    for key in dropped:
        del tensors[key]
    save_file(tensors, path, metadata={"format": "np"})
    return cls, directory


@pytest.mark.parametrize("generator", ["default", "own"])
def test_replayed_calls_record_their_writes_as_real_calls_do(qwen3_moe_lacking_late_experts, monkeypatch, generator):
    """Copies whose init calls agreed on recording in-place writes get the
    calls replayed: each write recorded again, a random one taking its step
    of mindspore's default generator then. The experts the checkpoint lacks
    are filled with those writes replayed, and the model and the generators
    are the unpatched ones. A call stepping a generator of its own is never
    replayed (a replay would step the default one)."""
    from mindone.transformers.models.qwen3_moe import modeling_qwen3_moe

    cls, directory = qwen3_moe_lacking_late_experts
    again = []
    record_again = deferred_writes.record_again
    monkeypatch.setattr(deferred_writes, "record_again", lambda *a: again.append(a[4]) or record_again(*a))
    if generator == "own":
        own = ms.Generator()
        init_weights = modeling_qwen3_moe.Qwen3MoePreTrainedModel._init_weights

        def _init_weights(self, module):
            if isinstance(module, ms.mint.nn.Linear):
                own.manual_seed(3)
                module.weight.data.normal_(mean=0.0, std=0.02, generator=own)
            else:
                init_weights(self, module)

        monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoePreTrainedModel, "_init_weights", _init_weights)
    with cpu_kernel_fallbacks():
        ms.set_seed(9)
        ref, acc = load_both(lambda: cls.from_pretrained(directory))
    assert_same_model(ref, acc)
    report = last_report()
    assert report.filled_in_init_pass == 0 and report.missing_initialised == 2, report.summary()
    assert report.writes_deferred > 0 and report.cells_copied > 0, report.summary()
    if generator == "default":
        assert "normal_" in again and report.init_calls_replayed > 0, report.summary()
    else:
        assert "normal_" not in again


def test_the_probe_waits_for_the_first_write_and_runs_in_a_thread_of_its_own(checkpoints, tmp_path, monkeypatch):
    """A load whose init pass writes nothing in place (Llama without a
    padding row) never probes; the first load that writes runs the probe
    from inside its pass, in another thread (none of the building thread's
    patches apply there), and still gives the unpatched model and random state."""
    import threading

    real_verify, probed_in = deferred_writes._verify, []

    def verify():
        probed_in.append(threading.current_thread())
        return real_verify()

    monkeypatch.setattr(deferred_writes, "_verdicts", ProbeCache())
    monkeypatch.setattr(deferred_writes, "_verify", verify)
    llama, config = FAMILIES["llama-pad"]
    plain = save_family(llama, config(pad_token_id=None), str(tmp_path / "llama"))
    with cpu_kernel_fallbacks():
        ms.set_seed(4)
        ref, acc = load_both(lambda: llama.from_pretrained(plain))
        assert_same_model(ref, acc)
        assert probed_in == [] and "kinds" not in deferred_writes._verdicts
        cls = FAMILIES["qwen3-moe"][0]
        ms.set_seed(6)
        ref, acc = load_both(lambda: cls.from_pretrained(checkpoints["qwen3-moe", "lacking"]))
        assert_same_model(ref, acc)
        report = last_report()
    assert len(probed_in) == 1 and probed_in[0] is not threading.current_thread()
    assert report.filled_in_init_pass == 0 and report.writes_deferred > 0, report.summary()
    assert "normal_" in deferred_writes._verdicts["kinds"][0] and not probed_in[0].is_alive()
    assert building.leftovers() == []
