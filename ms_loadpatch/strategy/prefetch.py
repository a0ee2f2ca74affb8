"""Reading checkpoint files ahead, in background threads, while the caller
does other work (building the model, assigning the previous shard).

File reads and the page faults of filling fresh memory happen outside the
GIL, so they overlap Python-heavy model construction even on one worker.
Read-ahead is bounded so that a cast-on-load (fp32 file, bf16 model) does
not hold every fp32 shard at once.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..activation import env_flag
from .reader import background_read_threads, read_arrays


def parallel_workers() -> int:
    """HF_ENABLE_PARALLEL_LOADING / HF_PARALLEL_LOADING_WORKERS, read at call
    time (mindone reads the flag once, at import)."""
    if not env_flag("HF_ENABLE_PARALLEL_LOADING"):
        return 1
    try:
        return max(1, int(os.environ.get("HF_PARALLEL_LOADING_WORKERS", "8")))
    except ValueError:
        return 8


class Prefetcher:
    def __init__(self, paths, workers: int = 1, ahead: int | None = None):
        self._paths = [os.path.normpath(os.fspath(p)) for p in paths]
        self._slots = threading.Semaphore(ahead if ahead is not None else workers + 1)
        self._closed = False
        # Until the caller first waits for a file it is busy (building the
        # model, the critical path): reads leave it a core. Then they use all.
        self._caller_busy = True
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ms_loadpatch-read")
        self._futures = {path: self._pool.submit(self._read, path) for path in self._paths}

    def _read(self, path):
        self._slots.acquire()
        if self._closed:
            self._slots.release()
            return None
        return read_arrays(path, background_read_threads() if self._caller_busy else None)

    def take(self, path):
        """(arrays, metadata) of `path`, waiting for its read; None if `path`
        was not prefetched. A read error is raised here, where a sequential
        read would have raised it."""
        self._caller_busy = False
        future = self._futures.pop(os.path.normpath(os.fspath(path)), None)
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


def local_checkpoint_files(candidates) -> list[str]:
    """The files a loader will read, given the paths it looks for in its own
    order: the first that exists wins; an index (`*.index*.json`) stands for
    the shards its weight_map names. [] when that is not plain to see: the
    loader then reads (and reports on) the files itself. A wrong guess costs
    a wasted read, never a wrong model: files are taken by path."""
    for path in candidates:
        if not path or not os.path.isfile(path):
            continue
        if not path.endswith(".json"):
            return [os.path.normpath(path)]
        try:
            with open(path) as f:
                shards = set(json.load(f)["weight_map"].values())
            return [os.path.normpath(os.path.join(os.path.dirname(path), name)) for name in sorted(shards)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
    return []


def start_prefetch(ctx, files) -> Prefetcher | None:
    """Read `files` in background threads for the load `ctx` (closed with it);
    HF_ENABLE_PARALLEL_LOADING, read now, sets the thread count."""
    workers = parallel_workers()
    ctx.report.read_workers = workers
    if not files:
        return None
    prefetcher = Prefetcher(files, workers=workers)
    ctx.cleanup.callback(prefetcher.close)
    ctx.cache["prefetcher"] = prefetcher
    return prefetcher


def take_or_read(ctx, path):
    """(arrays, metadata) of `path`: the prefetched read if there is one, else read now."""
    prefetcher = ctx.cache.get("prefetcher") if ctx is not None else None
    taken = prefetcher.take(os.path.normpath(os.fspath(path))) if prefetcher is not None else None
    return taken if taken is not None else read_arrays(path)
