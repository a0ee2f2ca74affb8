"""The report of one accelerated load: its phases, counts and technique, and
the last one of the process (`ms_loadpatch.last_report()`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..activation import env_flag
from .building import window

logger = logging.getLogger("ms_loadpatch.report")
REPORT_ENV_VAR = "MS_LOADPATCH_REPORT"


class LoadReport:
    """Phases and their seconds, tensors cast, technique used: one per load."""

    def __init__(self, model_class: str, library: str):
        self.model_class = model_class
        self.library = library
        self.phases: dict[str, float] = {}
        self.tensors_read = 0
        self.tensors_assigned = 0
        self.tensors_cast = 0
        self.tensors_cast_while_reading = 0  # of tensors_cast: cast as they were read (castread)
        self.tensors_read_again = 0  # cast while reading, but their parameter needed the file's values
        self.missing_initialised = 0  # parameters the checkpoint lacked, given their unpatched values
        # lazy parameters' random draws (strategy/building/draws.py, transformers): taken when made,
        # initializers run in full for want of a known draw, parameters the init pass read and so filled
        self.draws_taken = 0
        self.initializers_run_in_full = 0
        self.filled_in_init_pass = 0
        self.writes_deferred = 0  # in-place writes of the init pass on lazy parameters, recorded (deferred_writes)
        self.init_calls_replayed = 0  # init-pass calls on cells copied from one recipe, replayed
        self.shards = 0
        self.files_read: list = []  # prefetch.FileRead per checkpoint file, in the order taken
        self.read_workers = 1  # files read at once (HF_ENABLE_PARALLEL_LOADING)
        self.read_threads = 1  # threads reading one large file, this rank's share of the node
        self.local_ranks = 1  # ranks of a distributed job on this node (strategy/ranks.py)
        self.rank = None
        # a multi-node job (strategy/cooperative.py): read with the other nodes or alone, and why;
        # this rank's bytes read from storage and received (a leader over its channel, a follower from the node); staging
        self.cooperative = None
        self.bytes_from_storage = None
        self.bytes_received = None
        self.staging_bytes = None
        self.technique = ""
        self.fast_construction_from = None  # the cell where fast construction engaged (None: built plainly)
        self.cells_copied = 0  # cells sibling-clone copied from a recipe
        self.not_copied: dict[str, str] = {}  # class built more than once, never copied -> the first reason
        self.host_tensors = 0  # mint / ops factory results host-factories made from host memory
        self.gc_paused = False  # cyclic garbage collection paused for the whole load (gc-pause)
        self.total = 0.0

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def note_construction(self) -> None:
        """After the construction window closed: where its fast paths engaged
        (only a window of its own: a nested load's belongs to the outer one)."""
        if not window.window_open():
            self.fast_construction_from = window.state.engaged_at
            build = window.last_build() or {}
            self.cells_copied = build.get("cells_copied", 0)
            self.not_copied = build.get("not_copied", {})
            self.host_tensors = build.get("host_tensors", 0)

    @property
    def bytes_read(self) -> int:
        return sum(read.bytes for read in self.files_read)

    def as_dict(self) -> dict:
        fields = dict(vars(self))
        fields["files_read"] = [read.as_dict() for read in self.files_read]
        fields["bytes_read"] = self.bytes_read
        fields["read_seconds"] = self.read_seconds()
        return fields

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.phases.items())
        return (
            f"{self.library} {self.model_class}: {self.total:.3f}s ({phases}); "
            f"{self.tensors_read} tensors read from {self.shards} file(s){self._bytes_text()} "
            f"with {self.read_workers} worker(s) "
            f"of up to {self.read_threads} thread(s){self._rank_text()}, "
            f"{self.tensors_assigned} assigned, {self.tensors_cast} cast{self._cast_text()}, "
            f"{self.missing_initialised} parameters initialised for missing weights{self._draws_text()}; "
            f"technique: {self.technique}{self._construction_text()}"
        )

    def _draws_text(self) -> str:
        if not (self.draws_taken or self.initializers_run_in_full or self.filled_in_init_pass or self.writes_deferred):
            return ""
        return (
            f", {self.draws_taken} random draws taken for lazy parameters ({self.initializers_run_in_full} "
            f"initializers run in full, {self.filled_in_init_pass} parameters filled in the init pass, "
            f"{self.writes_deferred} in-place writes deferred, {self.init_calls_replayed} of its calls replayed)"
        )

    def read_seconds(self) -> float:
        """Seconds in which some checkpoint file was being read (reads overlap
        each other, and waits for a slot fall between them)."""
        total, end = 0.0, None
        for read in sorted(self.files_read, key=lambda r: r.started):
            if end is None or read.started > end:
                total += read.ended - read.started
                end = read.ended
            elif read.ended > end:
                total += read.ended - end
                end = read.ended
        return total

    def _bytes_text(self) -> str:
        """Bytes read, the seconds some read was running, and how many files
        came mostly from storage."""
        if not self.files_read:
            return ""
        megabytes, seconds = self.bytes_read / 1e6, self.read_seconds()
        rate = f", {megabytes / seconds:.0f} MB/s" if seconds > 0 else ""
        cold = [r for r in self.files_read if r.cold]
        threads = f", read with {max(r.threads for r in cold)} threads" if cold else ""
        return f" ({megabytes:.1f} MB in {seconds:.3f}s{rate}; {len(cold)} of {len(self.files_read)} cold{threads})"

    def _cast_text(self) -> str:
        return cast_detail(self.tensors_cast_while_reading, self.tensors_read_again)

    def _construction_text(self) -> str:
        start = self.fast_construction_from
        text = "" if start is None else f", fast construction from cell {start} ({self.cells_copied} cells copied)"
        if self.host_tensors:
            text += f", {self.host_tensors} factory tensors made on the host"
        return text + (", gc paused" if self.gc_paused else "")

    def _rank_text(self) -> str:
        if self.local_ranks == 1 and self.rank is None and self.cooperative is None:
            return ""
        rank = f"rank {self.rank}, " if self.rank is not None else ""
        job = ""
        if self.cooperative is not None:
            job = f"; read {self.cooperative}"
            if self.bytes_received is not None:
                job += (
                    f": {self.bytes_from_storage / 1e6:.1f} MB from storage, {self.bytes_received / 1e6:.1f} MB "
                    f"received, staging up to {self.staging_bytes / 1e6:.0f} MB"
                )
        return f" ({rank}{self.local_ranks} rank(s) on this node){job}"


def cast_detail(while_reading: int, read_again: int) -> str:
    """The text after a cast count: ' (N while reading, M read again)', or '' when both are 0."""
    if not while_reading and not read_again:
        return ""
    return f" ({while_reading} while reading, {read_again} read again)"


_last_reports: list[LoadReport] = []


def last_report() -> LoadReport | None:
    """The report of the most recent accelerated load in this process."""
    return _last_reports[-1] if _last_reports else None


def report_requested() -> bool:
    return env_flag(REPORT_ENV_VAR)


_handler_lock = threading.Lock()
_stderr_handler: logging.Handler | None = None


def _has_other_handler() -> bool:
    node = logger
    while node is not None:
        if any(h is not _stderr_handler for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def _make_visible() -> None:
    """MS_LOADPATCH_REPORT=1 asks to see reports whatever the app's logging
    setup, but the root logger is the app's: when nothing handles our records,
    print them with a handler of our own, dropped once the app adds one."""
    global _stderr_handler
    with _handler_lock:
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if _has_other_handler():
            if _stderr_handler is not None:
                logger.removeHandler(_stderr_handler)
                _stderr_handler = None
        elif _stderr_handler is None:
            _stderr_handler = logging.StreamHandler()
            _stderr_handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(_stderr_handler)


def emit(report: LoadReport) -> None:
    """Make `report` the last one (and log it): at the end of every accelerated load."""
    _last_reports[:] = [report]
    if report_requested():
        _make_visible()
        logger.info("%s", report.summary())
    else:
        logger.debug("%s", report.summary())
