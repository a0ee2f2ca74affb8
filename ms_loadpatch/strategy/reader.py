"""Reading safetensors files into memory the process owns, with no copy
beyond the read itself, and with every header field checked.

The data section is read once into one numpy buffer per file; every tensor
is a view of it. Not mmap: an aliased mmap defers the read to first use and
follows later writes to the file.

The header and its checks, and the errors naming the file, are in
safetensors_header.py; the threaded read into the buffer in threaded_read.py.
"""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no direct reads
    fcntl = None

from .safetensors_header import CheckpointError, unchanged_file
from .threaded_read import ReadPlan, data_buffer, read_into, read_parts

# Direct I/O moves whole blocks to and from block-aligned memory.
DIRECT_ALIGN = 4096


def read_arrays(
    path, threads: ReadPlan | int | None = None, stop=None, separate: bool = False
) -> tuple[dict[str, np.ndarray], dict | None]:
    """All tensors of one file as numpy views of one owned buffer, in file
    order (`separate`: each in a buffer of its own, so a tensor nobody keeps
    frees its memory); `threads` for the data read (default read_threads());
    `stop` (an Event) abandons the read (ReadStopped).

    Header and data come through one open file, and the file's size and
    modification time must be the same after the read as before it: a file
    replaced, rewritten, grown or shrunk meanwhile is refused, never mixed.
    Errors name the file: CheckpointError (an OSError, with the errno) for a
    file that cannot be opened or read, MemoryError when its data does not fit."""
    if separate:
        return _read_separately(path, threads, stop)
    with unchanged_file(path) as (f, header, _identity):  # buffered for the header; the data by preadv on its fd
        data_len = max((end for _, _, _, end in header.entries.values()), default=0)
        buffer = None
        if data_len and isinstance(threads, ReadPlan) and threads.direct and fcntl is not None:
            buffer = _read_direct(path, f.fileno(), header.data_start, data_len, threads, stop)
        if buffer is None:
            buffer = data_buffer(path, data_len)
            got = (
                read_into(f.fileno(), buffer, header.data_start, threads, stop, f"the read of {os.fspath(path)}")
                if data_len
                else 0
            )
            if got != data_len:
                raise CheckpointError(path, f"read {got} of {data_len} data bytes: the file changed or is truncated")
    return arrays_in(path, header, buffer), header.metadata


def arrays_in(path, header, buffer) -> dict[str, np.ndarray]:
    """Every tensor `header` lists as a view of `buffer`, the file's data section, in file order."""
    arrays = {}
    for name, (dtype, shape, begin, end) in header.entries.items():
        view = buffer[begin:end]
        if begin % dtype.itemsize:  # unaligned: a view would be refused or copied later anyway
            view = view.copy()
        arrays[name] = _shaped(path, name, view, dtype, shape)
    return arrays


def _read_direct(path, fd: int, data_start: int, data_len: int, plan: ReadPlan, stop):
    """The data section read with O_DIRECT (around the page cache: nothing
    left cached, no copy through it) into block-aligned memory; a view of
    exactly the data. None where the filesystem refuses direct I/O (tmpfs,
    some FUSE and network filesystems): the caller reads as usual."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return None
    try:
        first = data_start // DIRECT_ALIGN * DIRECT_ALIGN
        shift = data_start - first
        span = -(-(shift + data_len) // DIRECT_ALIGN) * DIRECT_ALIGN
        raw = data_buffer(path, span + DIRECT_ALIGN)
        pad = -raw.ctypes.data % DIRECT_ALIGN
        aligned = raw[pad : pad + span]
        try:
            got = read_into(
                fd, aligned, first, dataclasses.replace(plan, direct=False), stop, f"the read of {os.fspath(path)}"
            )
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # accepted the flag, refused the read
                return None
            raise
        if got < shift + data_len:
            raise CheckpointError(
                path, f"read {max(0, got - shift)} of {data_len} data bytes: the file changed or is truncated"
            )
        return aligned[shift : shift + data_len]
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _read_separately(path, threads, stop):
    with unchanged_file(path) as (f, header, _identity):
        buffers = {name: data_buffer(path, end - begin) for name, (_, _, begin, end) in header.entries.items()}
        counts = read_parts(
            f.fileno(),
            [(buffers[name], header.data_start + begin) for name, (_, _, begin, _) in header.entries.items()],
            threads,
            stop,
            f"the read of {os.fspath(path)}",
        )
        for (name, (_, _, begin, end)), count in zip(header.entries.items(), counts):
            if count != end - begin:
                raise CheckpointError(
                    path, f"read {count} of {end - begin} bytes of tensor {name!r}: the file changed or is truncated"
                )
    return {
        name: _shaped(path, name, buffers[name], dtype, shape) for name, (dtype, shape, _, _) in header.entries.items()
    }, header.metadata


def _shaped(path, name, data, dtype, shape):
    try:
        return data.view(dtype).reshape(shape)
    except ValueError:  # valid safetensors, e.g. shape [2**63, 0], but not a numpy shape
        raise CheckpointError(path, f"numpy cannot hold shape {list(shape)}", key=name) from None
