"""Where the ranks of a multi-node job find out, out of band, whether all of
them are in the same load: mindspore's key-value store
(`mindspore.mint.distributed.TCPStore`), never a collective, so a rank that
loads something else, loads twice or not at all never pairs with anything.

The store: the first rank on the msrun scheduler's host that needs it serves
it (MS_SCHED_HOST, port MS_SCHED_PORT + 1 or MS_LOADPATCH_STORE_PORT) for
the rest of its process; every other rank connects. A store whose serving
process ended fails the meeting in progress (after mindspore's message
timeout) and every later one of this process at once. It is probed once per
process (a key written, counted and read back); a store that cannot be
reached or fails its probe means every load reads alone, and status says why.

A meeting is keyed by what is loaded: the files' digest (names, sizes,
modification times, headers), the settings ranks must share, and how many
meetings for those files this process held before, so a rank's extra or
skipped load never shifts another's pairing. Each rank writes its statement,
then counts itself in; the meeting holds when the count reaches the job's
size within the wait. A rank whose wait ends adds a large number instead:
whoever counts after that sees the meeting failed, so every rank decides the
same (the count's order in the store is the one truth).
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

from ..activation import env_int
from .job import WAIT_ENV_VAR, first_line
from .probe_cache import ProbeCache

STORE_PORT_ENV_VAR = "MS_LOADPATCH_STORE_PORT"
_CLOSED = 1 << 40  # added by a rank whose wait ended: the count can never again read as the job's size
_POLL_SECONDS = (0.01, 0.2)  # first and longest pause between looks at the count
_stores = ProbeCache()  # "store" -> Store: the process's connection (or the served store), once
_meetings: dict[str, int] = {}  # meeting key -> meetings held by this process (under cooperative's session lock)


class Store:
    """The job's store as this process reaches it: `client` (None where it cannot), whether this process
    serves it, and why not where it cannot."""

    def __init__(self, client, serves: bool, address: str, problem: str | None = None):
        self.client, self.serves, self.address, self.problem = client, serves, address, problem

    def as_dict(self) -> dict:
        return {"address": self.address, "serves": self.serves, "problem": self.problem}


def _address() -> tuple[str, int] | None:
    host, port = os.environ.get("MS_SCHED_HOST"), os.environ.get("MS_SCHED_PORT")
    if not host or not (port or "").isdigit():
        return None
    return host, env_int(STORE_PORT_ENV_VAR) or int(port) + 1


def _may_serve(host: str, port: int) -> bool:
    """`host` is an address of this machine and `port` free there (another rank may still take it first)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
        return True
    except OSError:
        return False


def _open(wait: float) -> Store:
    address = _address()
    if address is None:
        return Store(None, False, "", "no msrun scheduler address (MS_SCHED_HOST, MS_SCHED_PORT) to meet at")
    host, port = address
    where = f"{host}:{port}"
    try:
        from mindspore.mint.distributed import TCPStore
    except ImportError as exc:
        return Store(None, False, where, f"mindspore has no TCPStore ({exc})")
    timeout = timedelta(seconds=wait)
    client, serves = None, False
    if _may_serve(host, port):
        try:
            client = TCPStore(host, port, world_size=1, is_master=True, wait_for_workers=False, timeout=timeout)
            serves = True
        except Exception:  # noqa: BLE001 - another rank of this host serves it: connect below
            client = None
    try:
        if client is None:
            client = TCPStore(host, port, is_master=False, timeout=timeout)
        _check(client)
    except Exception as exc:  # noqa: BLE001 - the verdict: every load reads alone
        return Store(None, serves, where, f"the job's store at {where} failed: {first_line(exc)}")
    return Store(client, serves, where)


def _check(client) -> None:
    """A key written, counted and read back, as a meeting uses the store."""
    key = f"ms_loadpatch/probe/{os.getpid()}/{time.monotonic_ns()}"
    client.set(key + "/value", b"ok")
    if client.add(key + "/count", 2) != 2 or client.add(key + "/count", 0) != 2:
        raise RuntimeError("a counter did not count")
    if bytes(client.get(key + "/value")) != b"ok":
        raise RuntimeError("a value came back changed")


def store(wait: float) -> Store:
    """The job's store, reached once per process (waiting up to `wait` seconds for it to be served)."""
    return _stores.get("store", lambda: _open(wait))


def give_up(found: Store, exc) -> None:
    """The store failed mid-meeting (the process serving it ended, most likely): every later load of this
    process reads alone at once instead of waiting on it again."""
    found.client, found.problem = None, f"the job's store at {found.address} failed: {first_line(exc)}"


def meet(client, key: str, mine: dict, rank: int, size: int, wait: float) -> tuple[list[dict], int] | str:
    """Every rank's statement, in rank order, and the meetings this process held for `key` before, where all
    `size` ranks reach the meeting `key` within `wait` seconds; else why not (the same on every rank)."""
    held = _meetings.get(key, 0)
    _meetings[key] = held + 1
    base = f"ms_loadpatch/{key}/{held}"
    client.set(f"{base}/rank{rank}", json.dumps(mine).encode())
    count = client.add(f"{base}/count", 1)
    deadline, pause = time.monotonic() + wait, _POLL_SECONDS[0]
    while count < size and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, _POLL_SECONDS[1])
        count = client.add(f"{base}/count", 0)
    if count < size:
        count = client.add(f"{base}/count", _CLOSED) - _CLOSED  # what it was: the count decides, not the clock
    if count != size:
        return f"{min(count % _CLOSED, size - 1)} of {size} ranks reached this load within {wait:g} s ({WAIT_ENV_VAR})"
    return [json.loads(bytes(client.get(f"{base}/rank{r}"))) for r in range(size)], held


def status() -> dict | None:
    """The job's store as reached, where it was."""
    found = _stores.as_dict().get("store")
    return None if found is None else found.as_dict()


__all__ = ["STORE_PORT_ENV_VAR", "Store", "give_up", "meet", "status", "store"]
