"""Namespaces: everything that makes KV bytes incompatible, reduced to an id and a root.

Two engines that register equal identities get the same namespace id and so share
pages; any difference (model, revision, dtype, page layout, tensor-parallel rank,
attention kind, any extra the engine names) gives a different root digest, and every
page chain starts from that root.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvd.errors import InvalidArgument, NotFound
from kvd.types import NamespaceId
from kvd.wire.layout import LayoutError, PageLayout

SUPPORTED_ATTENTION = ("gqa", "sliding", "gqa+sliding")


@dataclass(frozen=True)
class NamespaceIdentity:
    model: str
    layout: PageLayout
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    attention: str = "gqa"
    vocab_size: int = 0  # 0: any non-negative int32 token id
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("namespace identity needs a model name")
        if self.tp_size < 1 or self.tp_rank >= self.tp_size:
            raise InvalidArgument(f"tensor-parallel rank {self.tp_rank} is not below size {self.tp_size}")
        if self.attention not in SUPPORTED_ATTENTION:
            raise InvalidArgument(
                f"attention kind {self.attention!r} is not supported; kvd pages hold per-token K/V "
                f"for one of {list(SUPPORTED_ATTENTION)} (MLA, DSA and other sparse attention are not)"
            )

    def canonical(self) -> bytes:
        """A stable byte encoding: equal identities, equal bytes."""
        doc = {
            "model": self.model,
            "revision": self.revision,
            "layout": [*self.layout.page_shape, self.layout.dtype],
            "tp": [self.tp_rank, self.tp_size],
            "attention": self.attention,
            "vocab_size": self.vocab_size,
            "extra": sorted(self.extra),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# The daemon keeps a record per page, so tiny pages would cost more metadata than KV;
# real models' pages are tens of KiB to MiB.
MIN_PAGE_BYTES = 512
MAX_PAGE_BYTES = 1 << 30


def make_layout(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str) -> PageLayout:
    """A PageLayout the daemon accepts, with layout errors reported as bad client input."""
    try:
        layout = PageLayout(num_layers, num_kv_heads, head_dim, page_size, dtype)
    except LayoutError as e:
        raise InvalidArgument(str(e)) from None
    if not MIN_PAGE_BYTES <= layout.page_bytes <= MAX_PAGE_BYTES:
        raise InvalidArgument(
            f"page layout {list(layout.page_shape)} {layout.dtype} makes pages of {layout.page_bytes} bytes; "
            f"kvd takes pages of {MIN_PAGE_BYTES} to {MAX_PAGE_BYTES} bytes (raise page_size for tiny models)"
        )
    return layout


@dataclass(frozen=True)
class Namespace:
    id: NamespaceId
    identity: NamespaceIdentity
    root: bytes

    @property
    def layout(self) -> PageLayout:
        return self.identity.layout

    @property
    def page_size(self) -> int:
        return self.identity.layout.page_size

    @property
    def page_bytes(self) -> int:
        return self.identity.layout.page_bytes


class NamespaceRegistry:
    def __init__(self) -> None:
        self._by_root: dict[bytes, Namespace] = {}
        self._by_id: dict[NamespaceId, Namespace] = {}

    def register(self, identity: NamespaceIdentity) -> Namespace:
        # A cryptographic digest: namespaces are few, and two identities must never share a root.
        root = hashlib.blake2b(identity.canonical(), digest_size=16).digest()
        ns = self._by_root.get(root)
        if ns is not None:
            assert ns.identity == identity, f"namespace root collision between {ns.identity} and {identity}"
        else:
            ns = Namespace(NamespaceId(len(self._by_id) + 1), identity, root)
            self._by_root[root] = ns
            self._by_id[ns.id] = ns
        return ns

    def get(self, namespace_id: int) -> Namespace:
        ns = self._by_id.get(NamespaceId(namespace_id))
        if ns is None:
            raise NotFound(f"namespace {namespace_id} is not registered")
        return ns

    def all(self) -> list[Namespace]:
        return list(self._by_id.values())


def identity_doc(identity: NamespaceIdentity) -> dict:
    """A JSON-able form of an identity, for the shared-memory manifest (kvd/meta.py)."""
    lay = identity.layout
    return {
        "model": identity.model, "revision": identity.revision,
        "layout": [lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype],
        "tp_rank": identity.tp_rank, "tp_size": identity.tp_size, "attention": identity.attention,
        "vocab_size": identity.vocab_size, "extra": [list(pair) for pair in identity.extra],
    }


def identity_from_doc(doc: dict) -> NamespaceIdentity:
    """The inverse of identity_doc; raises InvalidArgument, KeyError or TypeError on a bad doc."""
    num_layers, num_kv_heads, head_dim, page_size, dtype = doc["layout"]
    return NamespaceIdentity(
        model=doc["model"], layout=make_layout(num_layers, num_kv_heads, head_dim, page_size, dtype),
        revision=doc["revision"], tp_rank=doc["tp_rank"], tp_size=doc["tp_size"], attention=doc["attention"],
        vocab_size=doc["vocab_size"], extra=tuple((str(k), str(v)) for k, v in doc["extra"]),
    )
