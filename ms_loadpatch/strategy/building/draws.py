"""Lazy parameters that take their random draws when they are created.

mindspore's random initializers seed themselves from numpy's global
RandomState (`mindspore.common.initializer._numpy_seed`, one draw each) when
they fill a tensor. A plain build fills every parameter as it is made, so it
draws once per random initializer, in creation order; a lazy build fills
none. While a `Ledger` accounts in a thread, a parameter made lazy there (or
given a new initializer while lazy, as an `_init_weights` does) takes its
initializer's draw at that moment, exactly as the plain build would, and
the ledger keeps the seed; when the parameter is filled later (the checkpoint
lacks it), its initializer gets that seed back instead of drawing again. So
numpy's global state, and the values of what the checkpoint lacks, are the
plain build's.

An initializer of a class not known to draw exactly once (`ONE_DRAW`, checked
once per process by `probe()`) or never (`NO_DRAW`) is run in full on a
scratch array when the parameter is made: the same draws, the data kept for
a later fill (exact; slower only there, counted in `Ledger.run_in_full`).

In-place writes an init pass recorded on a lazy parameter (deferred_writes)
are kept beside the seeds (`Ledger.writes`) and replayed when the parameter
is filled.

The mindspore patches that route the draws here, held while a ledger is
active and for its thread only, are draw_patches.py.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..lane import lane
from ..probe_cache import ProbeCache
from . import batched_draws
from .draw_patches import ACCOUNTING as _ACCOUNTING
from .draw_patches import FILLING as _FILLING
from .draw_patches import SeedTaken as _SeedTaken
from .draw_patches import leftovers  # noqa: F401 - building's leftovers() reads draws.leftovers
from .draw_patches import originals as _originals
from .session import holding

# initializer classes (mindspore.common.initializer) by how many draws filling a tensor takes
NO_DRAW = ("Zero", "One", "Constant")
ONE_DRAW = (
    "Normal",
    "Uniform",
    "TruncatedNormal",
    "HeUniform",
    "HeNormal",
    "XavierUniform",
    "XavierNormal",
    "VarianceScaling",
    "Orthogonal",
)

_OWED = object()  # a seed owed (Ledger.owed), never a value an initializer gets


class Ledger:
    """One load's seeds: id(initializer tensor) -> (tensor, seed or values)."""

    def __init__(self, classes=None):
        self.seeds: dict[int, tuple] = {}
        self.draws = 0  # draws taken for lazy tensors
        self.run_in_full = 0  # initializers run in full on a scratch array
        # (classes that never draw, classes that draw once), verified on this mindspore
        self.classes = classes if classes is not None else verified_classes()[:2]
        # (class, shape, attributes) whose initializer reached its draw: the same again draws at once
        self.reached_draw: set = set()
        # while a list: (parameter, initializer tensor) of every init_mode set in the accounting thread
        self.assignments: list | None = None
        # id(initializer tensor) -> (tensor, deferred_writes.RecordedWrites): writes to replay when it is filled
        self.writes: dict[int, tuple] = {}
        # initializer tensors whose draw is owed, in order: taken together by take_owed_draws()
        self.owed: list = []
        self._batching: bool | None = None  # batching_allowed(), read once per load
        self._known: dict[int, tuple] = {}  # id(templates) -> templates that knows_draws() confirmed

    def take(self, tensor) -> None:
        """The draws the plain build makes when it fills `tensor` (a lazy
        parameter's initializer tensor), taken now."""
        init = tensor.init
        if init is None or id(tensor) in self.seeds:
            return
        no_draw, one_draw = self.classes
        kind = type(init)
        if kind in no_draw:
            return
        key = None
        if kind in one_draw:
            try:
                build = lane.build
                known = build.known  # a copy whose recipe's draws this ledger knows
                key = None if known else _draw_key(kind, tensor.shape, init)
                if known or key in self.reached_draw:
                    if build.owing:
                        self.seeds[id(tensor)] = (tensor, _OWED)  # taken once, at take_owed_draws()
                        self.owed.append(tensor)
                        return
                    if self.owed:
                        self.take_owed_draws()
                    self.seeds[id(tensor)] = (tensor, _originals["numpy_seed"]())
                    self.draws += 1
                    return
            except TypeError:  # an attribute that cannot be hashed
                key = None
        if self.owed:
            self.take_owed_draws()  # the initializer below draws: the draws owed come first
        if kind in one_draw:
            build = lane.build
            build.capturing = True
            try:
                init(_capture_array(tensor.shape, _numpy_type(tensor.dtype)))
            except _SeedTaken:
                self.seeds[id(tensor)] = (tensor, build.captured)
                self.draws += 1
                if key is not None:
                    self.reached_draw.add(key)
                return
            finally:
                build.capturing = False
        scratch = np.ndarray(tensor.shape, dtype=_numpy_type(tensor.dtype))
        init(scratch)
        self.seeds[id(tensor)] = (tensor, scratch)  # filled without a draw we know: its values
        self.run_in_full += 1

    def knows_draws(self, templates) -> bool:
        """Whether each lazy tensor made from `templates` ((initializer,
        shape) pairs) takes its draw at once here: its class never draws, or
        draws once and an initializer like it reached its draw before."""
        if self._known.get(id(templates)) is templates:
            return True
        no_draw, one_draw = self.classes
        for init, shape in templates:
            kind = type(init)
            if kind in no_draw:
                continue
            try:
                if kind not in one_draw or _draw_key(kind, shape, init) not in self.reached_draw:
                    return False
            except TypeError:  # an attribute that cannot be hashed
                return False
        self._known[id(templates)] = templates
        return True

    def forget(self) -> None:
        self.seeds.clear()
        self.writes.clear()

    def drew(self, tensor) -> bool:
        """Whether `tensor`'s draw was taken as a seed (not run in full, not drawless)."""
        entry = self.seeds.get(id(tensor))
        return entry is not None and not isinstance(entry[1], np.ndarray)

    def reinitialize(self, tensor, init, draws: bool, owe: bool = False) -> None:
        """What `param.set_data(initializer(init, shape, dtype))` does to a
        lazy parameter whose initializer tensor is `tensor` (same shape and
        dtype), without making a new tensor: `init` becomes its initializer,
        and its draw (`draws`: init's class draws once, as recorded from a
        real call) is taken now, or (`owe`) owed until take_owed_draws(),
        which the caller runs before anything else can draw from numpy."""
        tensor.init = init
        self.writes.pop(id(tensor), None)  # a new initializer replaces what was written before it
        if draws:
            self.seeds.pop(id(tensor), None)
            if owe:
                self.owed.append(tensor)
            else:
                self.seeds[id(tensor)] = (tensor, _originals["numpy_seed"]())
                self.draws += 1
        else:
            self.seeds.pop(id(tensor), None)

    def batching(self) -> bool:
        if self._batching is None:
            self._batching = batched_draws.allowed()
        return self._batching

    def take_owed_draws(self) -> None:
        """The owed draws, in the order owed, as one batch: the same numbers
        and the same numpy state as one `_numpy_seed()` each (batched_draws.problem)."""
        owed, self.owed = self.owed, []
        if owed:
            for tensor, seed in zip(owed, batched_draws.take(len(owed))):
                self.seeds[id(tensor)] = (tensor, seed)
            self.draws += len(owed)


def _draw_key(kind, shape, init) -> tuple:
    """An initializer's key: what it checks before its draw (sigma, fans, gain) depends on these alone."""
    return (kind, shape, tuple(v for k, v in vars(init).items() if k != "_kwargs"))


def _capture_array(shape, numpy_type):
    """An array of `shape` and type over one element (zero strides): an
    initializer stopped at its draw reads only its shape and type, and a
    large one costs nothing to allocate."""
    return np.ndarray(shape, dtype=numpy_type, buffer=np.empty(1, dtype=numpy_type), strides=(0,) * len(shape))


_numpy_types: dict = {}  # mindspore dtype -> numpy type (mindspore builds its table on every call)


def _numpy_type(dtype):
    """The numpy type Tensor.init_data fills for `dtype` (int8 holds qint4x2)."""
    found = _numpy_types.get(dtype)
    if found is None:
        from mindspore.common import dtype as mstype

        found = _numpy_types[dtype] = mstype._dtype_to_nptype(mstype.int8 if dtype == mstype.qint4x2 else dtype)
    return found


@contextlib.contextmanager
def accounting(ledger: Ledger):
    """Lazy parameters made in this thread take their draws into `ledger`;
    a lazy tensor it holds gives its seed back when filled, here or later
    while `giving_back(ledger)` is held."""
    with _FILLING, _ACCOUNTING, holding(ledger=ledger):
        yield ledger


class owing:  # noqa: N801 - a context manager, called as a function is
    """While held, in this thread, a lazy tensor that the ledger knows draws
    once at once owes its draw: code that draws from numpy nowhere else (a
    sibling-clone copy whose trial fill left numpy's state alone) takes the
    owed draws as one batch when it ends. With `templates` ((initializer,
    shape) pairs of every lazy tensor the code makes, copies of them) that
    Ledger.knows_draws, each owes without its key being looked up."""

    __slots__ = ("templates", "ledger")

    def __init__(self, templates=None):
        self.templates, self.ledger = templates, None

    def __enter__(self):
        build = lane.build
        ledger = build.ledger if build is not None else None
        if ledger is None or build.owing or not ledger.batching():
            return None
        known = self.templates is not None and ledger.knows_draws(self.templates)
        self.ledger = ledger
        build.owing, build.known = True, known
        return None

    def __exit__(self, *exc_info):
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            build = lane.build
            build.owing = build.known = False
            ledger.take_owed_draws()


@contextlib.contextmanager
def suspended():
    """No accounting in this thread (objects the plain build does not make: probes, scratch parameters)."""
    with holding(ledger=None):
        yield


@contextlib.contextmanager
def giving_back(ledger: Ledger):
    """Tensors `ledger` accounted for are filled with their own seeds (no new
    accounting: the ledger only gives back)."""
    with _FILLING, holding(ledger=_GiveBackOnly(ledger)):
        yield


class _GiveBackOnly:
    def __init__(self, ledger):
        self.seeds, self.writes = ledger.seeds, ledger.writes
        self.assignments = None

    def take(self, tensor) -> None:
        pass


# -- which classes draw as the tables say, on this mindspore (once per process)

_verdicts = ProbeCache()


def verified_classes() -> tuple[frozenset, frozenset, str | None]:
    """(classes that never draw, classes that draw exactly once, a problem):
    the NO_DRAW / ONE_DRAW classes whose draws and values `_verify` confirmed
    here (any other is run in full), and why accounting cannot be exact at
    all (None when it can)."""
    return _verdicts.get("classes", _verify_or_problem)


def _verify_or_problem():
    try:
        return _verify()
    except Exception as exc:  # an internal it relies on changed
        return frozenset(), frozenset(), f"{type(exc).__name__}: {exc}"


def probe() -> str | None:
    """None when a lazy build that accounts its draws leaves numpy's global
    RandomState and, once filled, the parameters' values exactly as a plain
    build does; else why not."""
    return verified_classes()[2]


def _verify():
    import mindspore as ms
    from mindspore.common import initializer as module

    missing = [name for name in NO_DRAW + ONE_DRAW if not isinstance(getattr(module, name, None), type)]
    if missing or not callable(getattr(module, "_numpy_seed", None)):
        return frozenset(), frozenset(), f"mindspore.common.initializer lacks {', '.join(missing) or '_numpy_seed'}"
    if "init_mode" in vars(ms.Parameter) or "init_data" not in vars(ms.Tensor):
        return frozenset(), frozenset(), "Parameter.init_mode or Tensor.init_data is not where this expects it"
    shapes = ((6, 4), (3, 2, 2))
    # an initializer run in full (a class the tables do not know) must match the plain build
    for name in ("Sparse", "Identity", "Normal", "Constant"):
        reason = _compare_one(ms, module, name, shapes[0], (frozenset(), frozenset()))
        if reason is not None:
            return frozenset(), frozenset(), f"{name} {shapes[0]} run in full: {reason}"
    # a table's class that does not draw as it says is run in full
    tables = (
        frozenset(getattr(module, name) for name in NO_DRAW),
        frozenset(getattr(module, name) for name in ONE_DRAW),
    )
    confirmed = [set(), set()]
    for table, names in enumerate((NO_DRAW, ONE_DRAW)):
        for name in names:
            if all(_compare_one(ms, module, name, shape, tables) is None for shape in shapes):
                confirmed[table].add(getattr(module, name))
    return frozenset(confirmed[0]), frozenset(confirmed[1]), None


def _initializer(module, name):
    kind = getattr(module, name)
    return {"Constant": lambda: kind(0.5), "Sparse": lambda: kind(0.5)}.get(name, kind)()


def _compare_one(ms, module, name, shape, classes) -> str | None:
    """None when two parameters of initializer `name` built lazily with a
    ledger knowing `classes` (the second drawing at once, as a ledger does for
    what it saw reach its draw), then filled, match a plain build: numpy's
    state after the build and the values."""
    from .lazy import unshared_lazy_parameter

    def build(make=ms.Parameter):
        return [make(module.initializer(_initializer(module, name), shape, ms.float32), name=f"p{i}") for i in range(2)]

    state = np.random.get_state()
    try:
        np.random.seed(1234)
        plain = build()
        plain_values, plain_after = [p.asnumpy().tobytes() for p in plain], np.random.get_state()[1].copy()
        np.random.seed(1234)
        ledger = Ledger(classes)
        with accounting(ledger):  # no lock: probed where an import or another lock may be held
            lazy = build(unshared_lazy_parameter)
        lazy_after = np.random.get_state()[1].copy()
        np.random.random()  # draws in between do not change what a fill gives back
        with giving_back(ledger):
            for param in reversed(lazy):
                param.init_data()
        if not np.array_equal(plain_after, lazy_after):
            return "numpy's global state after the lazy build differs"
        if any(p.has_init for p in lazy) or [p.asnumpy().tobytes() for p in lazy] != plain_values:
            return "the filled values differ"
        if ledger.seeds:
            return "a seed was not given back"
    finally:
        np.random.set_state(state)
    return None
