"""Reading safetensors files into memory the process owns, with no copy
beyond the read itself, and with every header field checked.

The data section is read once into one numpy buffer per file; every tensor
is a view of it. Not mmap: an aliased mmap defers the read to first use and
follows later writes to the file.

A file is accepted exactly when the safetensors library accepts it (the
check mindone itself runs before loading a file), except what numpy cannot
hold: dtypes F8_*, F6_*, F4, C64, and empty tensors with shapes such as
[2**63, 0]. (Not modelled: serde_json's rounding of floats within a hair of
1.8e308 in fields safetensors ignores.) tests/test_reader_fuzz.py holds the
two readers against each other.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import struct
import threading
import time

import numpy as np
from safetensors import SafetensorError

from .ranks import NodeShare, node_share

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
logger = logging.getLogger("ms_loadpatch")


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
        raise CheckpointError(path, "the header has a lone surrogate \\u escape (not valid JSON text)", key=key) from None


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
    if not (
        type(offsets) is list and len(offsets) == 2 and all(type(o) is int and 0 <= o < _U64 for o in offsets)
    ):
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
                path, f"data_offsets {[begin, end]} point past the end of the data ({data_len} bytes): truncated?",
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


class SafetensorsFileError(_FileProblem, SafetensorError):
    """The safetensors library's error for a file (the type mindone's own
    check raises), naming the file and saying what is wrong in plain words."""


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
            yield f, read_header_from(f, path), (before.st_size, before.st_mtime_ns)
            after = os.fstat(f.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise CheckpointError(
            path, f"the file changed while it was read (size {before.st_size} -> {after.st_size} bytes, "
            "modification time changed): is another process writing it?"
        )


def checkpoint_os_error(path, exc: OSError) -> OSError:
    """`exc` (an OSError met opening or reading `path`) as a CheckpointError
    naming the file, with the same errno."""
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(path, "the file does not exist")
    reason = exc.strerror or str(exc) or type(exc).__name__
    error = CheckpointError(path, f"{reason} (errno {errno.errorcode.get(exc.errno, exc.errno)})"
                            if exc.errno else reason)
    error.errno, error.strerror = exc.errno, exc.strerror
    return error


# Below this a file's data is read in one call; above, in a few threads: page
# faults on fresh memory, not the copy, bound the read (about 2 s/GB on a VM
# whose freed memory goes back to the host), and they scale with cores.
PARALLEL_READ_MIN_BYTES = 64 << 20
_ALIGN = 2 << 20  # chunk borders on huge-page boundaries


def read_threads(share: NodeShare | None = None) -> int:
    """Threads for one file's read: twice the cores (measured: past the core
    count still helps, faults wait on the host), up to 8, divided among the
    ranks of a job sharing the node."""
    share = share or node_share()
    return share.divide(min(8, 2 * share.cores))


def background_read_threads(share: NodeShare | None = None) -> int:
    """Threads for a read that runs beside other work: one core left to it."""
    share = share or node_share()
    return share.divide(max(1, share.cores - 1))


# One read(2) at most this long: a stop request is seen between two.
READ_STEP_BYTES = 64 << 20
# How long a stopped load waits for its reader threads before leaving them to
# finish in the background (a read blocked on storage that does not answer).
STOP_GRACE_SECONDS = 2.0


class ReadStopped(Exception):
    """A read abandoned on request (the load it was for has ended)."""


def _fill(view: memoryview, read_part, stop=None) -> int:
    """Call read_part(next part of view, bytes so far) until `view` is full
    or it returns 0 (end of file); the count read. Loops: one read(2) returns
    at most about 2 GiB, and shards are often larger. Checks `stop` (an
    Event) between parts."""
    got = 0
    while got < len(view):
        if stop is not None and stop.is_set():
            raise ReadStopped()
        n = read_part(view[got : got + READ_STEP_BYTES], got)
        if not n:
            break
        got += n
    return got


def _pread_into(fd: int, view: memoryview, offset: int, stop=None) -> int:
    return _fill(view, lambda part, done: os.preadv(fd, [part], offset + done), stop)


def _seek_read_into(fd: int, view: memoryview, offset: int, stop=None) -> int:
    """_pread_into where there is no preadv (Windows): one thread, seek then read."""
    os.lseek(fd, offset, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        return _fill(view, lambda part, done: f.readinto(part), stop)


def join_or_leave(threads, stop, what: str, grace: float | None = None) -> None:
    """Ask `threads` to stop (`stop.set()`), wait up to `grace` seconds for
    them, then leave the rest (daemon threads, each owning its buffer and file)
    to end on their own when their read returns, with a warning naming `what`."""
    stop.set()
    deadline = time.monotonic() + (STOP_GRACE_SECONDS if grace is None else grace)
    for thread in threads:
        if thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        logger.warning(
            "ms_loadpatch: %s did not stop within %.1f s (storage not answering?); %s left to end in the background",
            what, STOP_GRACE_SECONDS if grace is None else grace, ", ".join(alive),
        )


def run_in_threads(calls, name: str, stop, what: str) -> list:
    """Each of `calls` in a daemon thread of its own (a read blocked on storage
    must not hold up the interpreter's exit); their results in order, the first
    error raised. If this thread is interrupted meanwhile, the others are
    stopped (join_or_leave) before the interrupt goes on. A thread that cannot
    be started (a thread limit) has its call run here instead."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            stop.set()

    threads = []
    try:
        for i in range(len(calls)):
            thread = threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread"
                run(i)
                continue
            threads.append(thread)
        for thread in threads:
            thread.join()
    except BaseException:
        join_or_leave(threads, stop, what)
        raise
    real = [e for e in errors if not isinstance(e, ReadStopped)]
    if real or errors:
        raise (real or errors)[0]
    return results


def read_into(fd: int, buffer: np.ndarray, offset: int, threads: int | None = None, stop=None, what="a read") -> int:
    """Read len(buffer) bytes of `fd` from `offset` into `buffer`, split
    across threads for large reads; the count read. `stop` (an Event) ends
    it early with ReadStopped."""
    view = memoryview(buffer).cast("B")
    threads = read_threads() if threads is None else threads
    if not hasattr(os, "preadv"):
        return _seek_read_into(fd, view, offset, stop)
    if threads <= 1 or len(view) < PARALLEL_READ_MIN_BYTES:
        return _pread_into(fd, view, offset, stop)
    step = -(-len(view) // threads // _ALIGN) * _ALIGN
    bounds = [(lo, min(lo + step, len(view))) for lo in range(0, len(view), step)]
    chunk_stop = threading.Event()
    if stop is not None and stop.is_set():
        raise ReadStopped()

    def chunk(lo, hi):
        return _pread_into(fd, view[lo:hi], offset + lo, _Either(stop, chunk_stop))

    counts = run_in_threads([lambda b=b: chunk(*b) for b in bounds], "ms_loadpatch-read-chunk", chunk_stop, what)
    for (lo, hi), count in zip(bounds, counts):
        if count != hi - lo:  # a short chunk: the file ends inside it
            return lo + count
    return len(view)


class _Either:
    """is_set() of either of two Events (the load's stop, or a sibling chunk's failure)."""

    def __init__(self, first, second):
        self._events = [e for e in (first, second) if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


def data_buffer(path, nbytes: int) -> np.ndarray:
    """An uninitialised byte buffer for `path`'s tensor data; MemoryError naming the file."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        raise MemoryError(
            f"Cannot load checkpoint file {os.fspath(path)}: not enough memory for its {nbytes} bytes of "
            f"tensor data ({exc})"
        ) from exc


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
