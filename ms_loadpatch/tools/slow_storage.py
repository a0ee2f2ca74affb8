"""Network storage to measure against: a directory served read-only through
FUSE with a delay per read request, a bandwidth per stream (per reading
thread) and an aggregate bandwidth, counting the bytes it serves.

The server (`python -m ms_loadpatch.tools.slow_storage_server`) runs in processes of
its own and can serve the directory at several mountpoints, one per "node" of
a multi-node job: each mount has its own page cache, while latency, aggregate
bandwidth and byte limits are those of one shared storage (libfuse 2 runs one
mount per process: one is forked per extra mount, sharing counters and pacing
through the stats file). `SlowStorage` starts it, waits for the mounts, and
unmounts and stops everything on exit; unmounting any mount ends them all,
and so does the end of the process that started the server. Pages read once
stay cached (`kernel_cache`) until `tools.cold.evict` makes a file cold
again. Needs libfuse 2 (Debian's `fuse`/`libfuse2`), `/dev/fuse` and mfusepy;
`unavailable()` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# The stats file: bytes served, read requests (over all mounts), the aggregate
# pacing clock (time.monotonic(), system-wide on Linux), then bytes served per mount.
_COUNTERS = struct.Struct("<QQ")
_HEADER = struct.Struct("<QQd")
_PER_MOUNT = struct.Struct("<Q")


def _stats_size(mounts: int) -> int:
    return _HEADER.size + mounts * _PER_MOUNT.size


@dataclass(frozen=True)
class StorageSettings:
    """What the served storage costs: `latency_ms` per read request,
    `stream_mb_s` per reading thread and `total_mb_s` over all of them and
    all mounts (None: no cap); past `fail_after_bytes` served over all mounts,
    reads fail with EIO (a storage that breaks mid-load); past
    `stall_after_bytes`, they never return (one that stops answering)."""

    latency_ms: float = 2.0
    stream_mb_s: float | None = None
    total_mb_s: float | None = None
    fail_after_bytes: int | None = None
    stall_after_bytes: int | None = None

    def arguments(self) -> list:
        args = ["--latency-ms", str(self.latency_ms)]
        if self.stream_mb_s:
            args += ["--stream-mb-s", str(self.stream_mb_s)]
        if self.total_mb_s:
            args += ["--total-mb-s", str(self.total_mb_s)]
        if self.fail_after_bytes is not None:
            args += ["--fail-after-bytes", str(self.fail_after_bytes)]
        if self.stall_after_bytes is not None:
            args += ["--stall-after-bytes", str(self.stall_after_bytes)]
        return args


def unavailable() -> str | None:
    """Why a FUSE mount cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "FUSE mounts are set up for Linux only"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if shutil.which("fusermount") is None:
        return "fusermount not found (Debian: apt-get install fuse libfuse2)"
    try:
        import mfusepy  # noqa: F401
    except ImportError as exc:
        return f"mfusepy cannot be imported ({exc})"
    except OSError as exc:  # mfusepy raises it when libfuse is missing
        return f"libfuse not found ({exc}; Debian: apt-get install libfuse2)"
    return None


def _mounted(path: str) -> bool:
    """Whether `path` is in the mount table: unlike os.path.ismount, also
    when its server has died (its mount then answers ENOTCONN)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
            table = f.read().splitlines()
    except OSError:
        return os.path.ismount(path)
    path = os.path.realpath(path)
    for line in table:
        fields = line.split(" ")
        if len(fields) > 1 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]) == path:
            return True
    return False


def _unmount(mountpoints, lazy: bool = True) -> None:
    for mountpoint in mountpoints:
        if not _mounted(mountpoint):
            continue
        if not lazy:
            done = subprocess.run(["fusermount", "-u", mountpoint], capture_output=True, timeout=10)
            if done.returncode == 0:
                continue
        # busy: detach now, gone when the last user closes it
        subprocess.run(["fusermount", "-u", "-z", mountpoint], capture_output=True, timeout=10)


def _exited(pid: int) -> bool:
    """Whether child `pid` has ended, without reaping it (its id stays ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class SlowStorage:
    """`source` served with `settings`, for the time of a `with` block, at
    `mounts` mountpoints (new temporary directories by default, or the
    list given as `mountpoint`); `mountpoint` and `path()` are the first."""

    def __init__(
        self,
        source,
        settings: StorageSettings = StorageSettings(),
        mountpoint=None,
        start_timeout: float = 20.0,
        mounts: int = 1,
    ):
        self.source = os.path.abspath(os.fspath(source))
        self.settings = settings
        if isinstance(mountpoint, (list, tuple)):
            if mounts not in (1, len(mountpoint)) or not mountpoint:
                raise ValueError(f"{len(mountpoint)} mountpoints given for {mounts} mounts")
            mounts = len(mountpoint)
            self.mountpoints = [os.fspath(m) for m in mountpoint]
        elif mountpoint:
            if mounts != 1:
                raise ValueError(f"one mountpoint given for {mounts} mounts: give a list")
            self.mountpoints = [os.fspath(mountpoint)]
        else:
            if mounts < 1:
                raise ValueError(f"mounts must be at least 1, not {mounts}")
            self.mountpoints = []
        self.mounts = mounts
        self._own_mountpoints = not self.mountpoints
        self._start_timeout = start_timeout
        self._process = None
        self._stats_dir = None

    @property
    def mountpoint(self) -> str | None:
        return self.mountpoints[0] if self.mountpoints else None

    def path(self, *parts) -> str:
        return self.path_on(0, *parts)

    def path_on(self, mount_index: int, *parts) -> str:
        return os.path.join(self.mountpoints[mount_index], *parts)

    def __enter__(self) -> SlowStorage:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot serve {self.source} through FUSE: {reason}")
        self._stats_dir = tempfile.mkdtemp(prefix="ms_loadpatch-storage-")
        try:
            if self._own_mountpoints:
                names = ["mount"] + [f"mount-{i}" for i in range(1, self.mounts)]
                self.mountpoints = [os.path.join(self._stats_dir, name) for name in names]
                for mountpoint in self.mountpoints:
                    os.mkdir(mountpoint)
            self._stats = os.path.join(self._stats_dir, "served")
            with open(self._stats, "wb") as f:
                f.write(bytes(_stats_size(self.mounts)))
            with open(os.path.join(self._stats_dir, "server.log"), "wb") as log:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ms_loadpatch.tools.slow_storage_server",
                        self.source,
                        *self.mountpoints,
                        "--stats",
                        self._stats,
                        "--parent",
                        str(os.getpid()),
                        *self.settings.arguments(),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: _stop can kill the per-mount processes too
                )
            deadline = time.monotonic() + self._start_timeout
            while not all(os.path.ismount(m) for m in self.mountpoints):
                if _exited(self._process.pid) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the FUSE server for {self.source} did not mount {', '.join(self.mountpoints)}: "
                        + self._log_tail()
                    )
                time.sleep(0.02)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def served(self) -> tuple:
        """(bytes served, read requests) so far, over all mounts."""
        with open(self._stats, "rb") as f:
            return _COUNTERS.unpack(f.read(_COUNTERS.size))

    def served_per_mount(self) -> list:
        """Bytes served so far through each mount."""
        with open(self._stats, "rb") as f:
            data = f.read(_stats_size(self.mounts))
        return [_PER_MOUNT.unpack_from(data, _HEADER.size + i * _PER_MOUNT.size)[0] for i in range(self.mounts)]

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._stats_dir, "server.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace") or "(no output)"
        except OSError:
            return "(no log)"

    def _stop(self) -> None:
        try:
            _unmount(self.mountpoints, lazy=False)
        finally:
            if self._process is not None:
                pid = self._process.pid
                deadline = time.monotonic() + 5
                while not _exited(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                # A request that never returns (stall_after_bytes) keeps a process alive. While the
                # server is not reaped, its group id cannot have been reused.
                if self._process.returncode is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                self._process.wait(timeout=10)
                self._process = None
            if self._stats_dir:
                shutil.rmtree(self._stats_dir, ignore_errors=True)
                self._stats_dir = None
