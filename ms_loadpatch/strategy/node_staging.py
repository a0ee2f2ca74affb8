"""How a node's leader hands what it read and received to the node's other
ranks (its followers), through memory the node shares and no collective: a
small file in /dev/shm (tmpfs; the temporary directory where there is none)
of SLOTS round-sized slots after a header of counters. The leader writes a
round into its slot, then counts it published; a follower copies the round
into its own buffers, then counts it consumed. A slot is written again only
once every follower still taking part consumed it.

Bounded waits on both sides: a leader drops a follower whose process ended
or that consumed nothing for FOLLOWER_WAIT seconds while a slot waited on
it, and goes on; a follower whose leader's process ended, that published
nothing for LEADER_STALL seconds, that ended with an error, or that dropped
it, reads what it still lacks from storage itself.

Written and read with pwrite / pread (each a system call, so a counter is
never seen before the bytes it counts, also on weakly ordered processors).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import time

HEADER_BYTES = 8192
SLOTS = 4
MAX_FOLLOWERS = 256
FOLLOWER_WAIT = 10.0
LEADER_STALL = 60.0
_MAGIC = 0x6D736C705F6E6F64  # "mslp_nod"
# header words (int64)
_W_MAGIC, _W_PID, _W_VERDICT, _W_PUBLISHED, _W_ENDED = 0, 1, 2, 3, 4
_W_CONSUMED = 16
_W_FOLLOWER = _W_CONSUMED + MAX_FOLLOWERS
_REASON_AT, _REASON_BYTES = 6144, 2048
PENDING, TOGETHER, ALONE = 0, 1, 2  # the leader's verdict
RUNNING, ENDED_WELL, ENDED_FAILED = 0, 1, 2
ACTIVE, LEFT, DROPPED = 0, 1, 2  # a follower's state
_POLL = (0.001, 0.05)


def staging_path(meeting: str, node: int) -> str:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    name = hashlib.sha256(meeting.encode()).hexdigest()[:32]
    return os.path.join(folder, f"ms_loadpatch-{name}-node{node}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Header:
    fd: int

    def put(self, word: int, value: int) -> None:
        os.pwrite(self.fd, struct.pack("<q", value), word * 8)

    def get(self, word: int) -> int:
        return struct.unpack("<q", os.pread(self.fd, 8, word * 8))[0]


class StagingWriter(_Header):
    """The leader's side: `followers` (their pids, in follower order), slots of `slot_bytes`."""

    def __init__(self, path: str, followers: list[int], slot_bytes: int):
        self.path, self.followers, self.slot_bytes = path, list(followers), slot_bytes
        self.dropped: list[int] = []  # follower indices dropped
        if os.path.exists(path):  # a file left by a process of an earlier job that was killed
            os.unlink(path)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + SLOTS * slot_bytes)
            self.put(_W_PID, os.getpid())
            self.put(_W_MAGIC, _MAGIC)  # last: a follower reads the file once this is there
        except BaseException:
            self.close()
            raise

    def verdict(self, together: bool, reason: str) -> None:
        os.pwrite(self.fd, reason.encode()[: _REASON_BYTES - 1] + b"\0", _REASON_AT)
        self.put(_W_VERDICT, TOGETHER if together else ALONE)

    def publish(self, number: int, pieces) -> None:
        """Round `number`'s bytes (`pieces`: memoryviews, in order) into its slot, once no follower taking part
        still needs what the slot holds; then counted published."""
        self._wait_for_slot(number - SLOTS + 1)
        at = HEADER_BYTES + (number % SLOTS) * self.slot_bytes
        for piece in pieces:
            os.pwrite(self.fd, piece, at)
            at += len(piece)
        self.put(_W_PUBLISHED, number + 1)

    def _wait_for_slot(self, needed: int) -> None:
        if needed <= 0:
            return
        progress = {}
        pause = _POLL[0]
        while True:
            waiting = False
            for index, pid in enumerate(self.followers):
                if index in self.dropped or self.get(_W_FOLLOWER + index) != ACTIVE:
                    continue
                consumed = self.get(_W_CONSUMED + index)
                if consumed >= needed:
                    continue
                now, last = time.monotonic(), progress.get(index)
                if last is None or last[0] != consumed:
                    progress[index] = last = (consumed, now)
                if now - last[1] > FOLLOWER_WAIT or not _alive(pid):
                    self.put(_W_FOLLOWER + index, DROPPED)  # before its slot is written again
                    self.dropped.append(index)
                    continue
                waiting = True
            if not waiting:
                return
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])

    def end(self, well: bool) -> None:
        self.put(_W_ENDED, ENDED_WELL if well else ENDED_FAILED)

    def close(self) -> None:
        """Closed and unlinked: a follower that has it open keeps reading what is there."""
        try:
            os.close(self.fd)
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class StagingReader(_Header):
    """A follower's side (`index`: its place among the node's followers)."""

    def __init__(self, fd: int, index: int, leader_pid: int, slot_bytes: int):
        self.fd, self.index, self.leader_pid, self.slot_bytes = fd, index, leader_pid, slot_bytes

    @classmethod
    def open(cls, path: str, index: int, leader_pid: int, slot_bytes: int, wait: float):
        """The leader's staging once it is there (within `wait` seconds, while the leader lives), else None."""
        deadline, pause = time.monotonic() + wait, _POLL[0]
        while time.monotonic() < deadline and _alive(leader_pid):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                reader = cls(fd, index, leader_pid, slot_bytes)
                if reader.get(_W_MAGIC) == _MAGIC and reader.get(_W_PID) == leader_pid:
                    return reader
                os.close(fd)  # not yet written, or left by another process
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])
        return None

    def _waiting(self, ready, given_up=None) -> str | None:
        """None once `ready()`; else why to stop waiting (the leader's process ended, it stalled, or it ended
        with an error or dropped this follower; or `given_up()`)."""
        pause, last = _POLL[0], (self.get(_W_PUBLISHED), time.monotonic())
        while not ready():
            if given_up is not None and given_up():
                return "its load ended"
            if self.get(_W_FOLLOWER + self.index) == DROPPED:
                return "the node's leader went on without it (it fell behind)"
            if self.get(_W_ENDED) == ENDED_FAILED:
                return "the node's leader's load ended with an error"
            if not _alive(self.leader_pid):
                return f"the node's leader (process {self.leader_pid}) ended"
            published = self.get(_W_PUBLISHED)
            if published != last[0]:
                last = (published, time.monotonic())
            elif time.monotonic() - last[1] > LEADER_STALL:
                return f"the node's leader published nothing for {LEADER_STALL:.0f} s"
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])
        return None

    def verdict(self) -> tuple[bool | None, str]:
        """Whether the leader reads with the other nodes (None: it never said), and its reason."""
        problem = self._waiting(lambda: self.get(_W_VERDICT) != PENDING)
        if problem is not None:
            return None, problem
        reason = os.pread(self.fd, _REASON_BYTES, _REASON_AT).split(b"\0", 1)[0].decode(errors="replace")
        return self.get(_W_VERDICT) == TOGETHER, reason

    def wait_round(self, number: int, given_up=None) -> str | None:
        return self._waiting(lambda: self.get(_W_PUBLISHED) > number, given_up)

    def read(self, number: int, offset: int, view) -> int:
        return os.preadv(self.fd, [view], HEADER_BYTES + (number % SLOTS) * self.slot_bytes + offset)

    def consumed(self, number: int) -> bool:
        """Round `number` counted consumed; False where the leader dropped this follower first (then the
        slot may have been written again while it was read)."""
        if self.get(_W_FOLLOWER + self.index) != ACTIVE:
            return False
        self.put(_W_CONSUMED + self.index, number + 1)
        return True

    def leave(self) -> None:
        try:
            if self.get(_W_FOLLOWER + self.index) == ACTIVE:
                self.put(_W_FOLLOWER + self.index, LEFT)
        finally:
            os.close(self.fd)


__all__ = ["StagingReader", "StagingWriter", "staging_path"]
