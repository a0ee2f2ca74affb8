"""Casting while reading (strategy/castread.py): a file read through a small
staging buffer and cast into its final dtype gives the bits mindspore's
Tensor.set_dtype gives the file's values; the probe catches a cast that
differs; a file that changes is refused, naming it; switched off, nothing is
cast while reading. Loads are compared against unpatched ones in
test_transformers_identity.py (the dtype matrix, and the cases where the
guess does not fit)."""

import json
import os
import struct
import threading

import mindone.transformers as mt
import mindspore as ms
import numpy as np
import pytest
from _helpers import tiny_qwen2_config

import ms_loadpatch
from ms_loadpatch.strategy import castread, safetensors_header
from ms_loadpatch.strategy.castread import CastPlan, read_cast
from ms_loadpatch.strategy.probe_cache import ProbeCache
from ms_loadpatch.strategy.reader import read_arrays
from ms_loadpatch.strategy.reports import last_report
from ms_loadpatch.strategy.safetensors_header import CheckpointError
from ms_loadpatch.testing import assert_same_model, load_both, write_random_checkpoint

BF16 = safetensors_header.numpy_dtypes()["BF16"]


_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32"}


def _write_safetensors(path, tensors):
    """safetensors.numpy cannot write bf16: the format written by hand."""
    header, offset = {"__metadata__": {"format": "np"}}, 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": _CODES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(a.tobytes() for a in tensors.values()))


@pytest.fixture
def mixed_file(tmp_path):
    """fp32, fp16, bf16 and integer tensors of odd sizes, back to back, with
    NaNs, infinities, subnormals and ties in the floats; one empty tensor."""
    rng = np.random.default_rng(0)
    specials = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 1e-40, -1e-45, 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 65520.0, 3.4e38],
        dtype=np.float32,
    )
    payload_nan = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF], dtype=np.uint32).view(np.float32)
    tensors = {
        "a": rng.standard_normal((37, 11)).astype(np.float32),
        "b": np.concatenate([specials, payload_nan, rng.standard_normal(1000).astype(np.float32) * 1e3]),
        "c": rng.integers(-(2**30), 2**30, size=(129,), dtype=np.int32),
        "d": rng.standard_normal((3, 5, 7)).astype(np.float16),
        "e": rng.standard_normal((513,)).astype(np.float32),
        "f": np.zeros((0, 4), dtype=np.float32),
        "g": rng.standard_normal((300,)).astype(np.float32).astype(BF16),
    }
    path = str(tmp_path / "mixed.safetensors")
    _write_safetensors(path, tensors)
    return path


def _set_dtype(array, dtype):
    tensor = ms.Tensor.from_numpy(np.ascontiguousarray(array))
    tensor.set_dtype(dtype)
    return tensor.asnumpy()


def _bits(array):
    return array.view(np.dtype(f"u{array.dtype.itemsize}")) if array.dtype.itemsize in (2, 4, 8) else array


@pytest.mark.parametrize("staging", [castread.STAGING_BYTES, 64, 4096], ids=["default", "64B", "4KB"])
@pytest.mark.parametrize("target", [ms.bfloat16, ms.float32, ms.float16], ids=str)
def test_read_cast_gives_set_dtype_bits(mixed_file, monkeypatch, target, staging):
    """Every tensor the plan casts has Tensor.set_dtype's bits of the file's
    values (with staging parts smaller than a tensor, and across tensors);
    the others are exactly read_arrays'."""
    monkeypatch.setattr(castread, "STAGING_BYTES", staging)
    plan = CastPlan(target)
    expected, _ = read_arrays(mixed_file)
    arrays, metadata, cast_at_read = read_cast(mixed_file, plan, threads=3)
    assert list(arrays) == list(expected) and metadata == {"format": "np"}
    for name, original in expected.items():
        if name in cast_at_read:
            assert plan.casts(original.dtype)
            want = _set_dtype(original, target)
            assert arrays[name].dtype == want.dtype and arrays[name].shape == original.shape
            np.testing.assert_array_equal(_bits(arrays[name]), _bits(want), err_msg=name)
            np.testing.assert_array_equal(_bits(cast_at_read[name].original()), _bits(original))
        else:
            assert arrays[name].dtype == original.dtype
            np.testing.assert_array_equal(_bits(arrays[name]), _bits(original), err_msg=name)
    casts = {name for name, a in expected.items() if a.dtype.kind == "f" or a.dtype == BF16}
    casts = {name for name in casts if plan.casts(expected[name].dtype) and expected[name].size}
    assert set(cast_at_read) == casts and casts, "nothing was cast while reading"


def test_probe_catches_a_cast_that_differs(monkeypatch):
    """A numpy cast that truncates instead of rounding fails its probe, and
    the plan then leaves that source to Tensor.set_dtype."""
    monkeypatch.setattr(castread, "_pairs", ProbeCache())

    def truncating(out, source, nan_bits=None):
        np.copyto(out.view(np.uint16), (source.view(np.uint32) >> 16).astype(np.uint16))

    monkeypatch.setattr(castread, "cast_into", truncating)
    problem = castread.cast_problem(np.dtype(np.float32), ms.bfloat16)
    assert problem is not None and "differ from Tensor.set_dtype" in problem
    assert not CastPlan(ms.bfloat16).casts(np.dtype(np.float32))


def test_probe_results_in_status():
    """status() lists cast-on-read with each dtype pair its probe passed or failed."""
    rows = {row["name"]: row for row in ms_loadpatch.status()["techniques"]}
    row = rows[castread.NAME]
    assert row["state"] in ("active", "skipped")
    assert "Float32 -> BFloat16" in row["description"] + row["reason"]
    passed = castread.cast_problem(np.dtype(np.float32), ms.bfloat16) is None
    assert (row["state"] == "active") == passed or "Float32 -> BFloat16" in row["reason"]


def test_original_refuses_a_changed_file(mixed_file):
    """The file's values read again (a guess that did not fit) come from the
    file as it was read: changed meanwhile, it is refused, naming it and the tensor."""
    _, _, cast_at_read = read_cast(mixed_file, CastPlan(ms.bfloat16))
    origin = cast_at_read["a"]
    stat = os.stat(mixed_file)
    os.utime(mixed_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError) as caught:
        origin.original()
    assert mixed_file in str(caught.value) and "'a'" in str(caught.value) and "changed" in str(caught.value)


def test_file_changing_during_the_read_is_refused(mixed_file, monkeypatch):
    """The same checks as read_arrays: a file rewritten while it is read is refused, naming it."""
    real = castread.cast_into
    touched = []

    def cast_then_touch(out, source, nan_bits=None):
        real(out, source, nan_bits)
        if not touched:
            touched.append(True)
            stat = os.stat(mixed_file)
            os.utime(mixed_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    monkeypatch.setattr(castread, "cast_into", cast_then_touch)
    with pytest.raises(CheckpointError) as caught:
        read_cast(mixed_file, CastPlan(ms.bfloat16))
    assert mixed_file in str(caught.value) and "changed while it was read" in str(caught.value)


@pytest.mark.parametrize("switch", ["on", "off"])
def test_load_cast_while_reading_or_switched_off(tmp_path, cpu_kernels, monkeypatch, switch):
    """A sharded fp32 checkpoint loaded as bf16: cast while reading (or not,
    switched off), bit-identical to an unpatched load either way, no reader
    or fault-in thread left behind."""
    if switch == "off":
        monkeypatch.setenv("MS_LOADPATCH_TECHNIQUES_OFF", castread.NAME)
    write_random_checkpoint(mt.Qwen2ForCausalLM, tiny_qwen2_config(), str(tmp_path), max_shard_bytes=20_000)
    ref, acc = load_both(lambda: mt.Qwen2ForCausalLM.from_pretrained(str(tmp_path), mindspore_dtype=ms.bfloat16))
    report = last_report()
    assert report.shards > 1 and report.tensors_cast == report.tensors_assigned
    if switch == "on":
        assert report.tensors_cast_while_reading == report.tensors_cast and report.tensors_read_again == 0
        assert "while reading" in report.summary()
    else:
        assert report.tensors_cast_while_reading == 0 and "while reading" not in report.technique
    assert_same_model(ref, acc)
    assert {p.dtype for p in acc.get_parameters()} == {ms.bfloat16}
    assert not [t for t in threading.enumerate() if t.name.startswith("ms_loadpatch-")]


def test_nan_recipe_only_for_nan_only_differences(monkeypatch):
    """A cast that differs from set_dtype only in NaN payloads gets set_dtype's
    NaNs (one per sign), learnt and checked by the probe; it is refused when
    it differs anywhere else too."""
    monkeypatch.setattr(castread, "_pairs", ProbeCache())
    real = castread.cast_into

    def payload_keeping(out, source, nan_bits=None):
        real(out, source, nan_bits)
        if nan_bits is None:  # a numpy that keeps some payload bit set_dtype drops
            nan = np.isnan(source)
            out.view(np.uint16)[nan] |= 1

    monkeypatch.setattr(castread, "cast_into", payload_keeping)
    assert castread.cast_problem(np.dtype(np.float32), ms.bfloat16) is None
    positive, negative = castread.cast_recipe(np.dtype(np.float32), ms.bfloat16)
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    assert [positive, negative] == list(_set_dtype(nan, ms.bfloat16).view(np.uint16))

    def also_off_by_one(out, source, nan_bits=None):
        payload_keeping(out, source, nan_bits)
        out.view(np.uint16)[source == 1.0] ^= 1

    monkeypatch.setattr(castread, "_pairs", ProbeCache())
    monkeypatch.setattr(castread, "cast_into", also_off_by_one)
    assert "differ from Tensor.set_dtype" in castread.cast_problem(np.dtype(np.float32), ms.bfloat16)
    assert castread.cast_recipe(np.dtype(np.float32), ms.bfloat16) is None
