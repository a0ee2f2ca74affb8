"""Which node reads which bytes of a checkpoint in a multi-node job
(strategy/cooperative.py): the files' checked headers and a digest that
keys the ranks' meeting, and the chunks each node reads, in rounds,
computed alike on every rank from the headers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass

from . import page_cache
from .safetensors_header import MAX_HEADER_BYTES, checkpoint_os_error, parse_header
from .threaded_read import first_read_rate


@dataclass(frozen=True)
class FileLayout:
    path: str
    header: object  # safetensors_header.SafetensorsHeader
    size: int
    cached: float | None  # share in this node's page cache when the load began

    @property
    def data_len(self) -> int:
        return max((end for _, _, _, end in self.header.entries.values()), default=0)


@dataclass(frozen=True)
class Chunk:
    file: int  # index into the layouts
    begin: int  # bytes of the file's data section
    end: int
    node: int  # the node that reads it


def read_layouts(files) -> tuple[list[FileLayout], str]:
    """Each file's checked header, and a digest of the files' names, sizes, modification times and headers."""
    digest = hashlib.sha256()
    layouts = []
    for path in files:
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                no_read_ahead(fd)
                stat = os.fstat(fd)
                size = stat.st_size
                head = os.pread(fd, 8, 0)
                if len(head) == 8:
                    head += os.pread(fd, min(struct.unpack("<Q", head)[0], MAX_HEADER_BYTES), 8)
            finally:
                os.close(fd)
        except OSError as exc:
            raise checkpoint_os_error(path, exc) from exc
        header = parse_header(path, size, head)
        # the modification time too: two copies with equal headers may hold other values
        digest.update(f"{os.path.basename(path)}\0{size}\0{stat.st_mtime_ns}\0{len(head)}\0".encode() + head)
        layouts.append(FileLayout(path, header, size, _cached(path)))
    return layouts, digest.hexdigest()


def no_read_ahead(fd: int) -> None:
    """Reads of `fd` fetch what they ask for: the kernel's read-ahead past a
    header or a chunk would pull another node's bytes from the storage."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _cached(path) -> float | None:
    try:
        return page_cache.resident_fraction(path)
    except OSError:
        return None


def plan_chunks(layouts, nodes: int, chunk: int) -> list[Chunk]:
    """The chunks in the order they are sent, each given to the node that has read the fewest bytes so far."""
    chunks, assigned = [], [0] * nodes
    for index, layout in enumerate(layouts):
        for begin in range(0, layout.data_len, chunk):
            end = min(begin + chunk, layout.data_len)
            node = min(range(nodes), key=lambda n: (assigned[n], n))
            assigned[node] += end - begin
            chunks.append(Chunk(index, begin, end, node))
    return chunks


def plan_rounds(layouts, nodes: int, chunk: int) -> list[list[Chunk]]:
    """The chunks in rounds of at most one per node (its next), each round in file order."""
    per_node: list[list[Chunk]] = [[] for _ in range(nodes)]
    for planned in plan_chunks(layouts, nodes, chunk):
        per_node[planned.node].append(planned)
    count = max((len(chunks) for chunks in per_node), default=0)
    return [
        sorted((chunks[i] for chunks in per_node if i < len(chunks)), key=lambda c: (c.file, c.begin))
        for i in range(count)
    ]


def first_read_mb_s(layout: FileLayout) -> int:
    """MB/s of this node's first read of `layout` (0: in the page cache, or not timed)."""
    if not page_cache.is_cold(layout.cached):
        return 0
    rate = first_read_rate(layout.path)
    return 0 if rate is None else max(1, int(rate / 1e6))
