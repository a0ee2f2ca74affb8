"""Reading safetensors files into memory the process owns, with no copy
beyond the read itself, and with every header field checked.

The data section is read once into one numpy buffer per file; every tensor
is a view of it. Not mmap: an aliased mmap defers the read to first use and
follows later writes to the file.

The header and its checks, and the errors naming the file, are in
safetensors_header.py; the threaded read into the buffer in threaded_read.py.
"""

from __future__ import annotations

import os

import numpy as np

from .safetensors_header import CheckpointError, unchanged_file
from .threaded_read import data_buffer, read_into, read_parts


def read_arrays(path, threads: int | None = None, stop=None,
                separate: bool = False) -> tuple[dict[str, np.ndarray], dict | None]:
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
        buffer = data_buffer(path, data_len)
        got = read_into(f.fileno(), buffer, header.data_start, threads, stop, f"the read of {os.fspath(path)}") \
            if data_len else 0
        if got != data_len:
            raise CheckpointError(path, f"read {got} of {data_len} data bytes: the file changed or is truncated")
    arrays = {}
    for name, (dtype, shape, begin, end) in header.entries.items():
        view = buffer[begin:end]
        if begin % dtype.itemsize:  # unaligned: a view would be refused or copied later anyway
            view = view.copy()
        arrays[name] = _shaped(path, name, view, dtype, shape)
    return arrays, header.metadata


def _read_separately(path, threads, stop):
    with unchanged_file(path) as (f, header, _identity):
        buffers = {name: data_buffer(path, end - begin) for name, (_, _, begin, end) in header.entries.items()}
        counts = read_parts(f.fileno(), [(buffers[name], header.data_start + begin)
                                         for name, (_, _, begin, _) in header.entries.items()],
                            threads, stop, f"the read of {os.fspath(path)}")
        for (name, (_, _, begin, end)), count in zip(header.entries.items(), counts):
            if count != end - begin:
                raise CheckpointError(path, f"read {count} of {end - begin} bytes of tensor {name!r}: "
                                            "the file changed or is truncated")
    return {name: _shaped(path, name, buffers[name], dtype, shape)
            for name, (dtype, shape, _, _) in header.entries.items()}, header.metadata


def _shaped(path, name, data, dtype, shape):
    try:
        return data.view(dtype).reshape(shape)
    except ValueError:  # valid safetensors, e.g. shape [2**63, 0], but not a numpy shape
        raise CheckpointError(path, f"numpy cannot hold shape {list(shape)}", key=name) from None
