"""A checkpoint read once per job: the nodes of a multi-node job split the
reading, and each chunk one node read reaches every rank over the job's
collective (strategy/job.py), so the shared storage serves each byte once.

The plan (strategy/shares.py) is computed alike on every rank from the
headers: each file's data section in chunks of the probed message size,
handed to the nodes in turn so that each reads about 1/N of the bytes. On
each node its lowest rank reads; every other rank, on its node or another,
receives. Each chunk is
one Broadcast from its reader, whose last word says whether the reader goes
on (it read the chunk, its load did not end); every STATES_EVERY chunks,
and at the end, one small AllReduce gathers every rank's state. All ranks
stop at the same chunk, so none waits for bytes that will never come, and
none returns while another still waits on it.

Staging per rank is the message being sent or received (two chunks at
most); the files' buffers are the read's own, at most AHEAD_FILES not yet
taken by the load.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

from ..activation import env_int
from . import job, page_cache
from .building.lazy import CONSTRUCTION_LOCK
from .prefetch import FileRead
from .ranks import node_share
from .reader import arrays_in
from .safetensors_header import CheckpointError, checkpoint_os_error
from .shares import Chunk, first_read_mb_s, no_read_ahead, plan_chunks, read_layouts
from .threaded_read import (
    COLD_READ_THREADS,
    COLD_READ_THREADS_ENV_VAR,
    ReadPlan,
    data_buffer,
    join_or_leave,
    read_into,
    read_threads,
)

AHEAD_FILES = 2  # files received and not yet taken by the load
AHEAD_CHUNKS = 4  # chunks a reading rank reads before they are sent
# Every rank's state is gathered every this many chunks (a receiving rank
# that abandons the load is heard there); a sender's comes with each chunk.
STATES_EVERY = 8
_SPLIT_FROM = 1 << 20
# each rank's state before a chunk
_GOING_ON, _READ_FAILED, _ABANDONED = 0, 1, 2
# one cooperative schedule at a time per process: collectives pair by order
_SESSION = threading.Lock()
_loads_reading_with_job: set[int] = set()  # threads whose load reads with the job (until it ends)


def _nested() -> bool:
    """A load inside one that reads with the job, or inside a build: every
    rank nests alike, so none enters a collective for it; and the session
    lock comes before CONSTRUCTION_LOCK (locks.LOCK_ORDER), never under it."""
    return threading.get_ident() in _loads_reading_with_job or CONSTRUCTION_LOCK._is_owned()


def take_part_without_loading(state: int = job.NOT_ACCELERATED) -> None:
    """Enter the load's agreement saying this rank will not cooperate (its
    load falls back), so the job's other ranks do not wait for it."""
    if job.job_size() is None or _nested():
        return
    with _SESSION, contextlib.suppress(Exception):
        job.agree(job.Collectives(), job.Statement(state))


def start(files, report, cleanup, failed) -> CooperativeRead | None:
    """In a multi-node job (job.job_size()): agree with every rank on `files`
    and, where the job cooperates, start reading them together, stopped by
    `cleanup` (`failed()`: whether the load raised); None where this rank
    reads alone (the report says why)."""
    if job.job_size() is None:
        return None
    if _nested():
        report.cooperative = "alone: nested in a load that reads with the job or builds"
        return None
    _SESSION.acquire()
    try:
        collectives = job.Collectives()
        share = node_share()
        report.local_ranks, report.rank = share.local_ranks, collectives.rank
        layouts, statement = None, job.Statement(job.NOTHING, probed=job.probed())
        if files:
            try:
                layouts, digest = read_layouts(files)
            except Exception:  # noqa: BLE001 - this rank's own read raises the error naming the file
                statement.state = job.UNREADABLE
            else:
                cached = layouts[0].cached is not None and not page_cache.is_cold(layouts[0].cached)
                statement = job.Statement(job.READY, digest, cached, job.probed())
        try:
            agreement = job.settle(collectives, job.agree(collectives, statement), lambda: first_read_mb_s(layouts[0]))
        except Exception as exc:  # noqa: BLE001 - the collective failed: read alone, as without a job
            report.cooperative = f"alone: the agreement over the job's collective failed ({_first_line(exc)})"
            _SESSION.release()
            return None
        if not agreement.cooperate:
            report.cooperative = f"alone: {agreement.reason}"
            _SESSION.release()
            return None
        # a chunk and its sender's state in one message no larger than the probe passed
        chunk = min(job.chunk_bytes(), job.collective_probe(collectives, agreement.readers).largest) - 64
        read = CooperativeRead(layouts, plan_chunks(layouts, agreement.nodes, chunk), agreement, collectives, report)
        report.cooperative = f"with the job: {agreement.reason}"
        report.staging_bytes = 2 * (chunk + 64)
    except BaseException:
        _SESSION.release()
        raise
    cleanup.callback(read.exit, failed)
    _loads_reading_with_job.add(threading.get_ident())
    read.start()  # the session lock is released when its schedule ends
    return read


def _abandoned_by(ranks) -> RuntimeError:
    return RuntimeError(
        f"ms_loadpatch: rank(s) {', '.join(map(str, ranks))} of the job abandoned the load "
        "(an error or an interrupt there); their logs say why"
    )


def _first_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _File:
    def __init__(self):
        self.buffer = None
        self.done = threading.Event()
        self.started = self.ended = 0.0
        self.taken = False


class CooperativeRead:
    """The files of one load read with the job's other ranks; `take(path)`
    as Prefetcher's. exit(...) (the load's cleanup) lets the schedule run to
    its end without keeping what arrives after a load that ended well, or
    tells every rank at the next chunk that this one abandoned it."""

    progress = None

    def __init__(self, layouts, chunks, agreement, collectives, report):
        self.layouts, self.chunks, self.agreement = layouts, chunks, agreement
        self.collectives = collectives
        self.report = report
        self.rank = collectives.rank
        self.node = agreement.node_of_rank[self.rank]
        self.reads = agreement.readers[self.node] == self.rank
        self._index = {os.path.normpath(layout.path): i for i, layout in enumerate(layouts)}
        self._files = [_File() for _ in layouts]
        self._cond = threading.Condition()
        self._held = 0  # files received and not taken
        self._wanted = -1  # the last file the load waits for
        self._draining = self._abandoned = False
        self._error: BaseException | None = None
        self._read = {}  # chunk index -> None (read) or the exception
        self._ahead = threading.Semaphore(AHEAD_CHUNKS)
        self._stop = threading.Event()
        self._threads = []
        self.sent = self.received = self.read_bytes = 0
        self._load_thread = threading.get_ident()
        self._root = None  # the rank sending the chunk being exchanged (None: all ranks' states)
        # the message sent or received: a chunk and the sender's state
        self._message = np.empty(max((c.end - c.begin + 3) // 4 for c in chunks) + 1 if chunks else 1, np.int32)

    # -- the load's side

    def start(self) -> None:
        transfer = threading.Thread(target=self._transfer, name="ms_loadpatch-cooperative", daemon=True)
        self._threads.append(transfer)
        if self.reads:
            self._threads.append(threading.Thread(target=self._read_owned, name="ms_loadpatch-read-own", daemon=True))
        for thread in self._threads:
            thread.start()

    def predicted(self, path) -> bool:
        return os.path.normpath(os.fspath(path)) in self._index

    def take(self, path, reads: list | None = None):
        """(arrays, metadata, {}) of `path` once it has arrived, None for a
        file not in the plan; the job's error where the schedule stopped."""
        index = self._index.get(os.path.normpath(os.fspath(path)))
        if index is None or self._files[index].taken:
            return None
        file = self._files[index]
        with self._cond:
            self._wanted = max(self._wanted, index)
            self._cond.notify_all()
        while not file.done.wait(0.05):  # short waits: an interrupt is seen
            if not self._threads[0].is_alive():
                break
        if not file.done.is_set():
            raise self._error or RuntimeError(f"ms_loadpatch: the cooperative read ended before {path} arrived")
        layout = self.layouts[index]
        arrays = arrays_in(layout.path, layout.header, file.buffer)
        file.buffer, file.taken = None, True
        with self._cond:
            self._held -= 1
            self._cond.notify_all()
        if reads is not None:
            reads.append(FileRead(layout.path, layout.data_len, file.started, file.ended, layout.cached, 1))
        return arrays, layout.header.metadata, {}

    def exit(self, failed) -> None:
        """The load ended (`failed()`: with an error): what remains of the schedule runs out without keeping data,
        or, after an error, every rank is told at the next chunk; the threads joined."""
        with self._cond:
            if failed():
                self._abandoned = True
            self._draining = True
            self._cond.notify_all()
        try:
            self._threads[0].join()
        finally:
            _loads_reading_with_job.discard(self._load_thread)
            self._stop.set()
            join_or_leave(self._threads[1:], self._stop, "the cooperative read")
        self.report.bytes_from_storage, self.report.bytes_received = self.read_bytes, self.received

    # -- the schedule

    def _buffer(self, index: int):
        with self._cond:
            file = self._files[index]
            if file.buffer is None:
                layout = self.layouts[index]
                file.buffer = data_buffer(layout.path, layout.data_len)
            return file.buffer

    def _wait_for_slot(self, index: int) -> bool:
        """Until `index` may be received (AHEAD_FILES held at most, unless the load waits for it);
        False when the load has ended and nothing received is kept."""
        with self._cond:
            while self._held >= AHEAD_FILES and self._wanted < index and not self._draining:
                self._cond.wait()
            if self._draining:
                return False
            self._held += 1
            return True

    def _transfer(self) -> None:
        keep = {}
        try:
            for index, layout in enumerate(self.layouts):
                if layout.data_len == 0:
                    self._files[index].buffer = np.empty(0, dtype=np.uint8)
                    self._files[index].done.set()
            for number, chunk in enumerate(self.chunks):
                layout, file = self.layouts[chunk.file], self._files[chunk.file]
                if chunk.begin == 0:
                    keep[chunk.file] = self._wait_for_slot(chunk.file)
                    file.started = time.perf_counter()
                if number and number % STATES_EVERY == 0 and not self._states_agree():
                    return
                root = self._root = self.agreement.readers[chunk.node]
                state = self._exchange(number, chunk, root, keep[chunk.file])
                if root == self.rank:
                    self._ahead.release()
                if state != _GOING_ON:
                    self._fail_at(state, chunk, root)
                    return
                if chunk.end == layout.data_len:
                    file.ended = time.perf_counter()
                    if not keep[chunk.file]:
                        file.buffer = None
                    file.done.set()
            self._states_agree()
        except Exception as exc:  # noqa: BLE001 - the collective failed: the load raises it
            root = self._root
            peers = [root] if root is not None and root != self.rank else self._others()
            self._error = RuntimeError(
                f"ms_loadpatch: the job's collective failed on rank {self.rank} while it exchanged the checkpoint "
                f"with rank(s) {', '.join(map(str, peers))} ({_first_line(exc)}): a rank may have died or left "
                "the load"
            )
        finally:
            self._stop.set()
            for _ in range(AHEAD_CHUNKS):
                self._ahead.release()
            _SESSION.release()

    def _others(self) -> list[int]:
        return [rank for rank in range(self.collectives.size) if rank != self.rank]

    def _mine(self) -> int:
        with self._cond:
            return _ABANDONED if self._abandoned else _GOING_ON

    def _states_agree(self) -> bool:
        """Every rank's state (one AllReduce): what a receiving rank says only here; False, the error set, where
        one abandoned the load."""
        self._root = None
        states = self.collectives.states(self._mine())
        gone = [rank for rank, state in enumerate(states) if state]
        if not gone:
            return True
        if gone != [self.rank]:
            self._error = _abandoned_by([rank for rank in gone if rank != self.rank])
        return False

    def _exchange(self, number: int, chunk: Chunk, root: int, keep: bool) -> int:
        """`chunk` sent by `root` to every rank, with root's state in the message's last word; that state."""
        length = chunk.end - chunk.begin
        words = -(-length // 4)
        message = self._message[: words + 1]
        if root == self.rank:
            state = self._mine()
            if state == _GOING_ON:
                with self._cond:
                    while number not in self._read:  # being read by this rank's reader
                        self._cond.wait()
                    if self._read.pop(number) is not None:
                        state = _READ_FAILED
            if state == _GOING_ON:
                message.view(np.uint8)[:length] = self._buffer(chunk.file)[chunk.begin : chunk.end]
            message[words] = state
            self.collectives.broadcast(message, root)
            self.sent += length
            return state
        got = self.collectives.broadcast(message, root)
        state = int(got[words])
        if state == _GOING_ON:
            self.received += length
            if keep:
                self._buffer(chunk.file)[chunk.begin : chunk.end] = got.view(np.uint8)[:length]
        return state

    def _fail_at(self, state: int, chunk: Chunk, root: int) -> None:
        if root == self.rank:
            return  # this rank's own error: the reader's, or the load's that abandoned
        if state == _READ_FAILED:
            self._error = CheckpointError(
                self.layouts[chunk.file].path,
                f"rank {root} could not read bytes {chunk.begin}-{chunk.end} of its data for the job "
                "(that rank's error says why)",
            )
        else:
            self._error = _abandoned_by([root])

    def _read_owned(self) -> None:
        """This node's chunks from storage, in the order they are sent, at most AHEAD_CHUNKS ahead."""
        fds = {}
        try:
            for number, chunk in enumerate(self.chunks):
                if chunk.node != self.node:
                    continue
                self._ahead.acquire()
                if self._stop.is_set():
                    return
                try:
                    self._read_chunk(chunk, fds)
                    outcome = None
                except BaseException as exc:  # noqa: BLE001 - raised by the load, told to the job
                    self._error = outcome = exc
                with self._cond:
                    self._read[number] = outcome
                    self._cond.notify_all()
                if outcome is not None:
                    return
        finally:
            for fd in fds.values():
                if page_cache.policy() == page_cache.DROP and hasattr(os, "posix_fadvise"):
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

    def _read_chunk(self, chunk: Chunk, fds: dict) -> None:
        layout = self.layouts[chunk.file]
        fd = fds.get(chunk.file)
        if fd is None:
            try:
                fd = fds[chunk.file] = os.open(layout.path, os.O_RDONLY)
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise checkpoint_os_error(layout.path, exc) from exc
            no_read_ahead(fd)
            if size != layout.size:
                raise CheckpointError(layout.path, "the file changed since the job agreed on it")
        view = self._buffer(chunk.file)[chunk.begin : chunk.end]
        threads = (
            (env_int(COLD_READ_THREADS_ENV_VAR) or COLD_READ_THREADS) if page_cache.is_cold(layout.cached) else None
        )
        plan = ReadPlan(threads or read_threads(), _SPLIT_FROM, cold=threads is not None)
        try:
            got = read_into(
                fd, view, layout.header.data_start + chunk.begin, plan, self._stop, f"the read of {layout.path}"
            )
        except CheckpointError:
            raise
        except OSError as exc:
            raise checkpoint_os_error(layout.path, exc) from exc
        if got != len(view):
            raise CheckpointError(
                layout.path, f"read {got} of {len(view)} bytes at {chunk.begin}: the file changed or is truncated"
            )
        self.read_bytes += got


__all__ = ["CooperativeRead", "start", "take_part_without_loading"]
