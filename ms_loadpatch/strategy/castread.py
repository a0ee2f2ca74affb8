"""Casting while reading: a load that changes dtype (an fp32 file loaded as
bf16) reads the tensors it casts through one small staging buffer, reused,
and casts each part straight into memory of the final dtype, which alone is
touched (a 2 GB fp32 file loaded as bf16 touches 1 GB, not 3), faulted in
with the GIL released so that it runs beside the model's construction.

The target dtype is a guess made before the model exists: the dtype the
caller passed to from_pretrained (`CastPlan`). What the guess does not fit
gets the file's own values back (`CastAtRead.original`, read again from the
same unchanged file) and takes mindspore's path as before: a parameter whose
dtype differs (a module kept in fp32), a buffer, a tensor a key mapping
transforms.

The cast is numpy's, through the dtypes mindspore maps to its own
(np_dtype.bfloat16), because numpy can write into memory already faulted in.
`cast_problem` checks, once per process and dtype pair, that it gives the
bits of Tensor.set_dtype (mindone's cast) on every rounding class of the
source: each high half with low halves below, at and above every tie
position, NaN payloads, infinities, subnormals. Where numpy differs only in
keeping NaN payloads that set_dtype replaces by one NaN per sign (fp32 ->
fp16), the probe learns those two and cast_into writes them. A failed probe
leaves that pair to set_dtype; MS_LOADPATCH_TECHNIQUES_OFF=cast-on-read
turns it off.
"""

from __future__ import annotations

import bisect
import os
import threading

import numpy as np

from . import page_cache, randomstate, switch, verdict
from .probe_cache import ProbeCache
from .safetensors_header import CheckpointError, checkpoint_os_error, read_header_from, unchanged_file
from .threaded_read import ReadPlan, as_plan, data_buffer, read_into, read_threads, run_in_threads

NAME = "cast-on-read"
DESCRIPTION = (
    "a load asked for another dtype reads the tensors it casts through a reused staging buffer into "
    "their final dtype's memory (numpy's cast, probed against Tensor.set_dtype)"
)
# Staging per reading thread; parts of this size keep the GIL-holding casts short.
STAGING_BYTES = 32 << 20
_ALIGN = 64

_pairs = ProbeCache()  # (source dtype, target) -> (problem, nan_bits)


def switched_off() -> bool:
    return switch.is_off(NAME)


def _floating() -> dict:
    """mindspore float dtype -> the numpy dtype Tensor.from_numpy maps to it."""
    import mindspore as ms

    from .safetensors_header import numpy_dtypes

    dtypes = numpy_dtypes()
    out = {ms.float32: dtypes["F32"], ms.float16: dtypes["F16"]}
    if "BF16" in dtypes:
        out[ms.bfloat16] = dtypes["BF16"]
    return out


def cast_into(out: np.ndarray, source: np.ndarray, nan_bits=None) -> None:
    """out[...] = source, cast to out's dtype. Without numpy's overflow / NaN
    warnings: set_dtype gives none. `nan_bits` (for +NaN, -NaN): what
    set_dtype makes of every NaN where numpy keeps the payload (a probe's
    recipe)."""
    with np.errstate(all="ignore"):
        np.copyto(out, source, casting="unsafe")
        if nan_bits is not None:
            nan = np.isnan(source)
            if nan.any():
                out.view(np.dtype(f"u{out.dtype.itemsize}"))[nan] = np.where(
                    np.signbit(source[nan]), nan_bits[1], nan_bits[0]
                )


def _rounding_classes(itemsize: int) -> np.ndarray:
    """Source bit patterns covering every rounding case of a cast to 16 bits."""
    if itemsize == 2:
        return np.arange(1 << 16, dtype=np.uint16)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    # bf16 keeps the high half (tie at 0x8000); fp16 keeps 3 bits more (tie at 0x1000 under each)
    low = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
    low += [(kept << 13) | dropped for kept in range(8) for dropped in (0x0FFF, 0x1000, 0x1001)]
    return (high[:, None] | np.array(low, dtype=np.uint32)[None, :]).ravel()


def cast_problem(source: np.dtype, target) -> str | None:
    """None when cast_into from numpy dtype `source` to mindspore dtype
    `target` (with cast_recipe's NaN bits) gives Tensor.set_dtype's bits;
    else why not. Once per process per pair."""
    return _probed_pair(source, target)[0]


def cast_recipe(source: np.dtype, target):
    """The nan_bits cast_into needs for this pair to match set_dtype (None: none)."""
    return _probed_pair(source, target)[1]


def _probed_pair(source, target):
    def probe():
        with randomstate.kept():
            return _probe(np.dtype(source), target)

    return _pairs.get((np.dtype(source).str, str(target)), probe)


def _probe(source: np.dtype, target):
    """(problem, nan_bits) for one pair; problem None when the cast matches."""
    import mindspore as ms

    try:
        target_np = _floating().get(target)
        if target_np is None or source.itemsize not in (2, 4):
            return f"no numpy cast from {source} to {target}", None
        bits = _rounding_classes(source.itemsize)
        values = bits.view(source)
        expected = ms.Tensor.from_numpy(values.copy())
        expected.set_dtype(target)
        expected = expected.asnumpy()
        if expected.dtype != target_np:
            return f"Tensor.set_dtype gives {expected.dtype}, numpy {target_np}", None
        unsigned = np.dtype(f"u{target_np.itemsize}")
        want = expected.view(unsigned)

        def differing(nan_bits):
            actual = np.empty(values.shape, dtype=target_np)
            for lo in range(0, len(values), 1 << 20):  # in parts, as reads cast them
                cast_into(actual[lo : lo + (1 << 20)], values[lo : lo + (1 << 20)], nan_bits)
            got = actual.view(unsigned)
            return np.flatnonzero(want != got), got

        nan_bits = None
        differ, got = differing(None)
        if differ.size:
            nan_bits = _nan_recipe(values, want, differ)
            if nan_bits is not None:
                differ, got = differing(nan_bits)
        if differ.size:
            first = differ[0]
            return (
                f"{differ.size} of {values.size} values differ from Tensor.set_dtype, e.g. source bits "
                f"{int(bits[first]):#x}: {int(want[first]):#x} vs {int(got[first]):#x}"
            ), None
    except Exception as exc:  # an internal the cast relies on changed
        return f"{type(exc).__name__}: {exc}", None
    return None, nan_bits


def _nan_recipe(values, want, differ):
    """(bits for +NaN, bits for -NaN) when numpy differs from set_dtype only
    on NaNs and set_dtype gives one NaN per sign; else None."""
    nan = np.isnan(values)
    if not nan[differ].all():
        return None
    negative = np.signbit(values)
    recipe = []
    for sign in (False, True):
        outputs = np.unique(want[nan & (negative == sign)])
        if outputs.size != 1:
            return None
        recipe.append(int(outputs[0]))
    return tuple(recipe)


def technique_status(libraries: list) -> verdict.TechniqueRow:
    """status()'s row for `libraries`: the dtype pairs cast while reading (probe
    passed) and those left to Tensor.set_dtype, with why. Runs the probes."""
    if switched_off():
        return verdict.row_off(NAME, libraries, DESCRIPTION)
    floating = _floating()
    passed, failed = [], []
    for source in floating:
        for target in floating:
            if source == target:
                continue
            pair = f"{source} -> {target}"
            problem, nan_bits = _probed_pair(floating[source], target)
            if nan_bits is not None:
                pair += f" (NaNs as set_dtype makes them: {nan_bits[0]:#x} / {nan_bits[1]:#x})"
            (passed.append(pair) if problem is None else failed.append(f"{pair}: {problem}"))
    return verdict.TechniqueRow(
        NAME,
        DESCRIPTION + "; for " + (", ".join(passed) or "no dtype pair"),
        verdict.ACTIVE if passed else verdict.SKIPPED,
        ("left to Tensor.set_dtype: " + "; ".join(failed)) if failed else "",
        tuple(libraries),
    )


class CastPlan:
    """What a load casts while reading: floating tensors of a file dtype
    whose probe passed, to `target` (the dtype the caller asked for)."""

    def __init__(self, target):
        self.target = target
        self.target_numpy = _floating()[target]
        self._sources: dict = {}

    @classmethod
    def for_dtype(cls, dtype) -> CastPlan | None:
        """A plan for a load asked to give `dtype` (a mindspore float dtype or
        its name); None when there is nothing to plan or it is switched off."""
        if dtype is None or switched_off():
            return None
        import mindspore as ms

        if isinstance(dtype, str):
            dtype = getattr(ms, dtype, None)
        try:
            if dtype not in _floating():
                return None
        except TypeError:  # unhashable: mindone will say what is wrong with it
            return None
        plan = cls(dtype)
        for source in _floating().values():  # probed here, in the caller's thread, not in a reader's
            plan.casts(source)
        return plan

    def casts(self, source: np.dtype) -> bool:
        if source == self.target_numpy:
            return False
        if source not in self._sources:
            floating = source in _floating().values()
            self._sources[source] = floating and cast_problem(source, self.target) is None
        return self._sources[source]

    def nan_bits(self, source: np.dtype):
        return cast_recipe(source, self.target)


class Staging:
    """One reading thread's staging buffer: faulted in once, then reused."""

    def __init__(self):
        self._buffer = None

    def get(self, nbytes: int) -> np.ndarray:
        if self._buffer is None or len(self._buffer) < nbytes:
            self._buffer = np.empty(max(nbytes, min(STAGING_BYTES, nbytes * 4)), dtype=np.uint8)
        return self._buffer[:nbytes]


class CastAtRead:
    """Where a tensor cast while reading came from, to read its file values again."""

    __slots__ = ("path", "name", "identity", "source")

    def __init__(self, path, name, identity, source: np.dtype):
        self.path, self.name, self.identity, self.source = path, name, identity, source

    def source_dtype(self):
        """The file's dtype, as a mindspore dtype."""
        return next(ms_dtype for ms_dtype, np_dtype in _floating().items() if np_dtype == self.source)

    def original(self) -> np.ndarray:
        """The tensor as the file holds it, from the file read before, unchanged since."""
        path = self.path
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                if (stat.st_size, stat.st_mtime_ns) != self.identity:
                    raise CheckpointError(
                        path,
                        "the file changed during the load (size or modification time): is another process writing it?",
                        key=self.name,
                    )
                header = read_header_from(f, path)
                dtype, shape, begin, end = header.entries[self.name]
                array = np.empty(end - begin, dtype=np.uint8)
                got = read_into(f.fileno(), array, header.data_start + begin, threads=1)
                page_cache.after_read(f.fileno(), whole_file=False)
        except CheckpointError:
            raise
        except OSError as exc:
            raise checkpoint_os_error(path, exc) from exc
        if got != end - begin:
            raise CheckpointError(
                path, f"read {got} of {end - begin} bytes: the file changed or is truncated", key=self.name
            )
        return array.view(dtype).reshape(shape)


class CastRegistry:
    """The tensors of a load that were cast while reading, by identity: the
    registry holds them, so an id is never reused while it is listed."""

    def __init__(self):
        self._entries: dict = {}

    def add(self, tensors: dict, cast_at_read: dict) -> None:
        """`tensors` (name -> Tensor) made from read_cast's arrays."""
        for name, origin in cast_at_read.items():
            self._entries[id(tensors[name])] = (tensors[name], origin)

    def pop(self, tensor) -> CastAtRead | None:
        """Where `tensor` came from if it was cast while reading (then unlisted), else None."""
        entry = self._entries.pop(id(tensor), None)
        return entry[1] if entry is not None and entry[0] is tensor else None

    def as_in_file(self, tensor, report):
        """`tensor`, or the file's values if it was cast while reading (read again)."""
        from .tensors import to_tensor

        origin = self.pop(tensor)
        if origin is None:
            return tensor
        report.tensors_read_again += 1
        return to_tensor(origin.original())

    def clear(self) -> None:
        self._entries.clear()


def _segments(entries: dict, plan: CastPlan):
    """File-ordered runs of cast tensors (same dtype, back to back; staging
    aligns them, wherever they start in the file): (dtype, begin, end,
    [names]); and the names kept in the file's dtype."""
    runs, kept = [], []
    for name, (dtype, _shape, begin, end) in sorted(entries.items(), key=lambda item: item[1][2]):
        if not plan.casts(dtype) or end == begin:
            kept.append(name)
            continue
        last = runs[-1] if runs else None
        if last is not None and last[0] == dtype and last[2] == begin:
            last[2] = end
            last[3].append(name)
        else:
            runs.append([dtype, begin, end, [name]])
    return runs, kept


def _offsets(sizes) -> tuple[list[int], int]:
    """Each size placed at a _ALIGN-aligned offset; (offsets, total)."""
    offsets, total = [], 0
    for size in sizes:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += size
    return offsets, total


def _fault_in(buffer: np.ndarray, threads: int, stop) -> None:
    """Touch every page of `buffer` in `threads` threads, GIL released (ndarray.fill)."""
    if not len(buffer):
        return
    step = -(-len(buffer) // max(1, threads) // _ALIGN) * _ALIGN
    parts = [buffer[lo : lo + step] for lo in range(0, len(buffer), step)]
    run_in_threads(
        [lambda part=part: part.fill(0) for part in parts],
        "ms_loadpatch-fault-in",
        stop or threading.Event(),
        "faulting in cast memory",
    )


def read_cast(path, plan: CastPlan, threads: ReadPlan | int | None = None, stop=None, staging: Staging | None = None):
    """(arrays, metadata, cast_at_read) of one file: reader.read_arrays'
    arrays, except that those `plan` casts are in its dtype and named in
    `cast_at_read` (name -> CastAtRead). The same checks and errors as
    read_arrays: a file changed during the read is refused."""
    threads = as_plan(threads)
    staging = staging or Staging()
    with unchanged_file(path) as (f, header, identity):
        runs, kept = _segments(header.entries, plan)
        kept_ranges = _merged([header.entries[name][2:] for name in kept])
        kept_offsets, kept_total = _offsets([end - begin for begin, end in kept_ranges])
        out_item = plan.target_numpy.itemsize
        run_offsets, out_total = _offsets([(end - begin) // dtype.itemsize * out_item for dtype, begin, end, _ in runs])
        kept_buffer, out = data_buffer(path, kept_total), data_buffer(path, out_total)
        _fault_in(out, min(threads.threads_now(), read_threads()), stop)  # faults take cores, not waits
        fd, short = f.fileno(), None
        for (begin, end), offset in zip(kept_ranges, kept_offsets):
            got = read_into(
                fd,
                kept_buffer[offset : offset + end - begin],
                header.data_start + begin,
                threads,
                stop,
                f"the read of {os.fspath(path)}",
            )
            if got != end - begin:
                short = (begin + got, end)
                break
        for (dtype, begin, end, _names), offset in zip(runs, run_offsets):
            if short is not None:
                break
            count, nan_bits = (end - begin) // dtype.itemsize, plan.nan_bits(dtype)
            target = out[offset : offset + count * out_item].view(plan.target_numpy)
            part = max(dtype.itemsize, STAGING_BYTES // _ALIGN * _ALIGN)
            for lo in range(0, end - begin, part):
                n = min(part, end - begin - lo)
                buffer = staging.get(n)
                got = read_into(
                    fd, buffer, header.data_start + begin + lo, threads, stop, f"the read of {os.fspath(path)}"
                )
                if got != n:
                    short = (begin + lo + got, end)
                    break
                first = lo // dtype.itemsize
                cast_into(target[first : first + n // dtype.itemsize], buffer.view(dtype), nan_bits)
        if short is not None:
            data_len = max((end for _, _, _, end in header.entries.values()), default=0)
            raise CheckpointError(
                path, f"the data ends at byte {short[0]} of {data_len}: the file changed or is truncated"
            )
    where = {}
    for (dtype, begin, _end, names), offset in zip(runs, run_offsets):
        for name in names:
            entry_begin, entry_end = header.entries[name][2:]
            lo = offset + (entry_begin - begin) // dtype.itemsize * out_item
            where[name] = (out, lo, lo + (entry_end - entry_begin) // dtype.itemsize * out_item, plan.target_numpy)
    starts = [begin for begin, _ in kept_ranges]
    for name in kept:
        dtype, _shape, entry_begin, entry_end = header.entries[name]
        index = bisect.bisect_right(starts, entry_begin) - 1  # the merged range holding it
        lo = kept_offsets[index] + entry_begin - kept_ranges[index][0]
        where[name] = (kept_buffer, lo, lo + entry_end - entry_begin, dtype)
    arrays, cast_at_read = {}, {}
    for name, (dtype, shape, _begin, _end) in header.entries.items():  # file order, as read_arrays
        buffer, lo, hi, final = where[name]
        view = buffer[lo:hi]
        if lo % final.itemsize:
            view = view.copy()
        try:
            arrays[name] = view.view(final).reshape(shape)
        except ValueError:
            raise CheckpointError(path, f"numpy cannot hold shape {list(shape)}", key=name) from None
        if final != dtype:
            cast_at_read[name] = CastAtRead(os.fspath(path), name, identity, dtype)
    return arrays, header.metadata, cast_at_read


def _merged(ranges) -> list[tuple[int, int]]:
    """Byte ranges, sorted and joined where they touch or overlap."""
    merged: list[list[int]] = []
    for begin, end in sorted(ranges):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(begin, end) for begin, end in merged]
