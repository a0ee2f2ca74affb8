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
from .threaded_read import data_buffer, read_into


def read_arrays(path, threads: int | None = None, stop=None) -> tuple[dict[str, np.ndarray], dict | None]:
    """All tensors of one file as numpy views of one owned buffer, in file
    order; `threads` for the data read (default read_threads()); `stop` (an
    Event) abandons the read (ReadStopped).

    Header and data come through one open file, and the file's size and
    modification time must be the same after the read as before it: a file
    replaced, rewritten, grown or shrunk meanwhile is refused, never mixed.
    Errors name the file: CheckpointError (an OSError, with the errno) for a
    file that cannot be opened or read, MemoryError when its data does not fit."""
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
        try:
            arrays[name] = view.view(dtype).reshape(shape)
        except ValueError:  # valid safetensors, e.g. shape [2**63, 0], but not a numpy shape
            raise CheckpointError(path, f"numpy cannot hold shape {list(shape)}", key=name) from None
    return arrays, header.metadata
