"""Messages: proto ↔ core conversions for the servicer (kvd/server/service.py), and the parse
step that refuses bytes which are no valid request before any handler runs (or hands a
large request on unparsed, to be parsed off the event loop: kvd/server/offload.py).

Every function here translates; none decides. Token ids of a request arrive packed in the
message or as a span of the session's token buffer (kvd/cache/token_buffers.py); either way a
core ``SequenceRequest`` comes out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvd.cache import stats as stats_mod
from kvd.cache.events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvd.cache.requests import (
    MAX_REQUEST_FIELDS,
    Batch,
    ExtendResult,
    Limits,
    LookupResult,
    PublishResult,
    SequencePlan,
    SequenceRequest,
    SequenceStatus,
    WithEvictions,
    check_call,
)
from kvd.cache.stats import PageStats, Stats
from kvd.cache.token_buffers import TokenBuffer
from kvd.core.errors import FailedPrecondition, InvalidArgument
from kvd.core.index import ExtraKey
from kvd.core.namespaces import Namespace, NamespaceIdentity, make_layout
from kvd.core.types import SequenceState
from kvd.durability.report import RecoveryReport
from kvd.server import shape
from kvd.server.offload import LARGE_REQUEST_BYTES
from kvd.tiers.stats import Latencies
from kvd.wire import kvd_pb2 as pb
from kvd.wire.codec import TOKEN_BYTES, pack_pages
from kvd.wire.layout import KV_PAGES

log = logging.getLogger(__name__)

# A status message travels percent-encoded in the HTTP/2 trailers, and a client drops
# trailers over 8 KiB (grpc's default soft metadata limit), reporting RESOURCE_EXHAUSTED
# instead of the real status. Messages quote client input (a sequence id of any length),
# so they are cut: 512 characters stay under 8 KiB even when every one is a 4-byte
# UTF-8 character encoded as %XX.
MAX_STATUS_CHARS = 512


# ---- conversions ---------------------------------------------------------------------


def extra_keys_from(keys) -> tuple[ExtraKey, ...]:
    return tuple(ExtraKey(k.kind, k.value, k.offset, max(1, k.length)) for k in keys)


def call_tokens(sequences) -> int:
    """Token ids of an Allocate or Lookup call, inline and in token-buffer spans alike."""
    return sum(len(s.tokens) // TOKEN_BYTES + s.tokens_at.num_tokens for s in sequences)


def batch_from(limits: Limits, ns: Namespace, sequences, buffer: TokenBuffer | None, unique: bool) -> Batch:
    """An Allocate's or Lookup's sequences as a core ``Batch``: their sizes checked (once,
    on the protos) before a core object per sequence and key is built, or a token id is
    copied out of the session's token ``buffer`` (kvd/cache/token_buffers.py)."""
    check_call(limits, sequences, call_tokens(sequences))
    return Batch.of(limits, ns, [request_from(s, buffer) for s in sequences], unique)


def request_from(s, buffer: TokenBuffer | None) -> SequenceRequest:
    tokens = span_tokens(s, buffer) if s.HasField("tokens_at") else s.tokens
    return SequenceRequest(s.seq_id, tokens, extra_keys_from(s.extra_keys))


def span_tokens(s, buffer: TokenBuffer | None) -> bytes:
    if s.tokens:
        raise InvalidArgument(f"sequence {s.seq_id!r:.300}: token ids given both inline and as a token-buffer span")
    if buffer is None:
        raise FailedPrecondition("a token span names the session's token buffer, but it opened none")
    return buffer.read(s.tokens_at.offset, s.tokens_at.num_tokens, f"sequence {s.seq_id!r:.300}")


def identity_from(msg: pb.NamespaceIdentity) -> NamespaceIdentity:
    if not msg.HasField("layout"):
        raise InvalidArgument("namespace identity needs a page layout")
    lay = msg.layout
    layout = make_layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype, lay.kind or KV_PAGES)
    return NamespaceIdentity(
        model=msg.model,
        layout=layout,
        revision=msg.revision,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        attention=msg.attention or "gqa",
        vocab_size=msg.vocab_size,
        extra=tuple(sorted(msg.extra.items())),
    )


def allocation(plan: SequencePlan) -> pb.SequenceAllocation:
    return pb.SequenceAllocation(**_allocation_fields(plan))


def _allocation_fields(plan: SequencePlan) -> dict:
    return dict(
        seq_id=plan.seq_id,
        shared_pages=pack_pages(plan.shared_pages),
        private_pages=pack_pages(plan.private_pages),
        shared_prefix_tokens=plan.shared_prefix_tokens,
        suffix_start=plan.suffix_start,
        num_tokens=plan.num_tokens,
    )


# The replies of a batch are built in place, one result at a time (``add``): a message
# given a list of 4,096 results copies them in one C call that holds the GIL for ~3 ms,
# and a large call's reply is built on the offload thread (kvd/server/offload.py).


def allocate_reply(done: WithEvictions[list[SequencePlan]]) -> pb.AllocateReply:
    reply = pb.AllocateReply(evicted_seq_ids=done.evicted)
    add = reply.sequences.add
    for plan in done.result:
        add(**_allocation_fields(plan))
    return reply


def publish_reply(results: list[PublishResult]) -> pb.PublishReply:
    reply = pb.PublishReply()
    add = reply.results.add
    for x in results:
        rebinds = [pb.Rebind(position=b.position, old_page=b.old_page, new_page=b.new_page) for b in x.rebinds]
        add(seq_id=x.seq_id, published_pages=x.published_pages, rebinds=rebinds)
    return reply


def extend_reply(done: WithEvictions[list[ExtendResult]]) -> pb.ExtendReply:
    return pb.ExtendReply(
        num_tokens=[x.num_tokens for x in done.result],
        new_page_counts=[len(x.new_pages) for x in done.result],
        new_pages=pack_pages([page for x in done.result for page in x.new_pages]),
        evicted_seq_ids=done.evicted,
    )


def lookup_reply(results: list[LookupResult]) -> pb.LookupReply:
    reply = pb.LookupReply()
    add = reply.results.add
    for x in results:
        add(
            seq_id=x.seq_id,
            hit_pages=pack_pages(x.hit_pages),
            hit_tokens=x.hit_tokens,
            remote_pending_tokens=x.remote_pending_tokens,
        )
    return reply


def sequence_status(s: SequenceStatus) -> pb.SequenceStatus:
    return pb.SequenceStatus(
        seq_id=s.seq_id,
        state=s.state.value,
        num_tokens=s.num_tokens,
        known_tokens=s.known_tokens,
        shared_pages=s.shared_pages,
        private_pages=s.private_pages,
        shared_prefix_tokens=s.shared_prefix_tokens,
        aux_bytes=s.aux_bytes,
    )


def seq_state(value: int) -> SequenceState:
    try:
        return SequenceState(value)
    except ValueError:
        raise InvalidArgument(f"unknown sequence state {value}; use one of {[s.name for s in SequenceState]}") from None


def status_message(text: str) -> str:
    if len(text) <= MAX_STATUS_CHARS:
        return text
    tail = f"... ({len(text)} characters)"
    return text[: MAX_STATUS_CHARS - len(tail)] + tail


def page_stats(s: PageStats) -> pb.PageStats:
    return pb.PageStats(**s.as_dict())


def namespace_stats(s: Stats, tenant: str = "") -> list[pb.NamespaceStats]:
    return [
        pb.NamespaceStats(
            namespace_id=n.namespace_id,
            model=n.model,
            page_bytes=n.page_bytes,
            pages=page_stats(n.pages),
            tenant=tenant,
        )
        for n in s.namespaces
    ]


def recovery_stats(r: RecoveryReport) -> pb.RecoveryStats:
    return pb.RecoveryStats(
        **{k: v for k, v in r.as_dict().items() if k not in ("dropped_pages", "extents", "verified_bytes")}
    )


def remote_stats_message(s: Stats) -> pb.RemoteStats:
    """The remote tier's stats; state "off" without one."""
    remote = s.tiers.get("remote")
    return pb.RemoteStats(**remote.as_dict()) if remote else pb.RemoteStats(state="off")


def disk_stats_message(s: Stats) -> pb.DiskStats:
    """The disk tier's stats; state "off", and an empty histogram, without one."""
    disk = s.tiers.get("disk")
    if disk is None:
        return pb.DiskStats(state="off", promotion_buckets=Latencies().counts)
    return pb.DiskStats(**disk.as_dict())


def stats_reply(s: Stats, namespaces: list[pb.NamespaceStats] | None = None) -> pb.StatsReply:
    """The stats of one cache; ``namespaces`` in place of its own (the tenants' together)."""
    return pb.StatsReply(
        totals=page_stats(s.totals),
        host_bytes=s.host_bytes,
        arena_bytes=s.arena_bytes,
        host_bytes_used=s.host_bytes_used,
        host_bytes_free=s.host_bytes_free,
        aux_bytes=s.aux_bytes,
        aux_bytes_used=s.aux_bytes_used,
        aux_bytes_per_sequence=s.aux_bytes_per_sequence,
        prefix_reuse=s.prefix_reuse,
        namespaces=namespace_stats(s) if namespaces is None else namespaces,
        shm_refusals=s.shm_refusals,
        recovery=recovery_stats(s.recovery),
        remote=remote_stats_message(s),
        disk=disk_stats_message(s),
    )


def tenants_stats_reply(by_tenant: dict[str, Stats]) -> pb.StatsReply:
    """Every tenant at once (admin): totals and budgets summed, namespaces named by tenant."""
    every = stats_mod.combined(list(by_tenant.values()))
    return stats_reply(every, [n for name, s in by_tenant.items() for n in namespace_stats(s, name)])


def kv_event(e: KVEvent) -> pb.KVEvent:
    if isinstance(e, BlockStored):
        return pb.KVEvent(
            stored=pb.BlockStored(
                namespace_id=e.namespace,
                block_hashes=e.keys,
                parent_block_hash=e.parent or b"",
                token_ids=bytes(e.tokens),
                block_size=e.page_size,
                lora_name=e.lora_name or "",
                medium=e.medium,
            )
        )
    if isinstance(e, AllBlocksCleared):
        return pb.KVEvent(cleared=pb.AllBlocksCleared())
    return pb.KVEvent(removed=pb.BlockRemoved(namespace_id=e.namespace, block_hashes=e.keys, medium=e.medium))


def _host_removal(e: KVEvent) -> bool:
    """Whether ``e`` is what a removals-only subscriber hears: a host page's removal or a clear."""
    return isinstance(e, AllBlocksCleared) or isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU


def kv_event_batch(b: EventBatch, removals_only: bool = False) -> pb.KVEventBatch | None:
    """The batch on the wire; for a subscriber of removals only (a client that holds host
    pages), the removals of host pages and clears (None: none)."""
    events = [e for e in b.events if not removals_only or _host_removal(e)]
    if removals_only and not events:
        return None
    return pb.KVEventBatch(seq=b.seq, ts=b.ts, events=[kv_event(e) for e in events])


# ---- requests that do not parse ----------------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["KVD"]


@dataclass(frozen=True)
class Refused:
    """A request refused before it was parsed: bytes that are no valid message of the
    method's type, or more fields than one call may hold (kvd/server/shape.py). grpc.aio parses a
    request before the handler runs and answers a parse error with UNKNOWN and a logged
    traceback; the parser below hands this marker to the handler instead, which refuses it
    with INVALID_ARGUMENT like any other bad input."""

    message: str


@dataclass(frozen=True)
class Unparsed:
    """A request of more than ``LARGE_REQUEST_BYTES``, as it came: grpc runs the parser
    below on the event loop, where counting and parsing a large request's fields would
    hold up every other call, so the handler parses it on the offload thread (kvd/server/offload.py)."""

    raw: bytes
    message_type: type

    def parse(self):
        """The message, or ``Refused``."""
        return _parse(self.message_type, self.raw)


def parser(message_type):
    """grpc's request deserializer for ``message_type``: a small request parsed, a large
    one handed on ``Unparsed``."""

    def parse(raw: bytes):
        return Unparsed(raw, message_type) if len(raw) > LARGE_REQUEST_BYTES else _parse(message_type, raw)

    return parse


def _parse(message_type, raw: bytes):
    name = message_type.DESCRIPTOR.full_name
    try:
        if shape.exceeds(name, raw, MAX_REQUEST_FIELDS):
            return Refused(
                f"a {name} of {len(raw)} bytes holds more than {MAX_REQUEST_FIELDS} fields and repeated "
                "elements (sequences, extra keys, ids), the limit of one call; split the batch"
            )
        return message_type.FromString(raw)
    except DecodeError as e:
        log.warning("refused %d request bytes that are not a valid %s: %s", len(raw), name, e)
        return Refused(f"request of {len(raw)} bytes is not a valid {name}: {e}")


def parsed(request):
    """The request message; raises InvalidArgument for a request refused before parsing.
    An ``Unparsed`` one is parsed here (the unary handlers parse theirs off the loop first)."""
    if isinstance(request, Unparsed):
        request = request.parse()
    if isinstance(request, Refused):
        raise InvalidArgument(request.message)
    return request
