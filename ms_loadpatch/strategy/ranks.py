"""Sharing the node with the other ranks of a distributed job.

A launcher (msrun, mpirun, torchrun-style) starts one process per device and
every rank calls from_pretrained at the same moment. The reader's thread
counts are what one process may use; on a node running N ranks each rank
gets 1/N of them, so the ranks together use about what one process would.
Read from the environment at each load (a job may set it after import).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..activation import env_int

LOCAL_RANKS_ENV_VAR = "MS_LOADPATCH_LOCAL_RANKS"

# Launchers that say how many of the job's processes run on this node.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_RANK_VARS = ("RANK_ID", "OMPI_COMM_WORLD_RANK", "RANK")
# Sources of local_ranks that give the whole job's size
_JOB_TOTALS = ("MS_WORKER_NUM", "RANK_SIZE")


@dataclass(frozen=True)
class NodeShare:
    """This process's part of the node: `local_ranks` processes of the job
    share its cores (1 outside a job); `rank` where the launcher says it."""

    local_ranks: int
    rank: int | None
    cores: int
    source: str

    @property
    def counted(self) -> bool:
        """`local_ranks` is this node's count, not the job's total (an upper bound)."""
        return self.source not in _JOB_TOTALS

    def divide(self, threads: int) -> int:
        """This rank's part of `threads` meant for the whole node, at least one."""
        return max(1, threads // self.local_ranks)


def available_cores() -> int:
    """Cores this process may run on (its affinity, which msrun's core
    binding and cgroup cpusets narrow), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=8)
def _msrun_local_workers(parent_pid: int) -> int | None:
    """msrun's --local_worker_num, from the launching msrun's command line
    (msrun starts each worker as its own child and exports only the job's
    total, MS_WORKER_NUM). None where that cannot be read."""
    try:
        with open(f"/proc/{parent_pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if not any(os.path.basename(a) == "msrun" or a.endswith("mindspore.parallel.cluster.run") for a in argv[:3]):
        return None
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--local_worker_num="):
            value = arg.split("=", 1)[1]
        elif arg == "--local_worker_num" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None:
            try:
                return max(1, int(value))
            except ValueError:
                return None
    return None


def _local_ranks() -> tuple[int, str]:
    explicit = env_int(LOCAL_RANKS_ENV_VAR)
    if explicit is not None:
        return explicit, LOCAL_RANKS_ENV_VAR
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        local = _msrun_local_workers(os.getppid())
        if local is not None:
            return local, "msrun --local_worker_num"
        total = env_int("MS_WORKER_NUM")
        if total is not None:  # the job's total: at least this node's count, so never more threads than cores
            return total, "MS_WORKER_NUM"
    for name in _LOCAL_SIZE_VARS:
        value = env_int(name)
        if value is not None:
            return value, name
    rank_size = env_int("RANK_SIZE")  # rank-table launches: the job's size, an upper bound
    if rank_size is not None:
        return rank_size, "RANK_SIZE"
    return 1, "not in a distributed job"


def _rank() -> int | None:
    for name in _RANK_VARS:
        text = os.environ.get(name)
        if text is not None and text.strip().isdigit():
            return int(text)
    return None


def node_share() -> NodeShare:
    cores = available_cores()
    local_ranks, source = _local_ranks()
    # more ranks than cores still get a thread each (divide's floor of one)
    return NodeShare(local_ranks=local_ranks, rank=_rank(), cores=cores, source=source)


__all__ = ["LOCAL_RANKS_ENV_VAR", "NodeShare", "available_cores", "node_share"]
