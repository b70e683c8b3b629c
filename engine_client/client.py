"""``KVDClient``: one engine process's session with the kvd daemon.

Every call is batched and synchronous. Token ids go over the socket as packed int32
bytes; KV bytes never do: ``page()`` returns a zero-copy view of shared memory.

    with KVDClient.connect("/tmp/kvd.sock") as kvd:
        ns = kvd.register_namespace("my-model", PageLayout(32, 8, 128, 16, "bfloat16"))
        [a] = kvd.allocate_with_prefix(ns, [SequenceRequest("a", prompt_ids)])
        for page_id in a.private_pages:
            kvd.page(ns, page_id)[...] = ...        # write K/V of the suffix
        kvd.publish(ns, ["a"])

When the daemon dies, calls fail fast with UNAVAILABLE and ``session_lost`` is set;
``reconnect()`` opens a new session once a daemon answers again. Sequences do not survive
a daemon restart (their ids then get NOT_FOUND); published pages do (warm restart).

A daemon that isolates tenants (kvd/tenants.py) sees only this process's tenant: ``connect``
does the handshake on ``<socket>.auth`` first (kvd/wire/auth.py), and a process whose
user belongs to no tenant gets PERMISSION_DENIED.
"""

from __future__ import annotations

import os
import socket as socket_mod
import sys
import threading
from itertools import accumulate, chain

import grpc
import numpy as np

from engine_client.ownership import PrivatePages
from engine_client.pages import PageMap, extent_tensor
from engine_client.token_buffer import MIN_TOKENS, ClientTokenBuffer
from engine_client.types import (
    ExtendItem,
    ExtendResult,
    ExtraKey,
    KVDError,
    LookupResult,
    Namespace,
    PinResult,
    PublishResult,
    Rebind,
    SequenceAllocation,
    SequenceRequest,
    SequenceState,
    SequenceStatus,
)
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.auth import admit, fetch_ticket
from kvd.wire.codec import TOKEN_BYTES, pack_tokens, unpack_pages
from kvd.wire.keys import chain_keys
from kvd.wire.layout import PageLayout
from kvd.wire.limits import MAX_MESSAGE_BYTES
from kvd.wire.paths import find_socket

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _extra_keys(keys) -> list[pb.ExtraKey]:
    return [pb.ExtraKey(kind=k.kind, value=k.value, offset=k.offset, length=k.length) for k in keys]


def _requests(requests) -> list[pb.SequenceRequest]:
    return [
        pb.SequenceRequest(seq_id=r.seq_id, tokens=pack_tokens(r.token_ids), extra_keys=_extra_keys(r.extra_keys))
        for r in requests
    ]


def _num_tokens(token_ids) -> int:
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return len(token_ids) // TOKEN_BYTES
    return len(token_ids)


def _allocation(msg: pb.SequenceAllocation) -> SequenceAllocation:
    return SequenceAllocation(
        seq_id=msg.seq_id,
        shared_pages=unpack_pages(msg.shared_pages),
        private_pages=unpack_pages(msg.private_pages),
        shared_prefix_tokens=msg.shared_prefix_tokens,
        suffix_start=msg.suffix_start,
        num_tokens=msg.num_tokens,
    )


def _no_listener(path: str) -> str | None:
    """Why no daemon can answer on ``path`` (no file, nobody listening), or None when one may."""
    try:
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as sock:
            sock.connect(path)
    except FileNotFoundError:
        return "the socket does not exist"
    except ConnectionRefusedError:
        return "nothing listens there (a file a dead daemon left, or no socket at all)"
    except OSError:
        return None  # e.g. EACCES: gRPC reports it in its own words
    return None


class KVDClient:
    """A session with the daemon; use ``connect`` and close it (or use ``with``)."""

    def __init__(
        self,
        channel: grpc.Channel,
        stub: kvd_pb2_grpc.KVDStub,
        stream,
        opened: pb.SessionOpened,
        socket: str,
        client_name: str | None = None,
    ) -> None:
        self._socket = socket
        self._client_name = client_name
        self._namespaces: dict[int, Namespace] = {}
        self._registrations: dict[int, pb.NamespaceIdentity] = {}
        self._page_maps: dict[int, PageMap] = {}
        self._evicted: set[tuple[int, str]] = set()
        self._private = PrivatePages()  # pages this client may write; under _lock (evictions arrive on a thread)
        self._lock = threading.Lock()
        self._reconnected = False
        self._closed = False
        self.call_timeout: float | None = None  # seconds per call (DEADLINE_EXCEEDED past it); None waits
        self._token_lock = threading.Lock()  # one call at a time writes the token buffer
        self._attach(channel, stub, stream, opened)

    def _attach(self, channel, stub, stream, opened: pb.SessionOpened) -> None:
        self._channel = channel
        self._stub = stub
        self._stream = stream
        self.session = opened.session
        self.prefix_reuse = opened.prefix_reuse
        self.host_bytes = opened.host_bytes
        self.daemon_instance = opened.daemon_instance  # differs after a daemon restart
        self._token_buffer: ClientTokenBuffer | None = None  # the session's (engine_client/token_buffer.py)
        self.session_lost = threading.Event()  # one per session: set when this session ends
        self._watcher = threading.Thread(
            target=self._watch_session, args=(stream, self.session_lost), name="kvd-session", daemon=True
        )
        self._watcher.start()

    @classmethod
    def connect(cls, socket: str | None = None, client_name: str | None = None, timeout: float = 10.0) -> KVDClient:
        """Opens a session; the daemon drops its references when this process closes it or dies.

        The socket is ``socket``, else found in the order kvd/wire/paths.py gives (``KVD_SOCKET``,
        the config file, ``/run/kvd/kvd.sock``, the per-user default). When no daemon listens
        there, this fails at once (UNAVAILABLE, naming every place looked at); ``timeout``
        bounds only the wait for a daemon that is there but slow to answer."""
        choice = find_socket(socket)
        problem = _no_listener(choice.path)
        if problem:
            raise KVDError(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"no kvd daemon on {choice.path}: {problem} (looked at: {'; '.join(choice.tried)}); "
                    "start one with `kvd serve`, or pass the socket of a running one"
                ),
            )
        return cls(*cls._open(choice.path, client_name, timeout), socket=choice.path, client_name=client_name)

    def reconnect(self, timeout: float = 10.0) -> dict[int, int]:
        """Opens a new session (after the daemon restarted) and registers this client's
        namespaces again; returns {old namespace id: new id} (equal after a warm restart).

        Sequences of the old session are gone: their ids get NOT_FOUND. Published pages
        survive a warm restart and hit again."""
        opened = self._open(self._socket, self._client_name, timeout)
        self._stream.cancel()
        self._channel.close()
        self._attach(*opened)
        self._reconnected = True
        self._closed = False
        registrations, self._registrations = self._registrations, {}
        namespaces, self._namespaces, self._page_maps = self._namespaces, {}, {}
        with self._lock:
            self._private.clear()
        renamed = {}
        for old_id, identity in registrations.items():
            reply = self._call(
                "RegisterNamespace", pb.RegisterNamespaceRequest(session=self.session, identity=identity)
            )
            self._namespaces[reply.namespace_id] = Namespace(
                reply.namespace_id, namespaces[old_id].layout, reply.page_bytes, reply.root
            )
            self._registrations[reply.namespace_id] = identity
            self._page_maps[reply.namespace_id] = PageMap(namespaces[old_id].layout)  # extents may be new
            renamed[old_id] = reply.namespace_id
        return renamed

    @staticmethod
    def _ready_channel(path: str, timeout: float) -> grpc.Channel:
        channel = grpc.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise KVDError(grpc.StatusCode.UNAVAILABLE, f"no kvd daemon answers on {path} within {timeout} s") from None
        return channel

    @classmethod
    def _open(cls, path: str, client_name: str | None, timeout: float):
        channel = cls._ready_channel(path, timeout)  # the daemon is up: no auth socket means no tenants
        try:
            admission = admit(path, timeout)
        except KVDError:
            channel.close()
            raise
        if admission.session_socket != path:  # a tenant's session lives on the tenant's socket
            channel.close()
            channel = cls._ready_channel(admission.session_socket, timeout)
        stub = kvd_pb2_grpc.KVDStub(channel)
        stream = stub.OpenSession(
            pb.OpenSessionRequest(
                client_name=client_name or os.path.basename(sys.argv[0] or "python"),
                pid=os.getpid(),
                ticket=admission.ticket,
            )
        )
        try:
            first = next(stream)
        except grpc.RpcError as e:
            channel.close()
            raise KVDError.from_rpc(e) from None
        return channel, stub, stream, first.opened

    def close(self) -> None:
        """Ends the session cleanly: the daemon releases its references and logs a close
        (a process that dies without this is logged as a client that went away)."""
        if not self._closed and not self.session_lost.is_set():
            try:
                self._stub.CloseSession(pb.CloseSessionRequest(session=self.session), timeout=self.call_timeout or 2.0)
            except grpc.RpcError:
                pass  # the daemon is gone or stopping: the session ends with it either way
        self._closed = True
        self._stream.cancel()
        self._channel.close()
        if self._watcher is not threading.current_thread():
            # A process that exits while this thread is still inside gRPC's C++ core can
            # abort ("terminate called without an active exception"): let it leave first.
            self._watcher.join(timeout=self.call_timeout or 2.0)

    def __enter__(self) -> KVDClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch_session(self, stream, lost: threading.Event) -> None:
        try:
            for event in stream:
                if event.HasField("evicted"):
                    self._note_evicted(event.evicted.namespace_id, event.evicted.seq_ids)
        except grpc.RpcError:
            pass  # cancelled by close(), or the daemon went away
        finally:
            lost.set()

    def _note_evicted(self, ns: int, seq_ids) -> None:
        """The daemon evicted these sequences: their pages are no longer ours to write."""
        if not seq_ids:
            return
        with self._lock:
            self._evicted.update((ns, s) for s in seq_ids)
            for seq_id in seq_ids:
                self._private.drop(ns, seq_id)

    def take_evicted(self) -> set[tuple[int, str]]:
        """(namespace, seq_id) of this session's sequences the daemon evicted (ON_HOLD →
        EVICTED) since the last call.

        Guaranteed to hold every eviction caused by a call of this client that has returned
        (``allocate_with_prefix``, ``extend``/``extend_batch``, ``fork``: their replies name
        what they evicted). Evictions caused by other sessions' calls arrive on the session
        stream, a moment after the call that caused them."""
        with self._lock:
            evicted, self._evicted = self._evicted, set()
        return evicted

    def _call(self, method: str, request):
        if self.session_lost.is_set() and not self._closed:
            raise KVDError(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"the session with the kvd daemon on {self._socket} ended (the daemon stopped, died or restarted); "
                    "call reconnect() for a new session: sequences do not survive a daemon restart, published pages do"
                ),
            )
        try:
            return getattr(self._stub, method)(request, timeout=self.call_timeout)
        except grpc.RpcError as e:
            error = KVDError.from_rpc(e)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            error = KVDError(
                error.code,
                (
                    f"the kvd daemon on {self._socket} does not answer (stopped, died or restarting): {error.message}; "
                    "call reconnect() once it is back"
                ),
            )
        elif error.code == grpc.StatusCode.NOT_FOUND and self._reconnected and "sequence" in error.message:
            error = KVDError(
                error.code,
                (
                    f"{error.message}; sequences do not survive a daemon restart (published pages do): "
                    "allocate it again, its published prefix still hits"
                ),
            )
        raise error from None

    # ---- namespaces and pages -----------------------------------------------------

    def register_namespace(
        self,
        model: str,
        layout: PageLayout,
        *,
        revision: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        attention: str = "gqa",
        vocab_size: int = 0,
        extra: dict[str, str] | None = None,
    ) -> int:
        """The namespace id for this KV identity; equal identities get equal ids."""
        identity_msg = pb.NamespaceIdentity(
            model=model,
            revision=revision,
            tp_rank=tp_rank,
            tp_size=tp_size,
            attention=attention,
            vocab_size=vocab_size,
            extra=extra or {},
            layout=pb.PageLayout(
                num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                page_size=layout.page_size,
                dtype=layout.dtype,
            ),
        )
        reply = self._call(
            "RegisterNamespace", pb.RegisterNamespaceRequest(session=self.session, identity=identity_msg)
        )
        self._namespaces[reply.namespace_id] = Namespace(reply.namespace_id, layout, reply.page_bytes, reply.root)
        self._registrations[reply.namespace_id] = identity_msg
        self._page_maps.setdefault(reply.namespace_id, PageMap(layout))
        return reply.namespace_id

    def layout(self, ns: int) -> PageLayout:
        return self._namespace(ns).layout

    def page_keys(
        self,
        ns: int,
        token_ids,
        extra_keys: tuple[ExtraKey, ...] = (),
        *,
        first_page: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The keys the daemon gives the full pages of these tokens once published: the
        block hashes its KV events (``subscribe_events``) name. Computed here, no call.

        A sequence that grows computes the keys of its new pages only: ``token_ids`` from
        page ``first_page`` on, ``parent`` the key of the page before (kvd/wire/keys.py)."""
        namespace = self._namespace(ns)
        return chain_keys(
            namespace.root,
            namespace.layout.page_size,
            pack_tokens(token_ids),
            extra_keys,
            first_page=first_page,
            parent=parent,
        )

    def _namespace(self, ns: int) -> Namespace:
        try:
            return self._namespaces[ns]
        except KeyError:
            raise KVDError(grpc.StatusCode.NOT_FOUND, f"namespace {ns} was not registered by this client") from None

    def _locate(self, ns: int, page_id: int):
        self._namespace(ns)
        page_map = self._page_maps[ns]
        found = page_map.find(page_id)
        if found is None:
            reply = self._call("DescribeExtents", pb.DescribeExtentsRequest(session=self.session, namespace_id=ns))
            page_map.refresh([(e.shm_name, e.first_page, e.num_pages) for e in reply.extents])
            found = page_map.find(page_id)
            if found is None:
                raise KVDError(grpc.StatusCode.NOT_FOUND, f"page {page_id} is not a page of namespace {ns}")
        return found

    def page_array(self, ns: int, page_id: int, writable: bool | None = None) -> np.ndarray:
        """numpy view of one page, [num_layers, 2, page_size, num_kv_heads, head_dim].

        Writable only for a private page of this client's live sequences (see ``page``);
        bfloat16 and float8 pages are viewed as uint16/uint8 (numpy has no such dtypes).
        """
        extent, index = self._locate(ns, page_id)
        return (extent.array if self._may_write(ns, page_id, writable) else extent.readonly)[index]

    def page(self, ns: int, page_id: int, writable: bool | None = None):
        """torch view of one page, [num_layers, 2 (K, V), page_size, num_kv_heads, head_dim].

        Reads and writes go straight to shared memory. A private page of this client's live
        sequences (from allocate, extend or fork, not yet published) comes writable; every
        other page, published ones first of all, through a read-only map: a write to it
        faults in this process and corrupts nobody's KV. ``writable=True`` insists on a
        writable view (``FAILED_PRECONDITION`` when the page is not private to this client);
        ``writable=False`` always reads.
        """
        extent, index = self._locate(ns, page_id)
        return extent_tensor(extent, self._namespace(ns).layout, self._may_write(ns, page_id, writable))[index]

    def _may_write(self, ns: int, page_id: int, writable: bool | None) -> bool:
        if writable is False:
            return False
        mine = self._private.writable(ns, page_id)
        if writable and not mine:
            raise KVDError(
                grpc.StatusCode.FAILED_PRECONDITION,
                (
                    f"page {page_id} of namespace {ns} is not a private page of a live sequence of this client; "
                    "published pages are immutable"
                ),
            )
        return mine

    def pages_by_extent(self, ns: int, page_ids, writable: bool = False) -> list[tuple[object, list[int], list[int]]]:
        """The pages grouped by the extent holding them, for batched copies: per extent its
        torch view ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, the
        pages' indices in it and their positions in ``page_ids``.

        Read-only views unless ``writable``, which needs every page to be a private page of
        this client's live sequences (``FAILED_PRECONDITION`` otherwise, as ``page``)."""
        groups: dict[str, tuple[object, list[int], list[int]]] = {}
        layout = self._namespace(ns).layout
        for position, page_id in enumerate(page_ids):
            extent, index = self._locate(ns, page_id)
            if writable:
                self._may_write(ns, page_id, True)
            _, indices, positions = groups.setdefault(extent.name, (extent_tensor(extent, layout, writable), [], []))
            indices.append(index)
            positions.append(position)
        return list(groups.values())

    def mapped_extents(self, ns: int):
        """The extents of a namespace this process has mapped (for cudaHostRegister)."""
        return self._page_maps[ns].extents()

    # ---- sequences ----------------------------------------------------------------

    def allocate_with_prefix(self, ns: int, requests: list[SequenceRequest]) -> list[SequenceAllocation]:
        """Pins the longest full-page prefix hit of each request and allocates private pages
        for the rest, in one atomic step; the whole batch or nothing."""
        reply = self._sequences_call("AllocateWithPrefix", pb.AllocateRequest, ns, requests)
        allocations = [_allocation(s) for s in reply.sequences]
        self._note_evicted(ns, reply.evicted_seq_ids)
        with self._lock:
            for a in allocations:
                self._private.drop(ns, a.seq_id)  # an evicted sequence re-entering
                self._private.add(ns, a.seq_id, a.private_pages)
        return allocations

    allocate_pages_for_sequences_with_prefix = allocate_with_prefix

    def _sequences_call(self, method: str, message, ns: int, requests: list[SequenceRequest]):
        """An Allocate or Lookup call. One of ``MIN_TOKENS`` ids or more passes them through the
        session's token buffer when no other thread's call holds it; any other goes inline."""
        total = sum(_num_tokens(r.token_ids) for r in requests)
        if total >= MIN_TOKENS and self._token_lock.acquire(blocking=False):
            try:
                buffer = self._token_buffer_for(total)
                if buffer is not None:
                    spans = buffer.spans(ClientTokenBuffer.arrays([r.token_ids for r in requests]))
                    sequences = [
                        pb.SequenceRequest(seq_id=r.seq_id, tokens_at=span, extra_keys=_extra_keys(r.extra_keys))
                        for r, span in zip(requests, spans)
                    ]
                    return self._call(method, message(session=self.session, namespace_id=ns, sequences=sequences))
            finally:
                self._token_lock.release()
        return self._call(method, message(session=self.session, namespace_id=ns, sequences=_requests(requests)))

    def _token_buffer_for(self, num_tokens: int) -> ClientTokenBuffer | None:
        """The session's token buffer, opened or grown to hold ``num_tokens`` ids; None when
        the daemon refuses one (the call then goes inline, and the daemon says what is wrong)."""
        if self._token_buffer is None or self._token_buffer.size < num_tokens * TOKEN_BYTES:
            try:
                reply = self._call(
                    "OpenTokenBuffer",
                    pb.OpenTokenBufferRequest(session=self.session, size_bytes=ClientTokenBuffer.size_for(num_tokens)),
                )
            except KVDError:
                return None
            self._token_buffer = ClientTokenBuffer(reply.shm_name, reply.size_bytes)
        return self._token_buffer

    def lookup(self, ns: int, requests: list[SequenceRequest]) -> list[LookupResult]:
        """The prefix hits allocate_with_prefix would find now, without pinning anything."""
        reply = self._sequences_call("Lookup", pb.LookupRequest, ns, requests)
        return [
            LookupResult(r.seq_id, unpack_pages(r.hit_pages), r.hit_tokens, r.remote_pending_tokens)
            for r in reply.results
        ]

    def publish(self, ns: int, seq_ids: list[str], num_tokens: dict[str, int] | None = None) -> list[PublishResult]:
        """Makes the sequences' full private pages immutable and shareable.

        ``num_tokens`` may limit a sequence to the pages covering its first N tokens (a
        whole number of pages). A page identical to one published meanwhile is replaced
        by it; the result's ``rebinds`` say which page ids changed.
        """
        num_tokens = num_tokens or {}
        reply = self._call(
            "Publish",
            pb.PublishRequest(
                session=self.session,
                namespace_id=ns,
                items=[pb.PublishItem(seq_id=s, num_tokens=num_tokens.get(s, 0)) for s in seq_ids],
            ),
        )
        with self._lock:
            for r in reply.results:
                self._private.published(ns, r.seq_id, r.published_pages)
        return [
            PublishResult(r.seq_id, r.published_pages, [Rebind(b.position, b.old_page, b.new_page) for b in r.rebinds])
            for r in reply.results
        ]

    def extend(self, ns: int, seq_id: str, num_tokens: int, token_ids=None) -> ExtendResult:
        """Room for ``num_tokens`` more tokens, in private pages. Give their ids to publish them later."""
        return self.extend_batch(ns, [ExtendItem(seq_id, num_tokens, token_ids)])[0]

    def extend_batch(self, ns: int, items: list[ExtendItem]) -> list[ExtendResult]:
        """extend() for a whole decode batch in one call; all or nothing."""
        # The request and reply are columns (see ExtendRequest in protos/kvd.proto): a few
        # C-level calls per batch instead of one message per sequence.
        ids = [i.token_ids for i in items]
        if all(type(t) is list for t in ids):  # a decode step: short lists of ints, packed at once
            counts, token_ids = [len(t) for t in ids], pack_tokens(list(chain.from_iterable(ids)))
        else:
            packed = [b"" if t is None else pack_tokens(t) for t in ids]
            counts, token_ids = [len(p) // 4 for p in packed], b"".join(packed)
        reply = self._call(
            "Extend",
            pb.ExtendRequest(
                session=self.session,
                namespace_id=ns,
                seq_ids=[i.seq_id for i in items],
                num_tokens=[i.num_tokens for i in items],
                token_id_counts=counts,
                token_ids=token_ids,
            ),
        )
        self._note_evicted(ns, reply.evicted_seq_ids)
        page_counts = reply.new_page_counts
        pages = unpack_pages(reply.new_pages)
        results = [
            ExtendResult(i.seq_id, pages[end - count : end], num_tokens)
            for i, num_tokens, count, end in zip(items, reply.num_tokens, page_counts, accumulate(page_counts))
        ]
        if pages:
            with self._lock:
                for r in results:
                    if r.new_pages:
                        self._private.add(ns, r.seq_id, r.new_pages)
        return results

    def fork(self, ns: int, src: str, dst: str) -> SequenceAllocation:
        """dst shares src's published pages; src's private pages (its partial tail) are copied."""
        reply = self._call(
            "Fork", pb.ForkRequest(session=self.session, namespace_id=ns, src_seq_id=src, dst_seq_id=dst)
        )
        allocation = _allocation(reply.sequence)
        self._note_evicted(ns, reply.evicted_seq_ids)
        with self._lock:
            self._private.add(ns, dst, allocation.private_pages)
        return allocation

    def release(self, ns: int, seq_ids: list[str]) -> int:
        """Drops the sequences; returns the number of page references released."""
        released = self._call(
            "Release", pb.ReleaseRequest(session=self.session, namespace_id=ns, seq_ids=seq_ids)
        ).released_pages
        with self._lock:
            for seq_id in seq_ids:
                self._private.drop(ns, seq_id)
        return released

    def set_state(self, ns: int, seq_id: str, state: SequenceState | str) -> SequenceState:
        """Moves a sequence along the README's life-cycle table (kvd/sequences.py ``TRANSITIONS``);
        returns the previous state. A refused transition is FAILED_PRECONDITION; EVICTED is the
        daemon's to set; COMPLETED releases the sequence."""
        state = SequenceState[state] if isinstance(state, str) else state
        reply = self._call(
            "SetState", pb.SetStateRequest(session=self.session, namespace_id=ns, seq_id=seq_id, state=state.value)
        )
        if state is SequenceState.COMPLETED:  # its pages are released
            with self._lock:
                self._private.drop(ns, seq_id)
        return SequenceState(reply.previous)

    def set_states(self, ns: int, seq_ids: list[str], state: SequenceState | str) -> list[SequenceState]:
        """`set_state` for a batch in one call: every sequence moves, or none does (the error
        names the first refused one); returns the previous states in order."""
        state = SequenceState[state] if isinstance(state, str) else state
        request = pb.SetStatesRequest(session=self.session, namespace_id=ns, seq_ids=seq_ids, state=state.value)
        reply = self._call("SetStates", request)
        if state is SequenceState.COMPLETED:  # their pages are released
            with self._lock:
                for seq_id in seq_ids:
                    self._private.drop(ns, seq_id)
        return [SequenceState(p) for p in reply.previous]

    def describe_sequences(self, ns: int, seq_ids: list[str]) -> list[SequenceStatus]:
        """The sequences' states and sizes, read without changing them (all or nothing:
        NOT_FOUND for an id that was never allocated, or was released or completed)."""
        reply = self._call(
            "DescribeSequences", pb.DescribeSequencesRequest(session=self.session, namespace_id=ns, seq_ids=seq_ids)
        )
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

    def set_aux_state(self, ns: int, seq_id: str, data: bytes) -> None:
        """Stores non-KV per-sequence state (recurrent state, checkpoints); a fork copies it.

        Allowed in every state, EVICTED too, and kept when an evicted sequence re-enters. At
        most the daemon's ``aux_bytes_per_sequence`` (INVALID_ARGUMENT above it); all
        sequences together share ``aux_bytes`` (RESOURCE_EXHAUSTED when it is full)."""
        self._call(
            "SetAuxState", pb.SetAuxStateRequest(session=self.session, namespace_id=ns, seq_id=seq_id, data=data)
        )

    def get_aux_state(self, ns: int, seq_id: str) -> bytes:
        return self._call(
            "GetAuxState", pb.GetAuxStateRequest(session=self.session, namespace_id=ns, seq_id=seq_id)
        ).data

    # ---- pins, stats --------------------------------------------------------------

    def pin(self, ns: int, token_ids, ttl: float | None = None, extra_keys: tuple[ExtraKey, ...] = ()) -> PinResult:
        """Keeps the cached pages of this prefix resident until unpin, ttl seconds, or session end."""
        reply = self._call(
            "Pin",
            pb.PinRequest(
                session=self.session,
                namespace_id=ns,
                tokens=pack_tokens(token_ids),
                extra_keys=_extra_keys(extra_keys),
                ttl_seconds=ttl or 0.0,
            ),
        )
        return PinResult(reply.pin_id, reply.pinned_pages, reply.pinned_tokens)

    def unpin(self, pin_id: int) -> None:
        self._call("Unpin", pb.UnpinRequest(session=self.session, pin_id=pin_id))

    def stats(self) -> dict:
        """The daemon's page statistics, as ``kvd stats --json`` prints them (with tenants: this tenant's)."""
        from kvd.wire.admin import stats_dict

        return stats_dict(self._call("GetStats", pb.StatsRequest(session=self.session)))

    def check_invariants(self) -> list[str]:
        """Broken invariants of the daemon's state (empty when healthy)."""
        return list(self._call("CheckInvariants", pb.CheckInvariantsRequest(session=self.session)).violations)

    def verify_pages(self) -> dict:
        """Audits every published page against its checksum (admin; ``kvd verify``)."""
        from kvd.wire.admin import verify_dict

        return verify_dict(self._call("VerifyPages", pb.VerifyPagesRequest(ticket=fetch_ticket(self._socket))))

    def reset_prefix_cache(self, ns: int | None = None) -> dict:
        """Drops the cached (unreferenced) published pages of namespace ``ns``, or of every
        namespace (with tenants: this tenant's), as vLLM's ``reset_prefix_cache`` after a
        weight update. Pages a sequence or pin references are untouched.
        Returns {"dropped_pages", "kept_pages"}."""
        from kvd.wire.admin import reset_dict, reset_request

        return reset_dict(self._call("ResetPrefixCache", reset_request(ns, session=self.session)))

    def subscribe_events(self, from_seq: int | None = None):
        """The KV events of this client's tenant as they happen (routers' view of which pages
        kvd holds): an iterator of ``kvd_pb2.KVEventBatch`` (``seq``, ``ts``, ``events``, each
        ``stored``, ``removed`` or ``cleared``) over its own stream, which ends with this
        session; ``cancel()`` it to stop early. ``from_seq`` resumes with the batches the
        daemon still buffers from that one on: a first ``seq`` above it means some were missed."""
        request = pb.SubscribeEventsRequest(
            session=self.session, has_from_seq=from_seq is not None, from_seq=from_seq or 0
        )
        return self._stub.SubscribeEvents(request)

    def ping(self) -> None:
        self._call("Ping", pb.PingRequest())
