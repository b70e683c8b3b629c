"""The client's types to and from the wire's messages (protos/kvd.proto): what the
client sends and how it reads the replies, apart from when and why it calls
(engine_client/client.py). The daemon's side of the same conversions is kvd/server/messages.py.
With connection.py (the transport), the only client module that sees protobuf messages.
"""

from __future__ import annotations

from itertools import accumulate, chain

from engine_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from engine_client.types import (
    ExtendItem,
    ExtendResult,
    ExtraKey,
    LookupResult,
    PublishResult,
    Rebind,
    SequenceAllocation,
    SequenceRequest,
    SequenceState,
    SequenceStatus,
)
from kvd.wire import kvd_pb2 as pb
from kvd.wire.codec import TOKEN_BYTES, pack_tokens, token_array, unpack_pages
from kvd.wire.layout import PageLayout

# Each unary and streaming method's request type, from the service in protos/kvd.proto.
REQUEST_TYPES = {m.name: getattr(pb, m.input_type.name) for m in pb.DESCRIPTOR.services_by_name["KVD"].methods}


def request(method: str, **fields):
    """The request of ``method`` with these fields (each field as protos/kvd.proto names it)."""
    return REQUEST_TYPES[method](**fields)


def identity(
    model: str,
    layout: PageLayout,
    revision: str,
    tp_rank: int,
    tp_size: int,
    attention: str,
    vocab_size: int,
    extra: dict[str, str],
) -> pb.NamespaceIdentity:
    """What makes KV bytes equal, as ``register_namespace`` sends it."""
    return pb.NamespaceIdentity(
        model=model,
        revision=revision,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention=attention,
        vocab_size=vocab_size,
        extra=extra,
        layout=pb.PageLayout(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            page_size=layout.page_size,
            dtype=layout.dtype,
            kind=layout.kind,
        ),
    )


def extra_keys(keys: tuple[ExtraKey, ...]) -> list[pb.ExtraKey]:
    return [pb.ExtraKey(kind=k.kind, value=k.value, offset=k.offset, length=k.length) for k in keys]


def inline_requests(requests: list[SequenceRequest]) -> list[pb.SequenceRequest]:
    """Sequence requests with their token ids inside the message."""
    return [
        pb.SequenceRequest(seq_id=r.seq_id, tokens=pack_tokens(r.token_ids), extra_keys=extra_keys(r.extra_keys))
        for r in requests
    ]


def token_span(offset: int, count: int) -> pb.TokenSpan:
    """Where ids lie in the session's token buffer: (byte offset, number of ids)."""
    return pb.TokenSpan(offset=offset, num_tokens=count)


def spanned_requests(requests: list[SequenceRequest], spans: list[tuple[int, int]]) -> list[pb.SequenceRequest]:
    """Sequence requests whose token ids lie in the session's token buffer at ``spans``
    ((byte offset, number of ids) each, engine_client/token_buffer.py)."""
    return [
        pb.SequenceRequest(
            seq_id=r.seq_id,
            tokens_at=token_span(offset, count),
            extra_keys=extra_keys(r.extra_keys),
        )
        for r, (offset, count) in zip(requests, spans)
    ]


def num_tokens(token_ids) -> int:
    """How many ids ``token_ids`` holds: a sequence of ints, or packed int32 bytes."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return len(token_ids) // TOKEN_BYTES
    return len(token_ids)


def allocation(msg: pb.SequenceAllocation) -> SequenceAllocation:
    return SequenceAllocation(
        seq_id=msg.seq_id,
        shared_pages=unpack_pages(msg.shared_pages),
        private_pages=unpack_pages(msg.private_pages),
        shared_prefix_tokens=msg.shared_prefix_tokens,
        suffix_start=msg.suffix_start,
        num_tokens=msg.num_tokens,
    )


def lookup_results(reply: pb.LookupReply) -> list[LookupResult]:
    return [
        LookupResult(r.seq_id, unpack_pages(r.hit_pages), r.hit_tokens, r.remote_pending_tokens) for r in reply.results
    ]


def publish_results(reply: pb.PublishReply) -> list[PublishResult]:
    return [
        PublishResult(r.seq_id, r.published_pages, [Rebind(b.position, b.old_page, b.new_page) for b in r.rebinds])
        for r in reply.results
    ]


def publish_items(seq_ids: list[str], num_tokens: dict[str, int]) -> list[pb.PublishItem]:
    """What to publish of each sequence: its pages covering ``num_tokens[seq_id]`` tokens, or all (0)."""
    return [pb.PublishItem(seq_id=s, num_tokens=num_tokens.get(s, 0)) for s in seq_ids]


def extend_columns(items: list[ExtendItem]) -> dict:
    """An Extend request's fields beside the session and namespace, as columns (see
    ExtendRequest in protos/kvd.proto): a few C-level calls per batch instead of one
    message per sequence."""
    ids = [i.token_ids for i in items]
    if all(type(t) is list for t in ids):  # a decode step: short lists of ints, packed at once
        counts, token_ids = [len(t) for t in ids], pack_tokens(list(chain.from_iterable(ids)))
    else:
        packed = [b"" if t is None else pack_tokens(t) for t in ids]
        counts, token_ids = [len(p) // TOKEN_BYTES for p in packed], b"".join(packed)
    return {
        "seq_ids": [i.seq_id for i in items],
        "num_tokens": [i.num_tokens for i in items],
        "token_id_counts": counts,
        "token_ids": token_ids,
    }


def extend_results(items: list[ExtendItem], reply: pb.ExtendReply) -> list[ExtendResult]:
    """One result per item: the reply's new pages, split by its per-sequence counts."""
    page_counts = reply.new_page_counts
    pages = unpack_pages(reply.new_pages)
    return [
        ExtendResult(i.seq_id, pages[end - count : end], total)
        for i, total, count, end in zip(items, reply.num_tokens, page_counts, accumulate(page_counts))
    ]


def sequence_statuses(reply: pb.DescribeSequencesReply) -> list[SequenceStatus]:
    return [
        SequenceStatus(
            s.seq_id,
            SequenceState(s.state),
            s.num_tokens,
            s.known_tokens,
            s.shared_pages,
            s.private_pages,
            s.shared_prefix_tokens,
            s.aux_bytes,
        )
        for s in reply.sequences
    ]


def event_batch(msg: pb.KVEventBatch) -> KVEventBatch:
    """A batch of the event stream, without the events of kinds newer than this client."""
    events = [e for e in map(_event, msg.events) if e is not None]
    return KVEventBatch(msg.seq, msg.ts, events)


def _event(msg: pb.KVEvent) -> KVEvent | None:
    """One event; None for a kind of event this client does not know (a newer daemon's)."""
    kind = msg.WhichOneof("event")
    if kind == "stored":
        s = msg.stored
        return BlockStored(
            namespace_id=s.namespace_id,
            block_hashes=list(s.block_hashes),
            parent_block_hash=s.parent_block_hash or None,
            token_ids=token_array(s.token_ids).tolist(),
            block_size=s.block_size,
            lora_name=s.lora_name or None,
            medium=s.medium,
        )
    if kind == "removed":
        return BlockRemoved(msg.removed.namespace_id, list(msg.removed.block_hashes), msg.removed.medium)
    if kind == "cleared":
        return AllBlocksCleared()
    return None
