"""MS_LOADPATCH_PAGE_CACHE (strategy/page_cache.py): `drop` leaves a
checkpoint's pages out of the page cache once a patched load has read them
(checked with mincore), `keep` (the default) leaves them in, and the model
is the unpatched one either way."""

import gc
import logging
import os

import mindone.diffusers as md
import mindone.transformers as mt
import pytest
from _helpers import tiny_qwen2_config, tiny_vae

import ms_loadpatch
from ms_loadpatch.strategy import page_cache, reports
from ms_loadpatch.strategy.threaded_read import cold_read_plan
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")

if page_cache.resident_fraction(__file__) is None:
    pytest.skip("no mincore here (Linux only)", allow_module_level=True)


def _files(directory):
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def _evicted(directory):
    """Every checkpoint file written back and its pages given back: a cold start
    (models of earlier tests collected first: a mapping keeps its pages)."""
    gc.collect()
    for path in _files(directory):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    fractions = [page_cache.resident_fraction(p) for p in _files(directory)]
    if any(f > 0 for f in fractions):
        pytest.skip(f"this filesystem keeps the pages whatever the advice ({fractions})")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("page-cache")
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(root / "qwen2", max_shard_size="20KB")
        md.AutoencoderKL(**tiny_vae()).save_pretrained(root / "vae")
    return {"qwen2": (mt.Qwen2ForCausalLM, str(root / "qwen2")), "vae": (md.AutoencoderKL, str(root / "vae"))}


def test_resident_fraction_sees_a_read_and_an_eviction(checkpoints):
    path = _files(checkpoints["vae"][1])[0]
    _evicted(checkpoints["vae"][1])
    assert page_cache.resident_fraction(path) == 0.0
    with open(path, "rb") as f:
        f.read()
    assert page_cache.resident_fraction(path) == 1.0


@pytest.mark.parametrize("name", ["qwen2", "vae"])
@pytest.mark.parametrize("setting", ["drop", "keep", None])
def test_policy_leaves_the_pages_as_asked_and_the_model_unchanged(checkpoints, monkeypatch, name, setting):
    cls, directory = checkpoints[name]
    if setting is None:
        monkeypatch.delenv(page_cache.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(page_cache.ENV_VAR, setting)
    _evicted(directory)
    accelerated = cls.from_pretrained(directory)
    assert reports.last_report() is not None and reports.last_report().tensors_read > 0
    assert len(_files(directory)) > (1 if name == "qwen2" else 0)
    fractions = [page_cache.resident_fraction(p) for p in _files(directory)]
    if setting == "drop":
        assert fractions == [0.0] * len(fractions)
    else:  # keep, the default: as an unpatched load leaves them
        assert fractions == [1.0] * len(fractions)
    with ms_loadpatch.disabled():
        reference = cls.from_pretrained(directory)
    assert_same_model(reference, accelerated)


def test_unknown_value_is_named_once_and_keeps(monkeypatch, caplog):
    monkeypatch.setenv(page_cache.ENV_VAR, "evict-please")
    with caplog.at_level(logging.WARNING, logger="ms_loadpatch"):
        assert page_cache.policy() == page_cache.KEEP
        assert page_cache.policy() == page_cache.KEEP
    warnings = [r.getMessage() for r in caplog.records if page_cache.ENV_VAR in r.getMessage()]
    assert len(warnings) == 1 and "evict-please" in warnings[0] and "keep, drop" in warnings[0]


@pytest.mark.parametrize("name", ["qwen2", "vae"])
def test_report_gives_each_file_read_and_whether_it_was_cold(checkpoints, monkeypatch, name):
    """Each checkpoint file once in the report, with its size; cold after an
    eviction, warm on the next load, which finds the pages `keep` left."""
    monkeypatch.delenv(page_cache.ENV_VAR, raising=False)
    cls, directory = checkpoints[name]
    files = _files(directory)
    _evicted(directory)
    cls.from_pretrained(directory)
    cold = reports.last_report()
    assert sorted(r.path for r in cold.files_read) == files
    assert [r.bytes for r in sorted(cold.files_read, key=lambda r: r.path)] == [os.path.getsize(p) for p in files]
    assert cold.bytes_read == sum(os.path.getsize(p) for p in files)
    assert all(r.cold and r.cached == 0.0 and r.seconds >= 0 for r in cold.files_read)
    assert all(r.threads == cold_read_plan().threads for r in cold.files_read)  # the cold plan
    spans = sorted((r.started, r.ended) for r in cold.files_read)
    assert max(r.seconds for r in cold.files_read) <= cold.read_seconds() <= spans[-1][1] - spans[0][0] + 1e-9
    assert f"0 of {len(files)} cold" not in cold.summary() and f"{len(files)} of {len(files)} cold" in cold.summary()
    as_dict = cold.as_dict()
    assert as_dict["bytes_read"] == cold.bytes_read and [r["cold"] for r in as_dict["files_read"]] == [True] * len(
        files
    )

    cls.from_pretrained(directory)
    warm = reports.last_report()
    assert all(r.cached == 1.0 and not r.cold for r in warm.files_read) and len(warm.files_read) == len(files)
    assert all(r.threads < cold_read_plan().threads for r in warm.files_read)  # today's plan
    assert f"0 of {len(files)} cold" in warm.summary()


def _spy_direct(monkeypatch):
    from ms_loadpatch.strategy import reader

    results = []
    real = reader._read_direct

    def spy(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(reader, "_read_direct", spy)
    return reader, results


@pytest.mark.parametrize("refused", [None, "flag", "read"])
def test_drop_reads_cold_files_around_the_page_cache(checkpoints, monkeypatch, refused):
    """Under `drop`, a cold file's data is read with O_DIRECT where the
    filesystem allows it; where it refuses the flag or the read itself, the
    usual read runs. The model is the unpatched one every way."""
    import errno
    import fcntl

    cls, directory = checkpoints["qwen2"]
    monkeypatch.setenv(page_cache.ENV_VAR, "drop")
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "1")
    reader, results = _spy_direct(monkeypatch)
    real_fcntl, real_read_into = fcntl.fcntl, reader.read_into

    def refusing_fcntl(fd, command, *args):
        if command == fcntl.F_SETFL and args and args[0] & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, *args)

    def refusing_read(fd, *args, **kwargs):
        if real_fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_read_into(fd, *args, **kwargs)

    if refused == "flag":
        monkeypatch.setattr(reader.fcntl, "fcntl", refusing_fcntl)
    elif refused == "read":
        monkeypatch.setattr(reader, "read_into", refusing_read)
    _evicted(directory)
    accelerated = cls.from_pretrained(directory)
    assert len(results) == len(_files(directory)), "not every cold file was offered a direct read"
    if refused is None:
        if any(r is None for r in results):
            pytest.skip("this filesystem refuses O_DIRECT")
    else:
        assert results == [None] * len(results)
    assert [page_cache.resident_fraction(p) for p in _files(directory)] == [0.0] * len(_files(directory))
    with ms_loadpatch.disabled():
        reference = cls.from_pretrained(directory)
    assert_same_model(reference, accelerated)


def test_keep_and_warm_files_are_read_through_the_page_cache(checkpoints, monkeypatch):
    cls, directory = checkpoints["qwen2"]
    _reader, results = _spy_direct(monkeypatch)
    monkeypatch.delenv(page_cache.ENV_VAR, raising=False)
    _evicted(directory)
    cls.from_pretrained(directory)  # cold, keep
    monkeypatch.setenv(page_cache.ENV_VAR, "drop")
    cls.from_pretrained(directory)  # drop, but warm: `keep` left the pages
    assert results == []


_READ_AND_ADVISE = """
import os, sys
from ms_loadpatch.strategy import page_cache
with open(sys.argv[1], "rb") as f:
    f.read()
    page_cache.after_read(f.fileno(), whole_file=sys.argv[2] == "whole")
"""


def _as_rank(code, *args, **env):
    """`code` in a child of this process (the ranks of one launcher share their parent)."""
    import subprocess
    import sys

    child_env = {k: v for k, v in os.environ.items() if k not in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE")}
    child_env.update({page_cache.ENV_VAR: "drop", **env})
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=child_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def readers_dir_of_children():
    """Where the children's ranks count their reads; removed after the test whatever happened."""
    import shutil

    path = os.path.join(os.path.dirname(page_cache.readers_dir()), f"ms_loadpatch-readers-{os.getuid()}-{os.getpid()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_drop_with_two_ranks_is_left_to_the_last_reader(checkpoints, readers_dir_of_children):
    """With two ranks counted on the node, the first to read a file leaves
    its pages for the other, whose read gives them back; a rank reading one
    tensor again counts for nothing; where only the job's total is known
    (MS_WORKER_NUM), each rank gives the pages back at once."""
    path = _files(checkpoints["vae"][1])[0]
    readers = readers_dir_of_children
    _evicted(checkpoints["vae"][1])
    _as_rank(_READ_AND_ADVISE, path, "whole", MS_LOADPATCH_LOCAL_RANKS="2")
    assert page_cache.resident_fraction(path) == 1.0 and len(os.listdir(readers)) == 1
    _as_rank(_READ_AND_ADVISE, path, "tensor", MS_LOADPATCH_LOCAL_RANKS="2")  # one tensor again
    assert page_cache.resident_fraction(path) == 1.0 and len(os.listdir(readers)) == 1
    _as_rank(_READ_AND_ADVISE, path, "whole", MS_LOADPATCH_LOCAL_RANKS="2")
    assert page_cache.resident_fraction(path) == 0.0 and not os.path.exists(readers)

    with open(path, "rb") as f:
        f.read()
    _as_rank(_READ_AND_ADVISE, path, "whole", MS_ROLE="MS_WORKER", MS_WORKER_NUM="8")
    assert page_cache.resident_fraction(path) == 0.0 and not os.path.exists(readers)


_PATCHED_LOAD = """
import sys
import ms_loadpatch
import mindone.transformers as mt
from ms_loadpatch.testing import cpu_kernel_fallbacks
with cpu_kernel_fallbacks():
    mt.Qwen2ForCausalLM.from_pretrained(sys.argv[1])
report = ms_loadpatch.last_report()
assert report is not None and report.files_read, report
"""


def test_two_ranks_loading_under_drop_read_each_file_from_storage_once(checkpoints, readers_dir_of_children):
    """Two ranks' patched loads under `drop`, one after the other: the first
    leaves every file in the page cache for the second, which gives them back."""
    directory = checkpoints["qwen2"][1]
    _evicted(directory)
    _as_rank(_PATCHED_LOAD, directory, MS_LOADPATCH_LOCAL_RANKS="2")
    assert [page_cache.resident_fraction(p) for p in _files(directory)] == [1.0] * len(_files(directory))
    _as_rank(_PATCHED_LOAD, directory, MS_LOADPATCH_LOCAL_RANKS="2")
    assert [page_cache.resident_fraction(p) for p in _files(directory)] == [0.0] * len(_files(directory))
    assert not os.path.exists(readers_dir_of_children)
