"""Load-level fuzzing: patched and unpatched mindone loads of broken checkpoints.

Each case takes one generated checkpoint, breaks it (hypothesis draws the
mutations: header JSON edits of the last tensor's entry, byte flips,
truncation, index edits) and loads it twice in this process, unpatched then
patched, both from the same global random state. The property:

- where the unpatched load succeeds, the patched one gives the same result
  (ms_loadpatch.testing.compare: names, shapes, dtypes, bits, object state)
  and leaves numpy's and Python's random generators where it did;
  Documented extra refusal: a shard index listing a tensor its shard does
  not hold (unpatched mindone leaves that weight random without a word);
- where the unpatched load fails, the patched one fails too, with an
  exception of the unpatched type (or a subclass) whose message names the
  broken file, a CheckpointError among its causes where the file is a
  file the safetensors library refuses;
- never a crash or a hang (faulthandler ends the run after --timeout
  seconds), nothing left behind (stress_loads.leftover_state: patches,
  locks, a current load, threads), and no read allocating more than the file
  could hold (tracemalloc peak of a read case under 2x the file + 64 MB).

Targets: full from_pretrained loads of a tiny Qwen2 (single file; sharded,
the last shard broken) and a tiny diffusers VAE, and direct
`load_state_dict` reads of files with 1 and with 10,000 tensors, the broken
entry the last one.

    python benchmarks/fuzz_loads.py --cases 20000 --seed 1        # the long run
    python benchmarks/fuzz_loads.py --cases 40 --seed 0           # what CI runs

The last line is the summary:
    SUMMARY cases=40 loaded=12 refused=28 failures=0 targets=df-read-1:3,... seconds=31.0
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stress_loads import leftover_state  # noqa: E402  (also makes the plugin's fast construction engage)

import ms_loadpatch  # noqa: E402
from ms_loadpatch.testing import global_random_state, random_state_difference, set_global_random_state  # noqa: E402

READ_ALLOWANCE = 64 << 20  # bytes a read may allocate beyond twice its file: Parameters, dict, header
MANY_TENSORS = 10_000


# -- the checkpoints


def prepare(root):
    """Write every target's checkpoint under `root` (plugin off); return {target: (load, file to break)}."""
    import mindone.diffusers as md
    import mindone.diffusers.models.model_loading_utils as df_loading
    import mindone.transformers as mt
    import mindone.transformers.modeling_utils as tf_utils
    import numpy as np
    import transformers as hf
    from safetensors.numpy import save_file

    qwen2 = hf.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    vae = dict(
        block_out_channels=[4, 8],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    with ms_loadpatch.disabled():
        model = mt.Qwen2ForCausalLM(qwen2)
        model.save_pretrained(os.path.join(root, "tf-single"))
        model.save_pretrained(os.path.join(root, "tf-sharded"), max_shard_size="40KB")
        md.AutoencoderKL(**vae).save_pretrained(os.path.join(root, "df-single"))
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "read"))
    one = {"weight": rng.standard_normal((3, 5)).astype(np.float32)}
    many = {
        f"layers.{i}.{kind}": rng.standard_normal(shape).astype(dtype)
        for i in range(MANY_TENSORS // 2)
        for kind, shape, dtype in (("weight", (2, 3), np.float32), ("bias", (3,), np.float16))
    }
    for name, tensors in (("1", one), ("10k", many)):
        save_file(tensors, os.path.join(root, "read", f"{name}.safetensors"), metadata={"format": "pt"})

    def shards(directory):
        return sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))

    targets = {}
    for name, cls in (
        ("tf-single", mt.Qwen2ForCausalLM),
        ("tf-sharded", mt.Qwen2ForCausalLM),
        ("df-single", md.AutoencoderKL),
    ):
        directory = os.path.join(root, name)
        targets[name] = (lambda path, cls=cls: cls.from_pretrained(path), directory, shards(directory)[-1])
    for size in ("1", "10k"):
        targets[f"tf-read-{size}"] = (tf_utils.load_state_dict, os.path.join(root, "read"), f"{size}.safetensors")
        targets[f"df-read-{size}"] = (df_loading.load_state_dict, os.path.join(root, "read"), f"{size}.safetensors")
    return targets


# -- mutations: (kind, a, b), a and b drawn integers


def _split(blob):
    if len(blob) < 8:
        return None
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        return None
    try:
        header = json.loads(blob[8 : 8 + length])
    except (ValueError, RecursionError):
        return None
    return (header, blob[8 + length :]) if isinstance(header, dict) else None


def _join(header_text: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header_text)) + header_text + data


def _last_entry(header):
    entries = [
        (v["data_offsets"][0], k)
        for k, v in header.items()
        if k != "__metadata__"
        and isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and v["data_offsets"]
        and isinstance(v["data_offsets"][0], int)
    ]
    return max(entries)[1] if entries else None


_DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "I8", "U8", "BOOL", "I16", "F8_E4M3", "F33", "", "f32"]


def _edit_entry(header, data, kind, a, b):
    """A JSON edit of the last tensor's entry; returns the new blob."""
    name = _last_entry(header)
    if name is None:
        return _join(json.dumps(header).encode(), data)
    entry = header[name]
    begin, end = entry["data_offsets"][0], entry["data_offsets"][-1]
    if kind == "offsets-shift":
        entry["data_offsets"] = [begin + (a % 9) - 4, end + (b % 9) - 4]
    elif kind == "offsets-overlap":
        entry["data_offsets"] = [max(0, begin - 1 - a % 16), end]
    elif kind == "offsets-descending":
        entry["data_offsets"] = [end, begin]
    elif kind == "offsets-out-of-range":
        entry["data_offsets"] = [begin, len(data) + 1 + a]
    elif kind == "offsets-wrong-type":
        entry["data_offsets"] = [[begin, end], f"{begin}", None, -begin, float(begin), 2**64 + begin][a % 6]
    elif kind == "dtype":
        entry["dtype"] = _DTYPES[a % len(_DTYPES)]
    elif kind == "shape":
        shape = list(entry["shape"])
        options = [
            shape[::-1],
            shape + [1],
            shape[:-1],
            [],
            [-1] + shape[1:],
            [0],
            [2**40],
            [2**62, 2**62],
            [s * 2 for s in shape],
            "3",
            None,
        ]
        entry["shape"] = options[a % len(options)]
    elif kind == "terabytes":  # offsets consistent with a shape a file this size cannot hold
        entry["shape"], entry["data_offsets"] = [2**38], [begin, begin + 4 * 2**38]
    elif kind == "extra-field":
        entry["x" * (1 + a % 3)] = b
    elif kind == "rename":  # valid file: a missing key and an unexpected one
        header[name + "_renamed"] = header.pop(name)
    elif kind == "duplicate-name":  # the same key twice in the JSON text, the second one wins for json.loads
        text = json.dumps(header)
        twin = json.dumps({name: dict(entry, data_offsets=[0, end - begin])})[1:-1]
        return _join(text[:-1].encode() + b", " + twin.encode() + b"}", data)
    elif kind == "non-utf8-name":
        text = json.dumps(header).encode()
        return _join(text.replace(json.dumps(name).encode(), b'"\xff\xfe' + name.encode()[1:] + b'"', 1), data)
    elif kind == "metadata":
        header["__metadata__"] = [{"format": "xx"}, {}, {"format": 1}, "pt", None, {"format": "np", "k": [1]}][a % 6]
    elif kind == "deep-json":
        nested = "[" * (a % 200_000 + 1) + "]" * (a % 200_000 + 1)
        text = json.dumps(header)
        return _join((text[:-1] + ', "deep": ' + nested + "}").encode(), data)
    elif kind == "huge-json":  # a valid header of some megabytes
        metadata = header.get("__metadata__")
        header["__metadata__"] = dict(
            metadata if isinstance(metadata, dict) else {"format": "pt"}, padding=" " * ((a % 8 + 1) << 20)
        )
    return _join(json.dumps(header).encode(), data)


HEADER_KINDS = [
    "offsets-shift",
    "offsets-overlap",
    "offsets-descending",
    "offsets-out-of-range",
    "offsets-wrong-type",
    "dtype",
    "shape",
    "terabytes",
    "extra-field",
    "rename",
    "duplicate-name",
    "non-utf8-name",
    "metadata",
    "deep-json",
    "huge-json",
]
BYTE_KINDS = ["truncate-tail", "flip-last-data", "flip-header", "length-field", "append"]
INDEX_KINDS = ["index-drop", "index-missing-file", "index-other-shard", "index-not-json"]


def mutate_file(blob: bytes, kind, a, b) -> bytes:
    split = _split(blob)
    if kind in HEADER_KINDS:
        if split is None:
            return blob
        try:
            return _edit_entry(split[0], split[1], kind, a, b)
        except (TypeError, KeyError, IndexError, ValueError):  # an entry an earlier mutation left odd
            return blob
    header_end = 8 + struct.unpack("<Q", blob[:8])[0] if len(blob) >= 8 else len(blob)
    if kind == "truncate-tail":
        return blob[: max(0, len(blob) - 1 - a % 64)]
    if kind == "flip-last-data":  # within the last tensor's bytes: a valid file, other values
        if split is None or (name := _last_entry(split[0])) is None:
            return blob
        begin, end = split[0][name]["data_offsets"][:2]
        if not isinstance(begin, int) or not isinstance(end, int) or end <= begin:
            return blob
        at = header_end + begin + a % (end - begin)
        return blob if at >= len(blob) else blob[:at] + bytes([blob[at] ^ (1 + b % 255)]) + blob[at + 1 :]
    if kind == "flip-header":
        at = 8 + a % max(1, header_end - 8)
        return blob if at >= len(blob) else blob[:at] + bytes([blob[at] ^ (1 + b % 255)]) + blob[at + 1 :]
    if kind == "length-field":
        values = [header_end - 8 + (a % 17) - 8, 2**64 - 1, 2**63, 0, len(blob), 100_000_001]
        return struct.pack("<Q", min(2**64 - 1, max(0, values[b % len(values)]))) + blob[8:]
    if kind == "append":
        return blob + bytes([b % 256]) * (1 + a % 9)
    raise AssertionError(kind)


def mutate_index(directory, kind, a):
    """Edit model.safetensors.index.json; returns the file an error must name."""
    path = os.path.join(directory, next(p for p in os.listdir(directory) if p.endswith(".index.json")))
    try:
        with open(path) as f:
            index = json.load(f)
    except ValueError:  # broken by an earlier mutation
        return path
    weight_map = index["weight_map"]
    names = sorted(weight_map)
    name = names[a % len(names)]
    shard_names = sorted(set(weight_map.values()))
    if kind == "index-drop":
        del weight_map[name]
    elif kind == "index-missing-file":
        weight_map[name] = "model-00009-of-00009.safetensors"
    elif kind == "index-other-shard":
        weight_map[name] = shard_names[(shard_names.index(weight_map[name]) + 1) % len(shard_names)]
    with open(path, "w") as f:
        f.write(json.dumps(index)[: -1 - a % 5] if kind == "index-not-json" else json.dumps(index))
    return os.path.join(directory, "model-00009-of-00009.safetensors") if kind == "index-missing-file" else path


# -- one case


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _library_refuses(path) -> bool:
    """Whether the safetensors library refuses the file: a bad file, not a valid one the model does not fit."""
    from safetensors import deserialize

    if not path.endswith(".safetensors"):
        return False
    try:
        with open(path, "rb") as f:
            deserialize(f.read())
    except Exception:  # noqa: BLE001 - SafetensorError, and whatever else it raises for bad input
        return True
    return False


def _index_lists_absent_tensor(directory) -> bool:
    """Whether the shard index lists a tensor its shard does not hold (read with the safetensors library)."""
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        held = {}
        for shard in set(weight_map.values()):
            with safe_open(os.path.join(directory, shard), framework="np") as f:
                held[shard] = set(f.keys())
    except Exception:  # noqa: BLE001 - no index, or one the library cannot read: not this case
        return False
    return any(name not in held[shard] for name, shard in weight_map.items())


def _outcome(call):
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return None, exc


def _snapshot(result):
    from ms_loadpatch.testing import snapshot

    if isinstance(result, dict):  # a load_state_dict: name -> (dtype, shape, bytes)
        return {name: (str(t.dtype), tuple(t.shape), t.asnumpy().tobytes()) for name, t in result.items()}
    return snapshot(result)


def _differences(expected, actual):
    from ms_loadpatch.testing import compare

    if isinstance(expected, dict) and "ties" not in expected:
        if expected.keys() != actual.keys():
            return [f"names differ: {sorted(expected.keys() ^ actual.keys())[:5]}"]
        return [
            f"{name}: {expected[name][:2]} != {actual[name][:2]} or bytes differ"
            for name in expected
            if expected[name] != actual[name]
        ][:5]
    return compare(expected, actual)


def run_case(targets, scratch, target, mutations):
    """Check the property for one case; returns ("loaded" | "refused", problems)."""
    load, source, victim = targets[target]
    directory = os.path.join(scratch, "case")
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(source, directory)
    broken = []  # files an error may be about: the broken shard, the index
    for kind, a, b in mutations:
        if kind in INDEX_KINDS:
            if target == "tf-sharded":
                broken.append(mutate_index(directory, kind, a))
            continue
        broken.append(os.path.join(directory, victim))
        with open(os.path.join(directory, victim), "rb") as f:
            blob = f.read()
        with open(os.path.join(directory, victim), "wb") as f:
            f.write(mutate_file(blob, kind, a, b))
    argument = directory if "-read-" not in target else os.path.join(directory, victim)
    size = os.path.getsize(os.path.join(directory, victim))

    start = global_random_state()
    with ms_loadpatch.disabled():
        reference, unpatched_error = _outcome(lambda: load(argument))
    expected = None if reference is None else _snapshot(reference)
    after_reference = global_random_state()
    del reference
    set_global_random_state(start)

    from ms_loadpatch import core

    threads = {t.ident for t in threading.enumerate()}
    states = {key: entry.state for key, entry in core._PATCHER._states.items()}
    reading = "-read-" in target
    if reading:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    try:
        result, patched_error = _outcome(lambda: load(argument))
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base if reading else 0
        tracemalloc.stop()
    problems, _notes = leftover_state(threads, states)
    from ms_loadpatch.strategy.safetensors_header import CheckpointError

    if peak > 2 * size + READ_ALLOWANCE:
        problems.append(f"the patched read allocated {peak} bytes for a file of {size}")
    if unpatched_error is None and patched_error is None:
        problems += _differences(expected, _snapshot(result))
        moved = random_state_difference(after_reference, global_random_state())
        if moved:
            problems.append(f"the patched load leaves {moved} elsewhere than the unpatched load")
    elif (
        unpatched_error is None and _index_lists_absent_tensor(directory) and isinstance(patched_error, CheckpointError)
    ):
        pass  # the documented extra refusal: unpatched mindone leaves such a weight random without a word
    elif unpatched_error is None:
        problems.append(
            f"the unpatched load succeeds, the patched one raises {type(patched_error).__name__}: {patched_error}"
        )
    elif patched_error is None:
        problems.append(
            f"the unpatched load raises {type(unpatched_error).__name__}: {unpatched_error}; "
            "the patched one returns a model"
        )
    else:
        if not isinstance(patched_error, type(unpatched_error)):
            problems.append(
                f"patched raises {type(patched_error).__name__}, not a {type(unpatched_error).__name__}: "
                f"{patched_error}"
            )
        if not any(path in str(patched_error) for path in broken):
            problems.append(
                f"the patched error names none of {broken}: {type(patched_error).__name__}: {patched_error}"
            )
        named = [path for path in broken if path in str(patched_error)]
        refused = any(os.path.exists(path) and _library_refuses(path) for path in named)
        if refused and not any(isinstance(e, CheckpointError) for e in _chain(patched_error)):
            problems.append(f"no CheckpointError among the causes of {type(patched_error).__name__}: {patched_error}")
    return ("loaded" if unpatched_error is None else "refused"), problems


# -- the campaign


def campaign(targets, scratch, cases, seed, timeout, log, counts):
    """Run `cases` cases; `counts` (a Counter) gets cases, outcomes, targets and failures."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    seconds = collections.Counter()
    file_mutation = st.tuples(
        st.sampled_from(HEADER_KINDS + BYTE_KINDS), st.integers(0, 1 << 20), st.integers(0, 1 << 16)
    )
    index_mutation = st.tuples(st.sampled_from(INDEX_KINDS), st.integers(0, 1 << 10), st.just(0))
    # per 100 cases: the full loads are slower, the 10,000-tensor reads slowest
    weights = {
        "tf-read-1": 25,
        "df-read-1": 25,
        "tf-single": 20,
        "df-single": 10,
        "tf-sharded": 18,
        "tf-read-10k": 1,
        "df-read-10k": 1,
    }
    picks = [target for target, weight in weights.items() for _ in range(weight)]

    @hypothesis_seed(seed)
    @settings(
        max_examples=cases,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )  # no shrinking: loads are slow
    @given(
        target=st.integers(0, len(picks) - 1).map(picks.__getitem__),
        mutations=st.lists(st.one_of(file_mutation, index_mutation), min_size=1, max_size=3),
    )
    def case(target, mutations):
        faulthandler.dump_traceback_later(timeout, exit=True)
        began = time.monotonic()
        try:
            outcome, problems = run_case(targets, scratch, target, mutations)
        finally:
            faulthandler.cancel_dump_traceback_later()
        seconds[target] += time.monotonic() - began
        counts["cases"] += 1
        counts[outcome] += 1
        counts[f"target:{target}"] += 1
        if counts["cases"] % 500 == 0:
            log(f"{counts['cases']} cases, {counts['refused']} refused")
        if problems:  # reported and counted; the campaign goes on, to find every kind of failure in one run
            counts["failures"] += 1
            print(f"FAILURE {target} {mutations}:\n  " + "\n  ".join(problems), flush=True)

    case()
    log("seconds per case: " + ", ".join(f"{t}: {seconds[t] / counts[f'target:{t}']:.3f}" for t in sorted(seconds)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases to run (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds one case may take before the run ends as a hang (default 120)",
    )
    args = parser.parse_args(argv)

    from ms_loadpatch.testing import cpu_kernel_fallbacks

    started = time.monotonic()
    counts, harness_error = collections.Counter(), None
    with tempfile.TemporaryDirectory(prefix="ms-loadpatch-fuzz-") as scratch, cpu_kernel_fallbacks():
        import mindone.diffusers.utils.logging as df_logging
        import transformers.utils.logging as tf_logging

        for logging_module in (df_logging, tf_logging):
            logging_module.set_verbosity_error()  # thousands of missing-key warnings
            logging_module.disable_progress_bar()
        targets = prepare(os.path.join(scratch, "checkpoints"))
        try:
            campaign(
                targets,
                scratch,
                args.cases,
                args.seed,
                args.timeout,
                lambda line: print(line, file=sys.stderr, flush=True),
                counts,
            )
        except Exception as exc:  # noqa: BLE001 - the harness's own bug ends the run
            harness_error = exc
            print(f"HARNESS ERROR {type(exc).__name__}: {exc}", flush=True)
    by_target = ",".join(f"{k.split(':', 1)[1]}:{n}" for k, n in sorted(counts.items()) if k.startswith("target:"))
    print(
        f"SUMMARY cases={counts['cases']} loaded={counts['loaded']} refused={counts['refused']} "
        f"failures={counts['failures']} targets={by_target or 'none'} "
        f"seconds={time.monotonic() - started:.1f}",
        flush=True,
    )
    return 1 if harness_error is not None or counts["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
