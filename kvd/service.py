"""The gRPC servicer: proto → core call → proto, and core errors → status codes.

Nothing here decides anything: which tenant's manager serves a session is kvd/tenants.py's
answer (``self.tenants.manager_for``), given the tenant whose socket the call came in on
(``socket_tenant``: a daemon with tenants serves each on a socket of its own, one servicer
per socket, see ``on_socket``). Conversions are the small functions at the top; the
one table ``STATUS_FOR`` maps each core error class to its gRPC status.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from kvd import invariants, shape
from kvd import stats as stats_mod
from kvd.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVDError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvd.events import AllBlocksCleared, BlockStored, EventBatch, KVEvent, Subscription
from kvd.index import ExtraKey
from kvd.manager import KVCacheManager, SequencePlan, SequenceRequest
from kvd.namespaces import NamespaceIdentity, make_layout
from kvd.recovery import RecoveryReport
from kvd.requests import MAX_REQUEST_FIELDS, ResetResult, SequenceStatus, check_call, extend_items
from kvd.stats import PageStats, Stats
from kvd.tenants import IMPLICIT, Tenants
from kvd.token_buffers import TokenBuffer
from kvd.types import SequenceState
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.codec import TOKEN_BYTES, pack_pages

log = logging.getLogger(__name__)

STATUS_FOR: dict[type[KVDError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_for(e: KVDError) -> grpc.StatusCode:
    """The status of the nearest class in `e`'s hierarchy that STATUS_FOR names, so a
    subclass of a core error (say, a finer NotFound) maps like its base."""
    return next(STATUS_FOR[c] for c in type(e).__mro__ if c in STATUS_FOR)


# Called with (method name, seconds) after every unary call; the metrics exporter listens.
LatencyObserver = Callable[[str, float], None]

# A status message travels percent-encoded in the HTTP/2 trailers, and a client drops
# trailers over 8 KiB (grpc's default soft metadata limit), reporting RESOURCE_EXHAUSTED
# instead of the real status. Messages quote client input (a sequence id of any length),
# so they are cut: 512 characters stay under 8 KiB even when every one is a 4-byte
# UTF-8 character encoded as %XX.
MAX_STATUS_CHARS = 512


# ---- conversions ---------------------------------------------------------------------


def _extra_keys(keys) -> tuple[ExtraKey, ...]:
    return tuple(ExtraKey(k.kind, k.value, k.offset, max(1, k.length)) for k in keys)


def _call_tokens(sequences) -> int:
    """Token ids of an Allocate or Lookup call, inline and in token-buffer spans alike."""
    return sum(len(s.tokens) // TOKEN_BYTES + s.tokens_at.num_tokens for s in sequences)


def _requests(sequences, buffer: Callable[[], TokenBuffer]) -> list[SequenceRequest]:
    """Core requests; ids given as a span are copied out of the session's ``buffer()``
    here, before the core checks them (kvd/token_buffers.py)."""
    return [_request(s, buffer) for s in sequences]


def _request(s, buffer: Callable[[], TokenBuffer]) -> SequenceRequest:
    tokens = _span_tokens(s, buffer) if s.HasField("tokens_at") else s.tokens
    return SequenceRequest(s.seq_id, tokens, _extra_keys(s.extra_keys))


def _span_tokens(s, buffer: Callable[[], TokenBuffer]) -> bytes:
    if s.tokens:
        raise InvalidArgument(f"sequence {s.seq_id!r:.300}: token ids given both inline and as a token-buffer span")
    return buffer().read(s.tokens_at.offset, s.tokens_at.num_tokens, f"sequence {s.seq_id!r:.300}")


def _identity(msg: pb.NamespaceIdentity) -> NamespaceIdentity:
    if not msg.HasField("layout"):
        raise InvalidArgument("namespace identity needs a page layout")
    lay = msg.layout
    layout = make_layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size, lay.dtype)
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


def _plan(plan: SequencePlan) -> pb.SequenceAllocation:
    return pb.SequenceAllocation(
        seq_id=plan.seq_id,
        shared_pages=pack_pages(plan.shared_pages),
        private_pages=pack_pages(plan.private_pages),
        shared_prefix_tokens=plan.shared_prefix_tokens,
        suffix_start=plan.suffix_start,
        num_tokens=plan.num_tokens,
    )


def _status(s: SequenceStatus) -> pb.SequenceStatus:
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


def _seq_state(value: int) -> SequenceState:
    try:
        return SequenceState(value)
    except ValueError:
        raise InvalidArgument(f"unknown sequence state {value}; use one of {[s.name for s in SequenceState]}") from None


def status_message(text: str) -> str:
    if len(text) <= MAX_STATUS_CHARS:
        return text
    tail = f"... ({len(text)} characters)"
    return text[: MAX_STATUS_CHARS - len(tail)] + tail


def _page_stats(s: PageStats) -> pb.PageStats:
    return pb.PageStats(**s.as_dict())


def _namespace_stats(s: Stats, tenant: str = "") -> list[pb.NamespaceStats]:
    return [
        pb.NamespaceStats(
            namespace_id=n.namespace_id,
            model=n.model,
            page_bytes=n.page_bytes,
            pages=_page_stats(n.pages),
            tenant=tenant,
        )
        for n in s.namespaces
    ]


def recovery_stats(r: RecoveryReport) -> pb.RecoveryStats:
    return pb.RecoveryStats(
        **{k: v for k, v in r.as_dict().items() if k not in ("dropped_pages", "extents", "verified_bytes")}
    )


def _remote_stats(s: Stats) -> pb.RemoteStats:
    return pb.RemoteStats(**s.remote.as_dict())


def stats_reply(s: Stats) -> pb.StatsReply:
    return pb.StatsReply(
        totals=_page_stats(s.totals),
        host_bytes=s.host_bytes,
        arena_bytes=s.arena_bytes,
        host_bytes_used=s.host_bytes_used,
        host_bytes_free=s.host_bytes_free,
        aux_bytes=s.aux_bytes,
        aux_bytes_used=s.aux_bytes_used,
        aux_bytes_per_sequence=s.aux_bytes_per_sequence,
        prefix_reuse=s.prefix_reuse,
        namespaces=_namespace_stats(s),
        shm_refusals=s.shm_refusals,
        recovery=recovery_stats(s.recovery),
        remote=_remote_stats(s),
    )


def tenants_stats_reply(by_tenant: dict[str, Stats]) -> pb.StatsReply:
    """Every tenant at once (admin): totals and budgets summed, namespaces named by tenant."""
    every = stats_mod.combined(list(by_tenant.values()))
    return pb.StatsReply(
        totals=_page_stats(every.totals),
        host_bytes=every.host_bytes,
        arena_bytes=every.arena_bytes,
        host_bytes_used=every.host_bytes_used,
        host_bytes_free=every.host_bytes_free,
        aux_bytes=every.aux_bytes,
        aux_bytes_used=every.aux_bytes_used,
        aux_bytes_per_sequence=every.aux_bytes_per_sequence,
        prefix_reuse=every.prefix_reuse,
        namespaces=[n for name, s in by_tenant.items() for n in _namespace_stats(s, name)],
        shm_refusals=every.shm_refusals,
        recovery=recovery_stats(every.recovery),
        remote=_remote_stats(every),
    )


def _kv_event(e: KVEvent) -> pb.KVEvent:
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


def kv_event_batch(b: EventBatch) -> pb.KVEventBatch:
    return pb.KVEventBatch(seq=b.seq, ts=b.ts, events=[_kv_event(e) for e in b.events])


# ---- requests that do not parse ----------------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["KVD"]


@dataclass(frozen=True)
class Refused:
    """A request refused before it was parsed: bytes that are no valid message of the
    method's type, or more fields than one call may hold (kvd/shape.py). grpc.aio parses a
    request before the handler runs and answers a parse error with UNKNOWN and a logged
    traceback; the parser below hands this marker to the handler instead, which refuses it
    with INVALID_ARGUMENT like any other bad input."""

    message: str


def _parser(message_type):
    name = message_type.DESCRIPTOR.full_name

    def parse(raw: bytes):
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

    return parse


def _parsed(request):
    """The request message; raises InvalidArgument for a request refused before parsing."""
    if isinstance(request, Refused):
        raise InvalidArgument(request.message)
    return request


def add_to_server(servicer: KvdServicer, server: grpc.aio.Server) -> None:
    """Registers the servicer as the generated ``add_KVDServicer_to_server`` does, with
    parsers that turn bad bytes into ``Refused`` (methods come from the proto's
    descriptor, so a method added there is served the same way)."""
    handlers = {}
    for m in SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            getattr(servicer, m.name),
            request_deserializer=_parser(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))


# ---- the servicer --------------------------------------------------------------------


# Between two steps of a long call (a Publish, an Allocate's eviction) the loop turns this
# many times. A waiting call needs several turns to finish (its request, its handler, its
# reply: each a completion of grpc's queue), and each turn ran another step first: beside
# back-to-back 50K-token publishes, an empty round trip took 2 ms (p50) with one turn
# after 0.2 ms steps, 0.9 ms with six. When nothing else waits a turn costs ~10 µs.
TURNS_BETWEEN_STEPS = 6
STEP_SECONDS = 0.0002  # a stepped call's work between two of those (as kvd/publishing.py's steps)


async def _let_others_run() -> None:
    for _ in range(TURNS_BETWEEN_STEPS):
        await asyncio.sleep(0)


def _unary(method):
    """Runs a core call; maps core errors to statuses and reports latency. A coroutine
    method (a call done in steps that yield the loop, such as Publish) is awaited."""
    name = method.__name__
    stepped = inspect.iscoroutinefunction(method)

    @functools.wraps(method)
    async def wrapper(self: KvdServicer, request, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        if self.streams.stopping:
            code, message = grpc.StatusCode.UNAVAILABLE, "kvd is stopping; reconnect once it is back"
        else:
            code, message = grpc.StatusCode.OK, ""
            try:
                reply = method(self, _parsed(request))
                return (await reply) if stepped else reply
            except KVDError as e:
                code, message = status_for(e), status_message(str(e))
            finally:
                seconds = time.perf_counter() - start
                if self.observe_latency is not None:
                    self.observe_latency(name, seconds)
                log.debug("%s: %s in %.3f ms %s", name, code.name, seconds * 1e3, message)
        # Set, not raised: an exception's traceback would keep the request (possibly
        # hundreds of MiB) alive in a reference cycle until the next garbage collection.
        context.set_code(code)
        context.set_details(message)
        return None

    return wrapper


@dataclass
class SessionStreams:
    """What the servicers of every socket of one daemon share: the open session streams
    (each a queue of events; None ends it), the KV event subscriptions (they end with
    their session) and whether the daemon is stopping."""

    events: dict[str, asyncio.Queue] = field(default_factory=dict)  # by session id
    subscriptions: dict[str, set[Subscription]] = field(default_factory=dict)  # by session id
    stopping: bool = False

    def end_subscriptions(self, session: str) -> None:
        for sub in self.subscriptions.pop(session, ()):
            sub.close()


class KvdServicer(kvd_pb2_grpc.KVDServicer):
    def __init__(self, tenants: Tenants | KVCacheManager, observe_latency: LatencyObserver | None = None) -> None:
        self.tenants = tenants if isinstance(tenants, Tenants) else Tenants({IMPLICIT: tenants})
        self.observe_latency = observe_latency
        self.streams = SessionStreams()
        self.instance = secrets.token_hex(8)  # SessionOpened.daemon_instance
        # Whose sessions this socket serves: the implicit tenant's without tenants; with
        # them, the main socket serves none (admin calls and Ping only).
        self.socket_tenant: str | None = None if self.tenants.isolated else IMPLICIT

    def on_socket(self, tenant: str) -> KvdServicer:
        """This daemon's servicer for the socket of ``tenant``: the only one its sessions
        may be opened and used on."""
        bound = copy.copy(self)  # shares the tenants, streams and instance id
        bound.socket_tenant = tenant
        return bound

    def end_sessions(self) -> None:
        """Ends every session stream on every socket and refuses further calls (at
        shutdown), so a stop need not wait for clients to leave."""
        self.streams.stopping = True
        for events in self.streams.events.values():
            events.put_nowait(None)
        for session in list(self.streams.subscriptions):
            self.streams.end_subscriptions(session)

    def _manager_of(self, session: str) -> KVCacheManager:
        return self.tenants.manager_for(session, self.socket_tenant)

    async def OpenSession(self, request, context):
        try:
            request = _parsed(request)
            m, session = self.tenants.open_session(request.ticket, request.client_name, request.pid, self.socket_tenant)
        except KVDError as e:
            await context.abort(status_for(e), status_message(str(e)))
        events: asyncio.Queue[pb.SessionEvent | None] = asyncio.Queue()  # None: the stream ends
        session.listener = lambda ns, seq_ids: events.put_nowait(
            pb.SessionEvent(evicted=pb.SequencesEvicted(namespace_id=ns, seq_ids=seq_ids))
        )
        self.streams.events[session.id] = events
        try:
            yield pb.SessionEvent(
                opened=pb.SessionOpened(
                    session=session.id,
                    prefix_reuse=m.prefix_reuse,
                    host_bytes=m.arena.budget_bytes,
                    daemon_instance=self.instance,
                )
            )
            while (event := await events.get()) is not None:
                yield event
        finally:
            self.streams.events.pop(session.id, None)
            self.streams.end_subscriptions(session.id)
            self.tenants.close_session(m, session.id, daemon_stopping=self.streams.stopping)

    async def SubscribeEvents(self, request, context):
        if self.streams.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kvd is stopping; subscribe again once it is back")
        try:
            request = _parsed(request)
            m = self._manager_of(request.session)
            m.sessions.get(request.session)
        except KVDError as e:
            await context.abort(status_for(e), status_message(str(e)))
        sub = m.events.subscribe(request.from_seq if request.has_from_seq else None)
        self.streams.subscriptions.setdefault(request.session, set()).add(sub)
        try:
            while (batch := await sub.get()) is not None:
                yield kv_event_batch(batch)
            if sub.overrun:
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details(
                    f"the subscriber fell {sub.limit} batches behind; subscribe again with from_seq to resume"
                )
        finally:
            self.streams.subscriptions.get(request.session, set()).discard(sub)
            m.events.detach(sub)

    @_unary
    def CloseSession(self, r):
        session = self._manager_of(r.session).sessions.get(r.session)
        session.closed_by_client = True
        self.streams.events[session.id].put_nowait(None)  # the stream's end releases the session
        return pb.CloseSessionReply()

    @_unary
    def RegisterNamespace(self, r):
        m = self._manager_of(r.session)
        m.sessions.get(r.session)
        ns = m.register_namespace(_identity(r.identity))
        return pb.RegisterNamespaceReply(namespace_id=ns.id, page_bytes=ns.page_bytes, root=ns.root)

    @_unary
    def DescribeExtents(self, r):
        m = self._manager_of(r.session)
        m.sessions.get(r.session)
        return pb.DescribeExtentsReply(
            extents=[
                pb.ExtentInfo(shm_name=e.name, first_page=e.first_page, num_pages=e.num_pages, page_bytes=e.page_bytes)
                for e in m.extents(r.namespace_id)
            ]
        )

    @_unary
    def OpenTokenBuffer(self, r):
        buffer = self._manager_of(r.session).open_token_buffer(r.session, r.size_bytes)
        return pb.OpenTokenBufferReply(shm_name=buffer.name, size_bytes=buffer.size)

    def _core_requests(self, m: KVCacheManager, r) -> list[SequenceRequest]:
        """An Allocate or Lookup call's sequences, sizes checked before a core object per
        sequence and key is built, or a token id is copied out of the token buffer."""
        check_call(m.limits, r.sequences, _call_tokens(r.sequences))
        return _requests(r.sequences, functools.partial(m.token_buffer, r.session))

    @_unary
    async def AllocateWithPrefix(self, r):
        m = self._manager_of(r.session)
        requests = self._core_requests(m, r)
        with m.events.held():  # what it evicts is one event batch, as for a call in one piece
            for build in m.room_for_allocate(r.session, r.namespace_id, requests):
                # other calls run while pages are evicted or an extent is built (kvd/room.py)
                if build is not None:
                    await asyncio.wrap_future(build)
                await _let_others_run()
            done = m.allocate(r.session, r.namespace_id, requests)
        return pb.AllocateReply(sequences=[_plan(p) for p in done.result], evicted_seq_ids=done.evicted)

    @_unary
    async def Lookup(self, r):
        # A lookup changes nothing, so a wide one (4,096 sequences with their keys: ~30 ms to
        # convert, ~60 ms to match) runs in steps between which other calls run.
        m = self._manager_of(r.session)
        check_call(m.limits, r.sequences, _call_tokens(r.sequences))
        buffer = functools.partial(m.token_buffer, r.session)
        requests, deadline = [], time.perf_counter() + STEP_SECONDS
        for s in r.sequences:
            requests.append(_request(s, buffer))
            if time.perf_counter() > deadline:
                await _let_others_run()
                deadline = time.perf_counter() + STEP_SECONDS
        results = []
        for part in m.lookup_parts(r.session, r.namespace_id, requests, STEP_SECONDS):
            results += part
            await _let_others_run()
        return pb.LookupReply(
            results=[
                pb.LookupResult(
                    seq_id=x.seq_id,
                    hit_pages=pack_pages(x.hit_pages),
                    hit_tokens=x.hit_tokens,
                    remote_pending_tokens=x.remote_pending_tokens,
                )
                for x in results
            ]
        )

    @_unary
    async def Publish(self, r):
        m = self._manager_of(r.session)
        job = m.publish_job(r.session, r.namespace_id, [(i.seq_id, i.num_tokens) for i in r.items])
        with m.events.held():  # the pages it indexes are one event batch, as for a call in one piece
            while not job.step():
                await _let_others_run()  # between the steps (kvd/publishing.py)
        results = job.results()
        return pb.PublishReply(
            results=[
                pb.PublishResult(
                    seq_id=x.seq_id,
                    published_pages=x.published_pages,
                    rebinds=[
                        pb.Rebind(position=b.position, old_page=b.old_page, new_page=b.new_page) for b in x.rebinds
                    ],
                )
                for x in results
            ]
        )

    @_unary
    def Extend(self, r):
        m = self._manager_of(r.session)
        items = extend_items(r.seq_ids, r.num_tokens, r.token_id_counts, r.token_ids)
        done = m.extend(r.session, r.namespace_id, items)
        return pb.ExtendReply(
            num_tokens=[x.num_tokens for x in done.result],
            new_page_counts=[len(x.new_pages) for x in done.result],
            new_pages=pack_pages([page for x in done.result for page in x.new_pages]),
            evicted_seq_ids=done.evicted,
        )

    @_unary
    def Fork(self, r):
        done = self._manager_of(r.session).fork(r.session, r.namespace_id, r.src_seq_id, r.dst_seq_id)
        return pb.ForkReply(sequence=_plan(done.result), evicted_seq_ids=done.evicted)

    @_unary
    def Release(self, r):
        return pb.ReleaseReply(
            released_pages=self._manager_of(r.session).release(r.session, r.namespace_id, list(r.seq_ids))
        )

    @_unary
    def SetState(self, r):
        previous = self._manager_of(r.session).set_state(r.session, r.namespace_id, r.seq_id, _seq_state(r.state))
        return pb.SetStateReply(previous=previous.value)

    @_unary
    def SetStates(self, r):
        previous = self._manager_of(r.session).set_states(
            r.session, r.namespace_id, list(r.seq_ids), _seq_state(r.state)
        )
        return pb.SetStatesReply(previous=[p.value for p in previous])

    @_unary
    def SetAuxState(self, r):
        self._manager_of(r.session).set_aux(r.session, r.namespace_id, r.seq_id, r.data)
        return pb.SetAuxStateReply()

    @_unary
    def GetAuxState(self, r):
        return pb.GetAuxStateReply(data=self._manager_of(r.session).get_aux(r.session, r.namespace_id, r.seq_id))

    @_unary
    def DescribeSequences(self, r):
        statuses = self._manager_of(r.session).describe(r.session, r.namespace_id, list(r.seq_ids))
        return pb.DescribeSequencesReply(sequences=[_status(s) for s in statuses])

    @_unary
    def Pin(self, r):
        pin = self._manager_of(r.session).pin(
            r.session, r.namespace_id, r.tokens, _extra_keys(r.extra_keys), r.ttl_seconds
        )
        return pb.PinReply(pin_id=pin.pin_id, pinned_pages=len(pin.pages), pinned_tokens=pin.tokens)

    @_unary
    def Unpin(self, r):
        self._manager_of(r.session).unpin(r.session, r.pin_id)
        return pb.UnpinReply()

    @_unary
    def GetStats(self, r):
        if self.tenants.isolated and r.session:
            m = self._manager_of(r.session)
            m.sessions.get(r.session)
            return stats_reply(stats_mod.collect(m))
        self.tenants.check_admin(r.ticket)
        if not self.tenants.isolated:
            return stats_reply(stats_mod.collect(self.tenants.managers()[0]))
        return tenants_stats_reply({name: stats_mod.collect(m) for name, m in self.tenants.items()})

    @_unary
    def CheckInvariants(self, r):
        if self.tenants.isolated and r.session:
            m = self._manager_of(r.session)
            m.sessions.get(r.session)
            return pb.CheckInvariantsReply(violations=invariants.violations(m))
        self.tenants.check_admin(r.ticket)
        if not self.tenants.isolated:
            return pb.CheckInvariantsReply(violations=invariants.violations(self.tenants.managers()[0]))
        return pb.CheckInvariantsReply(
            violations=[f"tenant {name}: {v}" for name, m in self.tenants.items() for v in invariants.violations(m)]
        )

    @_unary
    def VerifyPages(self, r):
        self.tenants.check_admin(r.ticket)
        results = [m.integrity.verify() for m in self.tenants.managers()]
        return pb.VerifyPagesReply(
            checked_pages=sum(v.checked_pages for v in results),
            checked_bytes=sum(v.checked_bytes for v in results),
            corrupted_pages=sum(v.corrupted_pages for v in results),
            seconds=sum(v.seconds for v in results),
            recovery=recovery_stats(
                RecoveryReport.combined([m.last_recovery or RecoveryReport() for m in self.tenants.managers()])
            ),
        )

    @_unary
    def ResetPrefixCache(self, r):
        namespace = r.namespace_id if r.has_namespace else None
        if self.tenants.isolated and r.session:
            m = self._manager_of(r.session)
            m.sessions.get(r.session)
            managers = [m]
        else:
            self.tenants.check_admin(r.ticket)
            managers = self.tenants.managers()
            if self.tenants.isolated and namespace is not None:
                raise InvalidArgument(
                    "namespace ids are per tenant: reset one namespace through a session of its tenant"
                )
        result = sum((m.reset_prefix_cache(namespace) for m in managers), ResetResult(0, 0))
        return pb.ResetPrefixCacheReply(dropped_pages=result.dropped_pages, kept_pages=result.kept_pages)

    @_unary
    def Ping(self, r):
        return pb.PingReply()
