"""Reading checkpoint files ahead, in background threads, while the caller
does other work (building the model, assigning the previous shard).

File reads and the page faults of filling fresh memory happen outside the
GIL, so they overlap Python-heavy model construction even on one worker.
Read-ahead is bounded so that a cast-on-load (fp32 file, bf16 model) does
not hold every fp32 shard at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .reader import read_arrays


def parallel_workers() -> int:
    """HF_ENABLE_PARALLEL_LOADING / HF_PARALLEL_LOADING_WORKERS, read at call
    time (mindone reads the flag once, at import)."""
    if os.environ.get("HF_ENABLE_PARALLEL_LOADING", "").strip().lower() not in ("1", "true", "yes", "on"):
        return 1
    try:
        return max(1, int(os.environ.get("HF_PARALLEL_LOADING_WORKERS", "8")))
    except ValueError:
        return 8


class Prefetcher:
    def __init__(self, paths, workers: int = 1, ahead: int | None = None):
        self._paths = [os.fspath(p) for p in paths]
        self._slots = threading.Semaphore(ahead if ahead is not None else workers + 1)
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ms_loadpatch-read")
        self._futures = {path: self._pool.submit(self._read, path) for path in self._paths}

    def _read(self, path):
        self._slots.acquire()
        if self._closed:
            self._slots.release()
            return None
        return read_arrays(path)

    def take(self, path):
        """(arrays, metadata) of `path`, waiting for its read; None if `path`
        was not prefetched. A read error is raised here, where a sequential
        read would have raised it."""
        future = self._futures.pop(os.fspath(path), None)
        if future is None:
            return None
        try:
            return future.result()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Drop what was not taken; wait for running reads (they own buffers)."""
        self._closed = True
        for future in self._futures.values():
            future.cancel()
        # wake readers blocked on a slot so they can see _closed and return
        for _ in self._futures:
            self._slots.release()
        self._futures.clear()
        self._pool.shutdown(wait=True)
