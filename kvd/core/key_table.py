"""The key table: which slot holds the page indexed under a page key.

An open-addressing hash table of int32 slots (-1 for an empty bucket), linear probing,
keyed by a key's first 8 bytes (a page key is a 128-bit hash: kvd/wire/keys.py), at most
half full: ~8–16 B a key, where a dict entry, its key ``bytes`` and the page id ``int``
took ~130 B (issue 41). The keys themselves live in the page columns
(``PageColumns.key``, written by the index before it adds a slot here), so a probe
confirms the whole key from the column.

One key is looked up, added or removed in Python through memoryviews (~0.3 µs); a batch
is added, and the table rebuilt when it grows, with numpy.
"""

from __future__ import annotations

import numpy as np

from kvd.core.page_columns import KEY_BYTES, PageColumns

_EMPTY = -1
_FIRST_SIZE = 1 << 10  # buckets; a power of two


class KeyTable:
    """Page key → slot, over the keys in ``columns.key``."""

    def __init__(self, columns: PageColumns) -> None:
        self._columns = columns
        self._count = 0
        self._table = np.full(_FIRST_SIZE, _EMPTY, np.int32)
        self._table_at = memoryview(self._table)
        self._mask = _FIRST_SIZE - 1

    def __len__(self) -> int:
        return self._count

    def find(self, key: bytes) -> int:
        """The slot whose key is ``key``; -1 for none."""
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        bucket = int.from_bytes(key[:8], "little") & mask
        while True:
            slot = table[bucket]
            if slot < 0 or keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] == key:
                return slot
            bucket = (bucket + 1) & mask

    def add(self, slot: int) -> None:
        """Adds ``slot`` under the key its column holds, which no slot here has."""
        self._reserve(self._count + 1)
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        key = keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES]
        bucket = int.from_bytes(key[:8], "little") & mask
        while table[bucket] >= 0:
            held = table[bucket]
            assert keys[held * KEY_BYTES : (held + 1) * KEY_BYTES] != key, f"key {bytes(key).hex()} added twice"
            bucket = (bucket + 1) & mask
        table[bucket] = slot
        self._count += 1

    def add_many(self, slots: np.ndarray) -> None:
        """``add`` for a batch of slots whose keys differ."""
        self._reserve(self._count + len(slots))
        self._place(np.asarray(slots, np.int64))
        self._count += len(slots)

    def remove(self, key: bytes) -> int:
        """Takes ``key`` out; returns its slot. The entries after it in its probe sequence
        move back (no tombstones: a table that keys come and go in never fills up with them)."""
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        bucket = int.from_bytes(key[:8], "little") & mask
        while True:
            slot = table[bucket]
            assert slot >= 0, f"key {key.hex()} is not in the table"
            if keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] == key:
                break
            bucket = (bucket + 1) & mask
        hole, probe = bucket, bucket
        while True:
            probe = (probe + 1) & mask
            moved = table[probe]
            if moved < 0:
                break
            home = int.from_bytes(keys[moved * KEY_BYTES : moved * KEY_BYTES + 8], "little") & mask
            if (probe - home) & mask >= (probe - hole) & mask:  # the hole lies on its probe path
                table[hole] = moved
                hole = probe
        table[hole] = _EMPTY
        self._count -= 1
        return slot

    def slots(self) -> np.ndarray:
        """Every slot in the table (int64), in bucket order."""
        return self._table[self._table >= 0].astype(np.int64)

    def _reserve(self, count: int) -> None:
        """Keeps the table at most half full once it holds ``count`` keys: doubles it and
        places every slot again."""
        size = len(self._table)
        if 2 * count <= size:
            return
        while 2 * count > size:
            size *= 2
        held = self.slots()
        self._table = np.full(size, _EMPTY, np.int32)
        self._table_at = memoryview(self._table)
        self._mask = size - 1
        self._place(held)

    def _place(self, slots: np.ndarray) -> None:
        """Puts slots whose keys are not in the table into it, each in the first empty bucket
        from its key's home, in rounds: a round fills the empty buckets the remaining slots
        face (one slot a bucket) and moves the others one bucket on."""
        table, mask = self._table, self._mask
        keys = self._columns.key
        buckets = keys[slots].view("<u8")[::2] & np.uint64(mask)
        buckets = buckets.astype(np.int64)
        while slots.size:
            held = table[buckets]
            taken = held >= 0
            if taken.any():
                assert not (keys[held[taken]] == keys[slots[taken]]).any(), "a key added twice"
            empty = np.flatnonzero(~taken)
            _, first = np.unique(buckets[empty], return_index=True)
            placed = empty[first]
            table[buckets[placed]] = slots[placed]
            rest = np.ones(slots.size, np.bool_)
            rest[placed] = False
            slots, buckets = slots[rest], (buckets[rest] + 1) & mask
