"""Tools for "patched equals unpatched" regression tests: snapshot a model,
compare two snapshots, load both ways, and route CPU-missing kernels."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np

from .core import disabled, enabled


@dataclasses.dataclass
class TensorRecord:
    kind: str  # "param" or "buffer"
    shape: tuple
    dtype: str
    bits: np.ndarray  # raw bytes as unsigned ints: bit-exact, NaN-safe comparison
    requires_grad: bool | None
    param_name: str | None
    # parameters only: whether copy.copy / deepcopy / Parameter.clone give its
    # values (they rebuild from a kept lazy initializer if there is one), and
    # whether it still holds that initializer (`init_mode`)
    copy_has_values: bool | None = None
    keeps_initializer: bool | None = None


_PARAM_ONLY_FIELDS = ("copy_has_values", "keeps_initializer")


def _bits(tensor) -> np.ndarray:
    array = np.ascontiguousarray(tensor.asnumpy())
    if array.dtype.itemsize in (1, 2, 4, 8):
        return array.view(f"u{array.dtype.itemsize}").copy()
    return array.copy()


def snapshot(model) -> dict:
    """Every parameter and buffer by structural name, with its bytes, plus
    which names share one Parameter object (tied weights) and the training mode."""
    records = {}
    owner_of = {}
    ties = {}
    for name, param in model.parameters_and_names(expand=True):
        bits = _bits(param)
        records[name] = TensorRecord(
            "param",
            tuple(param.shape),
            str(param.dtype),
            bits,
            bool(param.requires_grad),
            param.name,
            bool(np.array_equal(_bits(copy.copy(param)), bits)),
            getattr(param, "init_mode", None) is not None,
        )
    for prefix, cell in model.cells_and_names():
        for attr, param in cell._params.items():
            if param is None:
                continue
            key = f"{prefix}.{attr}" if prefix else attr
            first = owner_of.setdefault(id(param), key)
            if first != key:
                ties.setdefault(first, []).append(key)
    for name, buffer in model.named_buffers():
        records[name] = TensorRecord("buffer", tuple(buffer.shape), str(buffer.dtype), _bits(buffer), None, None)
    return {"tensors": records, "ties": {k: sorted(v) for k, v in ties.items()}, "training": bool(model.training)}


def compare(expected: dict, actual: dict, skip_values=()) -> list[str]:
    """Differences between two snapshots, as readable lines (empty when equal).
    `skip_values`: names whose values are not compared (randomly initialised ones)."""
    problems = []
    exp, act = expected["tensors"], actual["tensors"]
    for name in sorted(set(exp) - set(act)):
        problems.append(f"{name}: missing from the second model")
    for name in sorted(set(act) - set(exp)):
        problems.append(f"{name}: only in the second model")
    for name in sorted(set(exp) & set(act)):
        a, b = exp[name], act[name]
        for field in ("kind", "shape", "dtype", "requires_grad", "param_name", "copy_has_values", "keeps_initializer"):
            if field in _PARAM_ONLY_FIELDS and None in (getattr(a, field), getattr(b, field)):
                continue  # not recorded (a snapshot written before these fields)
            if getattr(a, field) != getattr(b, field):
                problems.append(f"{name}: {field} {getattr(a, field)!r} != {getattr(b, field)!r}")
        if name in skip_values or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if not np.array_equal(a.bits, b.bits):
            differing = int(np.count_nonzero(a.bits != b.bits))
            problems.append(f"{name}: values differ in {differing} of {a.bits.size} elements")
    if expected["ties"] != actual["ties"]:
        problems.append(f"tied parameters differ: {expected['ties']} != {actual['ties']}")
    if expected["training"] != actual["training"]:
        problems.append(f"training mode {expected['training']} != {actual['training']}")
    return problems


def load_both(load):
    """(unpatched result, patched result) of `load()`, called once each, in
    one process, each from the same global random state (numpy's, Python's
    `random` and mindspore's default generator): weights a checkpoint lacks
    get their initializers' draws. Raises AssertionError when the patched
    call leaves those generators elsewhere than the unpatched one did."""
    start = global_random_state()
    with disabled():
        reference = load()
    after_reference = global_random_state()
    set_global_random_state(start)
    with enabled():
        accelerated = load()
    problem = random_state_difference(after_reference, global_random_state())
    if problem:
        raise AssertionError(f"the patched load leaves {problem} elsewhere than the unpatched load")
    return reference, accelerated


def global_random_state():
    """numpy's, Python's and mindspore's default generator's states (None for
    mindspore's where it has no get_rng_state)."""
    import random

    import mindspore as ms
    import numpy as np

    generator = ms.get_rng_state().asnumpy().copy() if hasattr(ms, "get_rng_state") else None
    return np.random.get_state(), random.getstate(), generator


def set_global_random_state(state) -> None:
    """The generators back where global_random_state() found them."""
    import random

    import mindspore as ms
    import numpy as np

    np.random.set_state(state[0])
    random.setstate(state[1])
    if state[2] is not None:
        ms.set_rng_state(ms.Tensor(state[2]))


def random_state_difference(reference, accelerated) -> str | None:
    """Which generator two global_random_state() results disagree on, or None."""
    (ref_numpy, ref_python, ref_ms), (acc_numpy, acc_python, acc_ms) = reference, accelerated
    if ref_numpy[0] != acc_numpy[0] or not (ref_numpy[1] == acc_numpy[1]).all() or ref_numpy[2:] != acc_numpy[2:]:
        return "numpy's global RandomState"
    if ref_python != acc_python:
        return "Python's random"
    if ref_ms is not None and not (ref_ms == acc_ms).all():
        return "mindspore's default generator"
    return None


def assert_same_model(reference, accelerated, skip_values=()) -> None:
    problems = compare(snapshot(reference), snapshot(accelerated), skip_values)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(f"patched load differs from unpatched load:\n  {shown}{more}")


@contextlib.contextmanager
def cpu_kernel_fallbacks(in_place: bool = True):
    """mindspore's CPU wheel lacks some kernels mindone calls (`Arange` behind
    `mint.arange`, `InplaceNormal` behind `mint.randn`, `StackExt`, `Outer` and
    `OnesLikeExt` behind `mint.stack` / `outer` / `ones_like` while building models; `InplaceNormal`,
    `InplaceUniform`, `InplaceZero` and `InplaceFillScalar` behind `Tensor.normal_` / `uniform_` / `zero_` /
    `fill_` in the `_init_weights` of Qwen3-MoE, Qwen2-MoE, Gemma, NLLB-MoE and others;
    `RepeatInterleaveInt` / `RepeatInterleaveTensor` behind `Tensor.repeat_interleave` in the positional
    tables of CogVideoX and Wan; `Embedding` and `RmsNorm` in forward passes).
    Route them to equivalent ops for the duration; apply it to both sides of
    a comparison so they stay comparable. The random in-place kernels are
    replaced under `Tensor.normal_` / `uniform_`, which still take
    mindspore's generator step: their values come from that `(seed, offset)`
    alone, as the Ascend kernels' do. Writes into a view (`data[i].zero_()`)
    reach the viewed tensor. `in_place=False` routes only the kernels a
    build and a forward pass need, leaving the in-place ones to the wheel."""
    import mindspore as ms
    import wrapt
    from mindspore import mint, ops
    from mindspore.ops.auto_generate import gen_ops_def
    from mindspore.ops.function import array_func, random_func

    from .strategy.building.swaps import Swaps

    try:
        from mindspore.ops import tensor_method
    except ImportError:  # a mindspore whose tensor methods do not go through it
        tensor_method = None

    def arange(wrapped, instance, args, kwargs):
        return ops.arange(*args, **kwargs)

    def randn_kernel(wrapped, instance, args, kwargs):
        # the kernel behind mint.randn, after its generator step: values a function of (seed, offset) alone
        size, seed, offset = args[0], args[1], args[2]
        dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
        values = np.random.default_rng([int(seed), int(offset)]).standard_normal(tuple(size))
        return ms.Tensor(values.astype(np.float32), dtype=dtype or ms.float32)

    def stack_(wrapped, instance, args, kwargs):
        tensors = args[0] if args else kwargs["tensors"]
        return ops.stack(tensors, args[1] if len(args) > 1 else kwargs.get("dim", 0))

    def outer(wrapped, instance, args, kwargs):
        first, second = args[0], args[1]
        return first.reshape(-1, 1) * second.reshape(1, -1)

    def ones_like(wrapped, instance, args, kwargs):
        return ops.ones(tuple(args[0].shape), kwargs.get("dtype") or args[0].dtype)

    def repeat_interleave(wrapped, instance, args, kwargs):
        # RepeatInterleaveInt/Tensor through RepeatElements (Tile), which has no bf16 kernel: via float32, exact
        def kernel(input, repeats, dim=None, output_size=None):
            if isinstance(repeats, ms.Tensor):
                repeats = repeats.asnumpy().tolist()
            if dim is None:
                input, dim = input.reshape(-1), 0
            via = {ms.bfloat16: ms.float32, ms.bool_: ms.uint8}.get(input.dtype)
            out = array_func.repeat_interleave(input if via is None else input.astype(via), repeats, dim)
            out = out if via is None else out.astype(input.dtype)
            if output_size is not None and out.shape[dim] != output_size:
                raise ValueError(f"repeat_interleave: output_size {output_size}, got {out.shape[dim]}")
            return out

        return kernel(*args, **kwargs)

    def embedding(wrapped, instance, args, kwargs):
        input_ids, weight = args[0], args[1]
        return ops.gather(weight, input_ids, 0)

    def rms_norm(wrapped, instance, args, kwargs):
        x, gamma = args[0], args[1]
        epsilon = args[2] if len(args) > 2 else kwargs.get("epsilon", 1e-6)
        x32 = x.astype(ms.float32)
        rstd = ops.rsqrt((x32 * x32).mean(-1, keep_dims=True) + epsilon)
        return (x32 * rstd).astype(x.dtype) * gamma, rstd

    def inplace_normal(wrapped, instance, args, kwargs):
        # mindspore's kernel behind Tensor.normal_: its values a function of (seed, offset) alone
        target, mean, std, seed, offset = args
        rng = np.random.default_rng([int(seed), int(offset)])
        return _write_through(target, rng.standard_normal(tuple(target.shape)) * float(std) + float(mean))

    def inplace_uniform(wrapped, instance, args, kwargs):
        target, low, high, seed, offset = args
        rng = np.random.default_rng([int(seed), int(offset)])
        return _write_through(target, rng.uniform(float(low), float(high), tuple(target.shape)))

    def inplace_zero(wrapped, instance, args, kwargs):
        return _write_through(args[0], 0)

    def fill_(self, value):
        return _write_through(self, value.item() if isinstance(value, ms.Tensor) else value)

    with contextlib.ExitStack() as stack:
        stack.enter_context(wrapt.scoped_function_wrapper(mint, "arange", arange))
        stack.enter_context(wrapt.scoped_function_wrapper(random_func, "randn_", randn_kernel))
        stack.enter_context(wrapt.scoped_function_wrapper(mint, "stack", stack_))
        stack.enter_context(wrapt.scoped_function_wrapper(mint, "outer", outer))
        stack.enter_context(wrapt.scoped_function_wrapper(mint, "ones_like", ones_like))
        if hasattr(tensor_method, "repeat_interleave_ext"):  # where Tensor.repeat_interleave reaches the kernel
            stack.enter_context(
                wrapt.scoped_function_wrapper(tensor_method, "repeat_interleave_ext", repeat_interleave)
            )
        if in_place:
            stack.enter_context(wrapt.scoped_function_wrapper(random_func, "inplace_normal_", inplace_normal))
            stack.enter_context(wrapt.scoped_function_wrapper(random_func, "inplace_uniform_op", inplace_uniform))
            stack.enter_context(wrapt.scoped_function_wrapper(gen_ops_def, "inplace_zero_op", inplace_zero))
            stack.enter_context(Swaps([(ms.Tensor, "fill_", fill_)]))
        stack.enter_context(wrapt.scoped_function_wrapper(ops, "embedding", embedding))
        stack.enter_context(wrapt.scoped_function_wrapper(ops, "rms_norm", rms_norm))
        yield


def _write_through(target, values):
    """`values` (an array of target's shape, or a scalar) written into
    `target`, also where it is a view into another tensor; returns target."""
    import mindspore as ms

    try:
        view = target.untyped_storage().nbytes() != target.nbytes
    except RuntimeError:  # mindspore 2.7's CPU tensors have no storage object
        view = target.storage_offset() != 0
    if view:  # mindspore's copy_ does not write into a view on CPU; item assignment does
        target[...] = values if np.isscalar(values) else ms.Tensor(np.asarray(values, np.float32), target.dtype)
    else:
        full = np.full(tuple(target.shape), values, np.float32) if np.isscalar(values) else values
        target.copy_(ms.Tensor(np.asarray(full, np.float32)).astype(target.dtype))
    return target


def write_random_checkpoint(cls, config, directory, dtype="float32", max_shard_bytes=None, seed=0, std=0.02):
    """Write a checkpoint for `cls(config)` with random values, in the
    layout mindone's save_pretrained writes (model.safetensors, or shards
    plus model.safetensors.index.json), without initialising a model: the
    model is built lazily only to learn parameter names and shapes.
    Much faster than building and saving a large model for real. A
    mindone.diffusers class takes `config` as a dict (from_config) and gets
    its files named diffusion_pytorch_model*."""
    import json
    import os
    import sys

    from mindspore.nn.utils import no_init_parameters
    from safetensors.numpy import save_file

    from .strategy.safetensors_header import numpy_dtypes

    np_dtype = numpy_dtypes()[{"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]]
    # names and shapes only: mindone.transformers' init pass (in-place writes on lazy parameters) is skipped
    modeling_utils = sys.modules.get("mindone.transformers.modeling_utils")
    init_pass = getattr(modeling_utils, "_init_weights", None)
    try:
        if init_pass is not None:
            modeling_utils._init_weights = False
        with cpu_kernel_fallbacks(), no_init_parameters():
            model = cls.from_config(config) if isinstance(config, dict) else cls(config)
    finally:
        if init_pass is not None:
            modeling_utils._init_weights = init_pass
    os.makedirs(directory, exist_ok=True)
    (model.save_config if isinstance(config, dict) else config.save_pretrained)(directory)
    stem = "diffusion_pytorch_model" if isinstance(config, dict) else "model"
    shapes = {}
    for name, param in model.parameters_and_names():
        shapes[name] = tuple(param.shape)
    for name, _buffer in model.named_buffers():
        shapes.setdefault(name, None)  # buffers are rebuilt by the model; not saved here
    del model
    rng = np.random.default_rng(seed)
    shards, current, current_bytes = [], {}, 0
    for name, shape in shapes.items():
        if shape is None:
            continue
        size = int(np.prod(shape)) * np_dtype.itemsize
        if max_shard_bytes and current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np_dtype)
        current_bytes += size
    shards.append(current)
    metadata = {"format": "np"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, f"{stem}.safetensors"), metadata=metadata)
        return directory
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        file_name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file_name), metadata=metadata)
        for key, value in shard.items():
            weight_map[key] = file_name
            total += value.nbytes
    with open(os.path.join(directory, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return directory
