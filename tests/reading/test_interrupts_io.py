"""Interrupted and hostile loads: Ctrl-C at chosen points of a patched load,
SIGTERM in the middle of one, storage that fails or changes underneath, and
exhausted limits. Each ends in a clean interrupt or an error naming the file,
with the process as it was (_process_state.assert_state_restored), no reader
thread left, and the next patched load bit-identical to an unpatched one.

Faults are injected by wrapping the plugin's own functions for the test (the
real mindone models and files are loaded); the interrupt is Python's
KeyboardInterrupt raised in the main thread (`_thread.interrupt_main`).
"""

import _thread
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from _helpers import TESTS_DIR
from _process_state import assert_state_restored, process_state
from _tiny_checkpoints import (
    checkpoints,  # noqa: F401  (a fixture)
    file_to_break,
    load,
    shards,
)
from safetensors.numpy import load_file, save_file

import ms_loadpatch
from ms_loadpatch.glue import diffusers as df_glue
from ms_loadpatch.glue import transformers as tf_glue
from ms_loadpatch.strategy import safetensors_header, threaded_read
from ms_loadpatch.strategy.safetensors_header import CheckpointError
from ms_loadpatch.testing import assert_same_model, load_both

HERE = TESTS_DIR
pytestmark = pytest.mark.usefixtures("cpu_kernels", "plugin_enabled", "ctrl_c_raises")


LIBRARIES = ["tf", "df"]
LAYOUTS = ["single", "sharded"]


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ms_loadpatch-read") and t.is_alive()]


def _next_load_is_identical(library, directory):
    reference, accelerated = load_both(lambda: load(library, directory))
    assert_same_model(reference, accelerated)


class Interrupt:
    """Interrupts the main thread (KeyboardInterrupt, as Python's SIGINT
    handler raises it) the first time `hit()` is called, from whatever
    thread; remembers when, for the latency. Not a real SIGINT: once
    mindspore's runtime has started, its own SIGINT handler terminates the
    process (exit status 143), patched or not."""

    def __init__(self):
        self.sent_at = None
        self.thread = None

    def hit(self):
        if self.sent_at is None:
            self.thread = threading.current_thread().name
            self.sent_at = time.perf_counter()
            _thread.interrupt_main()


def _interrupt_at(point, library, monkeypatch, interrupt, slow_read_seconds=0.5):
    """Wrap the function where `point` happens so that it sends the interrupt."""
    if point == "construction":  # inside a cell's __init__, part of the model built
        from mindspore import nn

        real_init = nn.Cell.__init__
        calls = []

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            calls.append(1)
            if len(calls) == 5:
                interrupt.hit()

        monkeypatch.setattr(nn.Cell, "__init__", init)
    elif point == "read":  # in a reader thread, which then goes on slowly (storage taking its time)
        real_pread = threaded_read._pread_into

        def pread(fd, view, offset, *rest):
            interrupt.hit()
            time.sleep(slow_read_seconds)
            return real_pread(fd, view, offset, *rest)

        monkeypatch.setattr(threaded_read, "_pread_into", pread)
    elif point == "assign":  # after part of the tensors went into the model
        if library == "tf":
            real_assign = tf_glue.assign

            def assign(pairs, report, cast_at_read):
                pairs = list(pairs)
                real_assign(pairs[: len(pairs) // 2], report, cast_at_read)
                interrupt.hit()
                real_assign(pairs[len(pairs) // 2 :], report, cast_at_read)

            monkeypatch.setattr(tf_glue, "assign", assign)
        else:
            real_assign = df_glue.assign_in_final_dtype

            def assign(index, state_dict, *rest):
                names = list(state_dict)
                real_assign(index, {n: state_dict[n] for n in names[: len(names) // 2]}, *rest)
                interrupt.hit()
                real_assign(index, {n: state_dict[n] for n in names[len(names) // 2 :]}, *rest)

            monkeypatch.setattr(df_glue, "assign_in_final_dtype", assign)
    elif point == "init-missing":  # while the weights the checkpoint lacks are initialised
        module, name = tf_glue, "initialize_unloaded"
        real_init = getattr(module, name)

        def initialize(*args, **kwargs):
            interrupt.hit()
            return real_init(*args, **kwargs)

        monkeypatch.setattr(module, name, initialize)
    else:
        raise ValueError(point)


def _without_one_tensor(checkpoints, tmp_path, name):
    """A copy of a checkpoint lacking one weight that mindone initialises
    (the final norm's), so the init-missing step has work to do."""
    import shutil

    directory = tmp_path / name
    shutil.copytree(checkpoints / name, directory)
    for path in shards(directory):
        tensors = load_file(path)
        if "model.norm.weight" in tensors:
            del tensors["model.norm.weight"]
            save_file(tensors, path, metadata={"format": "np"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop("model.norm.weight")
        index.write_text(json.dumps(data))
    return directory


# a diffusers load leaves what its checkpoint lacks lazy, as mindone does: no init-missing step
@pytest.mark.parametrize(
    "library,point",
    [
        (library, point)
        for library in LIBRARIES
        for point in ("construction", "read", "assign", "init-missing")
        if (library, point) != ("df", "init-missing")
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_keyboard_interrupt(checkpoints, tmp_path, monkeypatch, library, layout, point):
    name = f"{library}-{layout}"
    directory = checkpoints / name
    if point == "init-missing" and library == "tf":
        directory = _without_one_tensor(checkpoints, tmp_path, name)
    before = process_state()
    interrupt = Interrupt()
    with monkeypatch.context() as patch:
        _interrupt_at(point, library, patch, interrupt)
        try:
            model = load(library, directory)
        except KeyboardInterrupt:
            caught_at = time.perf_counter()
        else:
            pytest.fail(f"the load returned a {type(model).__name__} although interrupted ({interrupt.sent_at})")
    assert interrupt.sent_at is not None, f"the load never reached {point}"
    latency = caught_at - interrupt.sent_at
    print(
        f"\ninterrupt at {point} ({library}-{layout}, sent from {interrupt.thread}): "
        f"reached the caller after {latency * 1000:.1f} ms"
    )
    assert not _reader_threads(), "reader threads left running"
    assert_state_restored(before)
    _next_load_is_identical(library, directory)


def _cold_plan(patch, directory):
    """The checkpoint's pages evicted and its storage taken for slow (the
    first read's rate), so its files are read with the cold plan, split in
    small chunks among its threads; the plans chosen, in a list. Taken for
    cold, too: mindone's own look at a single file's header may bring all
    of a file this small into the page cache before the read."""
    import gc

    from ms_loadpatch.strategy import prefetch
    from ms_loadpatch.tools import cold

    gc.collect()  # a model of an earlier load may map the files
    assert cold.evict(shards(directory)) == 0.0
    patch.setattr(prefetch, "_cached_share", lambda path: 0.0)
    patch.setattr(prefetch, "first_read_rate", lambda path: 1.0)
    patch.setattr(threaded_read, "COLD_SPLIT_FROM", 0)
    patch.setattr(threaded_read, "_ALIGN", 64)
    plans, real_plan = [], prefetch.read_plan
    patch.setattr(prefetch, "read_plan", lambda *args, **kwargs: plans.append(real_plan(*args, **kwargs)) or plans[-1])
    return plans


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_keyboard_interrupt_during_a_cold_read(checkpoints, monkeypatch, library, layout):
    """Ctrl-C while a cold file is read by the cold plan's many threads, in
    chunks: the interrupt reaches the caller, every chunk thread ends."""
    directory = checkpoints / f"{library}-{layout}"
    before = process_state()
    interrupt = Interrupt()
    with monkeypatch.context() as patch:
        plans = _cold_plan(patch, directory)
        _interrupt_at("read", library, patch, interrupt)
        with pytest.raises(KeyboardInterrupt):
            load(library, directory)
    assert interrupt.sent_at is not None, "the load never read"
    assert plans and all(plan.cold and plan.threads == threaded_read.cold_read_plan().threads for plan in plans)
    deadline = time.monotonic() + 10
    while _reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _reader_threads(), "reader threads left running"
    assert_state_restored(before)
    _next_load_is_identical(library, directory)


def test_interrupt_does_not_wait_for_a_slow_read(checkpoints, monkeypatch):
    """Ctrl-C while a reader thread is stuck in a slow read: the caller gets
    the interrupt while the read is still going; the read is then stopped
    (its thread ends after that part, within the bounded wait)."""
    interrupt = Interrupt()
    slow = 3.0
    read_finished = []
    real_pread = threaded_read._pread_into

    def pread(fd, view, offset, *rest):
        interrupt.hit()
        time.sleep(slow)
        read_finished.append(time.perf_counter())
        return real_pread(fd, view, offset, *rest)

    monkeypatch.setattr(threaded_read, "_pread_into", pread)
    before = process_state()
    with pytest.raises(KeyboardInterrupt):
        load("tf", checkpoints / "tf-sharded")
    caught_at = time.perf_counter()
    print(
        f"\ninterrupt during a {slow:.0f} s read: caller interrupted after "
        f"{(caught_at - interrupt.sent_at) * 1000:.1f} ms"
    )
    assert not read_finished or read_finished[0] > caught_at, "the interrupt waited for the read to end"
    monkeypatch.undo()
    deadline = time.monotonic() + slow + 5
    while _reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _reader_threads(), "the stopped read's thread never ended"
    assert_state_restored(before)
    _next_load_is_identical("tf", checkpoints / "tf-sharded")


# -- SIGTERM in the middle of a patched load

SIGTERM_CHILD = r"""
import os, sys, time
import mindone.transformers as mt
import ms_loadpatch
from ms_loadpatch.strategy import threaded_read
from ms_loadpatch.testing import cpu_kernel_fallbacks

real = threaded_read._pread_into
def slow(fd, view, offset, *rest):
    print("READING", flush=True)
    time.sleep(30)
    return real(fd, view, offset, *rest)
threaded_read._pread_into = slow
if sys.argv[2] == "patched-cold":  # the files taken for cold on slow storage: the cold plan's many threads
    from ms_loadpatch.strategy import prefetch
    prefetch._cached_share = lambda path: 0.0
    prefetch.first_read_rate = lambda path: 1.0
    threaded_read.COLD_SPLIT_FROM = 0
with cpu_kernel_fallbacks():
    with ms_loadpatch.disabled() if sys.argv[2] == "unpatched" else ms_loadpatch.enabled():
        if sys.argv[2] == "unpatched":
            print("READING", flush=True)
            while True:
                mt.Qwen2ForCausalLM.from_pretrained(sys.argv[1])
        mt.Qwen2ForCausalLM.from_pretrained(sys.argv[1])
print("LOADED", flush=True)
"""


@pytest.mark.parametrize("mode", ["patched", "patched-cold", "unpatched"])
def test_sigterm_mid_load_exits_like_unpatched(checkpoints, mode):
    """SIGTERM while a reader thread is blocked in a read (patched-cold: one
    of the cold plan's chunk threads): the process ends by the signal
    (default action), not hanging on its threads, no core dump."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD, str(checkpoints / "tf-sharded"), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in proc.stdout:
            if line.startswith("READING"):
                break
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == -signal.SIGTERM, f"exit {returncode}: {proc.stderr.read()[-2000:]}"


# -- storage faults


def _copy(checkpoints, tmp_path, name):
    import shutil

    directory = tmp_path / name
    shutil.copytree(checkpoints / name, directory)
    return directory


def _fails_naming(library, directory, path, expected_type=OSError):
    """The patched load fails naming `path`, the process as it was; None where
    the plugin hands the file to mindone instead (a diffusers single file its
    reader refuses), which reads it itself: then its model must equal the
    unpatched one (the fault injected into the plugin's reader is not met)."""
    before = process_state()
    if (library, directory.name) == ("df", "df-single"):
        model = load(library, directory)
        assert_state_restored(before)
        with ms_loadpatch.disabled():
            reference = load(library, directory)
        assert_same_model(reference, model)
        return None
    with pytest.raises(expected_type) as info:
        load(library, directory)
    assert str(path) in str(info.value), f"the file is not named: {type(info.value).__name__}: {info.value}"
    assert not _reader_threads()
    assert_state_restored(before)
    return info.value


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_shard_that_cannot_be_opened(checkpoints, tmp_path, monkeypatch, library, layout):
    """Permission denied on one shard (injected at the reader's open: as root,
    chmod 000 would still be readable)."""
    directory = _copy(checkpoints, tmp_path, f"{library}-{layout}")
    victim = file_to_break(directory)
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == victim:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), victim)
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(safetensors_header, "open", guarded_open, raising=False)
        error = _fails_naming(library, directory, victim)
    assert error is None or isinstance(error, CheckpointError) and error.errno == errno.EACCES, repr(error)
    _next_load_is_identical(library, directory)


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_read_failing_mid_file(checkpoints, tmp_path, monkeypatch, library, layout, cache):
    """EIO from the storage in the middle of the data (as a network mount
    gives); cold: while the cold plan's threads read it in chunks."""
    directory = _copy(checkpoints, tmp_path, f"{library}-{layout}")
    victim = file_to_break(directory)
    real_pread = threaded_read._pread_into

    def pread(fd, view, offset, *rest):
        if os.path.samefile(f"/proc/self/fd/{fd}", victim):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pread(fd, view, offset, *rest)

    with monkeypatch.context() as patch:
        plans = _cold_plan(patch, directory) if cache == "cold" else None
        patch.setattr(threaded_read, "_pread_into", pread)
        error = _fails_naming(library, directory, victim)
    assert error is None or isinstance(error, CheckpointError) and error.errno == errno.EIO, repr(error)
    if cache == "cold":
        assert plans and any(plan.cold for plan in plans), plans
    _next_load_is_identical(library, directory)


def _change_during_read(monkeypatch, victim, change):
    """Apply `change(victim)` after the reader read the victim's header, before its data."""
    real = safetensors_header.read_header_from

    def read_header_then_change(f, path):
        header = real(f, path)
        if os.fspath(path) == victim:
            change(victim)
        return header

    monkeypatch.setattr(safetensors_header, "read_header_from", read_header_then_change)


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 64)


def _grow(path):
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


def _rewrite_same_size(path):
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x7f" * 8)
    os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("change", [_truncate, _grow, _rewrite_same_size], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("library", LIBRARIES)
def test_file_changing_while_read(checkpoints, tmp_path, monkeypatch, library, change, cache):
    """Another process truncating, appending to or rewriting a shard between
    the reader's header and data reads: refused, never a mixed model; cold,
    while the cold plan's threads read it in chunks."""
    directory = _copy(checkpoints, tmp_path, f"{library}-sharded")
    victim = file_to_break(directory)
    with monkeypatch.context() as patch:
        plans = _cold_plan(patch, directory) if cache == "cold" else None
        _change_during_read(patch, victim, change)
        error = _fails_naming(library, directory, victim)
    assert "changed" in str(error) or "truncated" in str(error), str(error)
    if cache == "cold":
        assert plans and any(plan.cold for plan in plans), plans


# -- limits (each in a subprocess: the limit is process-wide)


def _limits_child(kind, tmp_path, **env):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_limits_child.py"), kind, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **env),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("REPORT ") :])


def _assert_clean_after(report):
    assert report["reader_threads"] == [], report
    assert report["state_restored"] is True, report
    assert report["next_load_identical"] is True, report


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_open_files_limit(tmp_path, cache):
    """RLIMIT_NOFILE at the descriptors already open plus one, a checkpoint of
    23 shards read by 8 threads (cold: each on the cold plan's chunk
    threads): no hang (reads waiting on each other), and when an open fails,
    EMFILE naming the file it could not open. Whether one fails depends on
    how the threads' opens overlap; either way nothing is left behind and
    the next load is identical."""
    report = _limits_child("nofile", tmp_path, LIMIT_FREE_FDS="1", LIMITS_COLD="1" if cache == "cold" else "")
    if cache == "cold":
        assert report["cold_plans"] > 0, report
    print("\nRLIMIT_NOFILE:", json.dumps(report["error"]))
    error = report["error"]
    if error is not None:
        assert "OSError" in error["mro"] and "Too many open files" in error["message"], error
        assert ".safetensors" in error["message"] or ".json" in error["message"], error
    _assert_clean_after(report)


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_address_space_limit(tmp_path, cache):
    """RLIMIT_AS leaving room for half the checkpoint's data: MemoryError
    naming the file and how much it needed (cold: on the cold plan)."""
    report = _limits_child("as", tmp_path, LIMITS_COLD="1" if cache == "cold" else "")
    if cache == "cold":
        assert report["cold_plans"] > 0, report
    print("\nRLIMIT_AS:", json.dumps(report["error"]))
    error = report["error"]
    assert error is not None, report
    assert "MemoryError" in error["mro"] or "OSError" in error["mro"], error
    assert "model.safetensors" in error["message"], error
    _assert_clean_after(report)
