"""Reading a byte range of an open file into memory: in one call, or, for
a large read, in chunks, one daemon thread each (a read blocked on storage
that does not answer must hold up neither a stopped load nor the
interpreter's exit). A stop request (an Event) is seen between steps of
READ_STEP_BYTES. The thread counts divide the node among the ranks of a job.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..activation import env_int
from . import page_cache
from .ranks import NodeShare, node_share

logger = logging.getLogger("ms_loadpatch")

# Below this a file's data is read in one call; above, in a few threads: page
# faults on fresh memory, not the copy, bound the read (dearest on a VM whose
# freed memory goes back to the host), and they scale with cores.
PARALLEL_READ_MIN_BYTES = 64 << 20
_ALIGN = 2 << 20  # chunk borders on huge-page boundaries


def read_threads(share: NodeShare | None = None) -> int:
    """Threads for one file's read: twice the cores (measured: past the core
    count still helps, faults wait on the host), up to 8, divided among the
    ranks of a job sharing the node."""
    share = share or node_share()
    return share.divide(min(8, 2 * share.cores))


def background_read_threads(share: NodeShare | None = None) -> int:
    """Threads for a read that runs beside other work: one core left to it."""
    share = share or node_share()
    return share.divide(max(1, share.cores - 1))


@dataclass(frozen=True)
class Narrowed:
    """Fewer threads until `widened` (an Event) is set: `threads` read while
    the caller is busy with other work (the build), every thread once it waits."""

    threads: int
    widened: threading.Event


@dataclass(frozen=True)
class ReadPlan:
    """How one file's data is read: by up to `threads` threads, a read of
    `split_from` bytes (default PARALLEL_READ_MIN_BYTES) or more split among
    them; `cold` for a file mostly not in the page cache; `direct`: with
    O_DIRECT where the filesystem allows it; `waits`: its threads mostly
    wait on slow storage, taking no cores from other work; `narrowed`: fewer
    threads until the caller waits for the read."""

    threads: int
    split_from: int | None = None
    cold: bool = False
    direct: bool = False
    progress: object = None  # an object whose add(nbytes) is called as bytes arrive (progress.ReadProgress)
    waits: bool = False
    narrowed: Narrowed | None = None

    def splits(self, nbytes: int) -> bool:
        """Whether a read of `nbytes` is split among the threads."""
        return self.threads > 1 and nbytes >= (PARALLEL_READ_MIN_BYTES if self.split_from is None else self.split_from)

    def threads_now(self) -> int:
        """The threads reading at this moment."""
        if self.narrowed is not None and not self.narrowed.widened.is_set():
            return min(self.threads, self.narrowed.threads)
        return self.threads


COLD_READ_THREADS_ENV_VAR = "MS_LOADPATCH_COLD_READ_THREADS"
COLD_READ_THREADS = 16
# A cold read is split from here: on storage with a delay per request, one
# stream of even a small file waits on each request in turn.
COLD_SPLIT_FROM = 8 << 20


def cold_read_plan(share: NodeShare | None = None, threads: int | None = None) -> ReadPlan:
    """The plan for a cold file on slow storage: requests in flight sized
    for the storage (a delay per request, a cap per stream), not for the
    cores, since its threads mostly wait; MS_LOADPATCH_COLD_READ_THREADS
    (default 16) for the node, divided among its ranks. `threads`: this
    many instead (fast storage, where reads take cores rather than wait)."""
    share = share or node_share()
    # Under MS_LOADPATCH_PAGE_CACHE=drop, around the page cache: faster cold,
    # and nothing to give back. Not where other ranks may read the same pages.
    direct = page_cache.policy() == page_cache.DROP and share.local_ranks == 1 and hasattr(os, "O_DIRECT")
    if threads is not None:
        return ReadPlan(threads, cold=True, direct=direct)
    return ReadPlan(
        share.divide(env_int(COLD_READ_THREADS_ENV_VAR) or COLD_READ_THREADS),
        COLD_SPLIT_FROM,
        cold=True,
        direct=direct,
        waits=True,
    )


# One stream slower than this is storage-bound (a delay per request, a cap
# per stream): more requests in flight help. A cold local disk reads its
# first bytes several times faster, storage with a delay per request several
# times slower. Low, since the timing also holds the wait for the GIL (a
# switch interval while the build runs). docs/benchmarks.md "Cold loads".
SLOW_STREAM_BYTES_PER_S = 100e6
PROBE_BYTES = 4 << 20


def first_read_rate(path) -> float | None:
    """Bytes per second of one read of the first PROBE_BYTES of `path` (the
    header's pages, read next anyway); None if it cannot be read (the read
    proper raises the error that names the file) or is too short to time."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        buffer = bytearray(PROBE_BYTES)
        started = time.perf_counter()
        got = os.preadv(fd, [buffer], 0) if hasattr(os, "preadv") else len(os.pread(fd, PROBE_BYTES, 0))
        seconds = time.perf_counter() - started
    except OSError:
        return None
    finally:
        os.close(fd)
    if got < PROBE_BYTES or seconds <= 0:
        return None
    return got / seconds


def as_plan(threads) -> ReadPlan:
    """A ReadPlan from what readers are given: a plan, a thread count, or None (read_threads())."""
    if isinstance(threads, ReadPlan):
        return threads
    return ReadPlan(read_threads() if threads is None else threads)


# One read(2) at most this long: a stop request is seen between two.
READ_STEP_BYTES = 64 << 20
# How long a stopped load waits for its reader threads before leaving them to
# finish in the background (a read blocked on storage that does not answer).
STOP_GRACE_SECONDS = 2.0


class ReadStopped(Exception):
    """A read abandoned on request (the load it was for has ended)."""


def _fill(view: memoryview, read_part, stop=None, progress=None) -> int:
    """Call read_part(next part of view, bytes so far) until `view` is full
    or it returns 0 (end of file); the count read. Loops: one read(2) returns
    at most about 2 GiB, and shards are often larger. Checks `stop` (an
    Event) between parts; tells `progress` each part's bytes."""
    got = 0
    while got < len(view):
        if stop is not None and stop.is_set():
            raise ReadStopped()
        n = read_part(view[got : got + READ_STEP_BYTES], got)
        if not n:
            break
        got += n
        if progress is not None:
            progress.add(n)
    return got


def _pread_into(fd: int, view: memoryview, offset: int, stop=None, progress=None) -> int:
    return _fill(view, lambda part, done: os.preadv(fd, [part], offset + done), stop, progress)


def _seek_read_into(fd: int, view: memoryview, offset: int, stop=None, progress=None) -> int:
    """_pread_into where there is no preadv (Windows): one thread, seek then read."""
    os.lseek(fd, offset, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        return _fill(view, lambda part, done: f.readinto(part), stop, progress)


def join_or_leave(threads, stop, what: str, grace: float | None = None) -> None:
    """Ask `threads` to stop (`stop.set()`), wait up to `grace` seconds for
    them, then leave the rest (daemon threads, each owning its buffer and file)
    to end on their own when their read returns, with a warning naming `what`."""
    stop.set()
    deadline = time.monotonic() + (STOP_GRACE_SECONDS if grace is None else grace)
    for thread in threads:
        if thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        logger.warning(
            "ms_loadpatch: %s did not stop within %.1f s (storage not answering?); %s left to end in the background",
            what,
            STOP_GRACE_SECONDS if grace is None else grace,
            ", ".join(alive),
        )


def run_in_threads(calls, name: str, stop, what: str) -> list:
    """Each of `calls` in a daemon thread of its own (a read blocked on storage
    must not hold up the interpreter's exit); their results in order, the first
    error raised. If this thread is interrupted meanwhile, the others are
    stopped (join_or_leave) before the interrupt goes on. A thread that cannot
    be started (a thread limit) has its call run here instead."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            stop.set()

    threads = []
    try:
        for i in range(len(calls)):
            thread = threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread"
                run(i)
                continue
            threads.append(thread)
        for thread in threads:
            thread.join()
    except BaseException:
        join_or_leave(threads, stop, what)
        raise
    real = [e for e in errors if not isinstance(e, ReadStopped)]
    if real or errors:
        raise (real or errors)[0]
    return results


def read_into(
    fd: int, buffer: np.ndarray, offset: int, threads: ReadPlan | int | None = None, stop=None, what="a read"
) -> int:
    """Read len(buffer) bytes of `fd` from `offset` into `buffer`, split
    across threads (read_parts) for large reads (`threads`: a ReadPlan or a
    thread count); the count read. `stop` (an Event) ends it early with
    ReadStopped."""
    (count,) = read_parts(fd, [(buffer, offset)], threads, stop, what)
    return count


# How often a thread waiting to join a narrowed read looks whether it is still needed.
WIDEN_POLL_SECONDS = 0.05


def _runs(views, threads: int) -> list[list[tuple[int, memoryview, int]]]:
    """`views` cut into about `threads` runs of consecutive bytes, in file
    order; each run a list of (part index, piece, file offset). A thread
    reads one run from start to end (measured: the same file read in parts
    of 16-64 MB handed out in turn is slower cold; the kernel reads ahead
    within a run)."""
    share = -(-sum(len(view) for view, _ in views) // threads)
    size = max(_ALIGN, -(-share // _ALIGN) * _ALIGN)
    runs, run, run_bytes = [], [], 0
    for index, (view, offset) in enumerate(views):
        for lo in range(0, len(view), size):
            piece = view[lo : lo + size]
            run.append((index, piece, offset + lo))
            run_bytes += len(piece)
            if run_bytes >= share:
                runs.append(run)
                run, run_bytes = [], 0
    if run:
        runs.append(run)
    return runs


def read_parts(fd: int, parts, threads: ReadPlan | int | None = None, stop=None, what="a read") -> list:
    """Read each (byte buffer, file offset) of `parts` in full, cut into
    runs (_runs) that up to `threads` threads take in file order from one
    queue (`threads`: a ReadPlan or a thread count; a narrowed plan's other
    threads start when it is widened); the count read into each part.
    `stop` (an Event) ends it early with ReadStopped."""
    plan = as_plan(threads)
    views = [(memoryview(buffer).cast("B"), offset) for buffer, offset in parts]
    if not hasattr(os, "preadv"):
        return [_seek_read_into(fd, view, offset, stop, plan.progress) for view, offset in views]
    if not plan.splits(sum(len(view) for view, _ in views)):
        return [_pread_into(fd, view, offset, stop, plan.progress) for view, offset in views]
    if stop is not None and stop.is_set():
        raise ReadStopped()
    runs = _runs(views, plan.threads)
    got = {}  # (part index, piece offset) -> bytes read
    taken = [0]  # runs handed out so far
    taken_lock = threading.Lock()
    run_stop = threading.Event()
    either = _Either(stop, run_stop)

    def read_runs(late: bool):
        if late:  # a thread of the widened plan: from when the caller waits, if runs are left
            while not plan.narrowed.widened.wait(WIDEN_POLL_SECONDS):
                if either.is_set() or taken[0] >= len(runs):
                    return
        while True:
            with taken_lock:
                index = taken[0]
                taken[0] += 1
            if index >= len(runs):
                return
            for part, piece, offset in runs[index]:
                got[part, offset] = _pread_into(fd, piece, offset, either, plan.progress)

    count = min(plan.threads, len(runs))
    early = min(count, plan.threads_now())
    run_in_threads([lambda k=k: read_runs(k >= early) for k in range(count)], "ms_loadpatch-read-part", run_stop, what)
    counts = [0] * len(views)
    short = set()
    for part, piece, offset in (entry for run in runs for entry in run):
        if part not in short:
            counts[part] += got[part, offset]
            if got[part, offset] != len(piece):  # the file ends inside this piece: nothing after it counts
                short.add(part)
    return counts


class _Either:
    """is_set() of either of two Events (the load's stop, or a sibling chunk's failure)."""

    def __init__(self, first, second):
        self._events = [e for e in (first, second) if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


def data_buffer(path, nbytes: int) -> np.ndarray:
    """An uninitialised byte buffer for `path`'s tensor data; MemoryError naming the file."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        raise MemoryError(
            f"Cannot load checkpoint file {os.fspath(path)}: not enough memory for its {nbytes} bytes of "
            f"tensor data ({exc})"
        ) from exc
