"""The disk tier's slot file: where each page lies in it, and the headers that say what it is (version 1).

The storage engine (kvd/diskstore/store.py) keeps every page in one preallocated file,
``kvd-disk.slots`` in the tier's directory (kvd/diskstore/slot_file.py). Everything is
little-endian, and every region below starts on a ``BLOCK`` (4 KiB) boundary and is a
whole number of blocks long, so the file can be read and written with O_DIRECT on any
device whose direct-I/O alignment is at most 4 KiB::

    superblock (offset 0, one block)
      magic 8s b"KVDDISK1", version u32, pad u32, file_id 16s (random, new at each format),
      chunk_bytes u64, checksum u64 (xxh3_64 of the 40 bytes before it)
    chunk k (offset BLOCK + k * chunk_bytes, chunk_bytes long)
      chunk header (one block)
        magic 8s b"KVDCHUNK", version u32, pad u32, checksum u64 (xxh3_64 of [24:72]),
        file_id 16s, index u64, generation u64 (random, new at each format of the chunk),
        page_bytes u64, page_size u32, slots u32
      slot headers: ``slots`` blocks of ``SlotClass.header_bytes``, one per slot
      slot data:    ``slots`` blocks of ``SlotClass.data_bytes``, one page each

Pages of different sizes (namespaces differ in page bytes and tokens per page) live in
different chunks: a chunk is formatted for one ``SlotClass`` when one is needed, and
formatted again for another class only once all its slots are free. One file, reserved
whole when it is created, serves every size without splitting the budget in advance
(and the same layout fits on a raw device). The slot headers of a chunk lie together,
so opening the file reads them in one large read per chunk; the data of consecutive
slots lies together too, so a run of pages is one read or write.

A slot header (``header_bytes``: ``HEAD_BYTES`` + 4 bytes a token, rounded up to a block)::

    [0]   magic 8s b"KVDSLOT1", version u32, pad u32
    [16]  header_checksum u64   xxh3_64 of header[24:HEAD_BYTES + 4 * page_size]
    [24]  file_id 16s, chunk_generation u64, slot u64, sequence u64 (the write's number)
    [64]  page_checksum u64     kvd/core/records.py's page_checksum(header[72:end], page)
    [72]  page_bytes u64, page_index u32, page_size u32 (tokens)
    [88]  scope 32s             the tenant's name, zero padded ("" for the implicit tenant)
    [120] namespace_root 16s, key 16s (the page's chain key), parent_key 16s (the chain
          root for page 0), local 16s (digest of the page's local extra bytes, or zeros)
    [184] tokens                page_size little-endian int32 token ids

A header is valid only when its magic, version, checksum, file id, chunk generation and
slot number all hold: a torn header, one left by an earlier format of the file or of the
chunk, or one at another place is no page. The page checksum covers what a hit checks
(the identity, from ``page_bytes`` on) and the page's bytes, so bytes read back are
served only for the identity they were written with.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

from kvd.core.records import page_checksum
from kvd.core.types import PageKey

FORMAT_VERSION = 1
BLOCK = 4096
FILE_NAME = "kvd-disk.slots"
SUPER_MAGIC = b"KVDDISK1"
CHUNK_MAGIC = b"KVDCHUNK"
SLOT_MAGIC = b"KVDSLOT1"
SCOPE_BYTES = 32  # kvd/config.py: a tenant name is 1-32 letters, digits or underscores
MAX_CHUNK_SLOTS = 1 << 24  # a SlotId packs (chunk, slot in chunk)

_SUPER = struct.Struct("<8sII16sQ")  # checksum follows at [40]
_CHUNK = struct.Struct("<8sIIQ16sQQQII")
_SLOT_HEAD = struct.Struct("<8sIIQ16sQQQQ")  # [0:72]
_IDENTITY = struct.Struct(f"<QII{SCOPE_BYTES}s16s16s16s16s")  # [72:184]
HEAD_BYTES = _SLOT_HEAD.size + _IDENTITY.size  # 184
_HEADER_COVERED = 24  # the header checksum covers the header from file_id on
_PAGE_COVERED = _SLOT_HEAD.size  # the page checksum covers the identity from page_bytes on

SlotId = NewType("SlotId", int)


def align(n: int) -> int:
    """``n`` rounded up to a whole block."""
    return -(-n // BLOCK) * BLOCK


def slot_id(chunk: int, index: int) -> SlotId:
    return SlotId(chunk * MAX_CHUNK_SLOTS + index)


def chunk_of(slot: SlotId) -> tuple[int, int]:
    """(chunk, slot in chunk) of ``slot``."""
    return divmod(slot, MAX_CHUNK_SLOTS)


@dataclass(frozen=True, slots=True)
class SlotClass:
    """The slot shape of pages of ``page_bytes`` bytes and ``page_size`` tokens."""

    page_bytes: int
    page_size: int

    @property
    def header_bytes(self) -> int:
        return align(HEAD_BYTES + 4 * self.page_size)

    @property
    def data_bytes(self) -> int:
        return align(self.page_bytes)

    def slots_in(self, chunk_bytes: int) -> int:
        """How many slots of this class a chunk holds besides its header (0: the page does not fit)."""
        return min((chunk_bytes - BLOCK) // (self.header_bytes + self.data_bytes), MAX_CHUNK_SLOTS - 1)


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """A chunk formatted for one slot class: where its slots' headers and data lie."""

    index: int
    generation: int
    cls: SlotClass
    slots: int
    chunk_bytes: int

    @property
    def offset(self) -> int:
        return chunk_offset(self.index, self.chunk_bytes)

    def header_offset(self, i: int) -> int:
        return self.offset + BLOCK + i * self.cls.header_bytes

    def data_offset(self, i: int) -> int:
        return self.offset + BLOCK + self.slots * self.cls.header_bytes + i * self.cls.data_bytes

    @property
    def headers_bytes(self) -> int:
        """Bytes of the chunk's slot headers, which lie together."""
        return self.slots * self.cls.header_bytes


def chunk_offset(index: int, chunk_bytes: int) -> int:
    return BLOCK + index * chunk_bytes


def file_bytes(chunks: int, chunk_bytes: int) -> int:
    return BLOCK + chunks * chunk_bytes


@dataclass(frozen=True, slots=True)
class PageIdentity:
    """What a page on disk is: everything a hit must match before its bytes are served."""

    scope: str  # the tenant ("" for the implicit one)
    namespace_root: bytes  # 16 bytes: model, layout, TP rank, ... (kvd/core/namespaces.py)
    key: PageKey  # the page's chain key (kvd/core/index.py)
    parent_key: bytes  # the parent's chain key; the chain root for page 0
    page_index: int
    local: bytes  # 16-byte digest of the page's local extra bytes, or b""
    tokens: bytes  # page_size little-endian int32 token ids

    def covered(self, page_bytes: int) -> bytes:
        """The header bytes the page checksum covers besides the page: header[72:end]."""
        return (
            _IDENTITY.pack(
                page_bytes,
                self.page_index,
                len(self.tokens) // 4,
                self.scope.encode(),
                self.namespace_root,
                self.key,
                self.parent_key,
                self.local.ljust(16, b"\0"),
            )
            + self.tokens
        )


@dataclass(frozen=True, slots=True)
class DiskPage:
    """A page stored in a slot: what it is, and what its bytes must hash to."""

    slot: SlotId
    identity: PageIdentity
    page_bytes: int
    checksum: int  # page_checksum(identity.covered(page_bytes), page)
    sequence: int  # the number of the write that stored it: later writes have larger numbers

    @property
    def page_class(self) -> SlotClass:
        return SlotClass(self.page_bytes, len(self.identity.tokens) // 4)

    def matches(self, page: np.ndarray) -> bool:
        """Whether ``page`` (uint8 [page_bytes]) holds the bytes this page was written with."""
        return (
            page.nbytes == self.page_bytes
            and page_checksum(self.identity.covered(self.page_bytes), page) == self.checksum
        )


# ---- superblock and chunk headers --------------------------------------------------------


def pack_superblock(out: np.ndarray, file_id: bytes, chunk_bytes: int) -> None:
    """Fills ``out`` (uint8 [BLOCK]) with the superblock."""
    out[:] = 0
    head = _SUPER.pack(SUPER_MAGIC, FORMAT_VERSION, 0, file_id, chunk_bytes)
    out[: len(head) + 8] = np.frombuffer(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), np.uint8)


def read_superblock(raw: np.ndarray) -> tuple[bytes, int] | None:
    """(file_id, chunk_bytes) of a valid superblock in ``raw``; None otherwise."""
    head = raw[: _SUPER.size].tobytes()
    magic, version, _, file_id, chunk_bytes = _SUPER.unpack(head)
    (checksum,) = struct.unpack_from("<Q", raw, _SUPER.size)
    if magic != SUPER_MAGIC or version != FORMAT_VERSION or xxhash.xxh3_64_intdigest(head) != checksum:
        return None
    return file_id, chunk_bytes


def pack_chunk_header(out: np.ndarray, file_id: bytes, chunk: ChunkFormat) -> None:
    """Fills ``out`` (uint8 [BLOCK]) with the header of ``chunk``."""
    out[:] = 0
    body = _CHUNK.pack(
        CHUNK_MAGIC, FORMAT_VERSION, 0, 0, file_id, chunk.index, chunk.generation,
        chunk.cls.page_bytes, chunk.cls.page_size, chunk.slots,
    )  # fmt: skip
    checksum = struct.pack("<Q", xxhash.xxh3_64_intdigest(body[_HEADER_COVERED:]))
    out[: len(body)] = np.frombuffer(body[:16] + checksum + body[_HEADER_COVERED:], np.uint8)


def read_chunk_header(raw: np.ndarray, file_id: bytes, index: int, chunk_bytes: int) -> ChunkFormat | None:
    """The format of chunk ``index`` when ``raw`` holds a valid header of it; None otherwise."""
    body = raw[: _CHUNK.size].tobytes()
    magic, version, _, checksum, fid, i, generation, page_bytes, page_size, slots = _CHUNK.unpack(body)
    if (
        magic != CHUNK_MAGIC
        or version != FORMAT_VERSION
        or xxhash.xxh3_64_intdigest(body[_HEADER_COVERED:]) != checksum
    ):
        return None
    cls = SlotClass(page_bytes, page_size)
    if fid != file_id or i != index or page_bytes == 0 or slots != cls.slots_in(chunk_bytes):
        return None
    return ChunkFormat(index, generation, cls, slots, chunk_bytes)


# ---- slot headers ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotStamp:
    """Where a header is written: it is valid only there, in that format of the file and chunk."""

    file_id: bytes
    generation: int
    slot: SlotId


def pack_slot_header(
    out: np.ndarray, stamp: SlotStamp, sequence: int, identity: PageIdentity, page: np.ndarray
) -> DiskPage:
    """Fills ``out`` (uint8 [header_bytes]) with the header of ``page`` (uint8 [page_bytes]),
    computing its checksums (reading the page once); returns what it describes."""
    covered = identity.covered(page.nbytes)
    checksum = page_checksum(covered, page)
    placed = _SLOT_HEAD.pack(
        SLOT_MAGIC, FORMAT_VERSION, 0, 0, stamp.file_id, stamp.generation, stamp.slot, sequence, checksum
    )
    end = HEAD_BYTES + len(identity.tokens)
    out[_HEADER_COVERED:_PAGE_COVERED] = np.frombuffer(placed[_HEADER_COVERED:], np.uint8)
    out[_PAGE_COVERED:end] = np.frombuffer(covered, np.uint8)
    out[end:] = 0
    header_checksum = xxhash.xxh3_64_intdigest(out[_HEADER_COVERED:end])
    out[:_HEADER_COVERED] = np.frombuffer(placed[:16] + struct.pack("<Q", header_checksum), np.uint8)
    return DiskPage(stamp.slot, identity, page.nbytes, checksum, sequence)


def has_slot_magic(headers: np.ndarray) -> np.ndarray:
    """Which rows of ``headers`` (uint8 [n, header_bytes]) begin with the slot magic: bool [n]."""
    return (headers[:, : len(SLOT_MAGIC)] == np.frombuffer(SLOT_MAGIC, np.uint8)).all(axis=1)


def read_slot_header(raw: np.ndarray, stamp: SlotStamp, cls: SlotClass) -> DiskPage | None:
    """The page ``raw`` (uint8 [header_bytes]) describes when it is a valid header written at
    ``stamp`` for a page of ``cls``; None otherwise (never written, invalidated, torn, stale)."""
    magic, version, _, header_checksum, file_id, generation, slot, sequence, checksum = _SLOT_HEAD.unpack_from(raw)
    if magic != SLOT_MAGIC or version != FORMAT_VERSION:
        return None
    page_bytes, page_index, page_size, scope, root, key, parent, local = _IDENTITY.unpack_from(raw, _PAGE_COVERED)
    if page_size != cls.page_size or page_bytes != cls.page_bytes:
        return None
    end = HEAD_BYTES + 4 * page_size
    if xxhash.xxh3_64_intdigest(raw[_HEADER_COVERED:end]) != header_checksum:
        return None
    if (file_id, generation, slot) != (stamp.file_id, stamp.generation, stamp.slot):
        return None
    identity = PageIdentity(
        scope.rstrip(b"\0").decode(),
        root,
        PageKey(key),
        parent,
        page_index,
        b"" if local == bytes(16) else local,
        raw[HEAD_BYTES:end].tobytes(),
    )
    return DiskPage(stamp.slot, identity, page_bytes, checksum, sequence)
