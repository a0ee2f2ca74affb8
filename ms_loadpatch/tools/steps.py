"""A status line per step on a terminal, with a running clock; silent elsewhere."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """One status line on a terminal with a running clock; silent otherwise."""

    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (sys.stdout.isatty() and self.stream.isatty()) if enabled is None else enabled

    def step(self, label: str):
        return _Step(self, label)


class _Step:
    def __init__(self, progress: Progress, label: str):
        self.progress, self.label = progress, label
        self._stop = threading.Event()
        self._thread = None
        self.seconds = 0.0

    def _draw(self, end=""):
        elapsed = time.perf_counter() - self._start
        self.progress.stream.write(f"\r\x1b[2K  {self.label} ... {elapsed:5.1f}s{end}")
        self.progress.stream.flush()

    def _tick(self):
        while not self._stop.wait(0.25):
            self._draw()

    def __enter__(self):
        self._start = time.perf_counter()
        if self.progress.enabled:
            self._draw()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self.seconds = time.perf_counter() - self._start
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._draw(end=" failed\n" if exc_type else "\n")
        return False


def step_of(progress, label):
    """`progress.step(label)`, or a silent step without a Progress."""
    return (progress or Progress(enabled=False)).step(label)
