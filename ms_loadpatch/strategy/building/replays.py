"""Replayed init-pass calls: per sibling-clone recipe, the effect that real
calls on three of its copies agreed on (new initializers of the cell's own
lazy parameters, their draws, in-place writes recorded on them), replayed on
the later copies without the call (init_pass.run uses it)."""

from __future__ import annotations

import contextlib
import random

import numpy as np

from . import batched_draws, deferred_writes

_plain_cells: dict[type, bool] = {}


def plain_cell(cls) -> bool:
    """Attribute lookups and writes on `cls` are nn.Cell's (no code of the class's own runs)."""
    plain = _plain_cells.get(cls)
    if plain is None:
        from mindspore import nn

        plain = _plain_cells[cls] = (
            cls.__getattribute__ is object.__getattribute__
            and cls.__getattr__ is nn.Cell.__getattr__
            and cls.__setattr__ is nn.Cell.__setattr__
            and not any(_FLAG in vars(klass) for klass in cls.__mro__)
        )
    return plain


_FLAG = "_is_hf_initialized"


class Replays:
    """Per sibling-clone recipe: the effect real calls agreed on, replayed on the later copies."""

    AGREEING_CALLS = 3  # real calls with one effect before it is replayed

    def __init__(self, ledger, counts, owe_draws=False):
        self.ledger, self.counts = ledger, counts
        self.owe = owe_draws  # ledger.batching() asked at the first replay (its probe runs then)
        self.entries: dict[int, list] = {}  # id(recipe) -> [effect, real calls agreeing (-1: never), recipe]

    @contextlib.contextmanager
    def one_by_one(self):
        """Draws taken at once while code not the plugin's runs between calls (a class's own apply)."""
        owe, self.owe = self.owe, False
        try:
            yield
        finally:
            self.owe = owe

    def call(self, cell, source, initialize) -> None:
        if not self.replayed(cell, source):
            self.call_refused(cell, source, initialize)

    def call_refused(self, cell, source, initialize) -> None:
        """The call on `cell` made for real, `replayed` having refused it: learnt
        from while fewer than three real calls agreed."""
        entry = self.entries.get(id(source))
        if entry is None:
            entry = self.entries[id(source)] = [None, 0, source, None]
        self.ledger.take_owed_draws()  # before a real call, which may draw
        if entry[1] < 0 or entry[1] >= self.AGREEING_CALLS:
            initialize(cell)
            return
        effect = self._recorded(cell, initialize)
        if effect is None or (entry[0] is not None and effect != entry[0]):
            entry[1] = -1
        else:
            entry[0], entry[1] = effect, entry[1] + 1
            if entry[1] == self.AGREEING_CALLS:
                entry[3] = _compiled(effect)

    def replayed(self, cell, source) -> bool:
        """The call on `cell` (copied from `source`) replayed, when real calls
        agreed on its effect and it applies; False: nothing was done."""
        entry = self.entries.get(id(source))
        compiled = entry[3] if entry is not None else None
        if compiled is None or compiled and not self._replay(cell, compiled):
            return False
        self.counts.replayed += 1
        return True

    def _recorded(self, cell, initialize):
        """Calls initialize(cell); returns its effect, or None when it did
        anything a replay would not do."""
        ledger = self.ledger
        params = {attr: p for attr, p in (cell.__dict__.get("_params") or {}).items() if p is not None}
        subtree = subtree_state(cell)
        if subtree is None or not all(p.has_init for p in params.values()):
            initialize(cell)
            return None
        own = {id(p): attr for attr, p in params.items()}
        before = {attr: p.init_mode for attr, p in params.items()}
        if any(id(tensor) in ledger.writes for tensor in before.values()):
            initialize(cell)
            return None
        random_state, python_state = np.random.get_state(), random.getstate()
        counts = self.counts
        before_counts = (counts.filled, counts.deferred, counts.generator_steps, ledger.run_in_full)
        ledger.assignments = []
        try:
            initialize(cell)
        finally:
            assignments, ledger.assignments = ledger.assignments, None
        writes = [event for event in assignments if len(event) == 4]  # deferred_writes.Recorder's
        steps = sum(1 for event in writes if event[2].kind in deferred_writes.RANDOM_WRITES)
        after_counts = (
            counts.filled,
            counts.deferred - len(writes),
            counts.generator_steps - steps,
            ledger.run_in_full,
        )
        if (
            before_counts != after_counts
            or not all(event[3] for event in writes)  # random writes stepped mindspore's default generator
            or python_state != random.getstate()
            or subtree_state(cell) != subtree
        ):
            return None
        effect, replayed = [], np.random.RandomState()
        replayed.set_state(random_state)
        for event in assignments:
            if len(event) == 4:
                item = self._write_item(own, event)
                if item is None:
                    return None
                effect.append(item)
                continue
            param, tensor = event
            attr, old, init = own.get(id(param)), before.get(own.get(id(param))), tensor.init
            if attr is None or old is None or init is None or (tensor.shape, tensor.dtype) != (old.shape, old.dtype):
                return None
            drew = ledger.drew(tensor)
            if drew:  # the draw must be the one the ledger took, in this order
                if replayed.randint(low=1, high=(1 << 63), dtype=np.int64) != ledger.seeds[id(tensor)][1]:
                    return None
            elif type(init) not in ledger.classes[0]:
                return None
            state = [(k, dict(v) if type(v) is dict else v) for k, v in vars(init).items()]
            if not all(_plain_value(v) for _, v in state):
                return None
            effect.append((_INIT, attr, type(init), state, tensor.shape, tensor.dtype, drew))
        same_draws = batched_draws.same_numpy_state(replayed.get_state(), np.random.get_state())
        inits = [item[1] for item in effect if item[0] is _INIT]
        if len(set(inits)) != len(inits) or not same_draws or not self._writes_kept(params, effect):
            return None
        return effect

    @staticmethod
    def _write_item(own, event):
        """A recorded write as an effect item (a random one without its
        generator step, which a replay takes anew), or None when not on a
        parameter of the cell's own."""
        param, tensor, write, _ = event
        attr = own.get(id(param))
        if attr is None or param.init_mode is not tensor:
            return None
        args = write.args[:-2] if write.kind in deferred_writes.RANDOM_WRITES else write.args
        return (_WRITE, attr, write.via_data, write.index, write.kind, args, tensor.shape, tensor.dtype)

    def _writes_kept(self, params, effect) -> bool:
        """The ledger holds, for each parameter, the writes the effect made
        after the parameter's last new initializer (as a replay leaves them)."""
        for attr, param in params.items():
            expected = []
            for item in effect:
                if item[1] == attr:
                    expected = [] if item[0] is _INIT else expected + [item[2:6]]
            entry = self.ledger.writes.get(id(param.init_mode))
            kept = [
                (w.via_data, w.index, w.kind, w.args[:-2] if w.kind in deferred_writes.RANDOM_WRITES else w.args)
                for w in (entry[1] if entry is not None else ())
            ]
            if kept != expected:
                return False
        return True

    def _replay(self, cell, compiled) -> bool:
        params = cell.__dict__.get("_params") or {}
        ledger = self.ledger
        writes, targets = ledger.writes, []
        for item in compiled:
            param = params.get(item[1])
            tensor = param.init_mode if param is not None and param.has_init else None
            if tensor is None or tensor.init is None or id(tensor) in writes:
                return False
            dtype = tensor.dtype  # one object per dtype: `is` first, their == is a slow pybind call
            if tensor.shape != item[2] or dtype is not item[3] and dtype != item[3]:
                return False
            targets.append(tensor)
        owe = self.owe and plain_cell(type(cell)) and ledger.batching()
        for tensor, item in zip(targets, compiled):
            if item[0] is _INIT:
                _, _, _, _, kind, state, dicts, drew = item
                init = object.__new__(kind)
                init.__dict__.update(state)
                for key in dicts:  # a dict attribute (an initializer's _kwargs): a copy each
                    init.__dict__[key] = dict(state[key])
                ledger.reinitialize(tensor, init, drew, owe)
            else:
                _, _, _, _, via_data, index, kind, args = item
                self.counts.deferred += 1
                deferred_writes.record_again(ledger, tensor, via_data, index, kind, args)
        return True


def _compiled(effect) -> tuple:
    """An agreed effect as _replay applies it: (kind, attr, shape, dtype, ...) per item, an
    initializer's state as a dict to copy from, with the names of its dict attributes."""
    compiled = []
    for item in effect:
        if item[0] is _INIT:
            _, attr, kind, state, shape, dtype, drew = item
            dicts = tuple(key for key, value in state if type(value) is dict)
            compiled.append((_INIT, attr, shape, dtype, kind, dict(state), dicts, drew))
        else:
            _, attr, via_data, index, kind, args, shape, dtype = item
            compiled.append((_WRITE, attr, shape, dtype, via_data, index, kind, args))
    return tuple(compiled)


# effect items: (_INIT, attr, initializer class, its state, shape, dtype, drew), a new initializer;
# (_WRITE, attr, via_data, index, kind, arguments, shape, dtype), an in-place write recorded
_INIT, _WRITE = "init", "write"


_SCALARS = (type(None), bool, int, float, str, np.floating, np.integer)
# a parameter's own state besides its initializer (init_mode, what a replay gives back)
_PARAMETER_SWITCHES = ("name", "requires_grad", "layerwise_parallel", "parallel_optimizer")


SUBTREE_LIMIT = 64  # cells under a recipe's cell whose calls are learnt and replayed


def subtree_state(cell):
    """What a replay would not restore, over `cell` and the cells below it:
    their attributes and the entries of dict attributes by identity, each
    parameter's attributes (a lazy one's initializer aside) and switches,
    and the bytes of every real tensor (buffers, parameters built real).
    None when some bytes cannot be read, or when the subtree has more than
    SUBTREE_LIMIT cells (a block of experts: checking it costs more than
    the few real calls on its copies)."""
    import mindspore as ms

    state = []
    for count, (_, sub) in enumerate(cell.cells_and_names()):
        if count == SUBTREE_LIMIT:
            return None
        for key, value in vars(sub).items():
            if key == _FLAG:
                continue
            state.append((key, id(value)))
            if isinstance(value, dict):  # _params, _cells, _buffers: OrderedDicts
                state.append(tuple((k, id(v)) for k, v in value.items()))
                values = value.values()
            else:
                values = (value,)
            for item in values:
                lazy = isinstance(item, ms.Parameter) and item.has_init
                if isinstance(item, ms.Parameter):
                    state.append(tuple((k, id(v)) for k, v in vars(item).items() if not (lazy and k == "init_mode")))
                    state.append(tuple(getattr(item, name, None) for name in _PARAMETER_SWITCHES))
                if isinstance(item, ms.Tensor) and not lazy:
                    try:
                        state.append(item.asnumpy().tobytes())
                    except Exception:  # a tensor whose bytes are not readable here: never replayed
                        return None
    return state


def _plain_value(value) -> bool:
    if type(value) is dict:
        return all(isinstance(v, _SCALARS) for v in value.values())
    return isinstance(value, _SCALARS) or type(value) is tuple and all(isinstance(v, _SCALARS) for v in value)
