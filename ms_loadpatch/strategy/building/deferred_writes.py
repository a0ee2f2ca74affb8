"""In-place writes an init pass makes on a lazy parameter: recorded, not run.

An `_init_weights` often writes into a parameter's data in place
(`weight.data.normal_(0, std)`, `bias.data.zero_()`, `weight.data.fill_(1)`,
`weight.data[pad].zero_()`, `weight[pad] = 0`). On a lazy parameter the
write is recorded instead (`Write`): a random one takes its generator step
now, exactly as mindspore's op does (`seed, offset = generator._step(step)`),
and keeps `(seed, offset)`; nothing is filled and no kernel runs. When the
checkpoint gives the parameter its values the record is dropped with the
ledger (draws.Ledger.writes). When the parameter is filled instead (the
checkpoint lacks it), `Parameter.init_data` fills it from its initializer
with its own draw and `replay` runs the writes in order, the random ones
through the kernel with their recorded `(seed, offset)`: the plain build's
values on any device.

What is recorded is only what the code does next, read from the caller's
bytecode (`next_use`): `.data` becomes a `LazyData` stand-in only where the
next instruction calls a recorded method on it or subscripts it for one;
anything else gets the real data, filled first (init_pass counts it).

`WRITES` says which generator step and kernel each random write takes on
the mindspore this was written against; `verified()` checks every kind of
write once per process against the real op on plain parameters (the
generator's state always, the values where this mindspore has the kernel);
a write that fails is filled, then run, and `status()` names it.
"""

from __future__ import annotations

import dis

import numpy as np

from ..probe_cache import ProbeCache

# random in-place methods: (kernel in mindspore.ops.function.random_func, its argument names and defaults)
RANDOM_WRITES = {
    "normal_": ("inplace_normal_", ("mean", "std"), (0, 1)),
    "uniform_": ("inplace_uniform_op", ("from_", "to"), (0, 1)),
}
# in-place methods with no randomness, replayed by calling them later: (argument names, defaults)
PLAIN_WRITES = {"zero_": ((), ()), "fill_": (("value",), (None,))}
# item assignment of a scalar (`param[index] = value`, `param.data[index] = value`)
SETITEM = "__setitem__"
KINDS = tuple(RANDOM_WRITES) + tuple(PLAIN_WRITES) + (SETITEM,)

_SCALARS = (bool, int, float, np.bool_, np.integer, np.floating)


class Write:
    """One recorded write: `via_data` (on `param.data`, else on the
    parameter), the chain of indices into it, the method and its arguments
    (a random write's end with its seed and offset)."""

    __slots__ = ("via_data", "index", "kind", "args")

    def __init__(self, via_data, index, kind, args):
        self.via_data, self.index, self.kind, self.args = via_data, index, kind, args


class RecordedWrites(list):
    """The writes recorded on one lazy parameter, in order (a ledger's
    `writes` entry); replayed onto it once it is filled."""

    def replay_onto(self, param) -> None:
        replay(param, self)


def replay(param, writes) -> None:
    """Run `writes` on the filled `param`, in order, as the code wrote them."""
    from mindspore.ops.function import random_func

    for write in writes:
        target = param.data if write.via_data else param
        for index in write.index:
            target = target[index]
        if write.kind in RANDOM_WRITES:
            getattr(random_func, RANDOM_WRITES[write.kind][0])(target, *write.args)
        elif write.kind == SETITEM:
            target[write.args[0]] = write.args[1]
        else:
            getattr(target, write.kind)(*write.args)


def recorded(param, via_data, index, kind, args, kwargs, kinds):
    """The Write for `kind(*args, **kwargs)` on `param` (through `.data` and
    `index`), its generator step taken; None when this call is not one the
    recorder models (`kinds`: the verified kinds), nothing done then."""
    if kind not in kinds:
        return None
    if kind == SETITEM:
        if kwargs or len(args) != 2 or not plain_index(args[0]) or not isinstance(args[1], _SCALARS):
            return None
        return Write(via_data, index, kind, args)
    names, defaults = RANDOM_WRITES[kind][1:] if kind in RANDOM_WRITES else PLAIN_WRITES[kind]
    kwargs = dict(kwargs)
    generator = kwargs.pop("generator", None) if kind in RANDOM_WRITES else None
    values = _bound(names, defaults, args, kwargs)
    if values is None or not all(isinstance(v, _SCALARS) for v in values):
        return None
    if kind in RANDOM_WRITES:
        from mindspore.ops.function import random_func

        if generator is None:
            generator = random_func.default_generator
        seed, offset = generator._step(random_func.generator_step_)  # pylint: disable=protected-access
        values = values + (seed, offset)
    return Write(via_data, index, kind, values)


def record_again(ledger, tensor, via_data, index, kind, args) -> None:
    """A write a learnt init call recorded, recorded on `tensor` as the call
    would (a random one takes its generator step now, from mindspore's
    default generator, as `recorded` does)."""
    if kind in RANDOM_WRITES:
        from mindspore.ops.function import random_func

        seed, offset = random_func.default_generator._step(random_func.generator_step_)  # pylint: disable=protected-access
        args = args + (seed, offset)
    _keep(ledger, tensor, Write(via_data, index, kind, args))


def _keep(ledger, tensor, write) -> None:
    """`write` appended to the ledger's writes for `tensor`."""
    entry = ledger.writes.get(id(tensor))
    if entry is None:
        entry = ledger.writes[id(tensor)] = (tensor, RecordedWrites())
    entry[1].append(write)


def _bound(names, defaults, args, kwargs):
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    values = list(args) + [kwargs.get(n, d) for n, d in zip(names[len(args) :], defaults[len(args) :])]
    if any(name in kwargs for name in names[: len(args)]) or any(v is None for v in values):
        return None
    return tuple(values)


def plain_index(index) -> bool:
    """An index whose meaning cannot change before the write is replayed: ints, slices of ints, Ellipsis."""
    if isinstance(index, tuple):
        return all(plain_index(i) for i in index)
    if isinstance(index, slice):
        return all(v is None or isinstance(v, (int, np.integer)) for v in (index.start, index.stop, index.step))
    return index is Ellipsis or (isinstance(index, (int, np.integer)) and not isinstance(index, bool))


# -- what the calling code does next with `.data` or `data[index]`

_LOADS = frozenset(
    (
        "LOAD_FAST",
        "LOAD_FAST_CHECK",
        "LOAD_CONST",
        "LOAD_GLOBAL",
        "LOAD_DEREF",
        "LOAD_NAME",
        "LOAD_SMALL_INT",
        "LOAD_FAST_BORROW",
    )
)
_METHOD_LOADS = frozenset(("LOAD_METHOD", "LOAD_ATTR"))
_uses: dict = {}  # (code, offset of the instruction being run) -> what comes next (see next_use)


def next_use(frame, current: str):
    """What the code of `frame` does with the value the instruction it is
    running produces (`current`: "data", that instruction loads the attribute
    `data`; "subscript", it subscripts): ("method", name), the next
    instruction loads that attribute of it; ("subscript",) / ("store",), an
    index made only of loads follows, then it is subscripted / assigned into;
    None for anything else (the value escapes: the caller gets real data)."""
    code, offset = frame.f_code, frame.f_lasti
    key = (code, offset, current)
    found = _uses.get(key, _uses)
    if found is _uses:
        found = _uses[key] = _classify(code, offset, current)
    return found


def _classify(code, offset, current):
    instructions = list(dis.get_instructions(code))
    at = next((i for i, ins in enumerate(instructions) if ins.offset == offset), None)
    if at is None:
        return None
    ins = instructions[at]
    if current == "data" and not (ins.opname == "LOAD_ATTR" and ins.argval == "data"):
        return None  # not a plain attribute load (mindspore's C code, getattr): the value may go anywhere
    if current == "subscript" and ins.opname != "BINARY_SUBSCR":
        return None
    rest = instructions[at + 1 :]
    if not rest:
        return None
    if rest[0].opname in _METHOD_LOADS and isinstance(rest[0].argval, str) and rest[0].argval in KINDS:
        return ("method", rest[0].argval)
    if current != "data":
        return None
    for ins in rest:  # the index: loads, and attributes of what was just loaded
        if ins.opname in _LOADS or (ins.opname == "LOAD_ATTR" and "NULL" not in (ins.argrepr or "")):
            continue
        if ins.opname == "BINARY_SUBSCR":
            return ("subscript",)
        if ins.opname == "STORE_SUBSCR":
            return ("store",)
        return None
    return None


class LazyData:
    """`param.data` of a lazy parameter in the init pass, where the code
    next writes into it (next_use): its writes recorded on the parameter.
    Anything else makes the parameter real and goes to its real data."""

    __slots__ = ("_param", "_index", "_recorder")

    def __init__(self, param, index, recorder):
        self._param, self._index, self._recorder = param, index, recorder

    def _real(self):
        target = self._recorder.make_real(self._param).data
        for index in self._index:
            target = target[index]
        return target

    def _write(self, kind, args, kwargs):
        if self._param.has_init and self._recorder.record(self._param, True, self._index, kind, args, kwargs):
            return self
        return getattr(self._real(), kind)(*args, **kwargs)

    def normal_(self, *args, **kwargs):
        return self._write("normal_", args, kwargs)

    def uniform_(self, *args, **kwargs):
        return self._write("uniform_", args, kwargs)

    def zero_(self, *args, **kwargs):
        return self._write("zero_", args, kwargs)

    def fill_(self, *args, **kwargs):
        return self._write("fill_", args, kwargs)

    def __getitem__(self, index):
        import sys

        use = next_use(sys._getframe(1), "subscript")
        if use is not None and use[1] in self._recorder.kinds and plain_index(index) and self._param.has_init:
            return LazyData(self._param, self._index + (index,), self._recorder)
        return self._real()[index]

    def __setitem__(self, index, value):
        if not (
            self._param.has_init and self._recorder.record(self._param, True, self._index, SETITEM, (index, value), {})
        ):
            self._real()[index] = value

    def __getattr__(self, name):
        return getattr(self._real(), name)

    def __repr__(self):
        return repr(self._real())


class Recorder:
    """Records writes on lazy parameters into a ledger's `writes`
    (id(initializer tensor) -> (tensor, [Write])); `make_real` fills one
    (its writes then replayed by the ledger's init_data). `kinds`: the
    verified kinds; `counts.deferred` counts what it recorded."""

    def __init__(self, ledger, kinds, make_real, counts):
        self.ledger, self.kinds, self.make_real, self.counts = ledger, kinds, make_real, counts

    def record(self, param, via_data, index, kind, args, kwargs) -> bool:
        tensor = param.init_mode
        if tensor is None:
            return False
        write = recorded(param, via_data, index, kind, args, kwargs, self.kinds)
        if write is None:
            return False
        _keep(self.ledger, tensor, write)
        self.counts.deferred += 1
        if self.ledger.assignments is not None:  # a call init_pass is learning: the write in its order
            self.ledger.assignments.append((param, tensor, write, kwargs.get("generator") is None))
        return True

    def data(self, param, frame):
        """A LazyData for `param.data` where the code next writes into it, else None."""
        use = next_use(frame, "data")
        if use is None or (use[0] == "method" and use[1] not in self.kinds):
            return None
        return LazyData(param, (), self)


# -- the probe: each kind of write recorded then replayed, against the real op (once per process)

_verdicts = ProbeCache()


NAME = "deferred-writes"


def usable_kinds() -> frozenset:
    """The kinds to record: none when MS_LOADPATCH_TECHNIQUES_OFF names this technique."""
    from .. import switch

    return frozenset() if switch.is_off(NAME) else verified()[0]


class LazyKinds:
    """usable_kinds(), asked for at the first write a pass meets: a model
    whose init pass writes nothing in place never runs the probe."""

    __slots__ = ("_kinds",)

    def __init__(self):
        self._kinds = None

    def __contains__(self, kind) -> bool:
        if self._kinds is None:
            self._kinds = usable_kinds()
        return kind in self._kinds


def verified() -> tuple[frozenset, dict]:
    """(kinds whose record and replay equal the real op here, {kind: why not} for the others)."""
    return _verdicts.get("kinds", _verify, own_thread=True)


def _verify():
    from .. import randomstate
    from . import draws

    passed, problems = set(), {}
    try:
        with randomstate.kept(), draws.suspended():
            for kind in KINDS:
                try:
                    problem = _compare(kind)
                except Exception as exc:  # an internal it relies on changed
                    problem = f"{type(exc).__name__}: {exc}"
                if problem is None:
                    passed.add(kind)
                else:
                    problems[kind] = problem
    except Exception as exc:  # noqa: BLE001 - the probe's own set-up: every kind fails alike
        return frozenset(), {kind: f"{type(exc).__name__}: {exc}" for kind in KINDS}
    return frozenset(passed), problems


# (how the probe calls each kind: through .data, indices, arguments)
_PROBE_CALLS = {
    "normal_": (True, (), (0.5, 0.25)),
    "uniform_": (True, (), (-0.5, 0.5)),
    "zero_": (True, (1,), ()),
    "fill_": (True, (), (1.5,)),
    SETITEM: (False, (), (1, 0.0)),
}


def _compare(kind) -> str | None:
    """None when recording `kind` on a plain parameter and replaying it gives
    the real op's generator state and values (where the real op runs here)."""
    import mindspore as ms
    from mindspore.ops.function import random_func

    if kind in RANDOM_WRITES:
        function = getattr(random_func, kind, None)
        names = set(getattr(getattr(function, "__code__", None), "co_names", ()))
        needed = {"_step", "generator_step_", "default_generator", RANDOM_WRITES[kind][0]}
        if not needed <= names:
            return f"mindspore's {kind} is not generator._step then {RANDOM_WRITES[kind][0]}"
        if random_func.default_generator is not ms.common.generator.default_generator:
            return "random_func's default generator is not mindspore's"
    via_data, index, args = _PROBE_CALLS[kind]
    base = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    generator = ms.Generator()

    def run(record):
        param = ms.Parameter(ms.Tensor(base.copy()), name="ms_loadpatch_probe")
        generator.manual_seed(1234)
        kwargs = {"generator": generator} if kind in RANDOM_WRITES else {}
        if record:
            write = recorded(param, via_data, index, kind, args, kwargs, KINDS)
            if write is None:
                raise RuntimeError("not recorded")
        state = generator.get_state().asnumpy().tobytes()
        try:
            if record:
                replay(param, [write])
            else:
                target = param.data if via_data else param
                for i in index:
                    target = target[i]
                if kind == SETITEM:
                    target[args[0]] = args[1]
                else:
                    getattr(target, kind)(*args, **kwargs)
            values = param.asnumpy().tobytes()
        except RuntimeError as exc:  # a kernel this wheel lacks: the error surfaces at the sync
            values = ("raised", str(exc).splitlines()[0] if str(exc) else "")
        return state if record else generator.get_state().asnumpy().tobytes(), values

    real_state, real_values = run(False)
    state, values = run(True)
    if state != real_state:
        return "the generator moves differently"
    if isinstance(real_values, tuple) != isinstance(values, tuple):
        return "the replay and the real op differ in raising"
    if not isinstance(real_values, tuple) and values != real_values:
        return "the replayed values differ"
    return None


def status_row():
    """status()'s row: active while any kind passed, naming those that did not."""
    from .. import switch, verdict

    description = (
        "in-place writes of an init pass on a lazy parameter (" + ", ".join(KINDS) + ") recorded "
        "with their generator steps and replayed only if the checkpoint lacks the parameter "
        "(probed against the real op on plain parameters)"
    )
    if switch.is_off(NAME):
        return verdict.row_off(NAME, None, description)
    passed, problems = verified()
    problem = None
    if problems:
        problem = "; ".join(f"{kind}: {why} (filled, then run)" for kind, why in sorted(problems.items()))
    if passed and problem:
        return verdict.TechniqueRow(
            NAME, description, verdict.ACTIVE, f"active for {', '.join(sorted(passed))}; {problem}"
        )
    return verdict.row(
        NAME, None, description, problem, passed="probe passed: record and replay equal the real op here"
    )
