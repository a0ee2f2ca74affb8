"""Reading safetensors files into memory the process owns, with no copy
beyond the read itself, and with every header field checked.

The data section is read once into one numpy buffer per file; every tensor
is a view of it. Not mmap: an aliased mmap defers the read to first use and
follows later writes to the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Headers of real checkpoints are well under this; a larger claim is corruption.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LFS_POINTER_PREFIX = b"version https://git-lfs"


class CheckpointError(OSError):
    """A checkpoint file that cannot be read. An OSError, as unpatched mindone raises."""

    def __init__(self, path, problem: str, key: str | None = None):
        self.path = os.fspath(path)
        self.key = key
        where = f"tensor {key!r} of " if key else ""
        super().__init__(f"Cannot load {where}checkpoint file {self.path}: {problem}")


def _numpy_dtypes() -> dict[str, np.dtype]:
    dtypes = {
        "F64": np.dtype(np.float64),
        "F32": np.dtype(np.float32),
        "F16": np.dtype(np.float16),
        "I64": np.dtype(np.int64),
        "I32": np.dtype(np.int32),
        "I16": np.dtype(np.int16),
        "I8": np.dtype(np.int8),
        "U64": np.dtype(np.uint64),
        "U32": np.dtype(np.uint32),
        "U16": np.dtype(np.uint16),
        "U8": np.dtype(np.uint8),
        "BOOL": np.dtype(np.bool_),
    }
    try:  # mindspore's own numpy bfloat16, the one Tensor.from_numpy maps to BFloat16
        from mindspore.common import np_dtype

        if np_dtype.np_dtype_valid(False):
            dtypes["BF16"] = np.dtype(np_dtype.bfloat16)
    except ImportError:
        pass
    return dtypes


_DTYPES: dict[str, np.dtype] | None = None


def numpy_dtypes() -> dict[str, np.dtype]:
    global _DTYPES
    if _DTYPES is None:
        _DTYPES = _numpy_dtypes()
    return _DTYPES


class SafetensorsHeader:
    """The parsed, validated header: tensor entries and metadata."""

    def __init__(self, path, header_len: int, entries: dict, metadata: dict | None):
        self.path = path
        self.header_len = header_len
        self.entries = entries  # name -> (np.dtype, shape tuple, begin, end)
        self.metadata = metadata

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def parse_header(path, file_size: int, head: bytes) -> SafetensorsHeader:
    """Validate `head` (the first bytes of the file, at least 8 + header length)."""
    if file_size == 0:
        raise CheckpointError(path, "the file is empty")
    if head.startswith(_LFS_POINTER_PREFIX):
        raise CheckpointError(
            path,
            "this is a git-lfs pointer file, not the weights; run `git lfs install` and `git lfs pull`",
        )
    if file_size < 8:
        raise CheckpointError(path, f"the file is {file_size} bytes, shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CheckpointError(
            path, f"the header claims {header_len} bytes but the file has {file_size}: truncated or not safetensors"
        )
    try:
        header = json.loads(head[8 : 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(path, f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointError(path, "__metadata__ must map strings to strings")
    data_len = file_size - 8 - header_len
    dtypes = numpy_dtypes()
    entries = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(path, "the entry is not an object", key=name)
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype_name not in dtypes:
            raise CheckpointError(path, f"unknown or unsupported dtype {dtype_name!r}", key=name)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(path, f"invalid shape {shape!r}", key=name)
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise CheckpointError(path, f"invalid data_offsets {offsets!r}", key=name)
        begin, end = offsets
        dtype = dtypes[dtype_name]
        if begin > end or end > data_len:
            raise CheckpointError(
                path, f"data_offsets {offsets} point past the end of the data ({data_len} bytes): truncated?", key=name
            )
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                path, f"data_offsets {offsets} hold {end - begin} bytes, shape {shape} of {dtype_name} needs "
                f"{math.prod(shape) * dtype.itemsize}", key=name
            )
        entries[name] = (dtype, tuple(shape), begin, end)
    return SafetensorsHeader(path, header_len, entries, metadata)


def read_header(path) -> SafetensorsHeader:
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) == 8 and not head.startswith(_LFS_POINTER_PREFIX[:8]):
                (header_len,) = struct.unpack("<Q", head)
                if header_len <= MAX_HEADER_BYTES:
                    head += f.read(header_len)
            else:
                head += f.read(64)
    except FileNotFoundError:
        raise CheckpointError(path, "the file does not exist") from None
    return parse_header(path, file_size, head)


def read_arrays(path) -> tuple[dict[str, np.ndarray], dict | None]:
    """All tensors of one file as numpy views of one owned buffer, in file order."""
    header = read_header(path)
    data_len = max((end for _, _, _, end in header.entries.values()), default=0)
    buffer = np.empty(data_len, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(header.data_start)
        got = f.readinto(memoryview(buffer)) if data_len else 0
    if got != data_len:
        raise CheckpointError(path, f"read {got} of {data_len} data bytes: the file changed or is truncated")
    arrays = {}
    for name, (dtype, shape, begin, end) in header.entries.items():
        view = buffer[begin:end]
        if begin % dtype.itemsize:  # unaligned: a view would be refused or copied later anyway
            view = view.copy()
        arrays[name] = view.view(dtype).reshape(shape)
    return arrays, header.metadata


def read_many(paths, workers: int = 1):
    """read_arrays over several files, in order; threads overlap the reads (I/O releases the GIL)."""
    paths = list(paths)
    if workers <= 1 or len(paths) <= 1:
        for path in paths:
            yield path, read_arrays(path)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(paths)), thread_name_prefix="ms_loadpatch-read") as pool:
        for path, result in zip(paths, pool.map(read_arrays, paths)):
            yield path, result
