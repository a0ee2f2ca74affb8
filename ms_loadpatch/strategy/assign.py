"""Putting checkpoint tensors into a network: one dict lookup per key, a
shape check (set_data on a lazy parameter does not check), a cast only when
the dtype differs, and set_data, which on a lazy parameter takes the
tensor's storage without a copy and clears its lazy state."""

from __future__ import annotations

import math

import mindspore as ms
from mindspore import ops

from .tensors import cast, to_tensor


def check_and_pair(index: dict, state_dict, model_name: str):
    """(kind, object, tensor) for every index key present in `state_dict`, in
    the index's (traversal) order. Raises RuntimeError with the messages of
    mindspore's Cell.load_state_dict before anything is assigned."""
    pairs, errors = [], []
    for key, (kind, _cell, _attr, target) in index.items():
        value = state_dict.get(key)
        if value is None:
            continue
        if not isinstance(value, ms.Tensor):
            errors.append(
                f'While copying the parameter named "{key}", expected Tensor or Tensor-like object from '
                f"checkpoint but received {type(value)}"
            )
            continue
        if value.shape != target.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                f"the shape in current model is {target.shape}."
            )
            continue
        pairs.append((kind, target, value))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(model_name, "\n\t".join(errors)))
    return pairs


def fill(param, value) -> None:
    """param.set_data(value), leaving the parameter as Parameter.init_data
    does: a lazy parameter keeps its initializer in `init_mode` after
    set_data, and copy / deepcopy / Parameter.clone (ZeRO, EMA) rebuild a
    parameter from a kept initializer instead of its values."""
    param.set_data(value)
    drop_kept_initializer(param)


def drop_kept_initializer(param) -> None:
    """A filled parameter without the initializer set_data leaves in its
    `init_mode`, as Parameter.init_data leaves it."""
    if getattr(param, "init_mode", None) is not None and not param.has_init:
        param.init_mode = None


def assign(pairs, report, cast_at_read) -> None:
    """Assign checked pairs. `cast_at_read` (a castread.CastRegistry) lists the tensors cast while
    reading: one that fits its parameter's dtype is used as it is; any other
    gets the file's values back and goes the usual way."""
    for kind, target, value in pairs:
        origin = cast_at_read.pop(value)
        if origin is not None:
            # a buffer, or a module kept in another dtype, gets the file's values
            fits = kind == "param" and value.dtype == target.dtype
            value = tensor_to_assign(origin, value, fits, report)
            if fits:
                fill(target, value)
                report.tensors_assigned += 1
                continue
        if kind == "param":
            if value.dtype != target.dtype:
                value = cast(value, target.dtype)
                report.tensors_cast += 1
            fill(target, value)
        else:  # buffers: few, and copied exactly as Cell.load_state_dict does
            target.assign_value(ms.Tensor(value.asnumpy(), dtype=target.dtype))
        report.tensors_assigned += 1


def tensor_to_assign(origin, value, keep: bool, report):
    """For `value`, cast while reading (castread.CastAtRead `origin`): itself
    when `keep` (that cast is the one the unpatched load makes; counted as a
    cast made while reading), else the file's values, read again (counted)."""
    if keep:
        report.tensors_cast += 1
        report.tensors_cast_while_reading += 1
        return value
    value = to_tensor(origin.original())
    report.tensors_read_again += 1
    return value


def cast_parameters(cell, dtype) -> int:
    """In place; parameters already in `dtype` are skipped. On a lazy
    parameter set_dtype only changes metadata: it is later filled in `dtype`."""
    count = 0
    for param in cell.get_parameters():
        if param.dtype != dtype:
            param.set_dtype(dtype)
            count += 1
    return count


def cell_to_keeping_lazy(cell, dtype, skip_untouched: bool = True):
    """`cell.to(dtype)` as mindspore's nn.Cell.to does it (its own
    `_apply` walk: floating parameters and buffers cast, `param.data = ...`,
    buffers replaced), except that a lazily built parameter is not read
    (Tensor.to segfaults on one): it only gets the dtype, metadata only, and
    stays lazy; `param.data = param` leaves it as it is. With
    `skip_untouched`, a cell whose pass changes nothing (no buffers, only lazy
    parameters already in `dtype` or not floating: the usual state right after
    a lazy build) is not passed over; the others get `_apply` in its own order.
    Checked against nn.Cell.to, and the skip against the full walk, by
    api_probes._probe_cell_to."""
    from mindspore.common import dtype as mstype

    floating = tuple(mstype.float_type) + tuple(mstype.complex_type)

    def target_of(tensor):  # Cell.to casts floating tensors only
        return dtype if tensor.dtype in floating else None

    def convert(tensor):
        target = target_of(tensor)
        if isinstance(tensor, ms.Parameter) and tensor.has_init:
            if target is not None and tensor.dtype != target:
                tensor.set_dtype(target)
            return tensor
        return tensor.to(device=None, dtype=target, non_blocking=False)

    if not skip_untouched:
        return cell._apply(convert)
    plain_apply = ms.nn.Cell._apply

    def untouched(one):
        if one._buffers:
            return False
        for param in one._params.values():
            if param is None:
                continue
            target = target_of(param)
            if not param.has_init or (target is not None and target != param.dtype):
                return False  # not lazy, or convert would cast it
        return True

    def apply(one):
        if getattr(type(one), "_apply", None) is not plain_apply:
            one._apply(convert)  # a class with its own walk keeps it
            return
        for child in one.cells():  # Cell._apply's order: the children, then the cell's own
            if child is not None and child is not one:
                apply(child)
        if not untouched(one):
            one._apply(convert, recurse=False)

    apply(cell)
    return cell


# -- diffusers: parameters by name, in the final dtype

# Casts whose first step loses nothing: casting straight to the final dtype
# gives what mindone's two steps (checkpoint -> construction dtype -> final) give.
# For fp16 and bf16 checkpoints this was checked value by value (versions.py).
EXACT_WIDENING = {
    (ms.float16, ms.float32),
    (ms.bfloat16, ms.float32),
    (ms.float16, ms.float64),
    (ms.bfloat16, ms.float64),
    (ms.float32, ms.float64),
    (ms.int8, ms.int16),
    (ms.int8, ms.int32),
    (ms.int8, ms.int64),
    (ms.int16, ms.int32),
    (ms.int16, ms.int64),
    (ms.int32, ms.int64),
}


def parameter_index(model):
    """name -> (parameter, construction dtype), or None when some parameter's
    name is not its structural name (mindone's loader matches by `param.name`,
    its cast by structural name: then only mindone's loader is faithful)."""
    index = {}
    for key, param in model.parameters_and_names():
        if param.name != key or key in index:
            return None
        index[key] = (param, param.dtype)
    return index


def _taken_with_its_own_shape(shape, target) -> bool:
    """Whether load_param_into_net takes a `shape` tensor for a `target`
    parameter: more dimensions, the extra trailing ones all 1. mindspore's
    _special_process_par sets the values reshaped, then _update_param goes on
    to set_data the tensor as it is, so the parameter ends with the file's
    shape. Raises numpy's ValueError where that reshape fails."""
    shape, target = tuple(shape), tuple(target)
    if len(shape) <= len(target) or any(d != 1 for d in shape[len(target) :]):
        return False
    if math.prod(shape) != math.prod(target):
        raise ValueError(
            f"cannot reshape array of size {math.prod(shape)} into shape ({','.join(map(str, target))})"
        )  # numpy's words
    return True


def assign_in_final_dtype(index, state_dict, dtype, keep_in_fp32_modules, report, registry) -> None:
    """What mindone diffusers' _load_state_dict_into_model + load_param_into_net +
    model.to(dtype) leave in each parameter of `index` (parameter_index), with
    one cast at most. `registry` (a castread.CastRegistry) lists the tensors
    cast while reading."""
    for key, value in state_dict.items():
        entry = index.get(key)
        if entry is None:  # unexpected key: mindone's loader ignores it too
            continue
        param, construction_dtype = entry
        origin = registry.pop(value)
        if value.shape != param.shape and not _taken_with_its_own_shape(value.shape, param.shape):
            raise RuntimeError(
                f"For 'load_param_into_net', {key} in the argument 'net' should have the same shape "
                f"as {key} in the argument 'parameter_dict'. But got its shape {param.shape} in"
                f" the argument 'net' and shape {value.shape} in the argument 'parameter_dict'."
                f"May you need to check whether the checkpoint you loaded is correct or the batch size and "
                f"so on in the 'net' and 'parameter_dict' are same."
            )
        # mindone first casts to the parameter's dtype (fp32 for keep-in-fp32 keys)
        loaded_dtype = construction_dtype
        if keep_in_fp32_modules and ops.is_floating_point(value):
            if any(module in key.split(".") for module in keep_in_fp32_modules):
                loaded_dtype = ms.float32
        final = dtype if dtype is not None else loaded_dtype
        cast_while_reading = False
        if origin is not None:
            source = origin.source_dtype()
            # unpatched: file -> loaded_dtype -> final; one cast file -> final when either step is no step
            one_step = source == loaded_dtype or (source, loaded_dtype) in EXACT_WIDENING or loaded_dtype == final
            cast_while_reading = one_step and value.dtype == final
            value = tensor_to_assign(origin, value, cast_while_reading, report)
        if not cast_while_reading:
            if value.dtype != loaded_dtype and (value.dtype, loaded_dtype) not in EXACT_WIDENING:
                value = cast(value, loaded_dtype)  # a lossy first step must be reproduced
                report.tensors_cast += 1
            if value.dtype != final:
                value = cast(value, final)
                report.tensors_cast += 1
        if param.dtype != final:
            param.set_dtype(final)  # lazy: metadata only; otherwise a cast set_data then overwrites
        param.set_data(value)  # not assign.fill: mindone's diffusers load keeps the initializer (init_mode) too
        report.tensors_assigned += 1
