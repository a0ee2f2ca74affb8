"""The distributed job a load runs in: whether the job's communication is
initialised (the plugin never calls `init()`), whether the launcher says it
runs on one node, which node each rank runs on, what the ranks that met
(strategy/meeting.py) conclude, and `MS_LOADPATCH_COOPERATIVE`'s choice.

Nothing here enters a collective on the job's groups: the ranks meet out of
band, and only the node leaders, once they agreed, move bytes over a group
of their own (strategy/leaders.py).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from dataclasses import dataclass, field

from ..activation import env_choice, env_int
from .ranks import node_share

ENV_VAR = "MS_LOADPATCH_COOPERATIVE"
AUTO, ON, OFF = "auto", "on", "off"
CHOICES = (AUTO, ON, OFF)
# Tells apart "nodes" that share one host (a test or benchmark harness)
NODE_ENV_VAR = "MS_LOADPATCH_NODE_ID"
# The largest chunk a node leader reads for one round (MB)
CHUNK_ENV_VAR = "MS_LOADPATCH_COOPERATIVE_CHUNK_MB"
DEFAULT_CHUNK_MB = 4
# Seconds a rank waits for every rank of the job to reach the same load
WAIT_ENV_VAR = "MS_LOADPATCH_COOPERATIVE_WAIT"
DEFAULT_WAIT_SECONDS = 10
# A round carries one chunk per node: this bounds a round (and a staging slot) for many nodes
ROUND_LIMIT = 16 << 20
# auto cooperates when the model below predicts the job this much faster together than alone
AUTO_MARGIN = 1.25
# auto cooperates across this many nodes at most: with 3 a leaders' broadcast failed mid-load under auto on
# the CPU wheel's mccl (not under on), cause not found yet; alone is slower, never wrong
AUTO_MOST_NODES = 2
PROTOCOL = 2


def mode() -> str:
    return env_choice(ENV_VAR, CHOICES)


def wait_seconds() -> int:
    return env_int(WAIT_ENV_VAR) or DEFAULT_WAIT_SECONDS


def chunk_bytes(nodes: int = 1) -> int:
    """Bytes a leader reads for one round: the setting, smaller for many nodes (ROUND_LIMIT), whole pages."""
    chunk = min((env_int(CHUNK_ENV_VAR) or DEFAULT_CHUNK_MB) << 20, ROUND_LIMIT // max(1, nodes))
    return max(1 << 16, chunk >> 12 << 12)


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


def job_rank() -> int:
    from mindspore.communication import get_rank

    return get_rank()


def one_node(size: int) -> str | None:
    """Why the launcher says every rank of the job runs on this node (its
    ranks share the page cache: nothing to meet about), else None."""
    if NODE_ENV_VAR in os.environ:
        return None  # "nodes" on one host: only the meeting tells them apart
    share = node_share()
    if share.counted and share.local_ranks >= size:
        return f"one node ({share.source} says {share.local_ranks} of {size} ranks run here)"
    return None


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


def settings() -> list:
    """What ranks must share to cooperate: the protocol, the chunk setting and the mode."""
    return [PROTOCOL, env_int(CHUNK_ENV_VAR) or DEFAULT_CHUNK_MB, mode()]


def statement(cached: bool) -> dict:
    """What this rank tells the ranks it meets: its node, its process, whether
    its node has the first file in its page cache, its settings."""
    return {"node": node_identity(), "pid": os.getpid(), "cached": bool(cached), "settings": settings()}


@dataclass
class Agreement:
    """What every rank concluded from the same statements, and the leaders' choice."""

    cooperate: bool
    reason: str
    node_of_rank: list[int]  # node index per rank, nodes numbered by their lowest rank
    leaders: list[int]  # the rank that reads for each node (its lowest)
    pids: list[int] = field(default_factory=list)  # each rank's process
    cached: bool = False  # every rank has the first file in its node's page cache
    storage_mb_s: int = -1  # the slowest leader's first read while all leaders read (MB/s), where timed
    collective_mb_s: int = -1  # what the leaders' channel carries to each leader (MB/s), where probed

    @property
    def nodes(self) -> int:
        return len(self.leaders)

    def followers(self, node: int) -> list[int]:
        return [rank for rank, n in enumerate(self.node_of_rank) if n == node and rank != self.leaders[node]]


def conclude(statements: list[dict]) -> Agreement:
    """The agreement every rank reaches from the statements of the ranks that met (one per rank, in rank order)."""
    first: dict[str, int] = {}
    for rank, said in enumerate(statements):
        first.setdefault(said["node"], rank)
    leaders = sorted(first.values())
    node_of_rank = [leaders.index(first[said["node"]]) for said in statements]
    agreement = Agreement(
        False,
        "",
        node_of_rank,
        leaders,
        pids=[int(said["pid"]) for said in statements],
        cached=all(said["cached"] for said in statements),
    )
    for rank, said in enumerate(statements):
        if said["settings"] != statements[0]["settings"]:
            agreement.reason = f"rank {rank} runs with other {ENV_VAR} settings or version than rank 0"
            return agreement
    if len(leaders) == 1:
        agreement.reason = "one node: its ranks share the page cache"
        return agreement
    agreement.cooperate = True
    agreement.reason = f"{len(leaders)} nodes"
    return agreement


def first_line(exc) -> str:
    """The first line of an error's text (its type where it has none), for a reason in a report."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def predicted_ratio(nodes: int, storage_mb_s: float, collective_mb_s: float) -> float:
    """Together over alone, for a checkpoint of S bytes: alone each node reads S at the storage's rate r (as
    timed with every leader reading); together each leader reads S/N at r and receives S(N-1)/N at the
    channel's rate C, overlapped: max(1/(N r), (N-1)/(N C)) / (1/r)."""
    if storage_mb_s <= 0 or collective_mb_s <= 0:
        return float("inf")
    return max(1 / (nodes * storage_mb_s), (nodes - 1) / (nodes * collective_mb_s)) * storage_mb_s


def choose(agreement: Agreement, storage_mb_s: list[int], collective_mb_s: float, problem: str | None) -> Agreement:
    """`agreement` with MS_LOADPATCH_COOPERATIVE's choice applied, from what every leader measured alike
    (the same on each: they shared it): each leader's first read while all read (0: from its page cache),
    the channel's probed rate, the channel's problem if its probe failed."""
    if not agreement.cooperate:
        return agreement
    if problem is not None:
        agreement.cooperate, agreement.reason = False, f"the leaders' channel failed its probe: {problem}"
        return agreement
    agreement.collective_mb_s = int(collective_mb_s)
    channel = f"channel {collective_mb_s:.0f} MB/s to each leader"
    if mode() == ON:
        agreement.reason += f", {ENV_VAR}=on ({channel})"
        return agreement
    if agreement.cached:
        agreement.cooperate, agreement.reason = False, "the checkpoint is in every node's page cache"
        return agreement
    if agreement.nodes > AUTO_MOST_NODES:
        agreement.cooperate = False
        agreement.reason = f"{ENV_VAR}=auto cooperates across {AUTO_MOST_NODES} nodes at most for now ({ENV_VAR}=on)"
        return agreement
    cold = [rate for rate in storage_mb_s if rate > 0]
    if not cold:
        agreement.cooperate, agreement.reason = False, "the storage's rate could not be timed"
        return agreement
    storage = agreement.storage_mb_s = min(cold)
    ratio = predicted_ratio(agreement.nodes, storage, collective_mb_s)
    inputs = f"storage {storage} MB/s per node with {agreement.nodes} leaders reading, {channel}"
    if ratio * AUTO_MARGIN > 1:
        agreement.cooperate = False
        agreement.reason = f"{inputs}: together predicted {ratio:.2f}x of alone, not below {1 / AUTO_MARGIN:.2f}x"
    else:
        agreement.reason += f", {inputs}: predicted {ratio:.2f}x of alone"
    return agreement


__all__ = [
    "Agreement",
    "ENV_VAR",
    "NODE_ENV_VAR",
    "WAIT_ENV_VAR",
    "choose",
    "chunk_bytes",
    "conclude",
    "job_size",
    "mode",
    "node_identity",
    "one_node",
    "predicted_ratio",
    "statement",
]
