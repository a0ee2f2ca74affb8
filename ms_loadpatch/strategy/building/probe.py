"""The probe: a small model built plain and with techniques, whole states compared.

Runs once per process on the installed mindspore (all techniques together
first; only if that differs, each alone to find which; a technique with a
probe model of its own, alone on that one). Compared: every
cell's class, `__dict__` keys in order and values, parameter metadata,
primitive attributes, global registries, compile-cache entries, and the
output of a forward pass. Legitimately per instance: `Cell._create_time`
(a clock reading) and object ids.
"""

from __future__ import annotations

import contextlib
import copy

from . import draws, window
from .lazy import lazy_parameters
from .state import first_difference, model_state
from .technique import ProbeFailed


def _probe_model():
    """A small model touching what the techniques change: mindspore layers
    with primitives (built with arguments, and without: their defaults) and
    initializers, containers, nested cells with parameters, a tied
    parameter, a cell without auto_prefix, a Parameter from a tensor, a
    buffer, a cell with bprop, a child replaced later, cells built again
    with the same arguments that keep the config they were given or a copy
    of their own, and hold a tensor computed in `__init__`."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, mint, nn, ops
    from mindspore.common.initializer import initializer

    class Leaf(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(4, 3)
            self.linear = mint.nn.Linear(3, 5, bias=False)
            self.norm = nn.LayerNorm((5,))
            self.scale = Parameter(ops.ones(5), name="scale")
            self.gain = Parameter(initializer("normal", [5]), name="gain", requires_grad=False)
            self.act = nn.GELU()
            self.matmul = ops.MatMul(transpose_b=True)
            self.grid = ops.AffineGrid()  # built without arguments: its default becomes a C++ attribute

        def construct(self, x):
            return self.norm(self.linear(self.dense(x))) * self.scale

    class WithBprop(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.inner = nn.Dense(3, 3, has_bias=False)

        def construct(self, x):
            return self.inner(x)

        def bprop(self, x, out, dout):
            return (dout,)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 4)
            self.blocks = nn.CellList([Leaf() for _ in range(2)])
            self.seq = nn.SequentialCell([nn.Dense(5, 5), nn.ReLU(), Leaf().dense])
            self.unprefixed = WithBprop()
            self.head = nn.Dense(4, 16, has_bias=False)
            self.head.weight = self.embed.embedding_table  # tied
            self.conv = nn.Conv2d(2, 2, 3)
            self.register_buffer("positions", ms.Tensor([1, 2, 3], ms.int32))
            self.replaced = nn.Dense(2, 2)
            self.replaced = nn.Dense(2, 3)
            self.inner_list = nn.CellList()
            self.inner_list.append(Leaf())
            self.tail = _LateParam()
            settings = Settings()
            # a class's first build is its own, its second is noted, the next two teach the recipe, then copies
            self.experts = nn.CellList([Expert(settings) for _ in range(6)] + [Expert(settings, scale=1)])
            self.own_copies = nn.CellList([OwnCopy(settings) for _ in range(5)])

        def construct(self, x):
            return x

    class Settings:  # a config object, as transformers passes to every layer
        def __init__(self):
            self.width, self.act = 3, "gelu"
            self.sizes = [3, 5]

    class Expert(nn.Cell):  # built several times with the same arguments, keeps the config: copied, sharing it
        def __init__(self, settings, scale=2):
            super().__init__()
            self.settings = settings
            self.width = settings.width * scale
            self.up = mint.nn.Linear(settings.width, self.width, bias=False)
            self.down = nn.Dense(self.width, settings.width)
            self.act = nn.GELU() if settings.act == "gelu" else nn.ReLU()
            self.sizes = list(settings.sizes)
            self.pair = nn.CellList([mint.nn.Linear(2, 2), mint.nn.Linear(2, 2)])
            # a tensor computed in __init__ (a rotary table), held twice, and a buffer; made on the
            # host: ops here would keep mindspore's pipeline busy during every probe build
            self.table = ms.Tensor(np.full(3, 1.0 / (settings.width * scale), np.float32))
            self.same_table = self.table
            self.register_buffer("steps", ms.Tensor(np.array([1, 2], np.int32) * scale))

        def construct(self, x):
            return self.down(self.act(self.up(x)))

    class OwnCopy(nn.Cell):  # keeps a copy of the config of its own: never shared between cells
        def __init__(self, settings):
            super().__init__()
            self.settings = copy.copy(settings)
            self.proj = mint.nn.Linear(2, 2)

    class _LateParam(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = nn.Dense(2, 2)
            self.a.extra = Parameter(initializer("zeros", [2]), name="extra")

    return Model()


def _registries():
    from mindspore import nn

    module = vars(nn.Cell)["__init__"].__globals__ if "__init__" in vars(nn.Cell) else {}
    cache = module.get("cells_compile_cache")
    return nn.Cell.total_instance_count, (len(cache) if isinstance(cache, dict) else None), len(nn.Cell.global_cells)


@contextlib.contextmanager
def _no_cyclic_collection():
    """Registry counts must not depend on when earlier cyclic garbage goes (Cell.__del__ counts down)."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_probe(techniques=(), make=_probe_model):
    """(model, registry deltas, compile-cache entries, numpy's global state
    after the build): built from a fixed numpy seed, its lazy parameters
    taking their draws (draws.py) and filled afterwards with them, as a load
    fills what its checkpoint lacks. The caller keeps the global state."""
    import numpy as np

    np.random.seed(20241127)
    ledger = draws.Ledger()
    with (
        lazy_parameters(),
        draws.accounting(ledger),
        contextlib.nullcontext() if any(t.pauses_collection for t in techniques) else _no_cyclic_collection(),
    ):
        before = _registries()
        with window.open_window(lambda: list(techniques), record=False):
            model = make()
        after = _registries()
    random_state = np.random.get_state()
    with draws.giving_back(ledger):
        for param in model.get_parameters():
            if param.has_init:
                param.init_data()
    registered = _compile_cache_entries(model)
    return (
        model,
        tuple(a - b if a is not None and b is not None else None for a, b in zip(after, before)),
        registered,
        (random_state[1].tobytes(), random_state[2]),
    )


def _compile_cache_entries(model):
    from mindspore import nn

    cache = vars(nn.Cell)["__init__"].__globals__.get("cells_compile_cache") if "__init__" in vars(nn.Cell) else None
    if not isinstance(cache, dict):
        return None
    return [id(cell) in cache and cache[id(cell)] is cell._compile_cache for _, cell in model.cells_and_names()]


def _probe_output(model):
    """The values of the Parameters made over tensors (the state leaves
    values out), and the output of the probe model's first leaf once its
    lazy weights get fixed values."""
    import mindspore as ms
    import numpy as np

    values = [
        (name, str(getattr(param, "device", None)), param.asnumpy().tobytes())
        for name, param in model.parameters_and_names()
        if not param.has_init
    ]
    leaf = model.blocks[0]
    for _, param in leaf.parameters_and_names():
        value = np.linspace(-1, 1, int(np.prod(param.shape)), dtype=np.float32).reshape(param.shape)
        param.set_data(ms.Tensor(value, dtype=param.dtype))
    x = ms.Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    output = leaf(x).asnumpy()
    return values, str(output.dtype), output.tobytes()


_reference = None  # the plain probe model's (state, registry deltas, compile-cache entries, output): once per process


def _plain_reference():
    global _reference
    if _reference is None:
        model, delta, registered, random_state = _build_probe()
        state = model_state(model)
        _reference = (state, delta, registered, random_state, _probe_output(model))
    return _reference


def _prepare(technique) -> str | None:
    try:
        technique.prepare()
    except ProbeFailed as exc:
        return str(exc)
    except Exception as exc:  # a layout this technique does not know
        return f"{type(exc).__name__}: {exc}"
    return None


def _build_difference(reference, candidate) -> str | None:
    """Why a probe build differs from the plain one, each given as (registry
    deltas, compile-cache entries, numpy's state after the build, model
    state); None when it does not."""
    (ref_delta, ref_registered, ref_random, ref_state), (delta, registered, random, state) = reference, candidate
    if ref_random != random:
        return "numpy's global random state after the build differs (random draws taken differently)"
    if ref_delta != delta:
        return f"global registries change differently (instance count, compile cache, cells): {delta} != {ref_delta}"
    if ref_registered != registered:
        return "cells are registered in the compile cache differently"
    if ref_state != state:
        return f"the probe model differs: {first_difference(ref_state, state)}"
    return None


def _compare(techniques, alongside=()) -> str | None:
    """None when the probe model built with `techniques` (and `alongside`:
    techniques already probed that real builds install with them) equals
    the plain one."""
    try:
        ref_state, ref_delta, ref_registered, ref_random, ref_output = _plain_reference()
        tokens = [t.probe_started() for t in techniques]
        candidate, cand_delta, cand_registered, cand_random = _build_probe((*techniques, *alongside))
        for technique, token in zip(techniques, tokens):
            reason = technique.probe_finished(token)
            if reason is not None:
                return reason
        reason = _build_difference(
            (ref_delta, ref_registered, ref_random, ref_state),
            (cand_delta, cand_registered, cand_random, model_state(candidate)),
        )
        if reason is not None:
            return reason
        values, *output = _probe_output(candidate)
        if values != ref_output[0]:
            return f"the probe model differs in its parameter values: {first_difference(ref_output[0], values)}"
        if tuple(output) != ref_output[1:]:
            return "the probe model computes a different output"
    except Exception as exc:
        return f"the probe failed: {type(exc).__name__}: {exc}"
    return None


def _compare_own(technique) -> str | None:
    """None when the technique's own probe model (`technique.probe_model`)
    built with it equals a plain build: registries, whole state, and what
    `technique.probe_values` renders (values the state leaves out)."""
    try:
        plain, plain_delta, plain_registered, plain_random = _build_probe((), technique.probe_model)
        token = technique.probe_started()
        candidate, cand_delta, cand_registered, cand_random = _build_probe((technique,), technique.probe_model)
        reason = technique.probe_finished(token)
        if reason is not None:
            return reason
        reason = _build_difference(
            (plain_delta, plain_registered, plain_random, model_state(plain)),
            (cand_delta, cand_registered, cand_random, model_state(candidate)),
        )
        if reason is not None:
            return reason
        plain_values, cand_values = technique.probe_values(plain), technique.probe_values(candidate)
        if plain_values != cand_values:
            return f"the probe model's values differ: {first_difference(plain_values, cand_values)}"
    except Exception as exc:
        return f"the probe failed: {type(exc).__name__}: {exc}"
    return None


def run_probe(technique) -> str | None:
    """None when the probe model built with `technique` alone equals the plain one."""
    if technique.probe_model is not None:
        return _prepare(technique) or _compare_own(technique)
    return _prepare(technique) or _compare([technique])


def run_probes(techniques, alongside=()) -> dict[str, str | None]:
    """Every technique's verdict: one probe build with all that prepare and
    `alongside` (active techniques a real build installs with them; a
    technique with a probe model of its own: on that one, alone); only if
    that differs, one per technique to find which (all fail when each alone
    passes: they differ only together)."""
    results, ready = {}, []
    for technique in techniques:
        reason = _prepare(technique)
        if reason is None and technique.probe_model is not None:
            reason = _compare_own(technique)
        elif reason is None:
            ready.append(technique)
        results[technique.name] = reason
    together = _compare(ready, alongside) if ready else None
    if together is not None:
        for technique in ready:
            results[technique.name] = _compare([technique], alongside)
        if all(results[technique.name] is None for technique in ready):
            for technique in ready:
                results[technique.name] = f"only together with the others: {together}"
    return results
