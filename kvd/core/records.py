"""Page metadata in shared memory: the one place that fixes its format (version 1).

A daemon killed with ``kill -9`` leaves its extents in /dev/shm. Beside them it keeps
enough metadata, also in shared memory and written as pages change state, for the next
daemon on the same socket to verify every published page and re-index it (warm restart,
kvd/durability/recovery.py). Everything is little-endian.

Manifest segment ``{prefix}-manifest`` (``MANIFEST_BYTES``, rewritten when a namespace
is registered or an extent is added)::

    magic       8s   b"KVDMANIF"
    version     u32  FORMAT_VERSION
    body_len    u32
    body_xxh3   u64  xxh3_64 of the body: a torn or scribbled manifest is detected
    body        JSON {"host_bytes", "extent_bytes", "namespaces": [identity, ... in id order]}

Extent metadata segment ``{extent name}.meta``: a header, then one fixed-size record per
page of the extent (record i describes page ``first_page + i``)::

    header (HEADER_BYTES = 64)
      magic 8s b"KVDPAGES", version u32, namespace id u32, namespace root 16s,
      first_page u64, num_pages u32, page_size u32, page_bytes u64, record_bytes u32, pad
    record (RECORD_HEAD = 64 + 4 * page_size bytes)
      [0]   state u8        FREE 0 | PUBLISHED 1 (described, not sealed yet) | SEALED 2
      [8]   checksum u64    xxh3_64 of record[16:] followed by the page's bytes
      [16]  has_parent u8, pad 3, page_index u32
      [24]  parent u64      page id of the previous page of the chain (has_parent = 1)
      [32]  key 16s         the page key
      [48]  local 16s       digest of the page's local extra bytes (PageContent.local), or zeros
      [64]  tokens          page_size little-endian int32 token ids

Write order keeps a crash harmless: a record's fields are written before its state
becomes PUBLISHED (before ``publish`` replies), its checksum before SEALED, and the state
drops to FREE before the page can be written again. A SEALED record is recovered only
when its checksum matches, so the checksum also covers the record's own fields; a
PUBLISHED one is complete (its state byte is written last) and recovery seals it itself.
The metadata segment is created before its extent's data segment and unlinked after it.
Every segment here is reserved in /dev/shm when it is created (kvd/core/shm.py): a record
written into a page of it never meets a full /dev/shm. An extent's metadata segment
(``ExtentHeader.segment_bytes``: 64 + (64 + 4 * page_size) bytes per page, 0.006% of a
2 MiB page of 16 tokens) counts in the host budget with the extent (kvd/core/arena.py).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass

import numpy as np
import posix_ipc
import xxhash

from kvd.core.shm import create_segment, reserve, unlink_quietly

FORMAT_VERSION = 1
MANIFEST_MAGIC = b"KVDMANIF"
EXTENT_MAGIC = b"KVDPAGES"
MANIFEST_BYTES = 1 << 20  # kvd/core/namespaces.py bounds namespaces so that their identities fit
MANIFEST_ENVELOPE_BYTES = 256  # the head and the body's keys and numbers besides the namespaces
META_SUFFIX = ".meta"
MANIFEST_SUFFIX = "-manifest"

FREE, PUBLISHED, SEALED = 0, 1, 2

_MANIFEST_HEAD = struct.Struct("<8sIIQ")
_HEADER = struct.Struct("<8sII16sQIIQI")
HEADER_BYTES = 64
RECORD_HEAD = 64
_RECORD_FIELDS = struct.Struct("<B3xIQ16s16s")  # record[16:64]
_CHECKSUM = struct.Struct("<Q")


class MetaError(ValueError):
    """Metadata that cannot be used: missing, torn, of another version or another layout."""


def page_checksum(covered: bytes | memoryview, page: np.ndarray) -> int:
    """xxh3_64 of a record's covered fields followed by the page bytes (~35 ms per GiB)."""
    h = xxhash.xxh3_64(covered)
    h.update(page)
    return h.intdigest()


def _create(name: str, size: int, what: str, mode: int) -> mmap.mmap:
    """The segment, reserved in /dev/shm and mapped; ``ShmFull`` when /dev/shm cannot hold it."""
    shm = create_segment(name, size, what, mode, exclusive=False)
    try:
        return mmap.mmap(shm.fd, size)
    except BaseException:
        unlink_quietly(name)
        raise
    finally:
        shm.close_fd()


def _open(name: str) -> mmap.mmap:
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise MetaError(f"segment {name} is missing") from None
    try:
        if shm.size == 0:
            raise MetaError(f"segment {name} is empty")
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


# ---- manifest -----------------------------------------------------------------------


def manifest_name(prefix: str) -> str:
    return prefix + MANIFEST_SUFFIX


def write_manifest(prefix: str, doc: dict, memory: mmap.mmap | None, mode: int = 0o660) -> mmap.mmap:
    """Writes the manifest (creating its segment on first use) and returns its map."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if _MANIFEST_HEAD.size + len(body) > MANIFEST_BYTES:
        raise MetaError(f"manifest of {len(body)} bytes does not fit its {MANIFEST_BYTES}-byte segment")
    if memory is None:
        memory = _create(manifest_name(prefix), MANIFEST_BYTES, "the manifest", mode)
    memory[_MANIFEST_HEAD.size : _MANIFEST_HEAD.size + len(body)] = body
    memory[: _MANIFEST_HEAD.size] = _MANIFEST_HEAD.pack(
        MANIFEST_MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body)
    )
    return memory


def read_manifest(prefix: str) -> dict:
    memory = _open(manifest_name(prefix))
    try:
        if len(memory) < _MANIFEST_HEAD.size:
            raise MetaError("the manifest is too short")
        magic, version, length, digest = _MANIFEST_HEAD.unpack_from(memory)
        if magic != MANIFEST_MAGIC:
            raise MetaError(f"the manifest has magic {magic!r}, not {MANIFEST_MAGIC!r}")
        if version != FORMAT_VERSION:
            raise MetaError(f"the manifest has format version {version}; this daemon reads {FORMAT_VERSION}")
        body = memory[_MANIFEST_HEAD.size : _MANIFEST_HEAD.size + length]
        if len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
            raise MetaError("the manifest's checksum does not match its body (torn or overwritten)")
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise MetaError(f"the manifest body is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise MetaError("the manifest body is not a JSON object")
        return doc
    finally:
        memory.close()


# ---- per-extent records -------------------------------------------------------------


def record_size(page_size: int) -> int:
    """Bytes of the record of one page of ``page_size`` tokens."""
    return RECORD_HEAD + 4 * page_size


@dataclass(frozen=True)
class ExtentHeader:
    namespace: int
    root: bytes
    first_page: int
    num_pages: int
    page_size: int
    page_bytes: int

    @property
    def record_bytes(self) -> int:
        return record_size(self.page_size)

    @property
    def segment_bytes(self) -> int:
        """The size of the metadata segment: the header and one record per page."""
        return HEADER_BYTES + self.num_pages * self.record_bytes


@dataclass(frozen=True)
class Record:
    """One SEALED record as read back at recovery."""

    index: int  # position in the extent
    checksum: int
    covered: bytes  # record[16:], what the checksum covers besides the page
    parent: int | None
    page_index: int
    key: bytes
    local: bytes
    tokens: bytes


class ExtentMeta:
    """The metadata segment of one extent: its header and one record per page."""

    def __init__(self, name: str, memory: mmap.mmap, header: ExtentHeader) -> None:
        self.name = name
        self.memory = memory
        self.header = header
        self._size = header.record_bytes

    @classmethod
    def create(cls, extent_name: str, header: ExtentHeader, mode: int = 0o660) -> ExtentMeta:
        name = extent_name + META_SUFFIX
        memory = _create(name, header.segment_bytes, f"metadata segment {name}", mode)
        memory[: _HEADER.size] = _HEADER.pack(
            EXTENT_MAGIC,
            FORMAT_VERSION,
            header.namespace,
            header.root,
            header.first_page,
            header.num_pages,
            header.page_size,
            header.page_bytes,
            header.record_bytes,
        )
        return cls(name, memory, header)

    @classmethod
    def open(cls, extent_name: str) -> ExtentMeta:
        name = extent_name + META_SUFFIX
        memory = _open(name)
        try:
            if len(memory) < HEADER_BYTES:
                raise MetaError(f"{name} is too short for a header")
            magic, version, ns, root, first, count, page_size, page_bytes, record_bytes = _HEADER.unpack_from(memory)
            if magic != EXTENT_MAGIC or version != FORMAT_VERSION:
                raise MetaError(f"{name} has magic {magic!r} version {version}, not {EXTENT_MAGIC!r} {FORMAT_VERSION}")
            header = ExtentHeader(ns, root, first, count, page_size, page_bytes)
            if record_bytes != header.record_bytes or len(memory) < header.segment_bytes:
                raise MetaError(f"{name} does not hold {count} records of {header.record_bytes} bytes")
        except BaseException:
            memory.close()
            raise
        return cls(name, memory, header)

    def _offset(self, i: int) -> int:
        return HEADER_BYTES + i * self._size

    def describe(self, i: int, key: bytes, parent: int | None, page_index: int, local: bytes, tokens: bytes) -> bytes:
        """Records a page just published (state PUBLISHED); returns the fields the checksum covers."""
        off = self._offset(i)
        self.memory[off] = FREE
        covered = _RECORD_FIELDS.pack(parent is not None, page_index, parent or 0, key, local.ljust(16, b"\0")) + tokens
        self.memory[off + 16 : off + self._size] = covered
        self.memory[off] = PUBLISHED
        return covered

    def seal(self, i: int, checksum: int) -> None:
        off = self._offset(i)
        self.memory[off + 8 : off + 16] = _CHECKSUM.pack(checksum)
        self.memory[off] = SEALED

    def clear(self, i: int) -> None:
        self.memory[self._offset(i)] = FREE

    def covered(self, i: int) -> bytes:
        off = self._offset(i)
        return self.memory[off + 16 : off + self._size]

    def states(self) -> np.ndarray:
        """The state byte of every record: uint8 [num_pages]."""
        raw = np.frombuffer(self.memory, dtype=np.uint8, count=self.header.num_pages * self._size, offset=HEADER_BYTES)
        return raw[:: self._size].copy()

    def columns(self) -> np.ndarray:
        """Every record's numeric fields as one structured view (no copy): ``state``,
        ``checksum``, ``has_parent``, ``page_index``, ``parent``; one row per page."""
        dtype = np.dtype(
            {
                "names": ["state", "checksum", "has_parent", "page_index", "parent"],
                "formats": ["u1", "<u8", "u1", "<u4", "<u8"],
                "offsets": [0, 8, 16, 20, 24],
                "itemsize": self._size,
            }
        )
        return np.frombuffer(self.memory, dtype=dtype, count=self.header.num_pages, offset=HEADER_BYTES)

    def record(self, i: int) -> Record:
        off = self._offset(i)
        (checksum,) = _CHECKSUM.unpack_from(self.memory, off + 8)
        covered = self.memory[off + 16 : off + self._size]
        has_parent, page_index, parent, key, local = _RECORD_FIELDS.unpack_from(covered)
        return Record(
            i,
            checksum,
            covered,
            parent if has_parent else None,
            page_index,
            key,
            local if any(local) else b"",
            covered[_RECORD_FIELDS.size :],
        )

    def reserve(self) -> None:
        """Reserves the segment in /dev/shm, as ``create`` does: for one a killed daemon left,
        which may have died before it reserved it. ``ShmFull`` when /dev/shm cannot hold it."""
        shm = posix_ipc.SharedMemory(self.name)
        try:
            reserve(shm.fd, self.header.segment_bytes, f"metadata segment {self.name}")
        finally:
            shm.close_fd()

    def close(self, unlink: bool) -> None:
        self.memory.close()
        if unlink:
            unlink_quietly(self.name)
