"""Page keys: the chain of hashes that names every full page, computed alike by the daemon
(kvd/core/index.py indexes pages under them) and by clients (to recognise the keys kvd's KV
events name, kvd/cache/events.py).

A page key hashes (parent key, page index, the page's token ids, the page's extra keys);
the chain starts at a per-request root that hashes the namespace root
(``RegisterNamespaceReply.root``), the page size and the request-wide extra keys (LoRA
identity, cache salt). Every extra key is tagged with its kind and length-prefixed, so a
LoRA name can never collide with a cache salt or an image hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvd.wire.enums import ExtraKind

_hash = xxhash.xxh3_128_digest
_U32 = struct.Struct("<I")


class KeyMaterial(Protocol):
    """An extra key as the daemon's and the client's ``ExtraKey`` both hold it."""

    kind: int
    value: bytes
    offset: int
    length: int


def tagged(kind: int, value: bytes, *fields: int) -> bytes:
    return bytes([kind]) + _U32.pack(len(value)) + value + b"".join(struct.pack("<q", f) for f in fields)


@dataclass(frozen=True, slots=True)  # slots: the daemon makes one per sequence of a call (kvd/cache/requests.py)
class ChainSpec:
    """Everything a request contributes to its page keys besides token ids."""

    root: bytes  # 16-byte start of the chain
    page_local: dict[int, bytes]  # page index -> tagged multimodal bytes of that page

    def local_bytes(self, page_index: int) -> bytes:
        """Bytes a stored page must match beyond tokens and parent: page 0 also pins the root."""
        local = self.page_local.get(page_index, b"")
        return self.root + local if page_index == 0 else local

    def local_digest(self, page_index: int) -> bytes:
        """What a stored page keeps of ``local_bytes``: a 16-byte digest, or b"" when there are none.

        Page 0's local bytes hold the chain root plus its multimodal items, so they are
        long; a fixed-size digest fits the page's shared-memory record (kvd/core/records.py).
        """
        local = self.local_bytes(page_index)
        return hashlib.blake2b(local, digest_size=16).digest() if local else b""


def chain_spec(namespace_root: bytes, page_size: int, extra_keys: Iterable[KeyMaterial]) -> ChainSpec:
    """Builds the chain root and per-page extra bytes of one request."""
    extra_keys = list(extra_keys)
    request_wide = b"".join(
        tagged(k.kind, k.value)
        for k in sorted((k for k in extra_keys if k.kind != ExtraKind.MULTIMODAL), key=lambda k: (k.kind, k.value))
    )
    # Once per request, so a cryptographic digest costs nothing and keeps tenants' salts apart.
    root = hashlib.blake2b(namespace_root + _U32.pack(page_size) + request_wide, digest_size=16).digest()
    page_local: dict[int, bytes] = {}
    for k in sorted((k for k in extra_keys if k.kind == ExtraKind.MULTIMODAL), key=lambda k: (k.offset, k.value)):
        # An item spans many pages: each holds a fixed-size digest of its value, not the value.
        value = hashlib.blake2b(k.value, digest_size=16).digest()
        first, last = k.offset // page_size, (k.offset + k.length - 1) // page_size
        for page_index in range(first, last + 1):
            rel = k.offset - page_index * page_size
            page_local[page_index] = page_local.get(page_index, b"") + tagged(k.kind, value, rel, k.length)
    return ChainSpec(root=root, page_local=page_local)


def page_key(parent_key: bytes, page_index: int, page_tokens: bytes, local: bytes) -> bytes:
    """Key of one full page given its parent's key (or the chain root for page 0)."""
    return _hash(parent_key + _U32.pack(page_index) + page_tokens + local)


def chain_keys(
    namespace_root: bytes,
    page_size: int,
    tokens: bytes,
    extra_keys: Iterable[KeyMaterial] = (),
    *,
    first_page: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """The keys of the full pages that ``tokens`` (packed little-endian int32) fill, in
    order: what the daemon indexes them under once they are published.

    ``tokens`` start at page ``first_page`` of the request, and ``parent`` is the key of
    page ``first_page - 1`` (None for page 0, whose parent is the chain root): a sequence
    that grows page by page thus hashes each new page once, not its whole prefix again.
    The keys equal the tail of those of the whole prefix; ``extra_keys`` are the
    request's, offsets counted from its first token.
    """
    if first_page < 0 or (parent is None) != (first_page == 0):
        raise ValueError(f"parent, the key of page first_page - 1, comes with a first_page > 0: got {first_page}")
    chain = chain_spec(namespace_root, page_size, extra_keys)
    step = page_size * 4
    keys = []
    if parent is None:
        parent = chain.root
    for i in range(len(tokens) // step):
        page_index = first_page + i
        parent = page_key(parent, page_index, tokens[i * step : (i + 1) * step], chain.local_bytes(page_index))
        keys.append(parent)
    return keys
