"""A checkpoint's pages in the OS page cache.

MS_LOADPATCH_PAGE_CACHE=keep (default) leaves them there, as an unpatched
load does; `drop` gives a file's pages back once the load has read it
(`posix_fadvise(POSIX_FADV_DONTNEED)`), so a job that loads a checkpoint once
does not leave the cache full of it. The advice is best effort: where the
platform or the filesystem has none (tmpfs holds files in those pages), the
pages stay. `resident_fraction` (mincore) says how much of a file is cached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

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


def after_read(fd: int) -> None:
    """The file behind `fd` was read: under DROP, its cached pages given back."""
    if policy() == DROP and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only: a filesystem may refuse it
            pass


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
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
