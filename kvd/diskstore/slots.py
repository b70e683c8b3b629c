"""Which slots of the slot file are free: per chunk, and per page size across chunks.

The store (kvd/diskstore/store.py) owns one ``SlotTable`` and calls it under its lock. A chunk is
formatted for one ``SlotClass`` (kvd/diskstore/layout.py) the first time pages of that size need
room and none of their chunks has a free slot: the lowest chunk with no slot in use, never
formatted or of another size (all its slots free, so all their headers zeroed on disk). Free
slots are handed out lowest first, from the lowest chunk of the size that has some, so the
pages of one write land in consecutive slots (one transfer) wherever the file allows.

A slot is in use from ``take`` until ``release``: while it is written, holds a page, is read
or has its header zeroed. The store releases a slot only once its header on disk is invalid
(never written, or zeroed and synced), so a free slot can always be written without first
invalidating anything.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import defaultdict
from collections.abc import Iterable

from kvd.diskstore.layout import ChunkFormat, DiskPage, SlotClass, SlotId, chunk_of, slot_id


class Chunk:
    """A formatted chunk: its free slots (a heap, lowest first) and whether its header is on disk."""

    __slots__ = ("format", "free", "used", "on_disk", "listed", "lock")

    def __init__(self, fmt: ChunkFormat, used: Iterable[int] = (), on_disk: bool = False) -> None:
        self.format = fmt
        taken = set(used)
        self.free = [i for i in range(fmt.slots) if i not in taken]  # sorted: a heap
        self.used = len(taken)
        self.on_disk = on_disk  # its header is written and synced (the store's writers set it)
        self.listed = False  # in its class's heap of chunks with free slots
        self.lock = threading.Lock()  # held while its header is written


class SlotTable:
    """The free and used slots of ``chunks`` chunks of ``chunk_bytes`` bytes."""

    def __init__(self, chunk_bytes: int, chunks: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunks: list[Chunk | None] = [None] * chunks
        # per class, the indexes of chunks that may have free slots, lowest first (the entries of
        # chunks since formatted for another class are skipped when reached)
        self._open: dict[SlotClass, list[int]] = defaultdict(list)
        self._empty: set[int] = set(range(chunks))  # chunks with no slot in use (unformatted or all free)

    def adopt(self, formats: list[ChunkFormat | None], pages: list[DiskPage]) -> None:
        """The chunks and pages found when the file was opened (kvd/diskstore/recovery.py)."""
        used: dict[int, list[int]] = defaultdict(list)
        for page in pages:
            index, i = chunk_of(page.slot)
            used[index].append(i)
        for fmt in formats:
            if fmt is not None:
                self._chunks[fmt.index] = chunk = Chunk(fmt, used[fmt.index], on_disk=True)
                self._list(chunk)
                if chunk.used:
                    self._empty.discard(fmt.index)

    def fits(self, page_class: SlotClass) -> bool:
        """Whether a chunk holds a page of ``page_class`` at all."""
        return page_class.slots_in(self.chunk_bytes) > 0

    def most(self, page_class: SlotClass) -> int:
        """How many pages of ``page_class`` the file holds, every chunk formatted for them."""
        return page_class.slots_in(self.chunk_bytes) * len(self._chunks)

    def chunk(self, slot: SlotId) -> Chunk:
        chunk = self._chunks[chunk_of(slot)[0]]
        assert chunk is not None, f"slot {slot} is in a chunk that was never formatted"
        return chunk

    def place(self, slot: SlotId) -> tuple[ChunkFormat, int]:
        """The format of ``slot``'s chunk and the slot's index in it."""
        return self.chunk(slot).format, chunk_of(slot)[1]

    def take(self, page_class: SlotClass, n: int) -> list[SlotId]:
        """Up to ``n`` free slots of ``page_class``, lowest first; formats chunks as needed."""
        taken: list[SlotId] = []
        heap = self._open[page_class]
        while len(taken) < n:
            chunk = self._chunks[heap[0]] if heap else self._new_chunk(page_class)
            if chunk is None:
                break
            if chunk.format.cls != page_class or not chunk.free:  # formatted again since, or used up
                heapq.heappop(heap)
                chunk.listed = chunk.listed and chunk.format.cls != page_class
                continue
            self._empty.discard(chunk.format.index)
            while chunk.free and len(taken) < n:
                taken.append(slot_id(chunk.format.index, heapq.heappop(chunk.free)))
                chunk.used += 1
        return taken

    def release(self, slots: Iterable[SlotId]) -> None:
        """Slots whose header on disk is invalid become free."""
        for slot in slots:
            chunk = self.chunk(slot)
            heapq.heappush(chunk.free, chunk_of(slot)[1])
            chunk.used -= 1
            self._list(chunk)
            if chunk.used == 0:
                self._empty.add(chunk.format.index)

    def _new_chunk(self, page_class: SlotClass) -> Chunk | None:
        """The lowest chunk with no slot in use (unformatted, or of another class: ``take`` found
        none of this class with a free slot), formatted for ``page_class`` in memory and listed
        (the store writes its header before the first slot of it)."""
        slots = page_class.slots_in(self.chunk_bytes)
        if slots == 0 or not self._empty:
            return None
        index = min(self._empty)
        generation = int.from_bytes(os.urandom(8), "little")
        self._chunks[index] = chunk = Chunk(ChunkFormat(index, generation, page_class, slots, self.chunk_bytes))
        self._list(chunk)
        return chunk

    def _list(self, chunk: Chunk) -> None:
        if chunk.free and not chunk.listed:
            heapq.heappush(self._open[chunk.format.cls], chunk.format.index)
            chunk.listed = True
