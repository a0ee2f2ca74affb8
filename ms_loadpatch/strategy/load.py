"""One accelerated load running in this thread: what the wrappers of its
calls hand each other, from the first call to the last, kept on one object.

The glue subclasses `Load` once per kind of load and adds its own fields;
a wrapper reaches the load it runs in with `Kind.current()`, which is None
outside a load of that kind. Nested loads (a pipeline loading its
components) each run their own and restore the outer one.
"""

from __future__ import annotations

import contextlib
import os
import time

import mindspore as ms

from . import cooperative, reports
from .building.construction import lazy_construction
from .building.session import BuildSession
from .castread import CastRegistry
from .lane import entered, lane
from .prefetch import CheckpointFiles, start_prefetch, take_or_read
from .safetensors_header import CheckpointError
from .tensors import to_tensor


class Load:
    """State of one accelerated load; ids are of models of this load."""

    library = ""  # the report's library and technique, set by each kind
    technique = ""

    def __init__(self, model_class: str):
        self.report = reports.LoadReport(model_class, self.library)
        self.report.technique = self.technique
        self.cleanup = contextlib.ExitStack()  # everything but the build's window, closed when the load ends
        self.cast_at_read = CastRegistry()  # tensors cast while reading and not yet assigned
        self.cast_plan = None  # what a read of this load casts (castread.CastPlan; None: nothing)
        self.prefetcher = None  # the files read ahead (None: each file read when asked)
        self.listed_tensors: int | None = None  # tensors the checkpoint's index lists (None: no index seen)
        self.keys_read: set[str] = set()  # every key read, checked against the index
        self.last_file: str | None = None  # the file read last, named in errors about its tensors
        self.build: BuildSession | None = None  # its build's session, current while it runs
        self.done = False  # the library's loading path ran to its end
        self.failed = False  # the load raised

    @classmethod
    def current(cls):
        """The load running in this thread, if it is one of this kind, else None."""
        load = lane.load
        return load if isinstance(load, cls) else None

    @contextlib.contextmanager
    def running(self):
        """This load current in this thread for the block; its window and
        cleanup closed after it, also on error, and its report emitted."""
        start = time.perf_counter()
        self.build = BuildSession.inheriting(lane.build)
        with entered("load", self), entered("build", self.build):
            try:
                yield self
            except BaseException:
                self.failed = True  # read by what the cleanup stops: a multi-node read tells the job
                raise
            finally:
                try:
                    self.close_construction()  # also on error: lock and no-init flag released
                finally:
                    try:
                        self.cleanup.close()
                    finally:
                        self.report.total = time.perf_counter() - start
        reports.emit(self.report)

    def start_reading(self, files: CheckpointFiles, cast_plan, progress_bars=None) -> None:
        """Read `files` ahead, in background threads closed with the load, casting what `cast_plan` casts."""
        self.cast_plan = cast_plan
        self.listed_tensors = files.listed_tensors
        # in a multi-node job, read together with the other nodes where they agree; else ahead, alone
        self.prefetcher = cooperative.start(files, self.report, self.cleanup, lambda: self.failed) or start_prefetch(
            files, self.report, self.cleanup, cast_plan, progress_bars
        )

    def checkpoint_tensors(self) -> int | None:
        """The checkpoint's tensor count as far as known before the build: its
        index's count, else those read already (mindone reads a single file
        before it builds the model); None when neither is known."""
        return self.listed_tensors or self.report.tensors_read or None

    @contextlib.contextmanager
    def construction(self, ledger=None):
        """The lazy window of this load's build (construction.lazy_construction), timed in its report."""
        window = lazy_construction(
            checkpoint_tensors=self.checkpoint_tensors(), when_built=self.report.note_construction, ledger=ledger
        )
        with self.report.phase("construct"), window:
            yield

    def close_construction(self) -> None:
        """The build's window closed, if this kind of load keeps one open; also on error."""

    def read(self, path):
        """(arrays, metadata, cast_at_read) of one file: the prefetched read if
        there is one, counted in the report, its keys and name kept for the
        index check and errors."""
        with self.report.phase("read"):
            arrays, metadata, cast_at_read = take_or_read(self.prefetcher, path, self.cast_plan, self.report.files_read)
        self.report.tensors_read += len(arrays)
        self.report.shards += 1
        self.keys_read.update(arrays)
        self.last_file = os.fspath(path)
        return arrays, metadata, cast_at_read

    def tensors_of(self, arrays, cast_at_read) -> dict:
        """name -> Tensor sharing each array; those cast while reading listed in the load's registry."""
        tensors = {name: to_tensor(array) for name, array in arrays.items()}
        self.cast_at_read.add(tensors, cast_at_read)
        return tensors

    def check_index_against_shards(self, files, listed_keys, weight_map) -> None:
        """Refuse a tensor the index lists but no shard read holds (the library
        would leave it randomly initialised without a word), naming the file
        the index points to and the key. `weight_map()`: key -> shard file name."""
        key = next((key for key in listed_keys if key not in self.keys_read), None)
        if key is None:
            return
        shard = weight_map().get(key)
        path = next((f for f in files if os.path.basename(os.fspath(f)) == shard), shard or files[0])
        raise CheckpointError(
            path, "the checkpoint's index lists this tensor in this file, but no shard holds it", key=key
        )

    def mapped_as_unpatched(self, mapping, tensor, name):
        """`mapping(tensor)`, a key's pt -> ms mapping; one that transforms the
        values (Conv1d) of a tensor cast while reading is given the file's
        values (read again), as the unpatched load maps them before any cast."""
        mapped = _mapped(mapping, tensor, name)
        if mapped is not tensor:
            in_file = self.cast_at_read.as_in_file(tensor, self.report)
            mapped = mapped if in_file is tensor else _mapped(mapping, in_file, name)
        return mapped


def _mapped(mapping, tensor, name):
    try:
        return mapping(tensor)
    except AttributeError:  # Conv1d mappings read `.name`, which only a Parameter has
        return mapping(ms.Parameter(tensor, name=name))
