"""The gRPC servicer: proto → core call → proto, and core errors → status codes.

Nothing here decides anything: which tenant's manager serves a session is kvd/cache/tenants.py's
answer (``self.tenants.manager_for``), given the tenant whose socket the call came in on
(``socket_tenant``: a daemon with tenants serves each on a socket of its own, one servicer
per socket, see ``on_socket``). Conversions are in kvd/server/messages.py; the one table
``STATUS_FOR`` maps each core error class to its gRPC status.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvd import __version__
from kvd.cache import invariants
from kvd.cache import stats as stats_mod
from kvd.cache.events import Subscription
from kvd.cache.manager import KVCacheManager
from kvd.cache.requests import Batch, ResetResult, extend_items
from kvd.cache.tenants import IMPLICIT, Tenants
from kvd.cache.token_buffers import read_back
from kvd.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVDError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvd.durability.report import RecoveryReport
from kvd.server import messages
from kvd.server.offload import Offload, large_call
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc

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


def add_to_server(servicer: KvdServicer, server: grpc.aio.Server) -> None:
    """Registers the servicer as the generated ``add_KVDServicer_to_server`` does, with
    parsers that turn bad bytes into ``messages.Refused`` (methods come from the proto's
    descriptor, so a method added there is served the same way)."""
    handlers = {}
    for m in messages.SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            getattr(servicer, m.name),
            request_deserializer=messages.parser(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(messages.SERVICE.full_name, handlers),))


# ---- the servicer --------------------------------------------------------------------


# Between two steps of a long call (a Publish, an Allocate's eviction) the loop turns this
# many times. A waiting call needs several turns to finish (its request, its handler, its
# reply: each a completion of grpc's queue), and each turn ran another step first: beside
# back-to-back 50K-token publishes, an empty round trip took 2 ms (p50) with one turn
# after 0.2 ms steps, 0.9 ms with six. When nothing else waits a turn costs ~10 µs.
TURNS_BETWEEN_STEPS = 6


async def _let_others_run() -> None:
    for _ in range(TURNS_BETWEEN_STEPS):
        await asyncio.sleep(0)


async def _drive(steps: Iterator[Future | None]) -> None:
    """Runs a core job's steps (kvd/cache/allocation.py, kvd/cache/publishing.py, an audit of
    kvd/durability/integrity.py), letting other calls run between them; a Future (an extent
    built in the background, a batch of checksums) is awaited first."""
    for build in steps:
        if build is not None:
            await asyncio.wrap_future(build)
        await _let_others_run()


# A call that takes longer than this is logged: an engine's link gives up on a call after
# 5 s (gpu_worker/vllm/kvd_link.py), and the log then says whether the daemon took that long.
SLOW_CALL_SECONDS = 1.0


def _unary(method):
    """Runs a core call; maps core errors to statuses and reports latency. A large request
    is parsed on the offload thread first (kvd/server/messages.py ``Unparsed``). A coroutine
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
                if isinstance(request, messages.Unparsed):
                    request = await self.offload.run(request.parse)
                reply = method(self, messages.parsed(request))
                return (await reply) if stepped else reply
            except KVDError as e:
                code, message = status_for(e), messages.status_message(str(e))
            finally:
                seconds = time.perf_counter() - start
                if self.observe_latency is not None:
                    self.observe_latency(name, seconds)
                log.debug("%s: %s in %.3f ms %s", name, code.name, seconds * 1e3, message)
                if seconds > SLOW_CALL_SECONDS:
                    log.warning("%s: %s took %.2f s (clients give up after 5 s)", name, code.name, seconds)
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


@dataclass(frozen=True)
class Scope:
    """The caches a call that reads or resets the cache covers, by tenant name; ``by_tenant``:
    the answer names each tenant (an admin's call on a daemon with tenants)."""

    managers: dict[str, KVCacheManager]
    by_tenant: bool


T, R, M = TypeVar("T"), TypeVar("R"), TypeVar("M")


def _reply(build: Callable[[R], M], result: R, spent: Batch) -> M:
    """``build(result)``, then the spent batch's requests dropped one at a time: freed in one
    piece, a large call's objects (~2 ms for 4,096 sequences with keys) would hold the GIL
    that long, on the loop at the call's end; on the offload thread, in pieces, they do not."""
    reply = build(result)
    while spent.requests:
        spent.requests.pop()
    return reply


class KvdServicer(kvd_pb2_grpc.KVDServicer):
    def __init__(
        self,
        tenants: Tenants | KVCacheManager,
        offload: Offload,
        observe_latency: LatencyObserver | None = None,
        about: pb.PingReply | None = None,
    ) -> None:
        """``offload``: the thread a large call's work that needs no core runs on (kvd/server/offload.py);
        ``about``: what Ping answers (the launcher's facts about the daemon: kvd/server/daemon.py)."""
        self.tenants = tenants if isinstance(tenants, Tenants) else Tenants({IMPLICIT: tenants})
        self.offload = offload
        self.observe_latency = observe_latency
        self.about = about or pb.PingReply(version=__version__)
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
            request = messages.parsed(request)
            m, session = self.tenants.open_session(request.ticket, request.client_name, request.pid, self.socket_tenant)
        except KVDError as e:
            await context.abort(status_for(e), messages.status_message(str(e)))
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
            request = messages.parsed(request)
            m = self._manager_of(request.session)
            sub = m.subscribe_events(request.session, request.from_seq if request.has_from_seq else None)
        except KVDError as e:
            await context.abort(status_for(e), messages.status_message(str(e)))
        self.streams.subscriptions.setdefault(request.session, set()).add(sub)
        try:
            while (batch := await sub.get()) is not None:
                if (sent := messages.kv_event_batch(batch, request.removals_only)) is not None:
                    yield sent
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
        self._manager_of(r.session).close_by_client(r.session)
        self.streams.events[r.session].put_nowait(None)  # the stream's end releases the session
        return pb.CloseSessionReply()

    @_unary
    def RegisterNamespace(self, r):
        ns = self._manager_of(r.session).register_namespace(r.session, messages.identity_from(r.identity))
        return pb.RegisterNamespaceReply(namespace_id=ns.id, page_bytes=ns.page_bytes, root=ns.root)

    @_unary
    def DescribeExtents(self, r):
        return pb.DescribeExtentsReply(
            extents=[
                pb.ExtentInfo(shm_name=e.name, first_page=e.first_page, num_pages=e.num_pages, page_bytes=e.page_bytes)
                for e in self._manager_of(r.session).extents(r.session, r.namespace_id)
            ]
        )

    @_unary
    def OpenTokenBuffer(self, r):
        buffer = self._manager_of(r.session).open_token_buffer(r.session, r.size_bytes)
        return pb.OpenTokenBufferReply(shm_name=buffer.name, size_bytes=buffer.size)

    @_unary
    def ReadTokenBuffer(self, r):
        buffer = self._manager_of(r.session).token_buffer(r.session)
        return pb.ReadTokenBufferReply(token_ids=read_back(buffer, r.span.offset, r.span.num_tokens))

    async def _off_loop_if(self, large: bool, work: Callable[[], T]) -> T:
        """``work()``: on the offload thread for a large call, inline for a small one."""
        return await self.offload.run(work) if large else work()

    def _batch_work(self, m: KVCacheManager, r, unique: bool) -> Callable[[], Batch]:
        """What makes an Allocate's or Lookup's ``Batch``, given what it needs of the core,
        read here on the loop: the session's token buffer and the namespace."""
        buffer = m.token_buffer(r.session)
        return functools.partial(
            messages.batch_from, m.limits, m.namespaces.get(r.namespace_id), r.sequences, buffer, unique
        )

    @_unary
    async def AllocateWithPrefix(self, r):
        m = self._manager_of(r.session)
        large = large_call(r.sequences)
        batch = await self._off_loop_if(large, self._batch_work(m, r, unique=True))
        with m.allocation(r.session, batch) as job:  # its hits held until it commits (kvd/cache/allocation.py)
            await _drive(job.steps())
            done = job.commit()
        return await self._off_loop_if(large, functools.partial(_reply, messages.allocate_reply, done, batch))

    @_unary
    async def Lookup(self, r):
        # A lookup changes nothing, so a wide one (4,096 sequences with their keys) matches
        # in steps between which other calls run.
        m = self._manager_of(r.session)
        large = large_call(r.sequences)
        batch = await self._off_loop_if(large, self._batch_work(m, r, unique=False))
        results = []
        for part in m.lookup_parts(r.session, batch):
            results += part
            await _let_others_run()
        return await self._off_loop_if(large, functools.partial(_reply, messages.lookup_reply, results, batch))

    @_unary
    async def Publish(self, r):
        m = self._manager_of(r.session)
        job = m.publish_job(r.session, r.namespace_id, [(i.seq_id, i.num_tokens) for i in r.items])
        await _drive(job.steps())
        return messages.publish_reply(job.results())

    @_unary
    def Extend(self, r):
        m = self._manager_of(r.session)
        items = extend_items(r.seq_ids, r.num_tokens, r.token_id_counts, r.token_ids)
        return messages.extend_reply(m.extend(r.session, r.namespace_id, items))

    @_unary
    def Fork(self, r):
        done = self._manager_of(r.session).fork(r.session, r.namespace_id, r.src_seq_id, r.dst_seq_id)
        return pb.ForkReply(sequence=messages.allocation(done.result), evicted_seq_ids=done.evicted)

    @_unary
    def Release(self, r):
        return pb.ReleaseReply(
            released_pages=self._manager_of(r.session).release(r.session, r.namespace_id, list(r.seq_ids))
        )

    @_unary
    def SetState(self, r):
        previous = self._manager_of(r.session).set_state(
            r.session, r.namespace_id, r.seq_id, messages.seq_state(r.state)
        )
        return pb.SetStateReply(previous=previous.value)

    @_unary
    def SetStates(self, r):
        previous = self._manager_of(r.session).set_states(
            r.session, r.namespace_id, list(r.seq_ids), messages.seq_state(r.state)
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
        return pb.DescribeSequencesReply(sequences=[messages.sequence_status(s) for s in statuses])

    @_unary
    def Pin(self, r):
        pin = self._manager_of(r.session).pin(
            r.session, r.namespace_id, r.tokens, messages.extra_keys_from(r.extra_keys), r.ttl_seconds
        )
        return pb.PinReply(pin_id=pin.pin_id, pinned_pages=len(pin.pages), pinned_tokens=pin.tokens)

    @_unary
    def Unpin(self, r):
        self._manager_of(r.session).unpin(r.session, r.pin_id)
        return pb.UnpinReply()

    def _scope(self, r) -> Scope:
        """What a call that reads or resets the cache covers (``r.session``, ``r.ticket``): with
        tenants, a session's own tenant's cache, or every tenant's for an admin ticket;
        without, the one cache there is."""
        if self.tenants.isolated and r.session:
            m = self._manager_of(r.session)
            m.session(r.session)
            return Scope({"": m}, by_tenant=False)
        self.tenants.check_admin(r.ticket)
        return Scope(dict(self.tenants.items()), by_tenant=self.tenants.isolated)

    @_unary
    def GetStats(self, r):
        scope = self._scope(r)
        stats = {name: stats_mod.collect(m) for name, m in scope.managers.items()}
        if scope.by_tenant:
            return messages.tenants_stats_reply(stats)
        [only] = stats.values()
        return messages.stats_reply(only)

    @_unary
    def CheckInvariants(self, r):
        scope = self._scope(r)
        return pb.CheckInvariantsReply(
            violations=[
                f"tenant {name}: {v}" if scope.by_tenant else v
                for name, m in scope.managers.items()
                for v in invariants.violations(m)
            ]
        )

    @_unary
    async def VerifyPages(self, r):
        self.tenants.check_admin(r.ticket)
        results = []
        for m in self.tenants.managers():
            if m.catalog.reindexing is not None:  # the audit and its report cover every page a warm restart found
                await m.catalog.reindexing.run()
            audit = m.integrity.verification()
            await _drive(audit.steps())
            results.append(audit.result)
        return pb.VerifyPagesReply(
            checked_pages=sum(v.checked_pages for v in results),
            checked_bytes=sum(v.checked_bytes for v in results),
            corrupted_pages=sum(v.corrupted_pages for v in results),
            seconds=sum(v.seconds for v in results),
            recovery=messages.recovery_stats(
                RecoveryReport.combined([m.catalog.last_recovery or RecoveryReport() for m in self.tenants.managers()])
            ),
        )

    @_unary
    def ResetPrefixCache(self, r):
        namespace = r.namespace_id if r.has_namespace else None
        scope = self._scope(r)
        if scope.by_tenant and namespace is not None:
            raise InvalidArgument("namespace ids are per tenant: reset one namespace through a session of its tenant")
        result = sum((m.catalog.reset_prefix_cache(namespace) for m in scope.managers.values()), ResetResult(0, 0))
        return pb.ResetPrefixCacheReply(dropped_pages=result.dropped_pages, kept_pages=result.kept_pages)

    @_unary
    def Ping(self, r):
        return self.about
