"""The safetensors header, checked field by field, and the errors that name
the checkpoint file they are about.

A file is accepted exactly when the safetensors library accepts it (the
check mindone itself runs before loading a file), except what numpy cannot
hold: dtypes F8_*, F6_*, F4, C64, and empty tensors with shapes such as
[2**63, 0]. (Not modelled: serde_json's rounding of floats within a hair of
1.8e308 in fields safetensors ignores.) tests/reading/test_reader_fuzz.py holds
reader.read_arrays and the safetensors library against each other.

Errors name the file (and the tensor) in their message: CheckpointError, an
OSError as unpatched mindone raises, for what this module finds;
exception_naming_file and its helpers for errors raised elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import struct

import numpy as np
from safetensors import SafetensorError

from . import page_cache

# safetensors' own limit (MAX_HEADER_SIZE); a larger claim is corruption.
MAX_HEADER_BYTES = 100_000_000
# serde_json (safetensors' JSON parser) refuses deeper nesting.
_MAX_JSON_DEPTH = 127
_U64 = 1 << 64
_LFS_POINTER_PREFIX = b"version https://git-lfs"
# dtypes safetensors knows but numpy cannot represent
_UNSUPPORTED_DTYPES = frozenset(
    {"F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"}
)
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")


class _FileProblem:
    """path, key (or None) and problem, in one message naming them."""

    def __init__(self, path, problem: str, key: str | None = None):
        self.path = os.fspath(path)
        self.key = key
        self.problem = problem
        where = f"tensor {key!r} of " if key is not None else ""
        self.message = f"Cannot load {where}checkpoint file {self.path}: {problem}"
        super().__init__(self.message)

    def __str__(self):  # not OSError's "[Errno N] strerror", which drops the file
        return self.message


class CheckpointError(_FileProblem, OSError):
    """A checkpoint file that cannot be read. An OSError, as unpatched mindone raises."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file that does not exist: a FileNotFoundError, as unpatched mindone raises."""


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


# -- JSON as serde_json reads it (Python's json is more lenient in a few places)


class _Object(list):
    """A JSON object as its (key, value) pairs, so duplicate keys stay visible."""

    __slots__ = ()


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text):
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text}")
    return value


def _serde_int(text):
    # serde_json reads -0 as a float: not a valid size or offset
    return -0.0 if text == "-0" else int(text)


def _loads(text: str):
    hooks = {"parse_constant": _reject_constant, "parse_float": _finite_float}
    if "-0" in text:  # the int hook costs a Python call per number: only when needed
        hooks["parse_int"] = _serde_int
    return json.loads(text, object_pairs_hook=_Object, **hooks)


def _check_free_value(path, value, depth: int, key) -> None:
    """A value safetensors ignores (an unknown field) must still be JSON serde_json accepts."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, _Object)):
            if level + 1 > _MAX_JSON_DEPTH:
                raise CheckpointError(path, "the header nests deeper than safetensors allows", key=key)
            if isinstance(item, _Object):
                for k, v in item:
                    _check_str(path, k, key)
                    stack.append((v, level + 1))
            else:
                stack.extend((v, level + 1) for v in item)
        elif isinstance(item, str):
            _check_str(path, item, key)
        elif type(item) is int and not -(1 << 63) <= item < _U64:
            try:  # serde_json reads it as a float
                float(item)
            except OverflowError:
                raise CheckpointError(path, "a number in the header is out of range", key=key) from None


def _check_str(path, text: str, key) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(
            path, "the header has a lone surrogate \\u escape (not valid JSON text)", key=key
        ) from None


def _tensor_entry(path, name, info, dtypes, check_strings: bool):
    """(dtype name, shape, offsets) of one entry, checked as safetensors'
    TensorInfo is deserialized: an object with these three fields (unknown
    fields ignored), or the same three as a list; dtype a name, or {name: null}."""
    if type(info) is _Object:
        fields = dict(info)
        if len(fields) != 3 or len(info) != 3 or not all(f in fields for f in _TENSOR_FIELDS):
            fields = {}  # the uncommon shapes: unknown fields, duplicates, missing fields
            for field, value in info:
                if field in _TENSOR_FIELDS:
                    if field in fields:
                        raise CheckpointError(path, f"the entry has {field!r} twice", key=name)
                    fields[field] = value
                else:
                    if check_strings:
                        _check_str(path, field, name)
                    _check_free_value(path, value, 2, name)
            missing = [f for f in _TENSOR_FIELDS if f not in fields]
            if missing:
                raise CheckpointError(path, f"the entry has no {missing[0]!r}", key=name)
        dtype_name, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    elif type(info) is list and len(info) == 3:
        dtype_name, shape, offsets = info
    else:
        raise CheckpointError(path, f"the entry is not a tensor description: {_short(info)}", key=name)
    if type(dtype_name) is _Object and len(dtype_name) == 1 and dtype_name[0][1] is None:
        dtype_name = dtype_name[0][0]
    if not (type(dtype_name) is str and (dtype_name in dtypes or dtype_name in _UNSUPPORTED_DTYPES)):
        raise CheckpointError(path, f"unknown dtype {_short(dtype_name)}", key=name)
    if not (type(shape) is list and all(type(d) is int and 0 <= d < _U64 for d in shape)):
        raise CheckpointError(path, f"invalid shape {_short(shape)}", key=name)
    if not (type(offsets) is list and len(offsets) == 2 and all(type(o) is int and 0 <= o < _U64 for o in offsets)):
        raise CheckpointError(path, f"invalid data_offsets {_short(offsets)}", key=name)
    return dtype_name, shape, offsets


def _short(value) -> str:
    text = repr(dict(value) if isinstance(value, _Object) else value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    raw = head[8 : 8 + header_len]
    try:
        text = raw.decode("utf-8")
        header = _loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        problem = "too deeply nested" if isinstance(exc, RecursionError) else exc
        raise CheckpointError(path, f"the header is not valid JSON ({problem})") from None
    if not isinstance(header, _Object):
        raise CheckpointError(path, "the header is not a JSON object")
    check_strings = "\\u" in text  # a lone surrogate can only come from an escape
    dtypes = numpy_dtypes()
    metadata, seen_metadata, described = None, False, {}
    for name, info in header:
        if check_strings:
            _check_str(path, name, None)
        if name == "__metadata__":
            if seen_metadata:
                raise CheckpointError(path, "the header has __metadata__ twice")
            seen_metadata = True
            if info is None:
                continue
            if not (isinstance(info, _Object) and all(isinstance(v, str) for _, v in info)):
                raise CheckpointError(path, "__metadata__ must map strings to strings")
            if check_strings:
                for k, v in info:
                    _check_str(path, k, None)
                    _check_str(path, v, None)
            metadata = dict(info)
            continue
        # every description must be well-formed; a later one for the same name wins
        described[name] = _tensor_entry(path, name, info, dtypes, check_strings)
    data_len = file_size - 8 - header_len
    # as safetensors checks: in offset order, each tensor starts where the
    # previous one ended, and the last one ends where the data does
    position = 0
    for begin, end, name in sorted((offsets[0], offsets[1], name) for name, (_, _, offsets) in described.items()):
        if end > data_len:
            raise CheckpointError(
                path,
                f"data_offsets {[begin, end]} point past the end of the data ({data_len} bytes): truncated?",
                key=name,
            )
        if begin != position or end < begin:
            if end < begin:
                problem = "end before they begin"
            else:
                problem = "overlap the previous tensor" if begin < position else "leave a gap before them"
            raise CheckpointError(path, f"data_offsets {[begin, end]} {problem}", key=name)
        position = end
    if position != data_len:
        raise CheckpointError(
            path, f"the tensors cover {position} of the {data_len} data bytes: trailing bytes, or not safetensors"
        )
    entries = {}
    for name, (dtype_name, shape, (begin, end)) in described.items():
        count = 1
        for dim in shape:
            count *= dim
            if count >= _U64:
                raise CheckpointError(path, f"shape {shape} overflows", key=name)
        if dtype_name in _UNSUPPORTED_DTYPES:
            raise CheckpointError(path, f"dtype {dtype_name} is not supported (numpy has no such type)", key=name)
        dtype = dtypes[dtype_name]
        if count * dtype.itemsize * 8 >= _U64:
            raise CheckpointError(path, f"shape {shape} overflows", key=name)
        if end - begin != count * dtype.itemsize:
            raise CheckpointError(
                path,
                f"data_offsets {[begin, end]} hold {end - begin} bytes, shape {shape} of {dtype_name} needs "
                f"{count * dtype.itemsize}",
                key=name,
            )
        entries[name] = (dtype, tuple(shape), begin, end)
    return SafetensorsHeader(path, header_len, entries, metadata)


class SafetensorsFileError(CheckpointError, SafetensorError):
    """The safetensors library's error for a file (the type mindone's own
    check raises), naming the file and saying what is wrong in plain words;
    a CheckpointError too, so one except clause catches every bad file."""


def named_safetensors_error(path, original: Exception) -> SafetensorsFileError | None:
    """A SafetensorsFileError for `original`, raised by safetensors reading `path`; None for other errors."""
    if not isinstance(original, SafetensorError):
        return None
    try:
        read_header(path)
        problem, key = f"{original}", None
    except CheckpointError as exc:
        problem, key = f"{exc.problem} (safetensors: {original})", exc.key
    except OSError as exc:
        problem, key = f"{exc} (safetensors: {original})", None
    return SafetensorsFileError(path, problem, key)


def exception_naming_file(exc: Exception, path, key: str | None = None, reason=None) -> Exception | None:
    """An exception of `exc`'s type whose message adds the checkpoint file
    (and tensor) it is about, or `reason` (a message naming them), for the
    caller to raise `from exc`; None when the message says it already, or
    when that type cannot be built from a message (then a note on `exc` says it)."""
    path = os.fspath(path)
    if reason is not None:
        where = str(reason)
        if where in str(exc):
            return None
    else:
        if path in str(exc):
            return None
        where = f"checkpoint file: {path}" + (f", tensor {key!r}" if key is not None else "")
    try:
        if isinstance(exc, OSError) and exc.errno is not None and not exc.filename and reason is None:
            tensor = f" (tensor {key!r})" if key is not None else ""
            better = type(exc)(exc.errno, f"{exc.strerror}{tensor}", path)  # "[Errno N] ...: 'path'"
        else:
            better = type(exc)(f"{exc} ({where})")
    except Exception:  # noqa: BLE001 - a type with its own constructor
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(where)
        return None
    return better


@contextlib.contextmanager
def file_named_in_errors(path, key: str | None = None, reason=None):
    """An Exception escaping the block names the checkpoint file `path` (or
    says `reason`; see exception_naming_file), chained from the original;
    BaseExceptions (KeyboardInterrupt) pass as they are."""
    try:
        yield
    except Exception as exc:
        better = exception_naming_file(exc, path, key, reason) if path is not None else None
        if better is None:
            raise
        raise better from exc


def safe_open_error_naming_file(exc: Exception, path) -> Exception | None:
    """What to raise instead of `exc`, met checking `path` with safetensors'
    safe_open, whose errors name neither the file nor, often, the problem
    ("header too large" for a git-lfs pointer): the same type, saying both;
    None for errors that are not about reading it."""
    if isinstance(exc, (OSError, MemoryError)) and not isinstance(exc, SafetensorError):
        return exception_naming_file(exc, path)  # e.g. ENOMEM from its memory map
    return named_safetensors_error(path, exc)


def read_header(path) -> SafetensorsHeader:
    with _os_errors_named(path), open(path, "rb") as f:
        return read_header_from(f, path)


def read_header_from(f, path) -> SafetensorsHeader:
    """The checked header of `path`, open as binary file `f` at its start."""
    file_size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) == 8 and not head.startswith(_LFS_POINTER_PREFIX[:8]):
        (header_len,) = struct.unpack("<Q", head)
        if header_len <= MAX_HEADER_BYTES:
            head += f.read(header_len)
    else:
        head += f.read(64)
    return parse_header(path, file_size, head)


@contextlib.contextmanager
def _os_errors_named(path):
    """An OSError in the block, other than a CheckpointError, raised as checkpoint_os_error's."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise checkpoint_os_error(path, exc) from exc


@contextlib.contextmanager
def unchanged_file(path):
    """(open binary file, its checked header, (size, mtime_ns)) of `path`, for
    a read that must see one file: errors as checkpoint_os_error says, and a
    file whose size or modification time differs when the block ends is
    refused, never mixed."""
    with _os_errors_named(path):
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            try:
                yield f, read_header_from(f, path), (before.st_size, before.st_mtime_ns)
            finally:
                page_cache.after_read(f.fileno())
            after = os.fstat(f.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise CheckpointError(
            path,
            f"the file changed while it was read (size {before.st_size} -> {after.st_size} bytes, "
            "modification time changed): is another process writing it?",
        )


def checkpoint_os_error(path, exc: OSError) -> OSError:
    """`exc` (an OSError met opening or reading `path`) as a CheckpointError
    naming the file, with the same errno."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(path, "the file does not exist")
    reason = exc.strerror or str(exc) or type(exc).__name__
    error = CheckpointError(
        path, f"{reason} (errno {errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else reason
    )
    error.errno, error.strerror = exc.errno, exc.strerror
    return error
