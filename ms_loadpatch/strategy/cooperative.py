"""A checkpoint read once per job: the nodes of a multi-node job split the
reading, one rank per node (its leader) reads, the leaders hand each other
the bytes over a channel of their own, and each node's other ranks (its
followers) take them from memory the node shares.

1. The ranks meet out of band (strategy/meeting.py), keyed by the files:
   every rank of the job in the same load within the wait, or each reads
   alone. A job the launcher puts on one node never meets at all.
2. Every rank concludes the same from the same statements (job.conclude);
   the leaders then probe their channel once per process
   (strategy/leaders.py) and, under `auto`, time the storage with all of
   them reading (job.choose). Each leader tells its followers the verdict.
3. The plan (shares.plan_rounds): rounds of one chunk per node. Each round
   is one AllReduce among the leaders carrying every leader's chunk and
   state (going on, read failed, abandoned), so all leaders stop at the
   same round; the leader then writes the round to the node's staging
   (strategy/node_staging.py), which its followers copy from.

Files arrive in order into the buffers the load takes (`take`, as the
read-ahead's), at most AHEAD_FILES not yet taken.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time

import numpy as np

from ..activation import env_int
from . import job, leaders, meeting, node_staging, page_cache
from .building.lazy import CONSTRUCTION_LOCK
from .prefetch import FileRead
from .ranks import node_share
from .reader import arrays_in
from .safetensors_header import CheckpointError, checkpoint_os_error
from .shares import Chunk, first_read_mb_s, no_read_ahead, plan_rounds, read_layouts
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
AHEAD_ROUNDS = 4  # rounds a leader reads its chunk for before they are exchanged
_SPLIT_FROM = 1 << 20
# each leader's state in a round
_GOING_ON, _READ_FAILED, _ABANDONED = 0, 1, 2
# one cooperative schedule at a time per process: a meeting's count and the leaders' rounds pair by order
_SESSION = threading.Lock()
_loads_reading_with_job: set[int] = set()  # threads whose load reads with the job (until it ends)


def _nested() -> bool:
    """A load inside one that reads with the job, or inside a build: it reads alone without meeting anyone;
    and the session lock comes before CONSTRUCTION_LOCK (locks.LOCK_ORDER), never under it."""
    return threading.get_ident() in _loads_reading_with_job or CONSTRUCTION_LOCK._is_owned()


def start(files, report, cleanup, failed):
    """In a job of several nodes (job.job_size(), job.one_node()): meet every rank about `files` and, where
    they agree, start reading them together, stopped by `cleanup` (`failed()`: whether the load raised);
    None where this rank reads alone (the report says why)."""
    size = job.job_size()
    if size is None or not files:
        return None
    if _nested():
        report.cooperative = "alone: nested in a load that reads with the job or builds"
        return None
    one_node = job.one_node(size)
    if one_node is not None:
        report.cooperative = f"alone: {one_node}"
        return None
    _SESSION.acquire()
    try:
        read = _meet(files, report, size)
    except BaseException:
        _SESSION.release()
        raise
    if read is None:
        _SESSION.release()
        return None
    cleanup.callback(read.exit, failed)
    _loads_reading_with_job.add(threading.get_ident())
    read.start()  # the session lock is released when its schedule ends
    return read


def _meet(files, report, size):
    rank = job.job_rank()
    report.local_ranks, report.rank = node_share().local_ranks, rank
    try:
        layouts, digest = read_layouts(files)
    except Exception:  # noqa: BLE001 - this rank's own read raises the error naming the file
        report.cooperative = "alone: its checkpoint's headers could not be read"
        return None
    wait = job.wait_seconds()
    store = meeting.store(wait)
    if store.client is None:
        report.cooperative = f"alone: {store.problem}"
        return None
    cached = layouts[0].cached is not None and not page_cache.is_cold(layouts[0].cached)
    settings = hashlib.sha256(json.dumps(job.settings()).encode()).hexdigest()[:16]
    key = f"{digest}/{settings}"
    try:
        met = meeting.meet(store.client, key, job.statement(cached), rank, size, wait)
    except Exception as exc:  # noqa: BLE001 - the store failed: read alone, as without a job
        meeting.give_up(store, exc)
        report.cooperative = f"alone: the meeting in the job's store failed ({job.first_line(exc)})"
        return None
    if isinstance(met, str):
        report.cooperative = f"alone: {met}"
        return None
    statements, held = met
    agreement = job.conclude(statements)
    if not agreement.cooperate:
        report.cooperative = f"alone: {agreement.reason}"
        return None
    node = agreement.node_of_rank[rank]
    chunk = job.chunk_bytes(agreement.nodes)
    rounds = plan_rounds(layouts, agreement.nodes, chunk)
    path = node_staging.staging_path(f"{store.address}/{key}/{held}", node)
    slot_bytes = agreement.nodes * chunk
    followers = agreement.followers(node)
    if rank != agreement.leaders[node]:
        reader = node_staging.StagingReader.open(
            path, followers.index(rank), agreement.pids[agreement.leaders[node]], slot_bytes, wait
        )
        if reader is None:
            report.cooperative = f"alone: the node's leader (rank {agreement.leaders[node]}) shared nothing in {wait} s"
            return None
        together, reason = reader.verdict()
        if not together:
            reader.leave()
            report.cooperative = f"alone: {reason}"
            return None
        report.cooperative = f"with the job: {reason}, served by the node's leader (rank {agreement.leaders[node]})"
        report.staging_bytes = node_staging.SLOTS * slot_bytes
        return FollowerRead(layouts, rounds, reader, report)
    staging = None
    if followers:
        try:
            staging = node_staging.StagingWriter(path, [agreement.pids[f] for f in followers], slot_bytes)
        except OSError:  # no room in the node's memory: the followers find nothing and read alone
            staging = None
    try:
        agreement = _choose(agreement, rank, layouts, chunk, store, f"{key}/{held}")
    except BaseException as exc:
        if staging is not None:
            staging.verdict(False, f"the node's leader failed to agree with the others ({job.first_line(exc)})")
            staging.close()
            staging = None
        if not isinstance(exc, Exception):
            raise
        agreement.cooperate = False  # the channel could not be made: every leader meets the same error
        agreement.reason = f"the leaders' channel could not be made ({job.first_line(exc)})"
    if staging is not None:
        staging.verdict(agreement.cooperate, agreement.reason)
    if not agreement.cooperate:
        if staging is not None:
            staging.close()
        report.cooperative = f"alone: {agreement.reason}"
        return None
    report.cooperative = f"with the job: {agreement.reason}"
    report.staging_bytes = leaders.channel(agreement.leaders, rank).round_bytes(chunk) + (
        node_staging.SLOTS * slot_bytes if staging is not None else 0
    )
    return LeaderRead(layouts, rounds, agreement, rank, report, staging)


def _choose(agreement, rank, layouts, chunk, store, meeting_key):
    """The leaders' choice, the same on each. `auto`: alone where every node has the checkpoint cached (no
    channel made); else each leader times its first read right after they met (all reading at once) and
    says it in the store, and the channel (made and probed once per process) decides. `on`: the channel."""
    auto = job.mode() == job.AUTO
    if auto and (agreement.cached or agreement.nodes > job.AUTO_MOST_NODES):
        return job.choose(agreement, [], 0.0, None)  # alone, no channel made
    node, wait, rates = agreement.node_of_rank[rank], job.wait_seconds(), []
    if auto:
        said = {"storage": first_read_mb_s(layouts[0])}
        met = meeting.meet(store.client, f"{meeting_key}/leaders", said, node, agreement.nodes, wait)
        if isinstance(met, str):
            agreement.cooperate, agreement.reason = False, f"the leaders did not all time their storage: {met}"
            return agreement
        rates = [leader["storage"] for leader in met[0]]

    def agree(transport, ok) -> bool:
        """Whether every leader's check of the channel's probe passed (one leader's bytes may arrive changed
        where another's do not): they meet on it in the store."""
        met = meeting.meet(store.client, f"{meeting_key}/probe/{transport}", {"ok": ok}, node, agreement.nodes, wait)
        return not isinstance(met, str) and all(leader["ok"] for leader in met[0])

    channel = leaders.channel(agreement.leaders, rank, chunk, agree)
    agreement = job.choose(agreement, rates, channel.bytes_per_s / 1e6, channel.problem)
    if agreement.cooperate:
        agreement.reason += f"; transport: {channel.transport}"
    return agreement


def _abandoned_by(ranks) -> RuntimeError:
    return RuntimeError(
        f"ms_loadpatch: rank(s) {', '.join(map(str, ranks))} of the job abandoned the load "
        "(an error or an interrupt there); their logs say why"
    )


class _File:
    def __init__(self, chunks: int):
        self.buffer = None
        self.done = threading.Event()
        self.started = self.ended = 0.0
        self.taken = False
        self.missing = chunks  # chunks not arrived yet


class _Arrivals:
    """Files arriving into buffers the load takes (`take(path)`, as Prefetcher's), round by round; exit(...)
    (the load's cleanup) lets the schedule run to its end without keeping what arrives after a load that
    ended well."""

    progress = None
    thread_name = ""

    def __init__(self, layouts, rounds, report):
        self.layouts, self.rounds, self.report = layouts, rounds, report
        self._index = {os.path.normpath(layout.path): i for i, layout in enumerate(layouts)}
        counts = [0] * len(layouts)
        for chunks in rounds:
            for chunk in chunks:
                counts[chunk.file] += 1
        self._files = [_File(count) for count in counts]
        self._keep = [False] * len(layouts)
        self._begun: set[int] = set()  # files a round has started
        self._cond = threading.Condition()
        self._held = 0  # files received and not taken
        self._wanted = -1  # the last file the load waits for
        self._draining = self._abandoned = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.received = self.read_bytes = 0
        self._load_thread = threading.get_ident()

    def start(self) -> None:
        self._threads.insert(0, threading.Thread(target=self._run, name=self.thread_name, daemon=True))
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
        """The load ended (`failed()`: with an error): what remains of the schedule runs out without keeping
        data, or, after an error, the others are told; the threads joined."""
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

    def _run(self) -> None:
        try:
            self._schedule()
        finally:
            self._stop.set()
            _SESSION.release()

    def _schedule(self) -> None:
        raise NotImplementedError

    def _buffer(self, index: int):
        with self._cond:
            file = self._files[index]
            if file.buffer is None:
                layout = self.layouts[index]
                file.buffer = data_buffer(layout.path, layout.data_len)
            return file.buffer

    def _begin_round(self, chunks) -> None:
        """Each file the round starts (its first chunk in round order, not always its first bytes): a slot
        among the files held (AHEAD_FILES, unless the load waits for it), or not kept once the load ended."""
        for chunk in chunks:
            if chunk.file not in self._begun:
                self._begun.add(chunk.file)
                with self._cond:
                    while self._held >= AHEAD_FILES and self._wanted < chunk.file and not self._draining:
                        self._cond.wait()
                    self._keep[chunk.file] = not self._draining
                    self._held += self._keep[chunk.file]
                self._files[chunk.file].started = time.perf_counter()

    def _arrived(self, chunk: Chunk) -> None:
        file = self._files[chunk.file]
        file.missing -= 1
        if file.missing == 0:
            file.ended = time.perf_counter()
            if not self._keep[chunk.file]:
                file.buffer = None
            file.done.set()

    def _empty_files_done(self) -> None:
        for index, layout in enumerate(self.layouts):
            if layout.data_len == 0:
                self._files[index].buffer = np.empty(0, dtype=np.uint8)
                self._files[index].done.set()

    def _mine(self) -> int:
        with self._cond:
            return _ABANDONED if self._abandoned else _GOING_ON


class LeaderRead(_Arrivals):
    """A node leader's side: its chunks read from storage, the rounds exchanged with the other leaders, each
    round then staged for the node's followers."""

    thread_name = "ms_loadpatch-cooperative"

    def __init__(self, layouts, rounds, agreement, rank, report, staging):
        super().__init__(layouts, rounds, report)
        self.agreement, self.rank, self.staging = agreement, rank, staging
        self.node = agreement.node_of_rank[rank]
        self.channel = leaders.channel(agreement.leaders, rank)  # made and probed by the choice
        self._read: dict[int, BaseException | None] = {}  # round -> None (its chunk read) or the exception
        self._ahead = threading.Semaphore(AHEAD_ROUNDS)
        self._threads.append(threading.Thread(target=self._read_owned, name="ms_loadpatch-read-own", daemon=True))

    def _schedule(self) -> None:
        well = False
        try:
            self._empty_files_done()
            for number, chunks in enumerate(self.rounds):
                self._begin_round(chunks)
                states = self._exchange(number, chunks)
                if any(c.node == self.node for c in chunks):
                    self._ahead.release()  # the reader may read one round further
                failed = [(rank, state) for rank, state in zip(self.agreement.leaders, states) if state != _GOING_ON]
                if failed:
                    self._fail_at(failed, chunks)
                    return
                if self.staging is not None:
                    self._stage(number, chunks)
                for chunk in chunks:
                    self._arrived(chunk)
            well = True
        except Exception as exc:  # noqa: BLE001 - the channel failed: the load raises it
            others = [rank for rank in self.agreement.leaders if rank != self.rank]
            self._error = RuntimeError(
                f"ms_loadpatch: the leaders' channel failed on rank {self.rank} while it exchanged the checkpoint "
                f"with rank(s) {', '.join(map(str, others))} ({job.first_line(exc)}): a rank may have died or left "
                "the load"
            )
        finally:
            for _ in range(AHEAD_ROUNDS):
                self._ahead.release()
            if self.staging is not None:
                self.staging.end(well)
                self.staging.close()

    def _stage(self, number: int, chunks) -> None:
        """The round for the node's followers; staging that fails (no room in the node's memory) is given up,
        the followers read from storage themselves and this load goes on."""
        try:
            self.staging.publish(number, [self._buffer(c.file)[c.begin : c.end] for c in chunks])
        except OSError:
            self.staging.end(False)
            self.staging.close()
            self.staging = None

    def _exchange(self, number: int, chunks) -> list[int]:
        """One round: this node's chunk (read by this rank's reader) and state out, every leader's in."""
        mine = next((c for c in chunks if c.node == self.node), None)
        state = self._mine()
        if mine is not None and state == _GOING_ON:
            with self._cond:
                while number not in self._read:  # being read by this rank's reader
                    self._cond.wait()
                if self._read.pop(number) is not None:
                    state = _READ_FAILED
        data = self._buffer(mine.file)[mine.begin : mine.end] if mine is not None and state == _GOING_ON else None
        lengths = [0] * self.agreement.nodes  # as planned, the same on every leader whatever its state
        for chunk in chunks:
            lengths[chunk.node] = chunk.end - chunk.begin
        states, payloads = self.channel.exchange(data, state, lengths)
        if all(s == _GOING_ON for s in states):
            for chunk in chunks:
                if chunk.node != self.node:
                    self._buffer(chunk.file)[chunk.begin : chunk.end] = payloads[chunk.node]
                    self.received += chunk.end - chunk.begin
        return states

    def _fail_at(self, failed, chunks) -> None:
        others = [(rank, state) for rank, state in failed if rank != self.rank]
        if not others:
            return  # this rank's own error: the reader's, or the load's that abandoned
        rank, state = others[0]
        if state == _READ_FAILED:
            chunk = next(c for c in chunks if self.agreement.leaders[c.node] == rank)
            self._error = CheckpointError(
                self.layouts[chunk.file].path,
                f"rank {rank} could not read bytes {chunk.begin}-{chunk.end} of its data for the job "
                "(that rank's error says why)",
            )
        else:
            self._error = _abandoned_by([r for r, _ in others])

    def _read_owned(self) -> None:
        """This node's chunks from storage, in the order they are exchanged, at most AHEAD_ROUNDS ahead."""
        fds = {}
        try:
            for number, chunks in enumerate(self.rounds):
                chunk = next((c for c in chunks if c.node == self.node), None)
                if chunk is None:
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
            _close_all(fds)

    def _read_chunk(self, chunk: Chunk, fds: dict) -> None:
        layout = self.layouts[chunk.file]
        self.read_bytes += _read_span(layout, chunk.begin, self._buffer(chunk.file), fds, self._stop, chunk.end)


class FollowerRead(_Arrivals):
    """A follower's side: each round copied from the node's staging; where the leader stops serving it, what
    it still lacks read from storage."""

    thread_name = "ms_loadpatch-follower"

    def __init__(self, layouts, rounds, reader, report):
        super().__init__(layouts, rounds, report)
        self.reader = reader

    def _schedule(self) -> None:
        try:
            self._empty_files_done()
            for number, chunks in enumerate(self.rounds):
                if self._draining:
                    return  # the load ended: the leader no longer waits for this rank
                self._begin_round(chunks)
                problem = self.reader.wait_round(number, lambda: self._draining)
                if problem is None:
                    offset = 0
                    for chunk in chunks:
                        length = chunk.end - chunk.begin
                        if self.reader.read(number, offset, self._buffer(chunk.file)[chunk.begin : chunk.end]) < length:
                            problem = "the node's staging was cut short"
                        offset += length
                    if problem is None and not self.reader.consumed(number):
                        problem = "the node's leader went on without it (it fell behind)"
                if problem is not None:
                    if not self._draining:
                        self._read_rest(problem)
                    return
                self.received += sum(c.end - c.begin for c in chunks)
                for chunk in chunks:
                    self._arrived(chunk)
        except BaseException as exc:  # noqa: BLE001 - raised by the load
            self._error = exc
        finally:
            self.reader.leave()

    def _read_rest(self, why: str) -> None:
        """Every file not yet whole, read from storage by this rank."""
        self.report.cooperative += f"; then alone: {why}"
        fds = {}
        try:
            for index, layout in enumerate(self.layouts):
                file = self._files[index]
                if file.done.is_set():
                    continue
                self._begin_round([Chunk(index, 0, layout.data_len, -1)])
                self.read_bytes += _read_span(layout, 0, self._buffer(index), fds, self._stop)
                file.missing = 1
                self._arrived(Chunk(index, 0, layout.data_len, -1))
        finally:
            _close_all(fds)


def _read_span(layout, begin: int, buffer, fds: dict, stop, end: int | None = None) -> int:
    """Bytes begin..end of `layout`'s data section (end: the chunk's, else the section's) from storage into
    `buffer` at the same place; the count read."""
    fd = fds.get(layout.path)
    if fd is None:
        try:
            fd = fds[layout.path] = os.open(layout.path, os.O_RDONLY)
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise checkpoint_os_error(layout.path, exc) from exc
        no_read_ahead(fd)
        if size != layout.size:
            raise CheckpointError(layout.path, "the file changed since the job agreed on it")
    view = buffer[begin : layout.data_len if end is None else end]
    threads = (env_int(COLD_READ_THREADS_ENV_VAR) or COLD_READ_THREADS) if page_cache.is_cold(layout.cached) else None
    plan = ReadPlan(threads or read_threads(), _SPLIT_FROM, cold=threads is not None)
    try:
        got = read_into(fd, view, layout.header.data_start + begin, plan, stop, f"the read of {layout.path}")
    except CheckpointError:
        raise
    except OSError as exc:
        raise checkpoint_os_error(layout.path, exc) from exc
    if got != len(view):
        raise CheckpointError(
            layout.path, f"read {got} of {len(view)} bytes at {begin}: the file changed or is truncated"
        )
    return got


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        if page_cache.policy() == page_cache.DROP and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def status() -> dict:
    """MS_LOADPATCH_COOPERATIVE, the job's store and the leaders' channels, where reached."""
    return {
        "env_var": job.ENV_VAR,
        "mode": job.mode(),
        "job_ranks": job.job_size(),
        "node": job.node_identity(),
        "store": meeting.status(),
        "leader_channels": leaders.status(),
    }


__all__ = ["FollowerRead", "LeaderRead", "start", "status"]
