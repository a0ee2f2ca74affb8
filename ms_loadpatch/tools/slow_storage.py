"""Network storage to measure against: a directory served read-only through
FUSE with a delay per read request, a bandwidth per stream (per reading
thread) and an aggregate bandwidth, counting the bytes it serves.

The server (`python -m ms_loadpatch.tools.slow_storage`) runs in processes of
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

import argparse
import contextlib
import errno
import fcntl
import mmap
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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
                        "ms_loadpatch.tools.slow_storage",
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


class _Shared:
    """The stats file as every server process maps it (MAP_SHARED): the
    counters and the aggregate pacing clock, changed under `locked()`."""

    def __init__(self, path: str, mounts: int):
        # kept open: closing any descriptor of the file would drop this process's lockf locks
        self._fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self._fd, _stats_size(mounts))
        self._threads = threading.Lock()

    @contextlib.contextmanager
    def locked(self):
        with self._threads:  # lockf locks belong to a process: they do not exclude its own threads
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield self.map
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)


def _operations(source: str, settings: StorageSettings, shared: _Shared, mount: int):
    import mfusepy

    latency = settings.latency_ms / 1000.0
    stream_rate = settings.stream_mb_s * 1e6 if settings.stream_mb_s else None
    total_rate = settings.total_mb_s * 1e6 if settings.total_mb_s else None
    streams_lock = threading.Lock()
    stream_free = {}  # per process: a reading thread reads through one mount
    mount_offset = _HEADER.size + mount * _PER_MOUNT.size

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
            now = time.monotonic()
            data = os.pread(fh, size, offset)
            done = now + latency
            with shared.locked() as stats:
                served, requests, clock = _HEADER.unpack_from(stats, 0)
                if settings.fail_after_bytes is not None and served >= settings.fail_after_bytes:
                    raise mfusepy.FuseOSError(errno.EIO)
                stalled = settings.stall_after_bytes is not None and served >= settings.stall_after_bytes
                if not stalled:
                    if total_rate:
                        clock = max(now, clock) + len(data) / total_rate
                        done = max(done, clock)
                    _HEADER.pack_into(stats, 0, served + len(data), requests + 1, clock)
                    (mine,) = _PER_MOUNT.unpack_from(stats, mount_offset)
                    _PER_MOUNT.pack_into(stats, mount_offset, mine + len(data))
            if stalled:
                threading.Event().wait()  # until the server is stopped
            if stream_rate:
                with streams_lock:
                    stream_free[stream] = max(now, stream_free.get(stream, 0.0)) + len(data) / stream_rate
                    done = max(done, stream_free[stream])
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


def _watch(mountpoints, parent, server, children) -> None:
    """Unmount every mount, which ends every server process, once the process
    that started the server has gone, or (seen from a per-mount process) the
    server's main process, or (seen from that one) a per-mount process."""
    while True:
        time.sleep(0.25)
        if parent is not None:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
        if server is not None and os.getppid() != server:
            break
        if any(_exited(pid) for pid in children):
            break
    _unmount(mountpoints)


def _serve(args, settings, shared, mount, server=None, children=()) -> None:
    import mfusepy

    if args.parent or server is not None or children:
        threading.Thread(
            target=_watch, args=(args.mountpoints, args.parent, server, children), name="watch", daemon=True
        ).start()
    mfusepy.FUSE(
        _operations(args.source, settings, shared, mount),
        args.mountpoints[mount],
        foreground=True,
        ro=True,
        kernel_cache=True,
        fsname="ms_loadpatch-slow-storage",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ms_loadpatch.tools.slow_storage",
        description="Serve SOURCE read-only at each MOUNTPOINT through FUSE, slowly, as one storage.",
    )
    parser.add_argument("source")
    parser.add_argument("mountpoints", nargs="+", metavar="mountpoint")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--stream-mb-s", type=float, default=None)
    parser.add_argument("--total-mb-s", type=float, default=None)
    parser.add_argument("--fail-after-bytes", type=int, default=None)
    parser.add_argument("--stall-after-bytes", type=int, default=None)
    parser.add_argument(
        "--stats",
        required=True,
        help=f"a file of {_HEADER.size} + {_PER_MOUNT.size} per mount bytes (zeros) the counters are kept in",
    )
    parser.add_argument("--parent", type=int, default=None, help="unmount when this process ends")
    args = parser.parse_args(argv)
    settings = StorageSettings(
        args.latency_ms, args.stream_mb_s, args.total_mb_s, args.fail_after_bytes, args.stall_after_bytes
    )
    import mfusepy  # noqa: F401  (fails here, before any fork, when libfuse is missing)

    shared = _Shared(args.stats, len(args.mountpoints))
    server = os.getpid()
    children = []
    # FUSE() blocks and takes the signals: one process per mount, forked while there is one thread
    for mount in range(1, len(args.mountpoints)):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _serve(args, settings, shared, mount, server=server)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(BaseException):
                    _unmount(args.mountpoints)  # one mount gone: all go
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    try:
        _serve(args, settings, shared, 0, children=children)
    finally:
        _unmount(args.mountpoints)
        deadline = time.monotonic() + 3
        for pid in children:
            while not _exited(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a request that never returns keeps it alive
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
