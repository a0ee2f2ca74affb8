"""Network storage to measure against: a directory served read-only through
a FUSE mount with a delay per read request, a bandwidth per stream (per
reading thread) and an aggregate bandwidth, counting the bytes it serves.

The server runs in a process of its own (`python -m
ms_loadpatch.tools.slow_storage`), so its work does not share the loading
process's interpreter. `SlowStorage` starts it, waits for the mount, and
unmounts and stops it on exit; the server also unmounts itself when the
process that started it goes away. The kernel's page cache works as for a
local disk (`kernel_cache`): pages read once stay cached until evicted, so
`tools.cold.evict` makes a file cold again. Needs libfuse 2 (Debian's
`fuse`/`libfuse2`), `/dev/fuse` and mfusepy; `unavailable()` says what is
missing.
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

_COUNTERS = struct.Struct("<QQ")  # bytes served, read requests


@dataclass(frozen=True)
class StorageSettings:
    """What the served storage costs: `latency_ms` per read request,
    `stream_mb_s` per reading thread and `total_mb_s` over all of them (None:
    no cap); past `fail_after_bytes` served, reads fail with EIO (a storage
    that breaks mid-load); past `stall_after_bytes`, they never return (one
    that stops answering)."""

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


class SlowStorage:
    """`source` served at `mountpoint` (a new temporary directory by default)
    with `settings`, for the time of a `with` block."""

    def __init__(
        self, source, settings: StorageSettings = StorageSettings(), mountpoint=None, start_timeout: float = 20.0
    ):
        self.source = os.path.abspath(os.fspath(source))
        self.settings = settings
        self._own_mountpoint = mountpoint is None
        self.mountpoint = os.fspath(mountpoint) if mountpoint else None
        self._start_timeout = start_timeout
        self._process = None
        self._stats_dir = None

    def path(self, *parts) -> str:
        return os.path.join(self.mountpoint, *parts)

    def __enter__(self) -> SlowStorage:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot serve {self.source} through FUSE: {reason}")
        self._stats_dir = tempfile.mkdtemp(prefix="ms_loadpatch-storage-")
        try:
            if self._own_mountpoint:
                self.mountpoint = os.path.join(self._stats_dir, "mount")
                os.mkdir(self.mountpoint)
            self._stats = os.path.join(self._stats_dir, "served")
            with open(self._stats, "wb") as f:
                f.write(bytes(_COUNTERS.size))
            with open(os.path.join(self._stats_dir, "server.log"), "wb") as log:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ms_loadpatch.tools.slow_storage",
                        self.source,
                        self.mountpoint,
                        "--stats",
                        self._stats,
                        "--parent",
                        str(os.getpid()),
                        *self.settings.arguments(),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + self._start_timeout
            while not os.path.ismount(self.mountpoint):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the FUSE server for {self.source} did not mount {self.mountpoint}: " + self._log_tail()
                    )
                time.sleep(0.02)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def served(self) -> tuple:
        """(bytes served, read requests) so far."""
        with open(self._stats, "rb") as f:
            return _COUNTERS.unpack(f.read(_COUNTERS.size))

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._stats_dir, "server.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace") or "(no output)"
        except OSError:
            return "(no log)"

    def _stop(self) -> None:
        try:
            if self.mountpoint and os.path.ismount(self.mountpoint):
                unmounted = subprocess.run(["fusermount", "-u", self.mountpoint], capture_output=True, timeout=10)
                if unmounted.returncode != 0:  # busy: detach now, gone when the last user closes it
                    subprocess.run(["fusermount", "-u", "-z", self.mountpoint], capture_output=True, timeout=10)
        finally:
            if self._process is not None:
                try:  # a request that never returns (stall_after_bytes) keeps it alive
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait(timeout=10)
                self._process = None
            if self._stats_dir:
                shutil.rmtree(self._stats_dir, ignore_errors=True)
                self._stats_dir = None


class _Pacing:
    """When each read may complete: after the request's latency, and after
    its bytes have passed through its stream's and the aggregate's capacity."""

    def __init__(self, settings: StorageSettings):
        self._latency = settings.latency_ms / 1000.0
        self._stream_rate = settings.stream_mb_s * 1e6 if settings.stream_mb_s else None
        self._total_rate = settings.total_mb_s * 1e6 if settings.total_mb_s else None
        self._lock = threading.Lock()
        self._stream_free = {}
        self._total_free = 0.0

    def done_at(self, stream: int, size: int) -> float:
        now = time.monotonic()
        done = now + self._latency
        with self._lock:
            if self._stream_rate:
                start = max(now, self._stream_free.get(stream, 0.0))
                self._stream_free[stream] = start + size / self._stream_rate
                done = max(done, self._stream_free[stream])
            if self._total_rate:
                self._total_free = max(now, self._total_free) + size / self._total_rate
                done = max(done, self._total_free)
        return done


def _operations(source: str, settings: StorageSettings, counters: mmap.mmap):
    import mfusepy

    pacing = _Pacing(settings)
    lock = threading.Lock()

    class Served(mfusepy.Operations):
        use_ns = True

        def _real(self, path):
            return os.path.join(source, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._real(path))
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno) from None
            return {
                "st_mode": st.st_mode,
                "st_nlink": st.st_nlink,
                "st_size": st.st_size,
                "st_uid": st.st_uid,
                "st_gid": st.st_gid,
                "st_atime": st.st_atime_ns,
                "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns,
            }

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._real(path))]

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise mfusepy.FuseOSError(errno.EROFS)
            try:
                return os.open(self._real(path), os.O_RDONLY)
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno) from None

        def read(self, path, size, offset, fh):
            stream = mfusepy.fuse_get_context()[2]
            done = pacing.done_at(stream, size)
            data = os.pread(fh, size, offset)
            with lock:
                served, requests = _COUNTERS.unpack_from(counters, 0)
                if settings.fail_after_bytes is not None and served >= settings.fail_after_bytes:
                    raise mfusepy.FuseOSError(errno.EIO)
                stalled = settings.stall_after_bytes is not None and served >= settings.stall_after_bytes
                if not stalled:
                    _COUNTERS.pack_into(counters, 0, served + len(data), requests + 1)
            if stalled:
                threading.Event().wait()  # until the server is stopped
            wait = done - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            return data

        def release(self, path, fh):
            os.close(fh)
            return 0

        def statfs(self, path):
            st = os.statvfs(source)
            return {
                key: getattr(st, key)
                for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
            }

    return Served()


def _unmount_when_orphaned(mountpoint: str, parent: int) -> None:
    """The process that started the server has gone: unmount, which ends the server."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            subprocess.run(["fusermount", "-u", "-z", mountpoint], capture_output=True, timeout=10)
            return
        except PermissionError:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ms_loadpatch.tools.slow_storage",
        description="Serve SOURCE read-only at MOUNTPOINT through FUSE, slowly.",
    )
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--stream-mb-s", type=float, default=None)
    parser.add_argument("--total-mb-s", type=float, default=None)
    parser.add_argument("--fail-after-bytes", type=int, default=None)
    parser.add_argument("--stall-after-bytes", type=int, default=None)
    parser.add_argument("--stats", required=True, help="a file of %d bytes the counters are kept in" % _COUNTERS.size)
    parser.add_argument("--parent", type=int, default=None, help="unmount when this process ends")
    args = parser.parse_args(argv)
    settings = StorageSettings(
        args.latency_ms, args.stream_mb_s, args.total_mb_s, args.fail_after_bytes, args.stall_after_bytes
    )
    import mfusepy

    with open(args.stats, "r+b") as f:
        counters = mmap.mmap(f.fileno(), _COUNTERS.size)
    if args.parent:
        threading.Thread(target=_unmount_when_orphaned, args=(args.mountpoint, args.parent), daemon=True).start()
    mfusepy.FUSE(
        _operations(args.source, settings, counters),
        args.mountpoint,
        foreground=True,
        ro=True,
        kernel_cache=True,
        fsname="ms_loadpatch-slow-storage",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
