"""A model's whole state in comparable form: what the probes and the
identity tests compare between a plain build and a fast one."""

from __future__ import annotations

from .cell_init_template import CellInitTemplate

PER_INSTANCE_TIME = CellInitTemplate.PER_INSTANCE_TIME


_SCALARS = (type(None), bool, int, float, str, bytes)
_mindspore_types = None  # (Cell, Parameter, Tensor, Primitive), resolved on first use
# What comparable() does with a value, by its type (the isinstance chain is
# the same for every value of a type; a probe renders some 30k values).
_SCALAR, _CLASS, _CELL, _PARAMETER, _TENSOR, _PRIMITIVE, _DICT, _SEQUENCE, _SET, _OTHER = range(10)
_kinds: dict[type, int] = {}


def _types():
    global _mindspore_types
    if _mindspore_types is None:
        import mindspore as ms
        from mindspore import nn
        from mindspore.ops.primitive import Primitive

        _mindspore_types = (nn.Cell, ms.Parameter, ms.Tensor, Primitive)
    return _mindspore_types


def _kind_of(kind: type) -> int:
    cell_type, parameter_type, tensor_type, primitive_type = _mindspore_types or _types()
    kinds = (
        (_SCALARS, _SCALAR),
        (type, _CLASS),
        (cell_type, _CELL),
        (parameter_type, _PARAMETER),
        (tensor_type, _TENSOR),
        (primitive_type, _PRIMITIVE),
        (dict, _DICT),
        ((list, tuple), _SEQUENCE),
        ((set, frozenset), _SET),
    )
    for base, code in kinds:  # noqa: B007 - `code` is read after the break
        if issubclass(kind, base):
            break
    else:
        code = _OTHER
    _kinds[kind] = code
    return code


def comparable(value, ids: dict, depth=0):
    """A comparable rendering of `value`: objects by structure, identity kept as first-seen order."""
    if depth > 12:
        return ("deep", type(value).__name__)
    kind = _kinds.get(type(value))
    if kind is None:
        kind = _kind_of(type(value))
    if kind == _SCALAR:
        return value
    if kind == _CLASS:
        return ("class", value.__module__, value.__qualname__)
    key = id(value)
    if key in ids:
        return ("same-as", ids[key][0])
    ids[key] = (len(ids), value)  # the object is kept: its id cannot be reused while ids lives
    depth += 1
    if kind == _DICT:
        return (type(value).__name__, [(k, comparable(v, ids, depth)) for k, v in value.items()])
    if kind == _SEQUENCE:
        return (type(value).__name__, [comparable(v, ids, depth) for v in value])
    if kind == _CELL:
        return ("cell", ids[key][0])  # cells are compared one by one
    if kind == _PARAMETER:
        init_mode = value.init_mode
        return (
            "param",
            type(value).__name__,
            value.name,
            tuple(value.shape),
            str(value.dtype),
            value.requires_grad,
            value.has_init,
            value.layerwise_parallel,
            value.parallel_optimizer,
            value.is_init,
            value.init_flag,
            value.requires_aggr,
            value.sliced,
            comparable(getattr(init_mode, "init", None), ids, depth) if init_mode is not None else None,
            comparable(vars(value), ids, depth),
        )
    if kind == _TENSOR:
        if value.has_init:
            return ("lazy-tensor", tuple(value.shape), str(value.dtype), comparable(value.init, ids, depth))
        return (
            "tensor",
            type(value).__qualname__,
            tuple(value.shape),
            str(value.dtype),
            str(getattr(value, "device", None)),
            value.asnumpy().tobytes(),
        )
    if kind == _PRIMITIVE:
        attributes = getattr(value, "get_attr_dict", None)  # the C++ side's attributes (add_prim_attr)
        return (
            "primitive",
            type(value).__qualname__,
            value.name,
            comparable(vars(value), ids, depth),
            comparable(attributes(), {}, depth) if callable(attributes) else None,
        )
    if kind == _SET:
        return (type(value).__name__, sorted(repr(comparable(v, ids, depth)) for v in value))
    if hasattr(value, "__dict__"):
        return ("object", type(value).__module__, type(value).__qualname__, comparable(vars(value), ids, depth))
    text = repr(value)
    if " at 0x" in text:  # an opaque object (e.g. a C++ ParamInfo): its content is compared through its owner
        return ("opaque", type(value).__qualname__)
    return ("repr", type(value).__qualname__, text)


def _cells_and_names(model) -> list:
    """model.cells_and_names() as a list, with the children it passes over
    for being falsy (an empty CellList) too: their state is compared as well."""
    out, seen = [], set()
    stack = [("", model)]
    while stack:
        name, cell = stack.pop()
        if id(cell) in seen:
            continue
        seen.add(id(cell))
        out.append((name, cell))
        children = [
            (f"{name}.{key}" if name else key, child) for key, child in cell._cells.items() if child is not None
        ]
        stack += reversed(children)
    return out


def model_state(model, skip=(PER_INSTANCE_TIME,)) -> list:
    """Every cell (preorder, shared ones once): name, class, flags, `__dict__`
    keys in order and values (cells by position, parameters and primitives by
    content); `skip`: documented per-instance values."""
    ids: dict = {}
    cells = _cells_and_names(model)
    for position, (_, cell) in enumerate(cells):
        ids[id(cell)] = (position, cell)
    out = []
    for name, cell in cells:
        state = [(k, "<per-instance>" if k in skip else comparable(v, ids)) for k, v in vars(cell).items()]
        mixed = getattr(cell, "get_mixed_precision_type", None)  # C++ side of the cell (flags live in __dict__)
        out.append(
            (
                name,
                type(cell).__qualname__,
                cell.cls_name,
                cell._cell_tag,
                repr(mixed()) if callable(mixed) else None,
                state,
            )
        )
    params = [(n, comparable(p, {})) for n, p in model.parameters_and_names()]
    return [out, params]


def first_difference(a, b, path="") -> str:
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                label = x[0] if isinstance(x, tuple) and x and isinstance(x[0], str) else i
                return first_difference(x, y, f"{path}/{label}")
    return f"{path}: {a!r:.200} != {b!r:.200}"
