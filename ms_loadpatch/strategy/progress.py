"""A line on stderr while a long load reads its checkpoint: bytes read of
the checkpoint's, and the rate. mindone's shard bar moves once per file, so
a cold read of a large shard shows nothing for seconds; this moves with the
bytes. Only on a terminal, only once a load has read for PROGRESS_AFTER
seconds, and only where the caller's library shows progress bars.
"""

from __future__ import annotations

import sys
import threading
import time

PROGRESS_AFTER = 2.0
PROGRESS_EVERY = 0.5


def wanted(stream=None, bars_enabled=None) -> bool:
    """Whether to show progress on `stream` (stderr): a terminal, and the
    library's progress bars on (`bars_enabled()`, None: on)."""
    stream = sys.stderr if stream is None else stream
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False
    return bool(terminal) and (bars_enabled is None or bool(bars_enabled()))


class ReadProgress:
    """Bytes read so far out of `total`, drawn on `stream` from `after`
    seconds every `every` seconds by a daemon thread; close() draws the last
    line (if any was drawn) and stops it."""

    def __init__(self, total: int, stream=None, after: float | None = None, every: float | None = None):
        self.total = total
        self._read = 0
        self._lock = threading.Lock()
        self._stream = sys.stderr if stream is None else stream
        self._after = PROGRESS_AFTER if after is None else after
        self._every = PROGRESS_EVERY if every is None else every
        self._stop = threading.Event()
        self._drawn = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ms_loadpatch-progress", daemon=True)

    def start(self) -> ReadProgress:
        try:
            self._thread.start()
        except RuntimeError:  # a thread limit: no progress, the load goes on
            pass
        return self

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._read += nbytes

    def file(self) -> FileProgress:
        """A counter for one file's read, adding to this one."""
        return FileProgress(self)

    @property
    def read(self) -> int:
        return self._read

    def line(self) -> str:
        seconds = max(time.monotonic() - self._started, 1e-9)
        scale, unit = (1e9, "GB") if self.total >= 1e9 else (1e6, "MB")
        return (
            f"ms_loadpatch: read {self._read / scale:.2f} of {self.total / scale:.2f} {unit} "
            f"({self._read / seconds / 1e6:.0f} MB/s)"
        )

    def _draw(self, end: str = "") -> None:
        try:
            self._stream.write("\r" + self.line() + end)
            self._stream.flush()
            self._drawn = True
        except (OSError, ValueError):  # the terminal went away: stop drawing
            self._stop.set()

    def _run(self) -> None:
        if self._stop.wait(self._after):
            return
        while not self._stop.is_set():
            self._draw()
            self._stop.wait(self._every)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(1.0)
        if self._drawn:
            self._draw("\n")


class FileProgress:
    """One file's bytes as they arrive, passed on to a ReadProgress;
    done(size) adds what the data reads did not count (the header)."""

    def __init__(self, shared: ReadProgress):
        self._shared = shared
        self._lock = threading.Lock()  # a file's chunks arrive from several threads
        self.counted = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.counted += nbytes
        self._shared.add(nbytes)

    def done(self, size: int) -> None:
        with self._lock:
            rest, self.counted = size - self.counted, max(size, self.counted)
        if rest > 0:
            self._shared.add(rest)
