"""The API-level probes: whether the installed mindspore has what every
load needs (`set_data`, `init_data`, `set_dtype`, `from_numpy`, bf16 arrays,
`no_init_parameters`), and whether what the strategy does with it gives
mindspore's own result (filling a lazy parameter, `nn.Cell.to` on a lazily
built model). Run once per process by `api_verdict.api_verdict()`, which turns
their findings into the technique rows and the per-library gate.
"""

from __future__ import annotations

from . import versions
from .strategy.verdict import Problem

# mindone's ModuleUtilsMixin methods that targets.py patches; PreTrainedModel
# lists nn.Cell first among its bases, so a Cell method of the same name wins.
# Only `to` (mindspore 2.10+) has a wrapper of its own (glue.transformers.cell_to).
_MIXIN_METHODS = ("to", "half", "float")


def _probe_bfloat16(ms) -> str | None:
    """None when a numpy array of np_dtype.bfloat16 becomes a BFloat16 tensor."""
    try:
        import numpy as np
        from mindspore.common import np_dtype

        bf16 = np_dtype.bfloat16
        if hasattr(np_dtype, "np_dtype_valid") and not np_dtype.np_dtype_valid(False):
            return "lacks a usable mindspore.common.np_dtype.bfloat16"
        tensor = ms.Tensor.from_numpy(np.zeros(2, dtype=bf16))
        if tensor.dtype != ms.bfloat16:
            return f"Tensor.from_numpy(np_dtype.bfloat16 array) gives {tensor.dtype}, not BFloat16"
    except Exception as exc:  # ImportError, AttributeError, a refused dtype...
        return f"lacks mindspore.common.np_dtype.bfloat16 with Tensor.from_numpy ({type(exc).__name__}: {exc})"
    return None


def _probe_cell_to(ms) -> str | None:
    """None when strategy.assign.cell_to_keeping_lazy gives what nn.Cell.to
    gives: on a cell tree with float and int parameters and buffers (one of
    them shared), every dtype, value and Parameter object the same, and a lazy
    parameter left lazy in the new dtype (nn.Cell.to itself would read it)."""
    try:
        import numpy as np
        from mindspore.common.initializer import initializer

        from .strategy.assign import cell_to_keeping_lazy
        from .strategy.building.lazy import unshared_lazy_parameter

        def build(lazy):
            shared = ms.Parameter(ms.Tensor(np.linspace(-1, 1, 4).astype(np.float32)), name="shared")
            cells = []
            for index in range(2):
                cell = ms.nn.Cell()
                cell.shared = shared
                cell.count = ms.Parameter(
                    ms.Tensor(np.arange(3, dtype=np.int32)), name=f"count{index}", requires_grad=False
                )
                cell.register_buffer("scale", ms.Tensor(np.full(2, 1 / 3, dtype=np.float32)))
                cell.register_buffer("steps", ms.Tensor(np.arange(2, dtype=np.int64)))
                cells.append(cell)
            root = ms.nn.SequentialCell(cells)
            if lazy:
                root.lazy = unshared_lazy_parameter(initializer("normal", (3, 2), ms.float32), "lazy")
            return root

        def state(root):
            out = {}
            for prefix, cell in root.cells_and_names():
                for attr, param in cell._params.items():
                    out[f"{prefix}.{attr}"] = (
                        id(param),
                        str(param.dtype),
                        bool(param.has_init),
                        None if param.has_init else param.astype(ms.float32).asnumpy().tolist(),
                    )
                for attr, buffer in cell._buffers.items():
                    out[f"{prefix}.{attr}"] = (str(buffer.dtype), buffer.astype(ms.float32).asnumpy().tolist())
            return out

        expected_root, actual_root = build(lazy=False), build(lazy=True)
        ids_before = {k: v[0] for k, v in state(actual_root).items() if len(v) == 4}
        expected_root.to(ms.bfloat16)
        cell_to_keeping_lazy(actual_root, ms.bfloat16)
        expected, actual = state(expected_root), state(actual_root)
        lazy = actual.pop(".lazy")
        if lazy[1:3] != (str(ms.bfloat16), True):
            return f"a lazy parameter came out as {lazy[1:3]}, not lazy BFloat16"
        for key in expected:
            if key not in actual:
                return f"{key} is missing after the cast"
            want, got = expected[key], actual[key]
            if len(want) == 4:  # parameter: the same object keeps its place
                if got[0] != ids_before[key]:
                    return f"{key} was replaced by another Parameter object"
                want, got = want[1:], got[1:]
            if want != got:
                return f"{key}: nn.Cell.to gives {want}, the fast path {got}"
        return _probe_cell_to_skip(ms, cell_to_keeping_lazy)
    except Exception as exc:  # an internal the wrapper uses changed
        return f"{type(exc).__name__}: {exc}"
    return None


def _probe_cell_to_skip(ms, cell_to_keeping_lazy) -> str | None:
    """None when cell_to_keeping_lazy, skipping the cells its pass leaves
    untouched (lazy parameters already in the dtype, or not floating, and no
    buffers), leaves a lazily built tree as the full `_apply` walk does:
    every cell's and parameter's whole state (building.state.model_state)."""
    import numpy as np
    from mindspore.common.initializer import initializer

    from .strategy.building.lazy import unshared_lazy_parameter
    from .strategy.building.state import model_state

    def build():
        done = ms.nn.Cell()
        done.weight = unshared_lazy_parameter(initializer("normal", (3, 2), ms.bfloat16), "weight")
        done.index = unshared_lazy_parameter(initializer("zeros", (2,), ms.int32), "index", requires_grad=False)
        wide = ms.nn.Cell()
        wide.weight = unshared_lazy_parameter(initializer("normal", (2, 2), ms.float32), "weight")
        buffered = ms.nn.Cell()
        buffered.bias = unshared_lazy_parameter(initializer("zeros", (2,), ms.bfloat16), "bias")
        buffered.register_buffer("scale", ms.Tensor(np.full(2, 1 / 3, dtype=np.float32)))
        return ms.nn.SequentialCell([done, wide, buffered, ms.nn.SequentialCell([done])])

    full, skipping = build(), build()
    cell_to_keeping_lazy(full, ms.bfloat16, skip_untouched=False)
    cell_to_keeping_lazy(skipping, ms.bfloat16)
    if model_state(full) != model_state(skipping):
        return "skipping untouched cells leaves a lazily built tree unlike the full walk"
    return None


def _probe_fill(ms) -> str | None:
    """None when strategy.assign.fill leaves a lazy parameter as mindone's
    transformers load does (Parameter.init_data, then set_data): holding the
    value, no initializer kept, and copy / deepcopy / clone giving the value."""
    try:
        import copy

        import numpy as np
        from mindspore.common.initializer import initializer

        from .strategy.assign import fill
        from .strategy.building.lazy import unshared_lazy_parameter

        value = np.arange(6, dtype=np.float32).reshape(2, 3)

        def lazy():
            return unshared_lazy_parameter(initializer("normal", (2, 3), ms.float32), "probe")

        real = lazy().init_data()
        real.set_data(ms.Tensor(value))
        fast = lazy()
        fill(fast, ms.Tensor(value))
        for side, param in (("mindspore's path", real), ("the fast path", fast)):
            if param.has_init or not np.array_equal(param.asnumpy(), value):
                return f"a parameter filled by {side} does not hold the value"
            for how, make in (("copy", copy.copy), ("deepcopy", copy.deepcopy), ("clone", lambda p: p.clone())):
                if not np.array_equal(make(param).asnumpy(), value):
                    return f"{how} of a parameter filled by {side} does not have its value"
        if (real.init_mode is None) != (fast.init_mode is None):
            return "the fast path keeps a different initializer state than Parameter.init_data"
    except Exception as exc:  # an internal it relies on changed
        return f"{type(exc).__name__}: {exc}"
    return None


def probe_adoption(ms) -> str | None:
    """None when strategy.tensors.adopted_parameter gives a Parameter over the
    array's own buffer whose state and values are those Parameter(array)
    gives (Parameter(array) copies the buffer)."""
    try:
        import numpy as np

        from .strategy.tensors import adopted_parameter

        for array in (np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.float16)):
            real = ms.Parameter(array.copy(), name="probe")
            fast = adopted_parameter(array, "probe")
            if (
                type(fast) is not type(real)
                or fast.has_init
                or not np.array_equal(fast.asnumpy(), array)
                or fast.dtype != real.dtype
            ):
                return "the Parameter does not hold the array's values"
            array[0] = 7  # shared, seen through the Parameter (data_ptr() is 0 for a host tensor on some versions)
            if fast.asnumpy().reshape(-1)[0] != 7:
                return "the Parameter does not hold the array's buffer"
            ours, theirs = ({k: str(v) for k, v in vars(p).items() if k != "_param_info"} for p in (fast, real))
            if ours != theirs:
                return f"its attributes differ from Parameter(array)'s: {sorted(ours.items() ^ theirs.items())}"
            for attribute in ("name", "requires_grad", "sliced", "init", "init_flag", "layerwise_parallel"):
                if getattr(fast, attribute) != getattr(real, attribute):
                    return f"its {attribute} differs from Parameter(array)'s"
    except Exception as exc:  # an internal it relies on changed
        return f"{type(exc).__name__}: {exc}"
    return None


def probe_lazy_assign(ms) -> str | None:
    """None when strategy.building.lazy_writes' copy (set_data of a copy of
    the value on a lazy parameter, then construction.settle_filled) leaves
    the parameter as assign_value leaves a plain one, the value unshared."""
    try:
        import numpy as np
        from mindspore.common.initializer import initializer

        from .strategy.building.construction import settle_filled
        from .strategy.building.lazy import unshared_lazy_parameter
        from .strategy.building.lazy_writes import taken_as_copy

        for shape, dtype in (((2, 3), ms.float32), ((4,), ms.float16)):
            value = ms.Tensor(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape), dtype=dtype)
            real = ms.Parameter(initializer("normal", shape, dtype), name="probe")
            real.assign_value(value)
            fast = unshared_lazy_parameter(initializer("normal", shape, dtype), name="probe")
            if not fast.has_init or not taken_as_copy(fast, value):
                return "a lazy parameter does not take the copy"
            settle_filled(fast)
            if (
                fast.has_init
                or fast.dtype != real.dtype
                or fast.shape != real.shape
                or not np.array_equal(fast.asnumpy(), real.asnumpy())
            ):
                return "the parameter does not hold the value as assign_value leaves it"
            value.assign_value(ms.Tensor(np.zeros(shape, dtype=np.float32), dtype=dtype))
            if not np.array_equal(fast.asnumpy(), real.asnumpy()):
                return "the parameter shares the value's storage"
            ours, theirs = ({k: str(v) for k, v in vars(p).items() if k != "_param_info"} for p in (fast, real))
            if ours != theirs:
                return f"its attributes differ from assign_value's: {sorted(ours.items() ^ theirs.items())}"
            for attribute in (
                "name",
                "requires_grad",
                "sliced",
                "init",
                "init_flag",
                "layerwise_parallel",
                "init_mode",
            ):
                if getattr(fast, attribute) != getattr(real, attribute):
                    return f"its {attribute} differs from assign_value's"
    except Exception as exc:  # an internal it relies on changed
        return f"{type(exc).__name__}: {exc}"
    return None


def _probe_draws() -> str | None:
    """None when lazy parameters that take their draws when made
    (strategy/building/draws.py) leave numpy's global state and, filled, the
    values of a plain build, for mindspore's initializer classes."""
    from .strategy.building import draws

    return draws.probe()


# the techniques a Problem of probe() names
LAZY_FILL, RANDOM_DRAWS, CELL_TO, MIXIN_METHODS = "lazy-fill", "random-draws", "cell-to-keeping-lazy", "mixin-methods"
# ... the API every technique needs (a Problem of it skips every library), and two probed for the calls that build
# then fill (a Problem of either gates no library: those calls copy instead)
FAST_PATH, ADOPTED_PARAMETERS, LAZY_ASSIGN = "fast-path", "adopted-parameters", "lazy-assign"


def probe(ms) -> tuple[tuple[Problem, ...], tuple[Problem, ...], dict]:
    """(why `ms` cannot take the fast path at all, the Problems that skip one
    library's or one technique's fast path, optional features present); empty when it can."""
    problems = []
    lacking = [
        (owner, attribute)
        for owner, attribute in (
            ("Parameter", "set_data"),
            ("Parameter", "init_data"),
            ("Tensor", "set_dtype"),
            ("Tensor", "from_numpy"),
        )
        if not callable(getattr(getattr(ms, owner, None), attribute, None))
    ]
    problems += [f"lacks {owner}.{attribute}" for owner, attribute in lacking]
    try:
        from mindspore.nn import utils as nn_utils

        if not callable(getattr(nn_utils, "no_init_parameters", None)):
            problems.append("lacks mindspore.nn.utils.no_init_parameters")
    except ImportError:
        problems.append("lacks mindspore.nn.utils.no_init_parameters")
    if ("Tensor", "from_numpy") not in lacking:
        bf16 = _probe_bfloat16(ms)
        if bf16 is not None:
            problems.append(bf16)
    library_problems = []
    if not problems:
        failed = _probe_fill(ms)
        if failed is not None:
            library_problems.append(
                Problem(LAZY_FILL, ("transformers",), f"filling a lazy parameter: its probe failed ({failed})")
            )
        failed = _probe_draws()
        if failed is not None:
            library_problems.append(
                Problem(
                    RANDOM_DRAWS,
                    ("transformers",),
                    "taking the random draws of lazy parameters (the unpatched build runs "
                    f"every initializer): its probe failed ({failed})",
                )
            )
    cell = getattr(getattr(ms, "nn", None), "Cell", None)
    features = {"cell_to": cell is not None and "to" in vars(cell)}
    for name in _MIXIN_METHODS:
        if cell is None or name not in vars(cell):
            continue
        if name == "to" and not problems:
            failed = _probe_cell_to(ms)
            if failed is None:
                continue
            problem = Problem(
                CELL_TO,
                ("transformers",),
                f"nn.Cell.to shadows mindone's ModuleUtilsMixin.to and its probe failed ({failed})",
            )
        else:
            problem = Problem(
                MIXIN_METHODS,
                ("transformers",),
                f"nn.Cell.{name} shadows mindone's ModuleUtilsMixin.{name}, which the fast path patches",
            )
        library_problems.append(problem)
    everywhere = tuple(Problem(FAST_PATH, versions.LIBRARIES, reason) for reason in problems)
    if not problems:
        failed = probe_adoption(ms)
        if failed is not None:
            library_problems.append(Problem(ADOPTED_PARAMETERS, (), failed))
        failed = probe_lazy_assign(ms)
        if failed is not None:
            library_problems.append(Problem(LAZY_ASSIGN, (), failed))
    return everywhere, tuple(library_problems), features
