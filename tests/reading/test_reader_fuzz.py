"""Fuzzing the safetensors reader (strategy/reader.py, its header checks in
strategy/safetensors_header.py) against the safetensors library, the check
mindone itself runs on every file.

Property, for every input: read_arrays either returns exactly what the
safetensors library reads (names, dtypes, shapes, bytes, metadata), or raises
CheckpointError; any other exception fails. It refuses only what the library
refuses, plus the documented extra: what numpy cannot hold (dtypes F8_*,
F6_*, F4, C64; empty tensors with absurd shapes such as [2**63, 0]).
A hang shows as a deadline failure.

Example counts are fixed and the runs derandomized, so CI is stable; set
MS_LOADPATCH_FUZZ_EXAMPLES to run a longer, randomized campaign locally.
"""

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import deserialize, safe_open
from safetensors.numpy import load_file, save

from ms_loadpatch.strategy import safetensors_header
from ms_loadpatch.strategy.reader import read_arrays
from ms_loadpatch.strategy.safetensors_header import CheckpointError

_CAMPAIGN = int(os.environ.get("MS_LOADPATCH_FUZZ_EXAMPLES", "0"))


def _settings(examples):
    return settings(
        max_examples=_CAMPAIGN or examples,
        derandomize=not _CAMPAIGN,
        database=None,
        deadline=10_000,  # ms; generous for a loaded CI machine, still catches a hang
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- the oracle and the property

_ST_NAME = {dtype: name for name, dtype in safetensors_header.numpy_dtypes().items()}


def _library_reading(path):
    """(tensors, metadata) as the safetensors library reads the file, or None if it refuses.
    tensors: name -> (dtype name, shape, raw bytes)."""
    with open(path, "rb") as f:
        blob = f.read()
    try:
        tensors = {name: (info["dtype"], tuple(info["shape"]), bytes(info["data"])) for name, info in deserialize(blob)}
        with safe_open(path, framework="np") as f:
            metadata = f.metadata()
    except Exception:  # SafetensorError, and whatever else it raises for bad input
        return None
    return tensors, metadata


def _numpy_refuses(dtype_name, shape) -> bool:
    """The one documented extra refusal: what numpy cannot represent."""
    if dtype_name in safetensors_header._UNSUPPORTED_DTYPES:
        return True
    try:
        np.empty(0, np.uint8).reshape(shape)
    except ValueError:
        return True
    return False


def check_file(path) -> str:
    """Assert the property for one file; returns "loaded" or "refused"."""
    expected = _library_reading(path)
    try:
        arrays, metadata = read_arrays(path)
    except CheckpointError as exc:
        assert exc.path == os.fspath(path) and str(path) in str(exc)
        if expected is not None:
            assert any(_numpy_refuses(d, shape) for d, shape, _ in expected[0].values()), (
                f"safetensors reads this file but read_arrays refuses it: {exc}"
            )
        return "refused"
    assert expected is not None, f"read_arrays loaded a file safetensors refuses: {sorted(arrays)}"
    tensors, expected_metadata = expected
    assert metadata == expected_metadata
    assert set(arrays) == set(tensors)
    for name, array in arrays.items():
        dtype_name, shape, data = tensors[name]
        assert (_ST_NAME[array.dtype], array.shape) == (dtype_name, shape), name
        assert np.ascontiguousarray(array).tobytes() == data, f"{name}: different bytes"
    if all(array.dtype.name != "bfloat16" for array in arrays.values()):
        # and the library's numpy reader, value for value (bitwise: NaN-safe)
        reference = load_file(path)
        assert set(reference) == set(arrays)
        for name, array in arrays.items():
            assert reference[name].dtype == array.dtype and reference[name].shape == array.shape
            assert reference[name].tobytes() == array.tobytes(), name
    return "loaded"


def _header_blob(header, data: bytes, pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:  # as safetensors writes it: padded with spaces to 8 bytes
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One file per worker, rewritten for every example."""
    path = tmp_path_factory.mktemp("fuzz") / "model.safetensors"

    def write(blob: bytes):
        path.write_bytes(blob)
        return path

    return write


# -- seeds: files written by the safetensors library (and BF16, which numpy cannot write)


def _seeds():
    rng = np.random.default_rng(0)
    seeds = [
        save(
            {
                "model.embed.weight": rng.standard_normal((4, 6)).astype(np.float32),
                "model.norm.weight": np.ones(6, np.float16),
                "model.layers.0.bias": rng.standard_normal(3),  # float64
                "ids": np.arange(5, dtype=np.int64),
                "mask": np.array([True, False, True]),
                "bytes": np.arange(7, dtype=np.uint8),
                "empty": np.zeros((0, 3), np.int32),
                "scalar": np.array(1.5, np.float32),
            },
            metadata={"format": "pt"},
        ),
        save({"a": np.arange(3, dtype=np.int8), "b": np.arange(2, dtype=np.uint16)}),
        _header_blob(
            {"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}},
            rng.integers(0, 256, 8, dtype=np.uint8).tobytes(),
        ),
        save({}),
    ]
    return seeds


SEEDS = _seeds()


def test_seeds_load_like_safetensors(scratch):
    assert [check_file(scratch(seed)) for seed in SEEDS] == ["loaded"] * len(SEEDS)


# -- 1. mutated real files


def _mutate(blob: bytes, mutation) -> bytes:
    kind, position, value = mutation
    header_end = 8 + struct.unpack("<Q", blob[:8])[0] if len(blob) >= 8 else len(blob)
    # most mutations land in the header: that is where the parser is
    where = position % max(1, header_end)
    if kind == "data":  # the tensor bytes: the file stays valid, its values change
        where = min(header_end, len(blob)) + position % max(1, len(blob) - header_end)
    if kind in ("flip", "data"):
        if where >= len(blob):
            return blob
        return blob[:where] + bytes([blob[where] ^ (1 + value % 255)]) + blob[where + 1 :]
    if kind == "truncate":
        return blob[: position % (len(blob) + 1)]
    if kind == "insert":
        return blob[:where] + bytes([value % 256]) * (1 + value % 3) + blob[where:]
    if kind == "delete":
        return blob[:where] + blob[where + 1 + value % 4 :]
    if kind == "length":  # the header length field
        return struct.pack("<Q", max(0, header_end - 8 + (value % 33) - 16)) + blob[8:]
    if kind == "text":  # a JSON-significant character in the header
        chars = b'{}[]",:0-9e.\\ ntfu'
        return blob[:where] + bytes([chars[value % len(chars)]]) + blob[where + 1 :]
    if kind == "extend":
        return blob + bytes([value % 256]) * (1 + value % 9)
    raise AssertionError(kind)


_MUTATION = st.tuples(
    st.sampled_from(["flip", "data", "data", "truncate", "insert", "delete", "length", "text", "extend"]),
    st.integers(0, 4096),
    st.integers(0, 1 << 16),
)


@_settings(400)
@given(seed=st.sampled_from(range(len(SEEDS))), mutations=st.lists(_MUTATION, min_size=1, max_size=4))
def test_mutated_files(scratch, seed, mutations):
    blob = SEEDS[seed]
    for mutation in mutations:
        blob = _mutate(blob, mutation)
    event(check_file(scratch(blob)))


# -- 2. generated headers: mostly well-formed, with one defect at a time

_ALL_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"]
_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_DEFECTS = [
    None,
    None,
    None,  # half of the examples: a valid file
    "gap",
    "overlap",
    "short_data",
    "long_data",
    "bad_dtype",
    "unsupported_dtype",
    "float_dim",
    "negative_dim",
    "huge_dim",
    "missing_field",
    "extra_field",
    "duplicate_field",
    "list_form",
    "dtype_map",
    "bad_metadata",
    "duplicate_name",
    "unpadded",
    "nested_extra",
    "zero_size",
    "wrong_size",
]


@st.composite
def generated_files(draw):
    names = draw(st.lists(_NAMES.filter(lambda n: n != "__metadata__"), min_size=0, max_size=6, unique=True))
    header, chunks, offset = {}, [], 0
    for name in names:
        dtype = draw(st.sampled_from(_ALL_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = int(np.prod(shape, dtype=np.int64)) * _SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        chunks.append(draw(st.binary(min_size=nbytes, max_size=nbytes)))
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(_NAMES, _NAMES, max_size=3))
    data = b"".join(chunks)
    defect = draw(st.sampled_from(_DEFECTS))
    tensors = [n for n in header if n != "__metadata__"]
    target_name = draw(st.sampled_from(tensors)) if tensors else None
    target = header[target_name] if tensors else None
    text = None
    if defect == "gap" and target:
        target["data_offsets"] = [o + 1 for o in target["data_offsets"]]
    elif defect == "overlap" and target:
        target["data_offsets"][0] = max(0, target["data_offsets"][0] - 1)
    elif defect == "short_data":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif defect == "long_data":
        data += b"\0" * draw(st.integers(1, 9))
    elif defect == "bad_dtype" and target:
        target["dtype"] = draw(st.sampled_from(["f32", "F33", "", "FLOAT", "bf16", 32, None]))
    elif defect == "unsupported_dtype" and target:
        target["dtype"] = draw(st.sampled_from(["F8_E4M3", "F8_E5M2", "C64", "F4", "F6_E2M3", "F8_E8M0"]))
    elif defect == "float_dim" and target:
        target["shape"] = [float(d) for d in target["shape"]] or [1.0]
    elif defect == "negative_dim" and target:
        target["shape"] = target["shape"] + [-1]
    elif defect == "huge_dim" and target:
        target["shape"] = target["shape"] + [draw(st.sampled_from([2**64, 2**64 - 1, 2**63, 2**32]))]
    elif defect == "missing_field" and target:
        del target[draw(st.sampled_from(sorted(target)))]
    elif defect == "extra_field" and target:
        target[draw(st.sampled_from(["x", "offsets", "__metadata__"]))] = draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats(-1e300, 1e300) | _NAMES,
                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_NAMES, inner, max_size=3),
                max_leaves=6,
            )
        )
    elif defect == "list_form" and target:
        header[target_name] = [target["dtype"], target["shape"], target["data_offsets"]] + draw(
            st.sampled_from([[], [], [0]])
        )
    elif defect == "dtype_map" and target:
        target["dtype"] = {target["dtype"]: draw(st.sampled_from([None, None, 0, []]))}
    elif defect == "bad_metadata":
        header["__metadata__"] = draw(st.sampled_from([{"format": 1}, ["format", "pt"], "pt", {"a": None}, None]))
    elif defect == "duplicate_name" and tensors:
        body = json.dumps(header, separators=(",", ":"))
        name = json.dumps(tensors[0])
        first = draw(
            st.sampled_from(
                [
                    '{"dtype":"F32","shape":[],"data_offsets":[0,4]}',
                    "5",
                    "null",
                    '{"dtype":"F99","shape":[],"data_offsets":[0,4]}',
                ]
            )
        )
        text = "{" + f"{name}:{first}," + body[1:]
    elif defect == "duplicate_field" and target:
        body = json.dumps(target, separators=(",", ":"))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__"]))
        header_text = json.dumps(
            {k: (v if v is not target else "TARGET") for k, v in header.items()}, separators=(",", ":")
        )
        dup = body[:-1] + f',"{field}":' + json.dumps(target.get(field, None)) + "}"
        text = header_text.replace('"TARGET"', dup, 1)
    elif defect == "nested_extra" and target:
        depth = draw(st.integers(120, 130))
        body = json.dumps(target, separators=(",", ":"))
        header_text = json.dumps(
            {k: (v if v is not target else "TARGET") for k, v in header.items()}, separators=(",", ":")
        )
        text = header_text.replace('"TARGET"', '{"x":' + "[" * depth + "]" * depth + "," + body[1:], 1)
    elif defect == "zero_size" and target:
        target["shape"] = [0] + target["shape"]
    elif defect == "wrong_size" and target:
        target["shape"] = target["shape"] + [2]
    if text is not None:
        raw = text.encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + data
    return _header_blob(header, data, pad=defect != "unpadded")


@_settings(500)
@given(blob=generated_files())
def test_generated_files(scratch, blob):
    event(check_file(scratch(blob)))


# -- 3. arbitrary JSON as a header


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(-1e300, 1e300, allow_nan=False) | _NAMES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_NAMES, inner, max_size=4),
    max_leaves=12,
)


@_settings(200)
@given(header=_JSON, data=st.binary(max_size=16))
def test_arbitrary_json_headers(scratch, header, data):
    event(check_file(scratch(_header_blob(header, data))))


# -- fixed cases the fuzzers found or that need exact bytes


@pytest.mark.parametrize(
    "header, data, outcome",
    [
        # nesting: serde_json (safetensors) takes 127 levels, not 128
        (
            b'{"a":{"x":' + b"[" * 125 + b"]" * 125 + b',"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            b"\1",
            "loaded",
        ),
        (
            b'{"a":{"x":' + b"[" * 126 + b"]" * 126 + b',"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            b"\1",
            "refused",
        ),
        # far deeper than Python's recursion limit: a RecursionError inside json, not a crash
        (
            b'{"a":{"x":' + b"[" * 5000 + b"]" * 5000 + b',"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            b"\1",
            "refused",
        ),
        # -0 is a float to serde_json, so not a size; NaN and 1e400 are not JSON to it
        (b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b"", "refused"),
        (b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":NaN}}', b"", "refused"),
        (b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1e400}}', b"", "refused"),
        (b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1' + b"0" * 400 + b"}}", b"", "refused"),
        # lone surrogate escapes: Python's json takes them, serde_json does not
        (b'{"\\ud800":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', b"", "refused"),
        (b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":["\\udc00"]}}', b"", "refused"),
        (b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\1", "loaded"),
        # element count overflows u64 before the zero dimension
        (b'{"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b"", "refused"),
        # safetensors takes this empty tensor; numpy has no such shape (the documented extra refusal)
        (b'{"a":{"dtype":"U8","shape":[18446744073709551615,0],"data_offsets":[0,0]}}', b"", "refused"),
        (b'{"a":{"dtype":"U8","shape":[4294967295,0],"data_offsets":[0,0]}}', b"", "loaded"),
        # a later entry for the same name wins, but each must be well-formed
        (
            b'{"a":{"dtype":"U8","shape":[9],"data_offsets":[5,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            b"\1",
            "loaded",
        ),
        (b'{"a":5,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\1", "refused"),
        (b'{"__metadata__":null,"__metadata__":null}', b"", "refused"),
        # serde's other forms of a struct and an enum
        (b'{"a":["U8",[1],[0,1]]}', b"\1", "loaded"),
        (b'{"a":{"dtype":{"U8":null},"shape":[1],"data_offsets":[0,1]}}', b"\1", "loaded"),
        # the header length is all there is
        (b"", b"", "refused"),
        (b"   {}", b"", "loaded"),
    ],
)
def test_fixed_cases(scratch, header, data, outcome):
    assert check_file(scratch(struct.pack("<Q", len(header)) + header + data)) == outcome


def test_no_oversized_allocation(scratch):
    """A header length near 2**64, or a tensor claiming petabytes, fails at
    once without reading or allocating what it claims."""
    assert check_file(scratch(struct.pack("<Q", 2**64 - 1) + b"{}")) == "refused"
    huge = b'{"a":{"dtype":"F64","shape":[1125899906842624],"data_offsets":[0,9007199254740992]}}'
    assert check_file(scratch(struct.pack("<Q", len(huge)) + huge)) == "refused"


# -- index files: the glue reads model.safetensors.index.json itself to start reading shards early


_INDEX_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | _NAMES | st.sampled_from(["model-00001-of-00002.safetensors", "a/b"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_NAMES, inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("index")


@_settings(150)
@given(
    index=st.one_of(
        st.fixed_dictionaries({"weight_map": st.dictionaries(_NAMES, _INDEX_VALUES, max_size=4)}),
        st.dictionaries(st.sampled_from(["weight_map", "metadata"]), _INDEX_VALUES, max_size=2),
        _INDEX_VALUES,
    ),
    raw=st.one_of(st.none(), st.binary(max_size=40)),
)
def test_index_files_never_break_the_load(index_dir, index, raw):
    """A broken index is mindone's to report: the glue's look at it gives a
    list of shard paths in the directory, or none, and never raises."""
    import mindone.transformers.modeling_utils as modeling_utils

    from ms_loadpatch.glue import common
    from ms_loadpatch.glue.transformers import TransformersLoad

    directory = index_dir
    text = raw if raw is not None else json.dumps(index).encode()
    (directory / "model.safetensors.index.json").write_bytes(text)
    from_pretrained = modeling_utils.PreTrainedModel.from_pretrained
    files = common.checkpoint_files(TransformersLoad, from_pretrained, (str(directory),), {}, modeling_utils)
    assert isinstance(files, list) and all(isinstance(f, str) for f in files)
    if raw is None and isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        names = list(index["weight_map"].values())
        if names and all(isinstance(n, str) for n in names):
            assert files == [os.path.normpath(os.path.join(str(directory), n)) for n in sorted(set(names))]
