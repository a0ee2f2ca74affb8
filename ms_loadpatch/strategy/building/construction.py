"""Constructing a model without initialising what the checkpoint overwrites,
and initialising afterwards exactly what it did not."""

from __future__ import annotations

import contextlib

from ..assign import drop_kept_initializer
from . import draws, fast_construction, lazy_writes, named_parameters
from .lazy import lazy_parameters

__all__ = [
    "lazy_construction",
    "refresh_parameter_names",
    "walk_cells",
    "state_index",
    "as_load_state_dict_leaves_it",
    "initialize_unloaded",
    "built_with_draws",
]


@contextlib.contextmanager
def lazy_construction(fast: bool = True, checkpoint_tensors: int | None = None, when_built=None, ledger=None):
    """Parameters built from initializers in this thread stay lazy (no memory,
    no random fill); with `fast`, cells are built through the probed
    construction techniques too (strategy/building: same objects, less Python
    work), from the first cell when `checkpoint_tensors` says the model is large.
    With a `ledger` (draws.Ledger), each lazy parameter takes the random
    draws a plain build makes filling it, when it is made: for a build the
    unpatched call makes with its initializers run.
    `when_built()` runs once the techniques' window has closed, still under
    CONSTRUCTION_LOCK: what the window noted is this build's until the lock
    is released (another thread's build then overwrites it)."""
    with lazy_parameters(), draws.accounting(ledger) if ledger is not None else contextlib.nullcontext():
        try:
            with fast_construction(checkpoint_tensors=checkpoint_tensors) if fast else contextlib.nullcontext():
                yield
        finally:
            if when_built is not None:
                when_built()


def refresh_parameter_names(root, each_cell=None) -> None:
    """Every parameter named by its path from `root`, as mindone's
    init_weights does after its init pass (`param.name = name` over
    `parameters_and_names()`): walked flat inside a fast window; a name that
    is already right is not set again (setting an equal name changes nothing).
    `each_cell(cell)` first, on every cell in cells_and_names() order (the
    init pass's place), from the same walk when it is flat."""
    cells = [] if each_cell is not None else None
    named = named_parameters(root, cells)
    if each_cell is not None:
        for cell in (cell for _, cell in root.cells_and_names()) if named is None else cells:
            each_cell(cell)
    for name, param in root.parameters_and_names() if named is None else named:
        if param.name != name:
            param.name = name


def walk_cells(root, prefix=""):
    """(name, cell, parent chain) in Cell.load_state_dict's traversal order,
    shared cells visited under every name, as that method does."""
    stack = [(prefix, root, ())]
    pop, push = stack.pop, stack.append
    while stack:
        name, cell, parents = pop()
        yield name, cell, parents
        children = cell._cells
        if children:
            chain = parents + (cell,)  # one tuple shared by all children
            for child_name, child in reversed(children.items()):
                if child is not None:
                    push((f"{name}{child_name}.", child, chain))


def state_index(root):
    """key -> (kind, owner cell, attribute, object) for every parameter and
    persistent buffer, under every name that reaches it (tied weights).
    Reads on each cell what Cell.load_state_dict reads (as_load_state_dict_leaves_it)."""
    index = {}
    for prefix, cell, _ in walk_cells(root):
        as_load_state_dict_leaves_it(cell, prefix)
        for attr, param in cell._params.items():
            if param is not None:
                index[prefix + attr] = ("param", cell, attr, param)
        if not cell._buffers:
            continue  # mindspore creates _non_persistent_buffers_set on first read: not for nothing
        non_persistent = cell._non_persistent_buffers_set
        for attr, buffer in cell._buffers.items():
            if buffer is not None and attr not in non_persistent:
                index[prefix + attr] = ("buffer", cell, attr, buffer)
    return index


# what Cell.load_state_dict reads on every cell; mindspore creates these lazily
_LOAD_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def as_load_state_dict_leaves_it(cell, name: str) -> None:
    """Read on `cell` (named `name`) what mindspore's Cell.load_state_dict
    reads, so its `__dict__` is as an unpatched load leaves it (mindspore
    makes the hook dicts on first read). The hooks themselves are not run: a
    cell with one is refused, naming the cell, rather than loaded differently."""
    for attr in _LOAD_HOOKS:
        hooks = getattr(cell, attr, None)
        if hooks:
            raise RuntimeError(
                f"ms_loadpatch: cell '{name.rstrip('.') or type(cell).__name__}' "
                f"({type(cell).__name__}) has {attr[1:]} registered, which the accelerated load does not run; "
                "load this model with ms_loadpatch.disabled()"
            )


def initialize_unloaded(root, ledger, skip=frozenset()) -> int:
    """Give every parameter still lazy (the checkpoint lacked it) the value
    an unpatched load gives it: its initializer's, with the draw the
    ledger took for it when it was made (draws.Ledger), in
    `root.get_parameters()` order; those whose id is in `skip` are left.
    Returns how many were filled."""
    filled = 0
    with draws.giving_back(ledger) if ledger is not None else contextlib.nullcontext():
        for param in root.get_parameters():
            if param.has_init and id(param) not in skip:
                param.init_data()
                filled += 1
    if ledger is not None:
        ledger.forget()
    return filled


def built_with_draws(call, when_built=None, foreign=frozenset(), fast_assign=False, into=None):
    """`call()` (returning a model, or building into the model `into`) for a call that builds with every
    initializer run and then fills some parameters itself (set_data or
    assign_value from another model, an initializer such as zeros): built
    lazily, each parameter taking its draws when made; what the call filled
    left as a plain build leaves it (assign_value: lazy_writes, taking copies
    with `fast_assign`); every parameter still lazy then filled as the plain
    build fills it (initialize_unloaded). Parameters whose id is in `foreign`
    (made before the call: a source model's cell the call puts into its
    model) are left as they are. Returns (what call returned, parameters filled here)."""
    ledger = draws.Ledger()
    try:
        with lazy_construction(when_built=when_built, ledger=ledger), lazy_writes.assigning(fast_assign, foreign):
            result = call()
    except BaseException:
        ledger.forget()
        raise
    model = result if into is None else into
    for param in model.get_parameters():
        if id(param) not in foreign:
            settle_filled(param)
    return result, initialize_unloaded(model, ledger, skip=foreign)


def settle_filled(param) -> None:
    """A lazy parameter the call filled with set_data, left as a plain build
    leaves it: mindspore keeps the initializer in `init_mode` (copies rebuild
    from it), and load_param_into_net, reading `init_param` False inside the
    lazy window, wrote True into the parameter's own `__dict__`."""
    if param.__dict__.get("init_param") is True:
        del param.__dict__["init_param"]
    drop_kept_initializer(param)
