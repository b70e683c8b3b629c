"""The key table: which slot holds the page indexed under a page key.

An open-addressing hash table of int32 slots (-1 for an empty bucket), linear probing,
at most half full: ~8–16 B a key, where a dict entry, its key ``bytes`` and the page id ``int``
took ~130 B (issue 41). The keys themselves live in the page columns
(``PageColumns.key``, written by the index before it adds a slot here), so a probe
confirms the whole key from the column.

A key's home bucket comes from its first 8 bytes (a page key is a 128-bit hash:
kvd/wire/keys.py) mixed with a secret of this process (xor, then multiplicative hashing:
the top bits of the product): a client can compute the page keys of the token ids it
sends, but not which bucket they land in, so it cannot line keys up into one long probe
run that every look-up would walk (a dict's str/bytes hash is salted for the same reason).

One key is looked up, added or removed in Python through memoryviews (~0.3 µs); a batch
is added, and the table rebuilt when it grows, with numpy.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from kvd.core.page_columns import KEY_BYTES, PageColumns

_EMPTY = -1
_FIRST_SIZE = 1 << 10  # buckets; a power of two
_MANY = 512  # slots added at once from which numpy beats a Python loop (measured: 64 took 1.8x the loop)
_low = struct.Struct("<Q").unpack_from  # a key's first 8 bytes
_SALT = int.from_bytes(os.urandom(8), "little")  # the process's secret: xor-ed into those bytes,
_FACTOR = int.from_bytes(os.urandom(8), "little") | 1  # then multiplied by this odd number
_BITS = (1 << 64) - 1


def _home(low: int, shift: int) -> int:
    """The home bucket of a key whose first 8 bytes are ``low``, in a table of 2**(64 - shift)."""
    return (((low ^ _SALT) * _FACTOR) & _BITS) >> shift


def _homes(keys: np.ndarray, shift: int) -> np.ndarray:
    """``_home`` of each key of a ``PageColumns.key`` array, as int64 (numpy's uint64 product
    wraps where the Python one is masked)."""
    low = keys.view("<u8")[::2]
    return (((low ^ np.uint64(_SALT)) * np.uint64(_FACTOR)) >> np.uint64(shift)).astype(np.int64)


class KeyTable:
    """Page key → slot, over the keys in ``columns.key``."""

    def __init__(self, columns: PageColumns) -> None:
        self._columns = columns
        self._count = 0
        self._table = np.full(_FIRST_SIZE, _EMPTY, np.int32)
        self._table_at = memoryview(self._table)
        self._mask = _FIRST_SIZE - 1
        self._shift = 64 - _FIRST_SIZE.bit_length() + 1

    def __len__(self) -> int:
        return self._count

    def find(self, key: bytes) -> int:
        """The slot whose key is ``key``; -1 for none."""
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        bucket = _home(_low(key)[0], self._shift)
        while True:
            slot = table[bucket]
            if slot < 0 or keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] == key:
                return slot
            bucket = (bucket + 1) & mask

    def add(self, slots: list[int] | np.ndarray) -> None:
        """Adds ``slots``, each under the key its column holds, which no other slot has."""
        self._reserve(self._count + len(slots))
        if len(slots) >= _MANY:
            self._place(np.asarray(slots, np.int64))
            self._count += len(slots)
            return
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        for slot in slots.tolist() if isinstance(slots, np.ndarray) else slots:
            key = keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES]
            bucket = _home(_low(key)[0], self._shift)
            while table[bucket] >= 0:
                held = table[bucket]
                assert keys[held * KEY_BYTES : (held + 1) * KEY_BYTES] != key, (
                    f"page key {bytes(key).hex()} already indexed to page {self._columns.page_at[held]}"
                )
                bucket = (bucket + 1) & mask
            table[bucket] = slot
            self._count += 1

    def remove(self, key: bytes) -> int:
        """Takes ``key`` out; returns its slot. The entries after it in its probe sequence
        move back (no tombstones: a table that keys come and go in never fills up with them)."""
        table, keys, mask = self._table_at, self._columns.key_at, self._mask
        bucket = _home(_low(key)[0], self._shift)
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
            home = _home(_low(keys, moved * KEY_BYTES)[0], self._shift)
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
        self._shift = 64 - size.bit_length() + 1
        # Into an empty table, linear probing puts the i-th slot in order of home bucket at
        # max(its home, the bucket after the (i-1)-th's): one sort and one running maximum
        # (~40 ms at 1M keys, where placing them in rounds took ~130 ms on the event loop).
        homes = _homes(self._columns.key[held], self._shift)
        order = np.argsort(homes)
        steps = np.arange(len(held))
        buckets = np.maximum.accumulate(homes[order] - steps) + steps
        inside = buckets < size
        self._table[buckets[inside]] = held[order[inside]]
        # a cluster that runs past the end goes on from bucket 0
        self._place(held[order[~inside]], np.zeros(np.count_nonzero(~inside), np.int64))

    def _place(self, slots: np.ndarray, buckets: np.ndarray | None = None) -> None:
        """Puts slots whose keys are not in the table into it, each in the first empty bucket
        from its key's home (or from ``buckets``, where the buckets up to there are taken), in
        rounds: a round fills the empty buckets the remaining slots face (one slot a bucket)
        and moves the others one bucket on."""
        table, mask = self._table, self._mask
        keys = self._columns.key
        if buckets is None:
            buckets = _homes(keys[slots], self._shift)
        while slots.size:
            held = table[buckets]
            taken = held >= 0
            if taken.any():
                assert not (keys[held[taken]] == keys[slots[taken]]).any(), "a page key already indexed"
            empty = np.flatnonzero(~taken)
            _, first = np.unique(buckets[empty], return_index=True)
            placed = empty[first]
            table[buckets[placed]] = slots[placed]
            rest = np.ones(slots.size, np.bool_)
            rest[placed] = False
            slots, buckets = slots[rest], (buckets[rest] + 1) & mask
