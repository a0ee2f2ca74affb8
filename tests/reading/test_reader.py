"""The reader's data path: one file read in several threads (chunks), reads
the kernel returns short, a file that ends early. Test checkpoints are far
below the size where the chunked read starts (PARALLEL_READ_MIN_BYTES), so
these tests lower it and the chunk alignment: chunk borders then fall
inside tensors, the case a wrong offset would corrupt.
"""

import os

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
import transformers as hf
from safetensors.numpy import load_file, save_file

from ms_loadpatch.strategy import safetensors_header, threaded_read
from ms_loadpatch.strategy.reader import read_arrays
from ms_loadpatch.strategy.safetensors_header import CheckpointError
from ms_loadpatch.testing import assert_same_model, load_both, write_random_checkpoint


@pytest.fixture
def chunked(monkeypatch):
    """Every read split into chunks of (a multiple of) 64 bytes."""
    monkeypatch.setattr(threaded_read, "PARALLEL_READ_MIN_BYTES", 0)
    monkeypatch.setattr(threaded_read, "_ALIGN", 64)


@pytest.fixture
def odd_file(tmp_path):
    """Tensors of several dtypes and odd sizes, so tensor borders and chunk borders do not line up."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((37, 11)).astype(np.float32),
        "b": rng.integers(-(2**62), 2**62, size=(129,), dtype=np.int64),
        "c": rng.standard_normal((3, 5, 7)).astype(np.float16),
        "d": rng.integers(0, 255, size=(1001,), dtype=np.uint8),
        "e": rng.standard_normal((256, 33)).astype(np.float64),
    }
    path = str(tmp_path / "odd.safetensors")
    save_file(tensors, path, metadata={"format": "np"})
    return path


def _assert_as_safetensors_reads(path, separate=False):
    expected = load_file(path)
    arrays, metadata = read_arrays(path, separate=separate)
    assert metadata == {"format": "np"}
    assert set(arrays) == set(expected)
    for name, array in expected.items():
        got = arrays[name]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name
    owners = {id(_owner(array)) for array in arrays.values()}
    assert len(owners) == (len(arrays) if separate else 1)  # a buffer per tensor, or one for the file


def _owner(array):
    while array.base is not None:
        array = array.base
    return array


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_chunked_read_matches_safetensors(chunked, odd_file, monkeypatch, threads, separate):
    monkeypatch.setattr(threaded_read, "read_threads", lambda: threads)
    _assert_as_safetensors_reads(odd_file, separate)


@pytest.mark.parametrize("separate", [False, True])
def test_short_reads_are_continued(chunked, odd_file, monkeypatch, separate):
    """One read(2) returns at most about 2 GiB on Linux, so a large shard
    always comes in several reads; here every read returns at most 777 bytes."""
    real = os.preadv
    calls = []

    def short_preadv(fd, buffers, offset):
        (view,) = buffers
        calls.append(offset)
        return real(fd, [view[:777]], offset)

    monkeypatch.setattr(threaded_read.os, "preadv", short_preadv)
    _assert_as_safetensors_reads(odd_file, separate)
    assert len(calls) > os.path.getsize(odd_file) // 777  # really read in pieces


@pytest.mark.parametrize("separate", [False, True])
def test_without_preadv_reads_in_one_thread(chunked, odd_file, monkeypatch, separate):
    """Platforms without os.preadv (Windows) take the seek-and-read path."""
    monkeypatch.delattr(threaded_read.os, "preadv")
    monkeypatch.setattr(threaded_read, "run_in_threads", None)  # would fail if chunk threads were started
    _assert_as_safetensors_reads(odd_file, separate)


@pytest.mark.parametrize("threads", [1, 3])
def test_file_ending_early_in_a_chunk_is_refused(chunked, odd_file, monkeypatch, threads):
    """A file that shrinks after its header was checked (rewritten while
    being loaded): the read comes back short in one chunk; refused, naming
    the file and how much arrived, whichever chunk ends early."""
    monkeypatch.setattr(threaded_read, "read_threads", lambda: threads)
    header = safetensors_header.read_header(odd_file)
    end = os.path.getsize(odd_file)
    cut = header.data_start + 1000  # inside the first chunk when there are several
    real = os.preadv

    def ends_at_cut(fd, buffers, offset):
        (view,) = buffers
        if offset >= cut:
            return 0
        return real(fd, [view[: cut - offset]], offset)

    monkeypatch.setattr(threaded_read.os, "preadv", ends_at_cut)
    with pytest.raises(CheckpointError) as raised:
        read_arrays(odd_file)
    assert raised.value.path == odd_file
    assert f"read 1000 of {end - header.data_start} data bytes" in str(raised.value)
    with pytest.raises(CheckpointError) as raised:  # a buffer per tensor: the tensor the file ends in is named
        read_arrays(odd_file, separate=True)
    assert raised.value.path == odd_file
    ((name, (_, _, begin, stop)),) = [(n, e) for n, e in header.entries.items() if e[2] <= 1000 < e[3]]
    assert f"read {1000 - begin} of {stop - begin} bytes of tensor {name!r}" in str(raised.value)


def test_patched_load_with_chunked_reads_is_identical(chunked, tmp_path, cpu_kernels, monkeypatch):
    """The whole from_pretrained path with the shards read in chunks."""
    chunk_reads = []
    real = threaded_read._pread_into
    monkeypatch.setattr(
        threaded_read,
        "_pread_into",
        lambda fd, view, offset, *rest: chunk_reads.append(offset) or real(fd, view, offset, *rest),
    )
    config = hf.Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=False,
    )
    directory = write_random_checkpoint(mt.Qwen2ForCausalLM, config, str(tmp_path / "qwen2"), max_shard_bytes=150_000)
    shards = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert len(shards) > 2
    for dtype in (None, ms.bfloat16):
        kwargs = {"dtype": dtype} if dtype is not None else {}
        chunk_reads.clear()
        reference, accelerated = load_both(lambda: mt.Qwen2ForCausalLM.from_pretrained(directory, **kwargs))  # noqa: B023
        assert_same_model(reference, accelerated)
        assert len(chunk_reads) > len(shards)  # some file really came in chunks


def test_cold_plan_splits_reads_the_warm_plan_reads_whole(tmp_path, monkeypatch):
    """A cold file's read of 8 MB or more goes out as several requests at
    once (many in flight for storage with a delay per request); the same read
    on the warm plan is one request, as before. MS_LOADPATCH_COLD_READ_THREADS
    sets the node's count, divided among its ranks."""
    data = np.random.default_rng(0).integers(0, 256, size=12 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    data.tofile(path)
    offsets = []
    real = threaded_read._pread_into
    monkeypatch.setattr(
        threaded_read,
        "_pread_into",
        lambda fd, view, offset, *rest: offsets.append(offset) or real(fd, view, offset, *rest),
    )
    monkeypatch.delenv(threaded_read.COLD_READ_THREADS_ENV_VAR, raising=False)
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "1")
    fd = os.open(path, os.O_RDONLY)
    try:
        for plan, requests in ((threaded_read.cold_read_plan(), 6), (None, 1)):
            offsets.clear()
            buffer = np.empty_like(data)
            assert threaded_read.read_into(fd, buffer, 0, plan) == len(data)
            assert np.array_equal(buffer, data) and len(offsets) == requests, (plan, offsets)
    finally:
        os.close(fd)
    assert threaded_read.cold_read_plan().threads == threaded_read.COLD_READ_THREADS
    monkeypatch.setenv(threaded_read.COLD_READ_THREADS_ENV_VAR, "32")
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "4")
    assert threaded_read.cold_read_plan().threads == 8 and threaded_read.cold_read_plan().cold


def test_plan_follows_the_cache_and_the_first_read(tmp_path, monkeypatch):
    """Cached: the caller's threads. Cold: the cold plan where the first read
    shows slow storage (or cannot time it: a file under PROBE_BYTES), the
    caller's threads where it shows fast storage, flagged cold either way."""
    from ms_loadpatch.strategy import prefetch

    path = tmp_path / "blob"
    path.write_bytes(bytes(2 * threaded_read.PROBE_BYTES))
    monkeypatch.delenv(threaded_read.COLD_READ_THREADS_ENV_VAR, raising=False)
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "1")
    assert prefetch.read_plan(path, 1.0, 3) == threaded_read.ReadPlan(3)
    rates = []
    monkeypatch.setattr(prefetch, "first_read_rate", lambda p: rates.append(p) or rate)
    for rate, expected in (
        (1e6, threaded_read.COLD_READ_THREADS),
        (None, threaded_read.COLD_READ_THREADS),
        (threaded_read.SLOW_STREAM_BYTES_PER_S * 2, 3),
    ):
        plan = prefetch.read_plan(path, 0.0, 3)
        assert plan.cold and plan.threads == expected, (rate, plan)
    assert rates == [path] * 3
    # a read nothing runs beside (read_file's own plan): cold without the timed first read
    assert prefetch.read_plan(path, 0.0, 3, alone=True) == threaded_read.cold_read_plan() and rates == [path] * 3
    assert prefetch.read_plan(path, 1.0, 3, alone=True) == threaded_read.ReadPlan(3)
    monkeypatch.undo()
    rate = threaded_read.first_read_rate(path)
    assert rate is not None and rate > 0
    assert threaded_read.first_read_rate(tmp_path / "missing") is None
    (tmp_path / "short").write_bytes(b"x" * 100)
    assert threaded_read.first_read_rate(tmp_path / "short") is None  # too short to time


def test_a_read_outside_a_load_takes_the_cold_plan_at_once(tmp_path, monkeypatch):
    """read_file without a plan (from_single_file's read, nothing built
    beside it): a cold file is read on the cold plan with no timed first
    read, a cached one on the warm plan; the arrays are the file's."""
    from ms_loadpatch.strategy import prefetch

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), np.float16)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    plans = []
    real_read_arrays = prefetch.read_arrays
    monkeypatch.setattr(
        prefetch, "read_arrays", lambda p, plan, *rest: plans.append(plan) or real_read_arrays(p, plan, *rest)
    )
    monkeypatch.setattr(prefetch, "first_read_rate", lambda p: pytest.fail("timed a read nothing overlaps"))
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "1")
    for cached in (0.0, 1.0):
        monkeypatch.setattr(prefetch, "_cached_share", lambda p, cached=cached: cached)
        arrays, _metadata, _cast = prefetch.read_file(path)
        assert {k: np.asarray(v).tolist() for k, v in arrays.items()} == {k: v.tolist() for k, v in tensors.items()}
    assert plans[0] == threaded_read.cold_read_plan() and not plans[1].cold, plans


def test_narrowed_read_widens_mid_file(tmp_path, monkeypatch):
    """A read that starts narrowed (the caller busy building) reads with its
    narrowed count, in file order; once widened (the caller waits for it),
    the other threads take the runs not yet started, in the same file read,
    and the bytes are the file's."""
    import threading
    import time

    data = np.random.default_rng(1).integers(0, 256, size=8 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    data.tofile(path)
    monkeypatch.setattr(threaded_read, "_ALIGN", 1 << 20)
    widened = threading.Event()
    plan = threaded_read.ReadPlan(4, split_from=0, narrowed=threaded_read.Narrowed(1, widened))
    assert plan.threads_now() == 1
    reads, running, most_running = [], [0], [0]
    lock = threading.Lock()
    real = threaded_read._pread_into

    def pread(fd, view, offset, *rest):
        with lock:
            reads.append((offset, threading.current_thread().name, widened.is_set()))
            running[0] += 1
            most_running[0] = max(most_running[0], running[0])
        try:
            if len(reads) == 2:  # the narrowed thread's second run: the caller now waits
                widened.set()
            time.sleep(0.2)  # long enough for the joining threads to take the runs left
            return real(fd, view, offset, *rest)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(threaded_read, "_pread_into", pread)
    buffer = np.empty_like(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert threaded_read.read_into(fd, buffer, 0, plan) == len(data)
    finally:
        os.close(fd)
    assert np.array_equal(buffer, data)
    assert plan.threads_now() == 4
    offsets = [offset for offset, _, _ in reads]
    assert sorted(offsets) == [0, 2 << 20, 4 << 20, 6 << 20]  # one run per thread of the widened plan
    before = [(offset, name) for offset, name, was_widened in reads if not was_widened]
    assert [offset for offset, _ in before] == [0, 2 << 20]  # narrowed: one thread, in file order
    assert len({name for _, name in before}) == 1
    later_threads = {name for offset, name, _ in reads if offset >= 4 << 20}
    assert later_threads - {before[0][1]}, "no thread joined the read once it was widened"
    assert most_running[0] >= 2


def test_narrowed_read_never_widened_is_finished_by_its_own_threads(tmp_path, monkeypatch):
    """The joining threads give up once every run is taken: a read the
    caller never waits for still ends, with every byte, on the narrowed count."""
    import threading

    data = np.random.default_rng(2).integers(0, 256, size=6 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    data.tofile(path)
    monkeypatch.setattr(threaded_read, "_ALIGN", 1 << 20)
    names = []
    real = threaded_read._pread_into
    monkeypatch.setattr(
        threaded_read,
        "_pread_into",
        lambda fd, view, offset, *rest: names.append(threading.current_thread().name) or real(fd, view, offset, *rest),
    )
    plan = threaded_read.ReadPlan(3, split_from=0, narrowed=threaded_read.Narrowed(1, threading.Event()))
    buffer = np.empty_like(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert threaded_read.read_into(fd, buffer, 0, plan) == len(data)
    finally:
        os.close(fd)
    assert np.array_equal(buffer, data) and len(names) == 3 and len(set(names)) == 1


def test_timed_read_narrows_what_takes_cores_not_what_waits_on_storage(tmp_path, monkeypatch):
    """A read beside the build is narrowed when its threads take cores (a
    file in the page cache, or cold on fast storage); the cold plan of slow
    storage keeps every thread from the start: they wait, taking none."""
    import threading

    from ms_loadpatch.strategy import prefetch

    path = tmp_path / "blob"
    path.write_bytes(bytes(2 * threaded_read.PROBE_BYTES))
    monkeypatch.setenv("MS_LOADPATCH_LOCAL_RANKS", "1")
    plans = []
    monkeypatch.setattr(prefetch, "read_file", lambda p, cast_plan, plan, *rest: plans.append(plan) or ({}, {}, {}))
    narrowed = threaded_read.Narrowed(1, threading.Event())
    for cached, rate in ((1.0, None), (0.0, threaded_read.SLOW_STREAM_BYTES_PER_S * 2), (0.0, 1e6)):
        monkeypatch.setattr(prefetch, "_cached_share", lambda p, cached=cached: cached)
        monkeypatch.setattr(prefetch, "first_read_rate", lambda p, rate=rate: rate)
        prefetch.timed_read(path, threads=4, narrowed=narrowed)
    warm, fast_cold, slow_cold = plans
    assert warm.narrowed is narrowed and warm.threads_now() == 1 and not warm.waits
    assert fast_cold.cold and fast_cold.narrowed is narrowed and fast_cold.threads_now() == 1
    assert slow_cold.waits and slow_cold.narrowed is None
    assert slow_cold.threads_now() == slow_cold.threads == threaded_read.cold_read_plan().threads
    narrowed.widened.set()
    assert warm.threads_now() == fast_cold.threads_now() == 4
