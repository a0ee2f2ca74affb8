"""A checkpoint's pages in the OS page cache.

MS_LOADPATCH_PAGE_CACHE=keep (default) leaves them there, as an unpatched
load does; `drop` gives a file's pages back once the load has read it
(`posix_fadvise(POSIX_FADV_DONTNEED)`), so a job that loads a checkpoint once
does not leave the cache full of it. The advice is best effort: where the
platform or the filesystem has none (tmpfs holds files in those pages), the
pages stay. `resident_fraction` (mincore) says how much of a file is cached.

Ranks of one job on a node read the same files through the shared page
cache; a rank that gave a file back before another read it would make the
storage serve it twice. With several local ranks the last of them to read a
file gives it back: each reader adds its pid to the file's entry in a
directory of the job (`readers_dir`, keyed by the launcher's pid), under an
flock, and the one that completes the count advises and removes the entry.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import tempfile

import numpy as np

from ..activation import env_choice

ENV_VAR = "MS_LOADPATCH_PAGE_CACHE"
KEEP, DROP = "keep", "drop"
CHOICES = (KEEP, DROP)


# A file with less than this share of its pages cached is read as cold.
COLD_BELOW = 0.5


def is_cold(cached: float | None) -> bool:
    """Whether a file with `cached` (resident_fraction) is mostly not in the page cache."""
    return cached is not None and cached < COLD_BELOW


def policy() -> str:
    """KEEP or DROP, read at each use (a job may set it between loads)."""
    return env_choice(ENV_VAR, CHOICES)


def after_read(fd: int, whole_file: bool = True) -> None:
    """The file behind `fd` was read (`whole_file`: by the load, not one
    tensor again): under DROP, its cached pages given back; with several
    ranks counted on the node, by the last of them to read it."""
    if policy() != DROP or not hasattr(os, "posix_fadvise"):
        return
    from .ranks import node_share

    share = node_share()
    try:
        if share.local_ranks > 1 and share.counted and not (whole_file and _last_reader(fd, share.local_ranks)):
            return
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:  # advice only: a filesystem may refuse it, a shared directory be unwritable
        pass


def readers_dir() -> str:
    """Where this job's ranks on the node note who has read which file: one
    directory per launcher (the ranks' common parent process)."""
    return os.path.join(tempfile.gettempdir(), f"ms_loadpatch-readers-{os.getuid()}-{os.getppid()}")


def _last_reader(fd: int, local_ranks: int) -> bool:
    """Adds this process to the readers of the file behind `fd`; True when
    `local_ranks` distinct processes have now read it (the entry is then removed)."""
    stat = os.fstat(fd)
    directory = readers_dir()
    entry = os.path.join(directory, f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}")
    for attempt in range(3):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            f = open(entry, "a+")
            break
        except FileNotFoundError:  # another rank removed the emptied directory in between
            if attempt == 2:
                raise
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when f closes
        f.seek(0)
        readers = set(f.read().split())
        me = str(os.getpid())
        if me not in readers:
            readers.add(me)
            f.write(me + "\n")
            f.flush()
        if len(readers) < local_ranks:
            return False
        os.unlink(entry)  # a later load of the job starts a new count
    try:
        os.rmdir(directory)
    except OSError:  # other files still being read
        pass
    return True


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return _libc


def resident_fraction(path) -> float | None:
    """The share of `path`'s pages in the page cache (0.0 to 1.0), from a
    mapping that touches none of them; None where mincore is not available
    (not Linux) or the file cannot be mapped. An empty file counts as cached."""
    if not hasattr(os, "posix_fadvise"):
        return None
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 1.0
        try:
            libc = _mincore()
        except (OSError, AttributeError):
            return None
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            if libc.mincore(address, size, vector) != 0:
                return None
            return int(np.count_nonzero(np.frombuffer(vector, np.uint8, pages) & 1)) / pages
        finally:
            libc.munmap(address, size)
