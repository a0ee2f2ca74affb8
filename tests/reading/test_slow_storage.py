"""Cold loads through network-like storage (tools/slow_storage.py: a FUSE
mount with a delay per read request): the harness serves the files as they
are and counts what it serves; a patched load of a cold checkpoint reads it
with the cold plan, asks the storage for each byte once and gives the
unpatched model; a storage that fails or stops answering mid-load gives a
clear error and leaves the process as it was."""

import _thread
import gc
import os
import subprocess
import threading
import time

import mindone.transformers as mt
import pytest
from _helpers import tiny_qwen2_config
from _process_state import assert_state_restored, process_state

import ms_loadpatch
from ms_loadpatch.strategy import reports, threaded_read
from ms_loadpatch.strategy.safetensors_header import CheckpointError
from ms_loadpatch.strategy.threaded_read import cold_read_plan
from ms_loadpatch.testing import assert_same_model, cpu_kernel_fallbacks
from ms_loadpatch.tools import cold
from ms_loadpatch.tools.slow_storage import SlowStorage, StorageSettings, unavailable

pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled")

if unavailable():
    pytest.skip(f"no FUSE mount here: {unavailable()}", allow_module_level=True)

FAST = StorageSettings(latency_ms=1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slow-storage") / "qwen2"
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(tiny_qwen2_config()).save_pretrained(directory, max_shard_size="20KB")
    return str(directory)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """One file of about 10 MB: long enough for the first read to be timed."""
    import transformers as hf

    directory = tmp_path_factory.mktemp("slow-storage") / "wide"
    config = hf.Qwen2Config(
        vocab_size=40000,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    with ms_loadpatch.disabled(), cpu_kernel_fallbacks():
        mt.Qwen2ForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _weights(directory):
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def _metadata_bytes(directory):
    """What a load reads before the weights: config and index files."""
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".json"))


def _metadata_read(storage):
    """Read the config and index files through the mount (they stay cached):
    the load's reads ahead of the weights then cannot race them to the storage."""
    for name in os.listdir(storage.mountpoint):
        if name.endswith(".json"):
            with open(storage.path(name), "rb") as f:
                f.read()
    assert storage.served()[0] == _metadata_bytes(storage.source)


def _cold(paths):
    gc.collect()  # a model of an earlier load may map the files
    left = cold.evict(paths)
    assert left == 0.0, f"{left:.0%} of the files stayed cached"


def test_serves_the_files_as_they_are_and_counts_the_bytes(checkpoint):
    with SlowStorage(checkpoint, FAST) as storage:
        assert os.path.ismount(storage.mountpoint)
        assert sorted(os.listdir(storage.mountpoint)) == sorted(os.listdir(checkpoint))
        served = [storage.path(os.path.basename(p)) for p in _weights(checkpoint)]
        _cold(served)
        before = storage.served()
        for path in served:
            with open(path, "rb") as f, open(os.path.join(checkpoint, os.path.basename(path)), "rb") as g:
                assert f.read() == g.read()
        size = sum(os.path.getsize(p) for p in served)
        after = storage.served()
        assert after[0] - before[0] == size and after[1] > before[1]
        for path in served:  # kept in the page cache: read again, nothing served
            with open(path, "rb") as f:
                f.read()
        assert storage.served() == after
        with pytest.raises(OSError):
            open(served[0], "r+b")
        mountpoint = storage.mountpoint
    assert not os.path.ismount(mountpoint) and not os.path.exists(mountpoint)


def test_unmounts_when_the_block_raises(checkpoint):
    with pytest.raises(ZeroDivisionError):
        with SlowStorage(checkpoint, FAST) as storage:
            mountpoint = storage.mountpoint
            raise ZeroDivisionError("inside the block")
    assert not os.path.ismount(mountpoint)


def test_cold_load_uses_the_cold_plan_reads_each_byte_once_and_is_the_unpatched_model(checkpoint):
    with SlowStorage(checkpoint, FAST) as storage:
        served_files = [storage.path(os.path.basename(p)) for p in _weights(checkpoint)]
        size = sum(os.path.getsize(p) for p in served_files)
        _cold(served_files)
        before = storage.served()[0]
        accelerated = mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)
        served = storage.served()[0] - before
        report = reports.last_report()
        assert sorted(r.path for r in report.files_read) == served_files
        assert all(r.cold and r.threads == cold_read_plan().threads for r in report.files_read)
        assert f"read with {cold_read_plan().threads} threads" in report.summary()
        assert size <= served <= 1.1 * size, (served, size)
        with ms_loadpatch.disabled():
            reference = mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)
        assert_same_model(reference, accelerated)
        del accelerated, reference

        mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)  # warm now: today's plan
        assert not any(r.cold or r.threads == cold_read_plan().threads for r in reports.last_report().files_read)


def test_storage_failing_mid_load_names_the_file_and_leaves_nothing_behind(checkpoint):
    first = min(os.path.getsize(p) for p in _weights(checkpoint))
    failing = StorageSettings(latency_ms=1.0, fail_after_bytes=_metadata_bytes(checkpoint) + first // 2)
    with SlowStorage(checkpoint, failing) as storage:
        _metadata_read(storage)
        _cold([storage.path(os.path.basename(p)) for p in _weights(checkpoint)])
        before = process_state()
        with pytest.raises(OSError) as raised:
            mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)
        assert_state_restored(before)
        assert isinstance(raised.value, CheckpointError), repr(raised.value)
        assert raised.value.path.startswith(storage.mountpoint) and raised.value.path in str(raised.value)


def test_interrupt_while_the_storage_stops_answering(checkpoint, ctrl_c_raises):
    """Once the config is read, no read request returns: Ctrl-C ends the
    load, the readers blocked on the storage are left to end, and the mount goes."""
    stalling = StorageSettings(latency_ms=1.0, stall_after_bytes=_metadata_bytes(checkpoint))
    with SlowStorage(checkpoint, stalling) as storage:
        _metadata_read(storage)
        _cold([storage.path(os.path.basename(p)) for p in _weights(checkpoint)])
        before = process_state()
        timer = threading.Timer(1.0, _thread.interrupt_main)
        started = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)
        finally:
            timer.cancel()
        assert time.monotonic() - started < 30, "the interrupt waited for the storage"  # it never answers
        assert_state_restored(before)
        mountpoint = storage.mountpoint
    assert not os.path.ismount(mountpoint)
    # the storage gone, the readers left blocked on it end
    deadline = time.monotonic() + 20
    while _readers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _readers()


def _readers():
    return [t.name for t in threading.enumerate() if t.name.startswith("ms_loadpatch-read") and t.is_alive()]


def test_storage_with_a_delay_per_request_gets_the_cold_plan(wide_checkpoint):
    """10 ms per request: the first 4 MB come slower than 100 MB/s, so
    the file is read with many requests in flight, and the model is the same."""
    (weights,) = _weights(wide_checkpoint)
    assert os.path.getsize(weights) > 2 * threaded_read.PROBE_BYTES
    with SlowStorage(wide_checkpoint, StorageSettings(latency_ms=10.0)) as storage:
        served_file = storage.path(os.path.basename(weights))
        _cold([served_file])
        rate = threaded_read.first_read_rate(served_file)
        assert rate is not None and rate < threaded_read.SLOW_STREAM_BYTES_PER_S
        _cold([served_file])
        accelerated = mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint)
        (read,) = reports.last_report().files_read
        assert read.cold and read.threads == cold_read_plan().threads
        with ms_loadpatch.disabled():
            assert_same_model(mt.Qwen2ForCausalLM.from_pretrained(storage.mountpoint), accelerated)


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    """A directory with one file of 4 MB."""
    directory = tmp_path_factory.mktemp("slow-storage-blob")
    with open(directory / "blob", "wb") as f:
        f.write(os.urandom(4 * 1024 * 1024))
    return str(directory)


def _server_processes(pgid):
    """The live (not zombie) processes of the server's process group."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            found.append(int(name))
    return found


def test_several_mounts_serve_the_same_files_and_count_per_mount(blob):
    path = os.path.join(blob, "blob")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        expected = f.read()
    with SlowStorage(blob, FAST, mounts=2) as storage:
        assert len(storage.mountpoints) == 2 and storage.mountpoint == storage.mountpoints[0]
        assert storage.path("blob") == storage.path_on(0, "blob") != storage.path_on(1, "blob")
        assert all(os.path.ismount(m) for m in storage.mountpoints)
        for index in range(2):  # each mount has its own page cache: each serves the file
            with open(storage.path_on(index, "blob"), "rb") as f:
                assert f.read() == expected
        assert storage.served_per_mount() == [size, size]
        assert storage.served()[0] == 2 * size


def test_several_mounts_share_the_aggregate_bandwidth(blob):
    size = os.path.getsize(os.path.join(blob, "blob"))
    cap = 8.0  # MB/s over both mounts: 2 * 4 MB take about 1 s (0.5 s if each mount had its own)
    with SlowStorage(blob, StorageSettings(latency_ms=1.0, total_mb_s=cap), mounts=2) as storage:

        def read(index):
            with open(storage.path_on(index, "blob"), "rb") as f:
                f.read()

        readers = [threading.Thread(target=read, args=(index,)) for index in range(2)]
        started = time.monotonic()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        elapsed = time.monotonic() - started
        assert storage.served_per_mount() == [size, size]
    assert elapsed >= 0.8 * 2 * size / (cap * 1e6), elapsed


def test_stopping_leaves_no_mount_and_no_server_process(blob):
    with SlowStorage(blob, FAST, mounts=3) as storage:
        server = storage._process.pid
        assert len(_server_processes(server)) >= 3  # one per mount
        mountpoints = storage.mountpoints
    assert not any(os.path.ismount(m) for m in mountpoints)
    assert _server_processes(server) == []


def test_unmounting_one_mount_ends_them_all(blob):
    with SlowStorage(blob, FAST, mounts=2) as storage:
        server = storage._process
        subprocess.run(["fusermount", "-u", storage.path_on(1)], check=True)
        assert server.wait(timeout=10) == 0
        assert not any(os.path.ismount(m) for m in storage.mountpoints)
        assert _server_processes(server.pid) == []
