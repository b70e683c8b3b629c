"""Namespaces: everything that makes KV bytes incompatible, reduced to an id and a root.

Two engines that register equal identities get the same namespace id and so share
pages; any difference (model, revision, dtype, page layout, tensor-parallel rank,
attention kind, any extra the engine names) gives a different root digest, and every
page chain starts from that root.

Identities are client input that the daemon keeps for its lifetime and writes into the
shared-memory manifest (kvd/core/records.py), so they are bounded: each free-form field by the
``MAX_*`` limits below (far beyond any real engine's: a Hugging Face model id has at most
96 characters), and the whole identity's manifest entry by ``MAX_IDENTITY_BYTES``. With
at most ``MAX_NAMESPACES`` namespaces per tenant (each tenant has its own manifest), the
manifest always fits its segment: no namespace, and no client, can exhaust the space that
the others' registrations need (checked at import below).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvd.core.errors import InvalidArgument, NotFound, ResourceExhausted
from kvd.core.records import MANIFEST_BYTES, MANIFEST_ENVELOPE_BYTES
from kvd.core.types import NamespaceId
from kvd.wire.layout import LayoutError, PageLayout

SUPPORTED_ATTENTION = ("gqa", "sliding", "gqa+sliding")

MAX_MODEL_CHARS = 1024  # a model id or local path
MAX_REVISION_CHARS = 256  # a git sha, tag or branch
MAX_EXTRA_ENTRIES = 32  # extra identity the engine names (quantisation, rope scaling, ...)
MAX_EXTRA_CHARS = 256  # each extra name and value
MAX_IDENTITY_BYTES = 4096  # the identity's JSON entry in the manifest (non-ASCII text is escaped)
MAX_NAMESPACES = 128  # per tenant

assert MANIFEST_ENVELOPE_BYTES + MAX_NAMESPACES * (MAX_IDENTITY_BYTES + 1) <= MANIFEST_BYTES, (
    "the manifest segment cannot hold MAX_NAMESPACES identities of MAX_IDENTITY_BYTES"
)


def _check_chars(what: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidArgument(f"namespace identity: {what} has {len(text)} characters, over the limit of {limit}")


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
        _check_chars("the model name", self.model, MAX_MODEL_CHARS)
        _check_chars("the revision", self.revision, MAX_REVISION_CHARS)
        if len(self.extra) > MAX_EXTRA_ENTRIES:
            raise InvalidArgument(
                f"namespace identity: {len(self.extra)} extra entries, over the limit of {MAX_EXTRA_ENTRIES}"
            )
        for name, value in self.extra:
            _check_chars(f"extra name {name[:64]!r}", name, MAX_EXTRA_CHARS)
            _check_chars(f"the value of extra {name[:64]!r}", value, MAX_EXTRA_CHARS)
        if self.tp_size < 1 or self.tp_rank >= self.tp_size:
            raise InvalidArgument(f"tensor-parallel rank {self.tp_rank} is not below size {self.tp_size}")
        if self.attention not in SUPPORTED_ATTENTION:
            raise InvalidArgument(
                f"attention kind {self.attention!r} is not supported; kvd pages hold per-token K/V "
                f"for one of {list(SUPPORTED_ATTENTION)} (MLA, DSA and other sparse attention are not)"
            )
        size = len(manifest_entry(self))
        if size > MAX_IDENTITY_BYTES:
            raise InvalidArgument(
                f"namespace identity takes {size} bytes as JSON (non-ASCII characters take 6 to 12), "
                f"over the limit of {MAX_IDENTITY_BYTES}"
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
    """Namespaces by root and id, at most ``capacity`` of them."""

    def __init__(self, capacity: int = MAX_NAMESPACES) -> None:
        self.capacity = capacity
        self._by_root: dict[bytes, Namespace] = {}
        self._by_id: dict[NamespaceId, Namespace] = {}

    def find(self, identity: NamespaceIdentity) -> Namespace | None:
        ns = self._by_root.get(_root(identity))
        assert ns is None or ns.identity == identity, f"namespace root collision between {ns.identity} and {identity}"
        return ns

    def new(self, identity: NamespaceIdentity) -> Namespace:
        """The namespace ``identity`` would get, not registered yet (``add`` does that), so a
        caller can record it elsewhere first; raises ResourceExhausted when the registry is full."""
        assert self.find(identity) is None, f"{identity} is registered already"
        if len(self._by_id) >= self.capacity:
            raise ResourceExhausted(
                f"{len(self._by_id)} namespaces are registered, the limit of this daemon (or tenant); "
                "a namespace lives until the daemon restarts"
            )
        return Namespace(NamespaceId(len(self._by_id) + 1), identity, _root(identity))

    def add(self, ns: Namespace) -> None:
        assert ns.id == len(self._by_id) + 1 and ns.root not in self._by_root, f"namespace {ns.id} added out of turn"
        self._by_root[ns.root] = ns
        self._by_id[ns.id] = ns

    def register(self, identity: NamespaceIdentity) -> Namespace:
        """The namespace of ``identity``, registered now if it is new."""
        ns = self.find(identity)
        if ns is None:
            ns = self.new(identity)
            self.add(ns)
        return ns

    def by_root(self, root: bytes) -> Namespace | None:
        """The registered namespace whose pages chain from ``root``; None when none is."""
        return self._by_root.get(root)

    def get(self, namespace_id: int) -> Namespace:
        ns = self._by_id.get(NamespaceId(namespace_id))
        if ns is None:
            raise NotFound(f"namespace {namespace_id} is not registered")
        return ns

    def all(self) -> list[Namespace]:
        return list(self._by_id.values())


def _root(identity: NamespaceIdentity) -> bytes:
    # A cryptographic digest: namespaces are few, and two identities must never share a root.
    return hashlib.blake2b(identity.canonical(), digest_size=16).digest()


def manifest_entry(identity: NamespaceIdentity) -> bytes:
    """The identity as the manifest's JSON encodes it (kvd/core/records.py), to bound its size."""
    return json.dumps(identity_doc(identity), sort_keys=True, separators=(",", ":")).encode()


def identity_doc(identity: NamespaceIdentity) -> dict:
    """A JSON-able form of an identity, for the shared-memory manifest (kvd/core/records.py)."""
    lay = identity.layout
    return {
        "model": identity.model,
        "revision": identity.revision,
        "layout": [lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype],
        "tp_rank": identity.tp_rank,
        "tp_size": identity.tp_size,
        "attention": identity.attention,
        "vocab_size": identity.vocab_size,
        "extra": [list(pair) for pair in identity.extra],
    }


def identity_from_doc(doc: dict) -> NamespaceIdentity:
    """The inverse of identity_doc; raises InvalidArgument, KeyError or TypeError on a bad doc."""
    num_layers, num_kv_heads, head_dim, page_size, dtype = doc["layout"]
    return NamespaceIdentity(
        model=doc["model"],
        layout=make_layout(num_layers, num_kv_heads, head_dim, page_size, dtype),
        revision=doc["revision"],
        tp_rank=doc["tp_rank"],
        tp_size=doc["tp_size"],
        attention=doc["attention"],
        vocab_size=doc["vocab_size"],
        extra=tuple((str(k), str(v)) for k, v in doc["extra"]),
    )
