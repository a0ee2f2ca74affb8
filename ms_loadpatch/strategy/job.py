"""The distributed job a load runs in, seen through mindspore's collectives:
whether the job's communication is initialised (the plugin never calls
`init()`), which node each rank runs on, what every rank is about to load,
and what the job's collective can carry.

Every rank of a job that takes part enters the same collectives in the same
order: one AllGather per load (`agree`), and once per process, when a load
first could cooperate, the collective's probe. Ranks that cannot cooperate
(a load that falls back, a checkpoint that differs) still enter the
AllGather and say so, so nobody waits in a collective another never enters.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..activation import env_choice, env_int
from .probe_cache import ProbeCache

ENV_VAR = "MS_LOADPATCH_COOPERATIVE"
AUTO, ON, OFF = "auto", "on", "off"
CHOICES = (AUTO, ON, OFF)
# Tells apart "nodes" that share one host (a test or benchmark harness)
NODE_ENV_VAR = "MS_LOADPATCH_NODE_ID"
# The largest message the collective is asked to carry (MB), probed first
CHUNK_ENV_VAR = "MS_LOADPATCH_COOPERATIVE_CHUNK_MB"
DEFAULT_CHUNK_MB = 4
# auto cooperates when the collective moves bytes this much faster than a node reads them
AUTO_MARGIN = 1.25

# What a rank says of its load in the agreement
READY, NOT_ACCELERATED, UNREADABLE, NOTHING = 1, 2, 3, 4
_STATE_TEXT = {
    NOT_ACCELERATED: "its load is not accelerated",
    UNREADABLE: "it could not read its checkpoint's headers",
    NOTHING: "it has no local safetensors files to share",
}
_PROTOCOL = 1
_FIELDS = 16  # int32 per rank in the agreement: see Statement.values


def mode() -> str:
    return env_choice(ENV_VAR, CHOICES)


def chunk_bytes() -> int:
    return (env_int(CHUNK_ENV_VAR) or DEFAULT_CHUNK_MB) << 20


class Collectives:
    """mindspore's collectives over the job's world group (mccl on the CPU
    wheel, HCCL on Ascend, NCCL on GPU builds): int32 AllGather and
    Broadcast (what every backend carries), float32 AllReduce."""

    def __init__(self):
        from mindspore import ops
        from mindspore.communication import GlobalComm, get_group_size, get_rank

        self.group = GlobalComm.WORLD_COMM_GROUP
        self.rank, self.size = get_rank(self.group), get_group_size(self.group)
        self._ops = ops
        self._gather = ops.AllGather(group=self.group)
        self._sum = ops.AllReduce(group=self.group)
        self._broadcasts = {}

    def gather(self, values) -> np.ndarray:
        """Every rank's `values` (int32), one row per rank."""
        import mindspore as ms

        mine = np.asarray(values, dtype=np.int32)
        return self._gather(ms.Tensor(mine)).asnumpy().reshape(self.size, mine.size)

    def states(self, mine: int) -> np.ndarray:
        """Every rank's small non-negative `mine`, in rank order (an AllReduce of one slot each)."""
        import mindspore as ms

        slots = np.zeros(self.size, dtype=np.float32)
        slots[self.rank] = mine
        return self._sum(ms.Tensor(slots)).asnumpy().astype(np.int64)

    def broadcast(self, words: np.ndarray, root: int) -> np.ndarray:
        """`words` (int32) of rank `root`, on every rank (the others pass an array of the same shape)."""
        import mindspore as ms

        op = self._broadcasts.get(root)
        if op is None:
            op = self._broadcasts[root] = self._ops.Broadcast(root, group=self.group)
        return op((ms.Tensor.from_numpy(words),))[0].asnumpy()  # the array's memory, not a copy


def job_size() -> int | None:
    """The ranks of the job this process belongs to, where its communication
    is initialised and it has more than one rank and MS_LOADPATCH_COOPERATIVE
    is not off; else None."""
    if mode() == OFF:
        return None
    comm = sys.modules.get("mindspore.communication")  # never imported: never initialised
    if comm is None:
        return None
    try:
        if not getattr(comm.GlobalComm, "INITED", False):
            return None
        size = comm.get_group_size()
    except Exception:  # noqa: BLE001 - a backend without a world group: no job to join
        return None
    return size if size > 1 else None


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def node_identity() -> str:
    """This rank's node: MS_LOADPATCH_NODE_ID where a launch sets it (nodes
    sharing one host), else host name and boot id."""
    return os.environ.get(NODE_ENV_VAR) or _machine()


def _words(text: str, count: int) -> list[int]:
    return np.frombuffer(hashlib.sha256(text.encode()).digest()[: 4 * count], dtype=np.int32).tolist()


@dataclass
class Statement:
    """What one rank says before a load: its state, the digest of what it is
    about to read, whether its node has the first file in its page cache,
    its settings and whether it probed already."""

    state: int
    digest: str = ""
    cached: bool = False
    probed: bool = False

    def values(self) -> list[int]:
        return [
            _PROTOCOL,
            self.state,
            *_words(node_identity(), 2),
            *_words(self.digest, 8),
            int(self.cached),
            chunk_bytes() >> 20,
            CHOICES.index(mode()),
            int(self.probed),
        ]


@dataclass
class Agreement:
    """What every rank concluded from the same gathered statements."""

    cooperate: bool
    reason: str
    node_of_rank: list[int]  # node index per rank, nodes numbered by their lowest rank
    readers: list[int]  # the rank that reads for each node (its lowest)
    cached: bool = False  # every rank has the first file in its node's page cache
    storage_mb_s: int = -1  # the slowest node's first read (MB/s), where timed

    @property
    def nodes(self) -> int:
        return len(self.readers)


def conclude(table: np.ndarray) -> Agreement:
    """The agreement every rank reaches from the gathered statements (a row per rank)."""
    node_keys = [tuple(row[2:4]) for row in table]
    first = {}
    for rank, key in enumerate(node_keys):
        first.setdefault(key, rank)
    readers = sorted(first.values())
    node_of_rank = [readers.index(first[key]) for key in node_keys]
    agreement = Agreement(False, "", node_of_rank, readers, cached=bool(all(row[12] for row in table)))
    for rank, row in enumerate(table):
        if row[0] != _PROTOCOL:
            agreement.reason = f"rank {rank} runs another version of ms_loadpatch"
            return agreement
        if row[1] != READY:
            agreement.reason = f"rank {rank} does not take part: {_STATE_TEXT.get(int(row[1]), 'unknown state')}"
            return agreement
    for rank, row in enumerate(table):
        if not np.array_equal(row[4:12], table[0][4:12]):
            agreement.reason = (
                f"rank {rank} loads other files than rank 0 (names, sizes, modification times or headers differ)"
            )
            return agreement
        if not np.array_equal(row[13:16], table[0][13:16]):
            agreement.reason = f"rank {rank} runs with other {ENV_VAR} settings than rank 0"
            return agreement
    if len(readers) == 1:
        agreement.reason = "one node: its ranks share the page cache"
        return agreement
    agreement.cooperate = True
    agreement.reason = f"{len(readers)} nodes"
    return agreement


def agree(collectives: Collectives, statement: Statement) -> Agreement:
    """The agreement over every rank's `statement` (one AllGather)."""
    return conclude(collectives.gather(statement.values()))


@dataclass(frozen=True)
class CollectiveProbe:
    """What the job's collective carried in its probe: the largest message
    that arrived intact on every rank (0: none) and the rate of the largest."""

    largest: int
    bytes_per_s: float
    problem: str | None = None


_probes = ProbeCache()  # "collective" -> CollectiveProbe


def probed() -> bool:
    return "collective" in _probes


def collective_probe(collectives: Collectives, readers: list[int]) -> CollectiveProbe:
    """The collective's probe, once per process (every rank runs it at the
    same point: the first load whose agreement allows cooperating). Messages
    of 1 MB and the chunk size from the first and the last node's reader,
    then the chunk size once more from the first, timed (a shape the
    collective has sent before), each checked word for word on every rank;
    a message larger than the largest that passed is never sent."""
    return _probes.get("collective", lambda: _run_probe(collectives, readers))


def _run_probe(collectives: Collectives, readers: list[int]) -> CollectiveProbe:
    limit = chunk_bytes()
    sizes = sorted({min(1 << 20, limit), limit})
    roots = sorted({readers[0], readers[-1]})
    passed, seconds, problem, broke = 0, 0.0, None, False
    # each size from every root, then the largest once more from the first, timed: a shape sent before
    for size, senders in [(size, roots) for size in sizes] + [(limit, roots[:1])]:
        words = size // 4
        ok = True
        patterns = {
            root: (np.arange(words, dtype=np.int64) * 2654435761 + root + size).astype(np.int32) for root in senders
        }
        started = time.perf_counter()  # the messages made before: the time is the collective's
        for root, expected in patterns.items():
            mine = expected if collectives.rank == root else np.zeros(words, dtype=np.int32)
            try:
                got = collectives.broadcast(mine, root)
            except Exception as exc:  # noqa: BLE001 - the verdict: nothing larger is sent
                problem = f"a broadcast of {size >> 20} MB failed: {str(exc).strip().splitlines()[0]}"
                ok = broke = True
                break
            ok = ok and got.shape == expected.shape and np.array_equal(got, expected)
        elapsed = time.perf_counter() - started
        if broke:  # no more collectives; a rank still in one gets the collective's timeout and breaks too
            return CollectiveProbe(0, 0.0, problem)
        if not ok:
            problem = f"a broadcast of {size >> 20} MB arrived changed"
            break
        passed, seconds = size, elapsed
    table = collectives.gather([passed >> 20, int(seconds * 1e6)])
    largest = int(table[:, 0].min()) << 20
    slowest = float(table[:, 1].max()) / 1e6
    rate = largest / slowest if largest and slowest > 0 else 0.0
    if largest == 0:
        problem = problem or "no message arrived intact on every rank"
    return CollectiveProbe(largest, rate, problem)


def settle(collectives: Collectives, agreement: Agreement, first_read_mb_s) -> Agreement:
    """`agreement` with MS_LOADPATCH_COOPERATIVE's choice applied (the same
    on every rank: each step follows from what all ranks gathered). Under
    `auto`, every rank times its first read (`first_read_mb_s()`: MB/s, 0
    where it came from the page cache) at the same moment, right after a
    collective, so that storage the nodes share shows the rate each gets
    when all read; the collective is probed where it is still a candidate."""
    if not agreement.cooperate:
        return agreement
    if mode() == AUTO:
        if agreement.cached:
            agreement.cooperate, agreement.reason = False, "the checkpoint is in every node's page cache"
            return agreement
        cold = [int(rate) for rate in collectives.gather([first_read_mb_s()])[:, 0] if rate > 0]
        if not cold:
            agreement.cooperate, agreement.reason = False, "the storage's rate could not be timed"
            return agreement
        agreement.storage_mb_s = min(cold)
    probe = collective_probe(collectives, agreement.readers)
    if probe.largest == 0:
        agreement.cooperate, agreement.reason = False, f"the collective's probe failed: {probe.problem}"
        return agreement
    collective = f"collective {probe.bytes_per_s / 1e6:.0f} MB/s"
    storage = agreement.storage_mb_s
    if mode() == ON:
        agreement.reason += f", {ENV_VAR}=on ({collective})"
    elif probe.bytes_per_s < AUTO_MARGIN * storage * 1e6:
        agreement.cooperate = False
        agreement.reason = f"storage reads {storage} MB/s per node, faster than the {collective}"
    else:
        agreement.reason += f", storage {storage} MB/s per node, {collective}"
    return agreement


def status() -> dict:
    """MS_LOADPATCH_COOPERATIVE and the collective's probe, where run."""
    probe = _probes.as_dict().get("collective")
    return {
        "env_var": ENV_VAR,
        "mode": mode(),
        "job_ranks": job_size(),
        "node": node_identity(),
        "collective_probe": None
        if probe is None
        else {"largest_bytes": probe.largest, "bytes_per_s": probe.bytes_per_s, "problem": probe.problem},
    }


__all__ = [
    "Agreement",
    "CollectiveProbe",
    "Collectives",
    "ENV_VAR",
    "NODE_ENV_VAR",
    "Statement",
    "agree",
    "collective_probe",
    "conclude",
    "job_size",
    "mode",
    "node_identity",
    "settle",
]
