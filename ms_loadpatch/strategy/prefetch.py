"""Reading checkpoint files ahead, in background threads, while the caller
does other work (building the model, assigning the previous shard).

File reads and the page faults of filling fresh memory happen outside the
GIL, so they overlap Python-heavy model construction even on one worker.
Read-ahead is bounded so that a cast-on-load (fp32 file, bf16 model) does
not hold every fp32 shard at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from dataclasses import asdict, dataclass

from ..activation import env_flag
from . import page_cache
from .castread import Staging, read_cast
from .progress import ReadProgress, wanted
from .ranks import node_share
from .reader import read_arrays
from .threaded_read import (
    SLOW_STREAM_BYTES_PER_S,
    Narrowed,
    ReadPlan,
    ReadStopped,
    as_plan,
    background_read_threads,
    cold_read_plan,
    first_read_rate,
    join_or_leave,
    read_threads,
)


def parallel_workers() -> int:
    """HF_ENABLE_PARALLEL_LOADING / HF_PARALLEL_LOADING_WORKERS, read at call
    time (mindone reads the flag once, at import)."""
    if not env_flag("HF_ENABLE_PARALLEL_LOADING"):
        return 1
    try:
        return max(1, int(os.environ.get("HF_PARALLEL_LOADING_WORKERS", "8")))
    except ValueError:
        return 8


@dataclass
class FileRead:
    """One checkpoint file's read: its size, when it started and ended
    (perf_counter), the share of its pages already in the page cache when it
    started (None where that cannot be seen), and the threads read with."""

    path: str
    bytes: int
    started: float
    ended: float
    cached: float | None
    threads: int = 1

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def cold(self) -> bool:
        """Mostly read from storage rather than from the page cache."""
        return page_cache.is_cold(self.cached)

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "cold": self.cold}


def _cached_share(path) -> float | None:
    try:
        return page_cache.resident_fraction(path)
    except OSError:  # the read raises the error that names the file
        return None


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read_plan(path, cached: float | None, threads=None, alone=False) -> ReadPlan:
    """How to read `path`, `cached` its share in the page cache: in the page
    cache, with `threads` (a count, None for read_threads()); cold, timed by
    its first read: on slow storage the cold plan (many requests in flight),
    on fast storage `threads` as warm (more take cores from the build and,
    measured, read no faster once it is done). `alone`: nothing runs beside
    the read, so a cold file gets the cold plan without the timed first
    read, which no other request would overlap."""
    if not page_cache.is_cold(cached):
        return as_plan(threads)
    if alone:
        return cold_read_plan()
    rate = first_read_rate(path)
    if rate is not None and rate >= SLOW_STREAM_BYTES_PER_S:
        return cold_read_plan(threads=as_plan(threads).threads)
    return cold_read_plan()


def timed_read(path, cast_plan=None, threads=None, stop=None, staging=None, progress=None, narrowed=None):
    """(read_file's result, FileRead) for `path`: read with `threads` (a
    thread count, None for read_threads()) when it is in the page cache, with
    the cold plan (many requests in flight) when it is mostly not; the bytes
    told to `progress` (a progress.ReadProgress) as they arrive. `narrowed`
    (threaded_read.Narrowed): fewer threads while the caller is busy, unless
    they mostly wait on slow storage."""
    cached = _cached_share(path)
    started = time.perf_counter()
    counter = progress.file() if progress is not None else None
    plan = dataclasses.replace(read_plan(path, cached, threads), progress=counter)
    if narrowed is not None and plan.threads > narrowed.threads and not plan.waits:
        plan = dataclasses.replace(plan, narrowed=narrowed)
    result = read_file(path, cast_plan, plan, stop, staging)
    size = os.path.getsize(path)
    if counter is not None:
        counter.done(size)
    return result, FileRead(path, size, started, time.perf_counter(), cached, plan.threads)


# How often a caller waiting for a read looks at pending interrupts.
INTERRUPT_CHECK_SECONDS = 0.05


class _Pending:
    """One file's read: done when `value` or `error` is set."""

    def __init__(self):
        self.done = threading.Event()
        self.value = None
        self.read: FileRead | None = None
        self.error: BaseException | None = None


class Prefetcher:
    """Files read by `workers` daemon threads (a read blocked on storage must
    not hold up the interpreter's exit), at most `ahead` files held at once.
    close() stops them: each read checks between parts of READ_STEP_BYTES."""

    def __init__(self, paths, workers: int = 1, ahead: int | None = None, cast_plan=None, progress=None):
        self._cast_plan = cast_plan
        self.progress = progress
        self._paths = [os.path.normpath(os.fspath(p)) for p in paths]
        self._slots = threading.Semaphore(ahead if ahead is not None else workers + 1)
        self._stop = threading.Event()
        # Until the caller first waits for a file it is busy (building the
        # model, the critical path): reads leave it a core. Then they use all,
        # the read under way included.
        self._narrowed = Narrowed(background_read_threads(), threading.Event())
        self._pending = {path: _Pending() for path in self._paths}
        self._queue = list(self._paths)
        self._queue_lock = threading.Lock()
        self._workers = max(1, min(workers, len(self._paths)))
        self._threads = []

    def start(self) -> None:
        """Start the reads (after close() is registered to run whatever happens)."""
        for i in range(self._workers):
            thread = threading.Thread(target=self._work, name=f"ms_loadpatch-read-{i}", daemon=True)
            self._threads.append(thread)  # before start: an interrupt right after it still finds it in close()
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": a thread limit
                self._threads.pop()
                break
        if not self._threads:  # nothing will read ahead: take_or_read reads on demand
            self._pending.clear()

    def _work(self):
        staging = Staging()
        while not self._stop.is_set():
            # the slot first, then the next file: files holding slots are
            # always the next ones in order, so the file the caller waits for
            # is never behind reads it has not asked for yet
            self._slots.acquire()
            with self._queue_lock:
                if self._stop.is_set() or not self._queue:
                    self._slots.release()
                    return
                path = self._queue.pop(0)
                pending = self._pending.get(path)
            if pending is None:  # dropped by close()
                self._slots.release()
                return
            try:
                # a single file is all the load waits for: its read gets every thread from the start
                narrowed = self._narrowed if len(self._paths) > 1 else None
                pending.value, pending.read = timed_read(
                    path, self._cast_plan, None, self._stop, staging, self.progress, narrowed
                )
            except BaseException as exc:  # noqa: BLE001 - raised in the caller by take()
                pending.error = exc
            finally:
                pending.done.set()

    def predicted(self, path) -> bool:
        """Whether `path` is one of the files this prefetcher was given."""
        return os.path.normpath(os.fspath(path)) in self._paths

    def take(self, path, reads: list | None = None):
        """read_file's result for `path`, waiting for its read; None if `path`
        was not prefetched or its read has not started (the caller reads it
        then). Its FileRead is appended to `reads`. A read error is raised
        here, where a sequential read would have raised it."""
        self._narrowed.widened.set()
        path = os.path.normpath(os.fspath(path))
        with self._queue_lock:
            pending = self._pending.pop(path, None)
            if pending is None:
                return None
            if path in self._queue:  # not started: no slot held; read by the caller now
                self._queue.remove(path)
                return None
        try:
            # in short waits: a KeyboardInterrupt pending in Python (which a
            # blocked wait would not see before the read ends) is raised here
            while not pending.done.wait(INTERRUPT_CHECK_SECONDS):
                pass
            if pending.error is not None:
                if isinstance(pending.error, ReadStopped):
                    return None  # stopped (cannot happen before close): read it here
                raise pending.error
            if reads is not None:
                reads.append(pending.read)
            return pending.value
        finally:
            pending.error = pending.value = pending.read = None
            self._slots.release()

    def close(self) -> None:
        """Drop what was not taken; stop running reads and wait for them a
        bounded time (join_or_leave)."""
        self._stop.set()
        # wake readers blocked on a slot so they can see the stop
        for _ in self._threads:
            self._slots.release()
        with self._queue_lock:
            self._pending.clear()
            self._queue.clear()
        join_or_leave(
            self._threads,
            self._stop,
            "reading ahead " + ", ".join(self._paths[:3]) + (" ..." if len(self._paths) > 3 else ""),
        )


class CheckpointFiles(list):
    """The paths of a checkpoint's files, and how many tensors its index
    lists (`listed_tensors`; None without an index)."""

    def __init__(self, paths=(), listed_tensors: int | None = None):
        super().__init__(paths)
        self.listed_tensors = listed_tensors


def local_checkpoint_files(candidates) -> CheckpointFiles:
    """The files a loader will read, given the paths it looks for in its own
    order: the first that exists wins; an index (`*.index*.json`) stands for
    the shards its weight_map names. Empty when that is not plain to see: the
    loader then reads (and reports on) the files itself. A wrong guess costs
    a wasted read, never a wrong model: files are taken by path."""
    for path in candidates:
        if not path or not os.path.isfile(path):
            continue
        if not path.endswith(".json"):
            return CheckpointFiles([os.path.normpath(path)])
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            shards = set(weight_map.values())
            return CheckpointFiles(
                [os.path.normpath(os.path.join(os.path.dirname(path), name)) for name in sorted(shards)],
                len(weight_map),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return CheckpointFiles()
    return CheckpointFiles()


def shard_weight_map(paths) -> dict:
    """key -> shard of the index files beside `paths`, kept where the shard is
    one of `paths` (every variant's index is read, a later one winning)."""
    directory = os.path.dirname(os.fspath(paths[0]))
    weight_map = {}
    for name in os.listdir(directory):
        if name.endswith(".json") and ".safetensors.index" in name:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(directory, name)) as f:
                    weight_map.update(json.load(f)["weight_map"])
    shards = {os.path.basename(os.fspath(p)) for p in paths}
    return {key: shard for key, shard in weight_map.items() if isinstance(shard, str) and shard in shards}


def read_file(path, cast_plan=None, threads=None, stop=None, staging=None, separate=False):
    """(arrays, metadata, cast_at_read) of one file: castread.read_cast with
    a plan, else reader.read_arrays (nothing cast while reading; `separate`:
    a buffer per tensor). `threads`: a ReadPlan, a thread count, or None for
    the plan the file's presence in the page cache calls for, the caller
    waiting on the read (`read_plan(alone=True)`)."""
    if threads is None:
        threads = read_plan(path, _cached_share(path), alone=True)
    if cast_plan is None:
        return (*read_arrays(path, threads, stop, separate), {})
    return read_cast(path, cast_plan, threads, stop, staging)


def start_prefetch(files: CheckpointFiles, report, cleanup, cast_plan=None, progress_bars=None) -> Prefetcher | None:
    """Read `files` in background threads, closed by `cleanup` (an ExitStack),
    casting what `cast_plan` casts; HF_ENABLE_PARALLEL_LOADING, read now,
    sets the thread count, noted in `report`. A long read shows its progress
    on a terminal where `progress_bars()` (the library's setting; None: on) allows."""
    workers = parallel_workers()
    share = node_share()
    report.read_workers = workers
    report.read_threads = read_threads(share)
    report.local_ranks, report.rank = share.local_ranks, share.rank
    if not files:
        return None
    progress = None
    if wanted(bars_enabled=progress_bars):
        progress = ReadProgress(sum(_size(path) for path in files)).start()
        cleanup.callback(progress.close)  # after the prefetcher's close: its readers stopped first
    prefetcher = Prefetcher(files, workers=workers, cast_plan=cast_plan, progress=progress)
    cleanup.callback(prefetcher.close)
    prefetcher.start()
    return prefetcher


def take_or_read(prefetcher: Prefetcher | None, path, cast_plan, reads: list):
    """read_file's result for `path`: `prefetcher`'s read if it has one, else
    read now; the read's FileRead appended to `reads`."""
    taken = prefetcher.take(os.path.normpath(os.fspath(path)), reads) if prefetcher is not None else None
    if taken is not None:
        return taken
    result, read = timed_read(path, cast_plan, progress=prefetcher.progress if prefetcher is not None else None)
    reads.append(read)
    return result
