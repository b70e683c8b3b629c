"""``Connection``: one session with the daemon at the transport level.

It finds the daemon, does the tenant handshake, opens the session stream and watches it
(evictions of the session's sequences arrive there; its end means the session is lost),
and makes every unary call, turning gRPC errors into ``KVDError``s that say what to do.
``KVDClient`` (engine_client/client.py) builds the page and sequence calls on top of it;
a reconnect replaces the connection, never the client.
"""

from __future__ import annotations

import os
import socket as socket_mod
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

from engine_client.types import ErrorCode, KVDError
from kvd.wire import kvd_pb2 as pb
from kvd.wire import kvd_pb2_grpc
from kvd.wire.auth import admit
from kvd.wire.limits import MAX_MESSAGE_BYTES
from kvd.wire.paths import find_socket
from kvd.wire.status import error_from_rpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

# Called with (namespace id, seq ids) when the daemon evicts some of the session's sequences.
EvictionListener = Callable[[int, list[str]], None]

T = TypeVar("T")


def find_daemon(socket: str | None) -> str:
    """The daemon's socket: ``socket``, else found in the order kvd/wire/paths.py gives
    (``KVD_SOCKET``, the config file, ``/run/kvd/kvd.sock``, the per-user default).
    UNAVAILABLE at once, naming every place looked at, when no daemon listens there."""
    choice = find_socket(socket)
    problem = _no_listener(choice.path)
    if problem:
        raise KVDError(
            ErrorCode.UNAVAILABLE,
            (
                f"no kvd daemon on {choice.path}: {problem} (looked at: {'; '.join(choice.tried)}); "
                "start one with `kvd serve`, or pass the socket of a running one"
            ),
        )
    return choice.path


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


def _ready_channel(path: str, timeout: float) -> grpc.Channel:
    channel = grpc.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise KVDError(ErrorCode.UNAVAILABLE, f"no kvd daemon answers on {path} within {timeout} s") from None
    return channel


class ReplyStream(Generic[T]):
    """A server stream's replies as the client's types. It ends when the daemon ends it (the
    session ended) or ``cancel()`` is called, from any thread; a stream the daemon breaks
    off (it died, or the reader fell behind) raises a ``KVDError`` saying why."""

    def __init__(self, call, convert: Callable[[Any], T]) -> None:
        self._call = call
        self._convert = convert

    def __iter__(self) -> ReplyStream[T]:
        return self

    def __next__(self) -> T:
        try:
            reply = next(self._call)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:  # cancel(), or the session's channel closed
                raise StopIteration from None
            raise error_from_rpc(e) from None
        return self._convert(reply)

    def cancel(self) -> None:
        self._call.cancel()


class Connection:
    """A session's channel, stub and stream; ``lost`` is set once the session has ended."""

    def __init__(self, socket: str, client_name: str | None, timeout: float, on_evicted: EvictionListener) -> None:
        """Opens a session on the daemon at ``socket``; ``timeout`` bounds the wait for a
        daemon that is there but slow to answer. A tenant's session lives on its own socket
        (the handshake on ``<socket>.auth`` names it, kvd/wire/auth.py)."""
        self.socket = socket
        channel = _ready_channel(socket, timeout)  # the daemon is up: no auth socket means no tenants
        try:
            admission = admit(socket, timeout)
        except KVDError:
            channel.close()
            raise
        if admission.session_socket != socket:
            channel.close()
            channel = _ready_channel(admission.session_socket, timeout)
        self.tenant = admission.tenant  # "" on a daemon without tenants
        self._channel = channel
        self._stub = kvd_pb2_grpc.KVDStub(channel)
        self._stream = self._stub.OpenSession(
            pb.OpenSessionRequest(
                client_name=client_name or os.path.basename(sys.argv[0] or "python"),
                pid=os.getpid(),
                ticket=admission.ticket,
            )
        )
        try:
            opened = next(self._stream).opened
        except grpc.RpcError as e:
            channel.close()
            raise error_from_rpc(e) from None
        self.session = opened.session
        self.prefix_reuse = opened.prefix_reuse
        self.host_bytes = opened.host_bytes
        self.daemon_instance = opened.daemon_instance  # differs after a daemon restart
        self.lost = threading.Event()
        self._on_evicted = on_evicted
        self._watcher = threading.Thread(target=self._watch, name="kvd-session", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        try:
            for event in self._stream:
                if event.HasField("evicted"):
                    self._on_evicted(event.evicted.namespace_id, list(event.evicted.seq_ids))
        except grpc.RpcError:
            pass  # cancelled by close(), or the daemon went away
        finally:
            self.lost.set()

    def call(self, method: str, request, timeout: float | None, after_reconnect: bool = False):
        """The reply of unary ``method``; a ``KVDError`` that says what to do when it fails.
        ``after_reconnect``: this client's earlier session ended, so a missing sequence is
        most likely one that did not survive a daemon restart."""
        if self.lost.is_set():
            raise KVDError(
                ErrorCode.UNAVAILABLE,
                (
                    f"the session with the kvd daemon on {self.socket} ended (the daemon stopped, died or restarted); "
                    "call reconnect() for a new session: sequences do not survive a daemon restart, published pages do"
                ),
            )
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            error = error_from_rpc(e)
        if error.code is ErrorCode.UNAVAILABLE:
            error = KVDError(
                error.code,
                (
                    f"the kvd daemon on {self.socket} does not answer (stopped, died or restarting): {error.message}; "
                    "call reconnect() once it is back"
                ),
            )
        elif error.code is ErrorCode.NOT_FOUND and after_reconnect and "sequence" in error.message:
            error = KVDError(
                error.code,
                (
                    f"{error.message}; sequences do not survive a daemon restart (published pages do): "
                    "allocate it again, its published prefix still hits"
                ),
            )
        raise error from None

    def stream(self, method: str, request, convert: Callable[[Any], T]) -> ReplyStream[T]:
        """The replies of server-streaming ``method``, each passed through ``convert``."""
        return ReplyStream(getattr(self._stub, method)(request), convert)

    def close(self, timeout: float) -> None:
        """Ends the session cleanly: the daemon releases its references and logs a close
        (a process that dies without this is logged as a client that went away)."""
        if not self.lost.is_set():
            try:
                self._stub.CloseSession(pb.CloseSessionRequest(session=self.session), timeout=timeout)
            except grpc.RpcError:
                pass  # the daemon is gone or stopping: the session ends with it either way
        self.drop()
        if self._watcher is not threading.current_thread():
            # A process that exits while this thread is still inside gRPC's C++ core can
            # abort ("terminate called without an active exception"): let it leave first.
            self._watcher.join(timeout=timeout)

    def drop(self) -> None:
        """Lets go of the channel without telling the daemon (its session ended already, or
        a new one replaces it)."""
        self._stream.cancel()
        self._channel.close()
