"""The node leaders' channel: a communication group of their own (one rank
per node, created once per process after they agreed to cooperate), never
the job's world group, so the job's own collectives can never pair with the
plugin's.

A round carries every leader's chunk and state. Two transports, the first
that passes the channel's probe (once per process per group: a round of
known bytes checked on every leader, then one timed) is used:
- broadcast: each leader's bytes broadcast from it in turn
  (`mindspore.mint.distributed.broadcast` with the group: raw uint8,
  received in place; the CPU wheel's mccl runs it on a created group,
  where its `ops.Broadcast` and `ops.AllGather` take only the world group);
- summed: one float32 AllReduce, each leader's chunk in its own slot and
  zeros in the others', bytes three to a float (integers below 2**24 add to
  zero exactly; float sums of raw bit patterns would change -0.0 and NaN
  payloads): what every backend runs on a created group.
"""

from __future__ import annotations

import time

import numpy as np

from .job import first_line
from .probe_cache import ProbeCache

_channels = ProbeCache()  # tuple of leader ranks -> LeaderChannel (its group created once)


def words_for(nbytes: int) -> int:
    return -(-nbytes // 3)


def pack(data: np.ndarray, out: np.ndarray) -> None:
    """`data` (uint8) into `out` (float32, words_for(len(data)) or more), three bytes to a float."""
    words = out.size
    quads = np.zeros((words, 4), dtype=np.uint8)
    padded = np.zeros(words * 3, dtype=np.uint8)
    padded[: data.size] = data
    quads[:, :3] = padded.reshape(words, 3)
    out[:] = quads.reshape(-1).view("<u4")


def unpack(words: np.ndarray, into: np.ndarray) -> None:
    """The bytes `pack` put in `words`, into `into` (uint8, its length)."""
    quads = words.astype("<u4").view(np.uint8).reshape(-1, 4)
    into[:] = quads[:, :3].reshape(-1)[: into.size]


BROADCAST, SUMMED = "broadcast", "summed"  # the channel's transports, in the order tried
_STATE_BYTES = 8


class LeaderChannel:
    """Rounds among the leaders (`leaders`: their world ranks, this one at `slot`), over the transport its
    probe found working: BROADCAST, each leader's chunk and state (its last 8 bytes) broadcast from it in
    turn (`mindspore.mint.distributed.broadcast` on the group: raw bytes, received in place); else SUMMED,
    one float32 AllReduce of every leader's chunk packed into its own slot."""

    def __init__(self, leaders: list[int], slot: int):
        from mindspore import ops
        from mindspore.communication import create_group

        self.leaders, self.slot = list(leaders), slot
        self.group = "ms_loadpatch_leaders_" + "_".join(map(str, leaders))
        create_group(self.group, self.leaders)
        self._sum = ops.AllReduce(group=self.group)
        self.transport: str | None = None
        self.problem: str | None = None
        self.bytes_per_s = 0.0

    def round_bytes(self, chunk: int) -> int:
        """What a round of chunks of `chunk` bytes holds in this process's messages at most."""
        if self.transport == SUMMED:
            return 2 * len(self.leaders) * (words_for(chunk) + 1) * 4  # the message and the sum
        return len(self.leaders) * (chunk + _STATE_BYTES)

    def exchange(self, data: np.ndarray | None, state: int, lengths: list[int]) -> tuple[list[int], list]:
        """One round: this leader's `data` (uint8, `lengths[slot]` bytes; None: nothing to send, its length 0)
        and `state` out; every leader's state and bytes (uint8 arrays of `lengths`) in."""
        if self.transport == SUMMED:
            return self._summed(data, state, lengths)
        return self._broadcast(data, state, lengths)

    def _broadcast(self, data, state, lengths):
        import mindspore as ms
        from mindspore.mint import distributed

        states, payloads = [], []
        for slot, root in enumerate(self.leaders):
            message = np.empty(lengths[slot] + _STATE_BYTES, dtype=np.uint8)
            if slot == self.slot:
                if data is not None:
                    message[: lengths[slot]] = data
                message[lengths[slot] :] = np.array([state], dtype="<i8").view(np.uint8)
            tensor = ms.Tensor.from_numpy(message)
            distributed.broadcast(tensor, src=root, group=self.group)
            received = tensor.asnumpy()  # after the broadcast has written it: the array alone may not be yet
            states.append(int(received[lengths[slot] :].view("<i8")[0]))
            payloads.append(received[: lengths[slot]])
        return states, payloads

    def _summed(self, data, state, lengths):
        import mindspore as ms

        words = words_for(max(max(lengths), 1))
        message = np.zeros((len(self.leaders), words + 1), dtype=np.float32)
        if data is not None and data.size:
            pack(data, message[self.slot, : words_for(data.size)])
        message[self.slot, words] = state
        total = self._sum(ms.Tensor.from_numpy(message.reshape(-1))).asnumpy().reshape(message.shape)
        payloads = []
        for slot, length in enumerate(lengths):
            payload = np.empty(length, dtype=np.uint8)
            if length:
                unpack(total[slot, : words_for(length)], payload)
            payloads.append(payload)
        return [int(v) for v in total[:, words]], payloads

    def probe(self, nbytes: int, agree) -> None:
        """The first transport that carries a round of known bytes from every leader exactly on every leader
        (`agree(transport, ok)`: whether every leader's check passed, asked of all alike), then one timed:
        `transport` and `bytes_per_s` (what each leader receives from the others per second), or `problem`."""
        problems = []
        for transport in (BROADCAST, SUMMED):
            self.transport = transport
            problem = self._try(max(3, nbytes))
            if agree(transport, problem is None):
                self.problem = None
                return
            problems.append(f"{transport}: {problem or 'it failed on another leader'}")
        self.transport, self.problem = None, "; ".join(problems)

    def _try(self, nbytes: int) -> str | None:
        patterns = [
            (np.arange(nbytes, dtype=np.uint64) * 2654435761 + 97 * slot + 1).astype(np.uint8)
            for slot in range(len(self.leaders))
        ]
        patterns[-1][:3] = (255, 0, 128)  # bytes whose floats would change sign or vanish if sent as floats
        lengths = [nbytes] * len(self.leaders)
        seconds = 0.0
        for _round in ("checked", "checked and timed"):
            started = time.perf_counter()
            try:
                states, payloads = self.exchange(patterns[self.slot], 0, lengths)
            except Exception as exc:  # noqa: BLE001 - the verdict: the next transport, or alone
                return f"a round of {nbytes >> 10} KB failed ({first_line(exc)})"
            seconds = time.perf_counter() - started
            if states != [0] * len(self.leaders) or not all(map(np.array_equal, payloads, patterns)):
                return f"a round of {nbytes >> 10} KB arrived changed"
        self.bytes_per_s = (len(self.leaders) - 1) * nbytes / seconds if seconds > 0 else 0.0
        return None


def channel(leaders: list[int], rank: int, probe_bytes: int = 0, agree=None) -> LeaderChannel:
    """The leaders' channel, its group created and probed once per process (every leader asks at the same
    point, right after they agreed; `agree` as LeaderChannel.probe's)."""

    def make():
        made = LeaderChannel(leaders, leaders.index(rank))
        made.probe(probe_bytes, agree)
        return made

    return _channels.get(tuple(leaders), make)


def status() -> list[dict]:
    return [
        {"leaders": list(key), "transport": found.transport, "bytes_per_s": found.bytes_per_s, "problem": found.problem}
        for key, found in _channels.as_dict().items()
    ]


__all__ = ["BROADCAST", "SUMMED", "LeaderChannel", "channel", "pack", "status", "unpack", "words_for"]
