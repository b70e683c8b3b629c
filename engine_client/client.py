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

A daemon that isolates tenants (kvd/cache/tenants.py) sees only this process's tenant: ``connect``
does the handshake on ``<socket>.auth`` first (kvd/wire/auth.py), and a process whose
user belongs to no tenant gets PERMISSION_DENIED.
"""

from __future__ import annotations

import threading

import numpy as np

from engine_client import messages
from engine_client.connection import Connection, ReplyStream, find_daemon
from engine_client.events import KVEventBatch
from engine_client.ownership import PrivatePages
from engine_client.pages import PageMap, extent_tensor
from engine_client.token_buffer import MIN_TOKENS, ClientTokenBuffer
from engine_client.types import (
    ErrorCode,
    ExtendItem,
    ExtendResult,
    ExtraKey,
    KVDError,
    LookupResult,
    Namespace,
    PinResult,
    PrewarmResult,
    PublishResult,
    ResetReport,
    SequenceAllocation,
    SequenceRequest,
    SequenceState,
    SequenceStatus,
    Stats,
    VerifyReport,
)
from kvd.wire.auth import fetch_ticket
from kvd.wire.codec import TOKEN_BYTES, pack_tokens
from kvd.wire.keys import chain_keys
from kvd.wire.layout import PageLayout


class KVDClient:
    """A session with the daemon; use ``connect`` and close it (or use ``with``)."""

    def __init__(self, socket: str, client_name: str | None = None, timeout: float = 10.0) -> None:
        self._client_name = client_name
        self._namespaces: dict[int, Namespace] = {}
        self._registrations: dict[int, object] = {}  # each namespace's identity message, for reconnect
        self._page_maps: dict[int, PageMap] = {}
        self._evicted: set[tuple[int, str]] = set()
        self._private = PrivatePages()  # pages this client may write; under _lock (evictions arrive on a thread)
        self._lock = threading.Lock()
        self._reconnected = False
        self.call_timeout: float | None = None  # seconds per call (DEADLINE_EXCEEDED past it); None waits
        self._token_lock = threading.Lock()  # one call at a time writes the token buffer
        self._token_buffer: ClientTokenBuffer | None = None  # the session's (engine_client/token_buffer.py)
        self._connection = Connection(socket, client_name, timeout, self._note_evicted)

    @classmethod
    def connect(cls, socket: str | None = None, client_name: str | None = None, timeout: float = 10.0) -> KVDClient:
        """Opens a session; the daemon drops its references when this process closes it or dies.

        The socket is ``socket``, else found in the order kvd/wire/paths.py gives (``KVD_SOCKET``,
        the config file, ``/run/kvd/kvd.sock``, the per-user default). When no daemon listens
        there, this fails at once (UNAVAILABLE, naming every place looked at); ``timeout``
        bounds only the wait for a daemon that is there but slow to answer."""
        return cls(find_daemon(socket), client_name, timeout)

    @property
    def session(self) -> str:
        return self._connection.session

    @property
    def session_lost(self) -> threading.Event:
        """Set when this session ends (the daemon stopped, died or restarted); a new one after ``reconnect``."""
        return self._connection.lost

    @property
    def daemon_instance(self) -> str:
        """Differs after a daemon restart."""
        return self._connection.daemon_instance

    @property
    def prefix_reuse(self) -> bool:
        return self._connection.prefix_reuse

    @property
    def host_bytes(self) -> int:
        return self._connection.host_bytes

    def reconnect(self, timeout: float = 10.0) -> dict[int, int]:
        """Opens a new session (after the daemon restarted) and registers this client's
        namespaces again; returns {old namespace id: new id} (equal after a warm restart).

        Sequences of the old session are gone: their ids get NOT_FOUND. Published pages
        survive a warm restart and hit again."""
        connection = Connection(self._connection.socket, self._client_name, timeout, self._note_evicted)
        self._connection.drop()
        self._connection, self._reconnected, self._token_buffer = connection, True, None
        registrations, self._registrations = self._registrations, {}
        namespaces, self._namespaces, self._page_maps = self._namespaces, {}, {}
        with self._lock:
            self._private.clear()
        renamed = {}
        for old_id, identity in registrations.items():
            reply = self._call("RegisterNamespace", session=self.session, identity=identity)
            self._namespaces[reply.namespace_id] = Namespace(
                reply.namespace_id, namespaces[old_id].layout, reply.page_bytes, reply.root
            )
            self._registrations[reply.namespace_id] = identity
            self._page_maps[reply.namespace_id] = PageMap(namespaces[old_id].layout)  # extents may be new
            renamed[old_id] = reply.namespace_id
        return renamed

    def close(self) -> None:
        """Ends the session cleanly: the daemon releases its references and logs a close
        (a process that dies without this is logged as a client that went away)."""
        self._connection.close(self.call_timeout or 2.0)

    def drop(self) -> None:
        """Ends the session without a call to the daemon, for a daemon that does not answer
        (``close`` would wait for it again): the daemon releases the session's references
        once it sees the session's stream end."""
        self._connection.drop()

    def __enter__(self) -> KVDClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    def _call(self, method: str, **fields):
        """The reply of unary ``method`` (protos/kvd.proto) to a request with these fields."""
        request = messages.request(method, **fields)
        return self._connection.call(method, request, self.call_timeout, self._reconnected)

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
        identity_msg = messages.identity(model, layout, revision, tp_rank, tp_size, attention, vocab_size, extra or {})
        reply = self._call("RegisterNamespace", session=self.session, identity=identity_msg)
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
            raise KVDError(ErrorCode.NOT_FOUND, f"namespace {ns} was not registered by this client") from None

    def describe_extents(self, ns: int) -> list[tuple[str, int, int]]:
        """The namespace's extents now, each (shared-memory name, first page, pages), one call."""
        self._namespace(ns)
        reply = self._call("DescribeExtents", session=self.session, namespace_id=ns)
        return [(e.shm_name, e.first_page, e.num_pages) for e in reply.extents]

    def map_extents(self, ns: int):
        """Maps every extent the namespace has now (one call) and returns the mapped extents."""
        self._page_maps[ns].refresh(self.describe_extents(ns))
        return self.mapped_extents(ns)

    def _locate(self, ns: int, page_id: int):
        self._namespace(ns)
        page_map = self._page_maps[ns]
        found = page_map.find(page_id)
        if found is None:
            self.map_extents(ns)
            found = page_map.find(page_id)
            if found is None:
                raise KVDError(ErrorCode.NOT_FOUND, f"page {page_id} is not a page of namespace {ns}")
        return found

    def page_array(self, ns: int, page_id: int, writable: bool | None = None) -> np.ndarray:
        """numpy view of one page, [num_layers, 2, page_size, num_kv_heads, head_dim] (latent pages:
        [num_layers, page_size, head_dim], kvd/wire/layout.py).

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
                ErrorCode.FAILED_PRECONDITION,
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
        reply = self._sequences_call("AllocateWithPrefix", ns, requests)
        allocations = [messages.allocation(s) for s in reply.sequences]
        self._note_evicted(ns, reply.evicted_seq_ids)
        with self._lock:
            for a in allocations:
                self._private.drop(ns, a.seq_id)  # an evicted sequence re-entering
                self._private.add(ns, a.seq_id, a.private_pages)
        return allocations

    allocate_pages_for_sequences_with_prefix = allocate_with_prefix

    def _sequences_call(self, method: str, ns: int, requests: list[SequenceRequest]):
        """An Allocate or Lookup call. One of ``MIN_TOKENS`` ids or more passes them through the
        session's token buffer when no other thread's call holds it; any other goes inline."""
        total = sum(messages.num_tokens(r.token_ids) for r in requests)
        if total >= MIN_TOKENS and self._token_lock.acquire(blocking=False):
            try:
                buffer = self._token_buffer_for(total)
                if buffer is not None:
                    spans = buffer.spans(ClientTokenBuffer.arrays([r.token_ids for r in requests]))
                    sequences = messages.spanned_requests(requests, spans)
                    return self._call(method, session=self.session, namespace_id=ns, sequences=sequences)
            finally:
                self._token_lock.release()
        sequences = messages.inline_requests(requests)
        return self._call(method, session=self.session, namespace_id=ns, sequences=sequences)

    def _token_buffer_for(self, num_tokens: int) -> ClientTokenBuffer | None:
        """The session's token buffer, opened or grown to hold ``num_tokens`` ids; None when
        the daemon refuses one (the call then goes inline, and the daemon says what is wrong)."""
        if self._token_buffer is None or self._token_buffer.size < num_tokens * TOKEN_BYTES:
            try:
                size = ClientTokenBuffer.size_for(num_tokens)
                reply = self._call("OpenTokenBuffer", session=self.session, size_bytes=size)
            except KVDError:
                return None
            self._token_buffer = ClientTokenBuffer(reply.shm_name, reply.size_bytes)
        return self._token_buffer

    def lookup(self, ns: int, requests: list[SequenceRequest]) -> list[LookupResult]:
        """The prefix hits allocate_with_prefix would find now, without pinning anything."""
        return messages.lookup_results(self._sequences_call("Lookup", ns, requests))

    def publish(self, ns: int, seq_ids: list[str], num_tokens: dict[str, int] | None = None) -> list[PublishResult]:
        """Makes the sequences' full private pages immutable and shareable.

        ``num_tokens`` may limit a sequence to the pages covering its first N tokens (a
        whole number of pages). A page identical to one published meanwhile is replaced
        by it; the result's ``rebinds`` say which page ids changed.
        """
        items = messages.publish_items(seq_ids, num_tokens or {})
        reply = self._call("Publish", session=self.session, namespace_id=ns, items=items)
        with self._lock:
            for r in reply.results:
                self._private.published(ns, r.seq_id, r.published_pages)
        return messages.publish_results(reply)

    def extend(self, ns: int, seq_id: str, num_tokens: int, token_ids=None) -> ExtendResult:
        """Room for ``num_tokens`` more tokens, in private pages. Give their ids to publish them later."""
        return self.extend_batch(ns, [ExtendItem(seq_id, num_tokens, token_ids)])[0]

    def extend_batch(self, ns: int, items: list[ExtendItem]) -> list[ExtendResult]:
        """extend() for a whole decode batch in one call; all or nothing."""
        reply = self._call("Extend", session=self.session, namespace_id=ns, **messages.extend_columns(items))
        self._note_evicted(ns, reply.evicted_seq_ids)
        results = messages.extend_results(items, reply)
        if reply.new_pages:
            with self._lock:
                for r in results:
                    if r.new_pages:
                        self._private.add(ns, r.seq_id, r.new_pages)
        return results

    def fork(self, ns: int, src: str, dst: str) -> SequenceAllocation:
        """dst shares src's published pages; src's private pages (its partial tail) are copied."""
        reply = self._call("Fork", session=self.session, namespace_id=ns, src_seq_id=src, dst_seq_id=dst)
        allocation = messages.allocation(reply.sequence)
        self._note_evicted(ns, reply.evicted_seq_ids)
        with self._lock:
            self._private.add(ns, dst, allocation.private_pages)
        return allocation

    def release(self, ns: int, seq_ids: list[str]) -> int:
        """Drops the sequences; returns the number of page references released."""
        released = self._call("Release", session=self.session, namespace_id=ns, seq_ids=seq_ids).released_pages
        with self._lock:
            for seq_id in seq_ids:
                self._private.drop(ns, seq_id)
        return released

    def set_state(self, ns: int, seq_id: str, state: SequenceState | str) -> SequenceState:
        """Moves a sequence along the README's life-cycle table (kvd/cache/sequences.py ``TRANSITIONS``);
        returns the previous state. A refused transition is FAILED_PRECONDITION; EVICTED is the
        daemon's to set; COMPLETED releases the sequence."""
        state = SequenceState[state] if isinstance(state, str) else state
        reply = self._call("SetState", session=self.session, namespace_id=ns, seq_id=seq_id, state=state.value)
        if state is SequenceState.COMPLETED:  # its pages are released
            with self._lock:
                self._private.drop(ns, seq_id)
        return SequenceState(reply.previous)

    def set_states(self, ns: int, seq_ids: list[str], state: SequenceState | str) -> list[SequenceState]:
        """`set_state` for a batch in one call: every sequence moves, or none does (the error
        names the first refused one); returns the previous states in order."""
        state = SequenceState[state] if isinstance(state, str) else state
        reply = self._call("SetStates", session=self.session, namespace_id=ns, seq_ids=seq_ids, state=state.value)
        if state is SequenceState.COMPLETED:  # their pages are released
            with self._lock:
                for seq_id in seq_ids:
                    self._private.drop(ns, seq_id)
        return [SequenceState(p) for p in reply.previous]

    def describe_sequences(self, ns: int, seq_ids: list[str]) -> list[SequenceStatus]:
        """The sequences' states and sizes, read without changing them (all or nothing:
        NOT_FOUND for an id that was never allocated, or was released or completed)."""
        reply = self._call("DescribeSequences", session=self.session, namespace_id=ns, seq_ids=seq_ids)
        return messages.sequence_statuses(reply)

    def set_aux_state(self, ns: int, seq_id: str, data: bytes) -> None:
        """Stores non-KV per-sequence state (recurrent state, checkpoints); a fork copies it.

        Allowed in every state, EVICTED too, and kept when an evicted sequence re-enters. At
        most the daemon's ``aux_bytes_per_sequence`` (INVALID_ARGUMENT above it); all
        sequences together share ``aux_bytes`` (RESOURCE_EXHAUSTED when it is full)."""
        self._call("SetAuxState", session=self.session, namespace_id=ns, seq_id=seq_id, data=data)

    def get_aux_state(self, ns: int, seq_id: str) -> bytes:
        return self._call("GetAuxState", session=self.session, namespace_id=ns, seq_id=seq_id).data

    # ---- pins, stats --------------------------------------------------------------

    def pin(self, ns: int, token_ids, ttl: float | None = None, extra_keys: tuple[ExtraKey, ...] = ()) -> PinResult:
        """Keeps the cached pages of this prefix resident until unpin, ttl seconds, or session end."""
        reply = self._call(
            "Pin",
            session=self.session,
            namespace_id=ns,
            tokens=pack_tokens(token_ids),
            extra_keys=messages.extra_keys(extra_keys),
            ttl_seconds=ttl or 0.0,
        )
        return PinResult(reply.pin_id, reply.pinned_pages, reply.pinned_tokens, reply.pending_tokens)

    def prewarm(self, ns: int, requests: list[SequenceRequest]) -> list[PrewarmResult]:
        """Promotes the prompts' full pages from the disk tier and the remote store into host
        memory ahead of their requests; returns at once with what was resident and what started."""
        reply = self._call("Prewarm", session=self.session, namespace_id=ns, prompts=messages.inline_requests(requests))
        return [PrewarmResult(**{f: getattr(x, f) for f in PrewarmResult.__dataclass_fields__}) for x in reply.results]

    def unpin(self, pin_id: int) -> None:
        self._call("Unpin", session=self.session, pin_id=pin_id)

    def stats(self) -> Stats:
        """The daemon's page statistics, as ``kvd stats --json`` prints them (with tenants: this tenant's)."""
        from kvd.wire.admin import stats_dict

        return stats_dict(self._call("GetStats", session=self.session))

    def check_invariants(self) -> list[str]:
        """Broken invariants of the daemon's state (empty when healthy)."""
        return list(self._call("CheckInvariants", session=self.session).violations)

    def verify_pages(self) -> VerifyReport:
        """Audits every published page against its checksum (admin; ``kvd verify``)."""
        from kvd.wire.admin import verify_dict

        ticket = fetch_ticket(self._connection.socket)
        return verify_dict(self._call("VerifyPages", ticket=ticket))

    def reset_prefix_cache(self, ns: int | None = None) -> ResetReport:
        """Drops the cached (unreferenced) published pages of namespace ``ns``, or of every
        namespace (with tenants: this tenant's), as vLLM's ``reset_prefix_cache`` after a
        weight update. Pages a sequence or pin references are untouched.
        Returns {"dropped_pages", "kept_pages"}."""
        from kvd.wire.admin import reset_dict

        reply = self._call("ResetPrefixCache", session=self.session, has_namespace=ns is not None, namespace_id=ns or 0)
        return reset_dict(reply)

    def subscribe_events(self, from_seq: int | None = None, removals_only: bool = False) -> ReplyStream[KVEventBatch]:
        """The KV events of this client's tenant as they happen (routers' view of which pages
        kvd holds): an iterator of ``KVEventBatch`` (``seq``, ``ts``, ``events``: each a
        ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``, engine_client/events.py)
        over its own stream, which ends with this session; ``cancel()`` ends it early, from
        any thread. A stream the daemon breaks off raises ``KVDError`` (UNAVAILABLE: it
        went away; RESOURCE_EXHAUSTED: this reader fell too far behind). ``from_seq``
        resumes with the batches the daemon still buffers from that one on: a first ``seq``
        above it means some were missed. ``removals_only``: only batches with a
        host page's ``BlockRemoved`` (medium "CPU") or ``AllBlocksCleared``, and only those
        events (a client that tracks host pages it holds or reported, not the whole cache)."""
        request = messages.request(
            "SubscribeEvents",
            session=self.session,
            has_from_seq=from_seq is not None,
            from_seq=from_seq or 0,
            removals_only=removals_only,
        )
        return self._connection.stream("SubscribeEvents", request, messages.event_batch)

    def ping(self) -> None:
        self._call("Ping")
