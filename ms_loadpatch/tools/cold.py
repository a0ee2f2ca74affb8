"""Cold runs of `ms-loadpatch bench --cold`: a checkpoint's pages given back
to the OS before each timed part (`posix_fadvise(POSIX_FADV_DONTNEED)`, no
root needed), and what the storage itself takes to deliver the same files,
read sequentially and in parallel, each from a cold start."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..strategy import page_cache

PARALLEL_THREADS = 8
REQUEST_BYTES = 16 << 20
SEQUENTIAL_BYTES = 1 << 20


def evict(paths) -> float | None:
    """Give back the cached pages of `paths` (written back first: dirty pages
    stay); the share of their bytes still cached afterwards (0.0 when all
    went; None where mincore or the advice is not available)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_share(paths)


def resident_share(paths) -> float | None:
    """The share of the bytes of `paths` in the page cache."""
    total = cached = 0
    for path in paths:
        fraction = page_cache.resident_fraction(path)
        if fraction is None:
            return None
        size = os.path.getsize(path)
        total += size
        cached += fraction * size
    return cached / total if total else 0.0


def sequential_read(paths, block: int = SEQUENTIAL_BYTES) -> float:
    """Seconds to read every byte of `paths`, one file after another, in `block` reads."""
    buffer = bytearray(block)
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


def parallel_read(paths, threads: int = PARALLEL_THREADS, request: int = REQUEST_BYTES, fresh: bool = False) -> float:
    """Seconds to read every byte of `paths` with `threads` threads taking
    `request`-byte preads from one queue of all files' parts; `fresh`: into
    a buffer the size of each file, allocated in the timed part, as a loader
    reads (the page faults of fresh memory counted), else each thread into
    one buffer it reuses (the storage alone)."""
    parts = [
        (path, offset, min(request, size - offset))
        for path in paths
        for size in (os.path.getsize(path),)
        for offset in range(0, size, request)
    ]
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    lock, errors = threading.Lock(), []
    parts.reverse()

    largest = max((length for _, _, length in parts), default=0)
    targets = {}

    def work():
        buffer = (
            None if fresh else bytearray(largest)
        )  # written over by each read: its zero-fill is not part of the floor
        try:
            while True:
                with lock:
                    if not parts:
                        return
                    path, offset, length = parts.pop()
                view = memoryview(targets[path])[offset : offset + length] if fresh else memoryview(buffer)[:length]
                while length:
                    got = _read_at(fds[path], view, offset)
                    if got == 0:
                        raise OSError(f"{path}: ended before offset {offset}")
                    view, offset, length = view[got:], offset + got, length - got
        except BaseException as exc:  # noqa: BLE001 - raised by the caller below
            errors.append(exc)

    workers = [threading.Thread(target=work, name=f"ms_loadpatch-bench-read-{i}") for i in range(threads)]
    start = time.perf_counter()
    if fresh:
        targets.update((path, np.empty(os.path.getsize(path), dtype=np.uint8)) for path in paths)
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def _read_at(fd, view, offset) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def sequential_floor(paths) -> dict:
    """The cold sequential read of `paths`, after an eviction; with the
    share still cached after it."""
    left = evict(paths)
    return {"sequential_seconds": sequential_read(paths), "resident_after_evict": left}
