"""Opening the slot file: which chunks are formatted, and which slots hold a valid page.

``recover`` runs once when the store opens (kvd/diskstore/store.py), on its worker threads. It
reads the superblock; a file without a valid one, or formatted with another chunk size, is
formatted afresh (a new file id: no header written before can be valid again). Otherwise it
reads every chunk's header, then each formatted chunk's slot headers in one large read (they
lie together, kvd/diskstore/layout.py), and keeps the slots whose header is valid for that place,
that chunk generation and that file. Page bytes are not read here: the write order (a page's
bytes are written and synced before its header; a slot's header is zeroed and synced before
the slot is written again) makes a valid header describe complete bytes, and every read
checks the bytes against the header's checksum before they are served.

A header that begins with the slot magic but is not valid (torn by a crash, scribbled) is
counted in ``torn``; its slot is free, like one never written.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from kvd.diskstore.layout import (
    BLOCK,
    ChunkFormat,
    DiskPage,
    SlotStamp,
    chunk_offset,
    has_slot_magic,
    pack_superblock,
    read_chunk_header,
    read_slot_header,
    read_superblock,
    slot_id,
)
from kvd.diskstore.slot_file import SlotFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovered:
    """What the file held when it was opened."""

    file_id: bytes
    chunks: list[ChunkFormat | None]  # by chunk index; None: not formatted
    pages: list[DiskPage]  # every slot with a valid header
    torn: int  # headers with the slot magic that are not valid
    formatted: bool  # the file was formatted now: nothing it held before survives
    header_bytes_read: int
    seconds: float


@dataclass(frozen=True)
class _ChunkScan:
    pages: list[DiskPage]
    torn: int


def recover(file: SlotFile, chunk_bytes: int, chunks: int, executor: Executor) -> Recovered:
    """Reads what ``file`` holds (``chunks`` chunks of ``chunk_bytes``); formats it when it holds
    nothing usable. ``OSError`` when the file cannot be read or written."""
    start = time.perf_counter()
    found = read_superblock(file.read_blocks(0, BLOCK))
    if found is None or found[1] != chunk_bytes:
        file_id = _format(file, chunk_bytes)
        if found is not None:
            log.warning(
                "disk tier: %s had chunks of %d bytes, not %d: formatted afresh", file.path, found[1], chunk_bytes
            )
        return Recovered(file_id, [None] * chunks, [], 0, True, BLOCK, time.perf_counter() - start)
    file_id = found[0]

    def chunk_header(index: int) -> ChunkFormat | None:
        return read_chunk_header(file.read_blocks(chunk_offset(index, chunk_bytes), BLOCK), file_id, index, chunk_bytes)

    formats = list(executor.map(chunk_header, range(chunks)))
    scans = list(executor.map(lambda f: _scan(file, file_id, f), [f for f in formats if f is not None]))
    pages = [p for scan in scans for p in scan.pages]
    header_bytes = BLOCK * (1 + chunks) + sum(f.headers_bytes for f in formats if f is not None)
    return Recovered(
        file_id, formats, pages, sum(s.torn for s in scans), False, header_bytes, time.perf_counter() - start
    )


def _scan(file: SlotFile, file_id: bytes, chunk: ChunkFormat) -> _ChunkScan:
    """The valid slot headers of one chunk, read together."""
    # headers: [slots, header_bytes]
    headers = file.read_blocks(chunk.header_offset(0), chunk.headers_bytes).reshape(chunk.slots, chunk.cls.header_bytes)
    pages, torn = [], 0
    for i in np.flatnonzero(has_slot_magic(headers)).tolist():
        page = read_slot_header(headers[i], SlotStamp(file_id, chunk.generation, slot_id(chunk.index, i)), chunk.cls)
        if page is None:
            torn += 1
        else:
            pages.append(page)
    return _ChunkScan(pages, torn)


def _format(file: SlotFile, chunk_bytes: int) -> bytes:
    """Writes a new superblock (a new file id) and makes it durable; returns the file id."""
    file_id = os.urandom(16)
    block = np.frombuffer(mmap.mmap(-1, BLOCK), np.uint8)
    pack_superblock(block, file_id, chunk_bytes)
    file.write_blocks(0, block)
    file.sync()
    return file_id
