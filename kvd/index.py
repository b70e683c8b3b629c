"""Chained page keys and the prefix index of published full pages.

A page key hashes (parent key, page index, the page's token ids, the page's extra keys);
the chain starts at a per-request root that hashes the namespace root, the page size and
the request-wide extra keys (LoRA identity, cache salt). Every extra key is tagged with
its kind and length-prefixed, so a LoRA name can never collide with a cache salt or an
image hash. Raw prompt text is never hashed or stored; token ids are.

The hash only narrows the search: a hit counts only when the stored page's token ids,
parent page and a digest of the local extra bytes equal the request's (``PageContent``), so a collision
costs a miss, never wrong KV.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

from kvd.types import PageId, PageKey
from kvd.wire.enums import ExtraKind

_hash = xxhash.xxh3_128_digest
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class ExtraKey:
    """Something other than token ids that changes a page's KV.

    MULTIMODAL items cover tokens [offset, offset + length) and enter the key of every
    page they overlap, with their offset relative to that page. LORA and CACHE_SALT apply
    to the whole request and enter the chain root.
    """

    kind: ExtraKind
    value: bytes
    offset: int = 0
    length: int = 1


def _tagged(kind: int, value: bytes, *fields: int) -> bytes:
    return bytes([kind]) + _U32.pack(len(value)) + value + b"".join(struct.pack("<q", f) for f in fields)


@dataclass(frozen=True)
class ChainSpec:
    """Everything a request contributes to its page keys besides token ids."""

    root: bytes                      # 16-byte start of the chain
    page_local: dict[int, bytes]     # page index -> tagged multimodal bytes of that page

    def local_bytes(self, page_index: int) -> bytes:
        """Bytes a stored page must match beyond tokens and parent: page 0 also pins the root."""
        local = self.page_local.get(page_index, b"")
        return self.root + local if page_index == 0 else local

    def local_digest(self, page_index: int) -> bytes:
        """What a stored page keeps of ``local_bytes``: a 16-byte digest, or b"" when there are none.

        Page 0's local bytes hold the chain root plus its multimodal items, so they are
        long; a fixed-size digest fits the page's shared-memory record (kvd/meta.py).
        """
        local = self.local_bytes(page_index)
        return hashlib.blake2b(local, digest_size=16).digest() if local else b""


def chain_spec(namespace_root: bytes, page_size: int, extra_keys: list[ExtraKey]) -> ChainSpec:
    """Builds the chain root and per-page extra bytes of one request."""
    request_wide = b"".join(
        _tagged(k.kind, k.value) for k in sorted(
            (k for k in extra_keys if k.kind != ExtraKind.MULTIMODAL), key=lambda k: (k.kind, k.value)
        )
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
            page_local[page_index] = page_local.get(page_index, b"") + _tagged(k.kind, value, rel, k.length)
    return ChainSpec(root=root, page_local=page_local)


def page_key(parent_key: bytes, page_index: int, page_tokens: bytes, local: bytes) -> PageKey:
    """Key of one full page given its parent's key (or the chain root for page 0)."""
    return PageKey(_hash(parent_key + _U32.pack(page_index) + page_tokens + local))


@dataclass(frozen=True)
class PageContent:
    """What a published page holds, kept with its index entry to confirm hash hits."""

    page: PageId
    key: PageKey
    tokens: bytes              # page_size little-endian int32 token ids
    parent: PageId | None      # the previous page of the chain; None for page 0
    local: bytes               # ChainSpec.local_digest of this page

    def matches(self, tokens: bytes, parent: PageId | None, local: bytes) -> bool:
        return self.parent == parent and self.tokens == tokens and self.local == local


class PrefixIndex:
    """Maps page keys to the published page holding that content, with the content itself."""

    def __init__(self) -> None:
        self._entries: dict[PageKey, PageContent] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PageKey) -> PageId | None:
        content = self._entries.get(key)
        return None if content is None else content.page

    def lookup(self, key: PageKey) -> PageContent | None:
        return self._entries.get(key)

    def insert(self, content: PageContent) -> None:
        held = self._entries.get(content.key)
        assert held is None, f"page key {content.key.hex()} already indexed to page {held.page}"
        self._entries[content.key] = content

    def remove(self, content: PageContent) -> None:
        held = self._entries.pop(content.key)
        assert held.page == content.page, f"index held page {held.page} under the key of page {content.page}"

    def match(self, chain: ChainSpec, tokens: bytes, page_bytes: int, full_pages: int) -> tuple[list[PageId], list[PageKey]]:
        """The longest run of leading full pages whose stored content equals the request's.

        ``page_bytes`` is the size of one page's token ids. This runs for every page of
        every prompt (3,125 pages for 50K tokens), so its loop makes as few calls as it can.
        """
        pages: list[PageId] = []
        keys: list[PageKey] = []
        parent_key, parent = chain.root, None
        entry_of, page_local = self._entries.get, chain.page_local
        for i in range(full_pages):
            page_tokens = tokens[i * page_bytes:(i + 1) * page_bytes]
            local = chain.local_bytes(i) if i == 0 or page_local else b""
            key = page_key(parent_key, i, page_tokens, local)
            content = entry_of(key)
            if content is None or not content.matches(page_tokens, parent, chain.local_digest(i) if local else b""):
                break  # a miss; on a hash collision too, never wrong KV
            parent_key, parent = key, content.page
            pages.append(parent)
            keys.append(key)
        return pages, keys

    def items(self):
        """(key, page) of every entry."""
        return ((key, content.page) for key, content in self._entries.items())
