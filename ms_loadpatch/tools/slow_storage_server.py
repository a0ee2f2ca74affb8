"""The server of tools/slow_storage.py: `python -m
ms_loadpatch.tools.slow_storage_server SOURCE MOUNT [MOUNT ...] --stats FILE`
serves SOURCE read-only at each mount through FUSE, as one storage: one
process per mount (libfuse 2 runs one mount per process, and FUSE() takes
the signals), forked from the first while it has one thread, all sharing
the counters and the aggregate pacing clock through the stats file."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import mmap
import os
import signal
import sys
import threading
import time
import traceback

from .slow_storage import _HEADER, _PER_MOUNT, StorageSettings, _exited, _stats_size, _unmount


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
        prog="python -m ms_loadpatch.tools.slow_storage_server",
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
