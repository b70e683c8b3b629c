"""Mooncake Store as kvd's remote tier: the one module that imports ``mooncake``.

Every method blocks (a network round trip or more), so only the remote tier's worker
thread calls them (kvd/remote/link.py), one at a time. Pages move between kvd's
shared-memory extents and the store without a copy of our own: each extent is
registered with the store's transfer engine (``register``), and puts and gets name the
page's address directly (``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``),
with the page's header (kvd/remote/format.py) as a second buffer of the same object.

Mooncake reports per key with negative codes; the ones kvd tells apart are below. Any
code of the RPC group means the master cannot be reached: ``StoreUnavailable``.

While the master is down each call waits on Mooncake's RPC timeouts (~4 s, measured
here) with the GIL released, but ``close`` (and the client's teardown at process exit)
waits longer (~10 s) holding the GIL: ``master_unreachable`` tells beforehand whether
closing is worth trying (kvd/remote/link.py abandons the client otherwise).

A master that restarts between two probes answers the next one as if nothing happened,
and Mooncake's client exposes no master epoch, so each host keeps a **canary**: a small
object stored when the link comes up, hard-pinned (the store never evicts it) in this host's
own segment (so no other host's death takes it). Only a master that lost its objects
loses the canary: ``probe`` answering False is how kvd learns that every page it stored is
gone, whenever the restart happened.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

NO_AVAILABLE_HANDLE = -200  # no segment has room for the object
_RPC_CODES = range(-999, -899)  # RPC_FAIL (-900) and its kin: the master is unreachable
CANARY_PREFIX = "kvd1/canary/"  # + this host's segment name: the object ``probe`` checks


class StoreUnavailable(Exception):
    """The store's master cannot be reached (or the client could not be set up)."""


class PutOutcome(enum.Enum):
    STORED = "stored"
    FULL = "full"  # no room in the store
    REFUSED = "refused"  # any other per-key refusal


class GetOutcome(enum.Enum):
    ARRIVED = "arrived"  # exactly the buffers' size arrived
    MISMATCHED = "mismatched"  # the stored value has another size: not the object asked for
    FAILED = "failed"  # nothing arrived: the transfer failed (the host holding it died) or the object went


@dataclass(frozen=True)
class MooncakeSettings:
    master: str  # host:port of mooncake_master's RPC service
    metadata: str  # the metadata server, e.g. http://host:port/metadata
    local_hostname: str  # the address other hosts reach this one at (host or host:port)
    protocol: str = "tcp"  # "tcp", or "rdma" with rdma_devices
    rdma_devices: str = ""
    segment_bytes: int = 1 << 30  # memory this host lends to the store
    buffer_bytes: int = 16 << 20  # the client's own transfer buffer (unused by zero-copy calls)


def _unreachable(codes: list[int]) -> bool:
    return bool(codes) and all(c in _RPC_CODES for c in codes)


def master_unreachable(master: str, timeout: float) -> str | None:
    """Why the master (host:port) accepts no TCP connection within ``timeout``; None when it does."""
    host, port = master.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        return f"master {master} accepts no connection ({e.strerror or e})"
    return None


class MooncakeStore:
    """One Mooncake client: set up on construction, closed by ``close``."""

    def __init__(self, settings: MooncakeSettings) -> None:
        # Mooncake's setup retries an absent master for ~90 s; a closed port is known at once.
        problem = master_unreachable(settings.master, 1.0)
        if problem is not None:
            raise StoreUnavailable(problem)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            settings.local_hostname,
            settings.metadata,
            settings.segment_bytes,
            settings.buffer_bytes,
            settings.protocol,
            settings.rdma_devices,
            settings.master,
        )
        if rc != 0:
            self._store.close()
            raise StoreUnavailable(f"setting up the Mooncake client for master {settings.master} failed (code {rc})")
        self._config = ReplicateConfig()
        self._config.replica_num = 1
        segment = self._store.get_hostname()  # this host's segment, as the master names it
        self._canary_key = CANARY_PREFIX + segment
        self._canary_config = ReplicateConfig()
        self._canary_config.replica_num = 1
        self._canary_config.with_hard_pin = True
        self._canary_config.preferred_segment = segment
        self._canary = np.zeros(64, dtype=np.uint8)  # its value

    def register(self, address: int, size: int) -> None:
        rc = self._store.register_buffer(address, size)
        if rc != 0:
            raise StoreUnavailable(f"registering {size} bytes at {address:#x} with the store failed (code {rc})")

    def unregister(self, address: int) -> None:
        self._store.unregister_buffer(address)

    def probe(self) -> bool:
        """Whether the store still holds this host's canary; raises ``StoreUnavailable``
        unless the master answers."""
        [present] = self.exists([self._canary_key])
        return present

    def store_canary(self) -> None:
        """Stores the canary: raises ``StoreUnavailable`` until a restarted master has this
        host's segment mounted again (it refuses every put until then)."""
        canary = self._canary
        rc = self._store.upsert_from(self._canary_key, canary.ctypes.data, canary.nbytes, self._canary_config)
        if rc != 0:
            raise StoreUnavailable(f"the store takes no object yet (code {rc}): its segments are not mounted")

    def exists(self, keys: list[str]) -> list[bool]:
        codes = self._store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise StoreUnavailable(f"existence query of {len(keys)} keys failed (codes {sorted(set(codes))})")
        return [c == 1 for c in codes]

    def put(self, keys: list[str], parts: list[tuple[list[int], list[int]]]) -> list[PutOutcome]:
        """Stores each key's value from its buffers ((addresses, sizes), concatenated); a key
        that exists already counts as stored (another host put the same page)."""
        codes = self._store.batch_put_from_multi_buffers(
            keys, [addresses for addresses, _ in parts], [sizes for _, sizes in parts], self._config
        )
        if _unreachable(codes):
            raise StoreUnavailable(f"put of {len(keys)} pages failed: the master is unreachable (code {codes[0]})")
        return [
            PutOutcome.STORED if c >= 0 else PutOutcome.FULL if c == NO_AVAILABLE_HANDLE else PutOutcome.REFUSED
            for c in codes
        ]

    def get(self, keys: list[str], parts: list[tuple[list[int], list[int]]]) -> list[GetOutcome]:
        """Reads each key's value into its buffers."""
        codes = self._store.batch_get_into_multi_buffers(
            keys, [addresses for addresses, _ in parts], [sizes for _, sizes in parts]
        )
        if _unreachable(codes):
            raise StoreUnavailable(f"get of {len(keys)} pages failed: the master is unreachable (code {codes[0]})")
        return [self._got(key, code, sum(sizes)) for key, code, (_, sizes) in zip(keys, codes, parts)]

    def _got(self, key: str, code: int, size: int) -> GetOutcome:
        """Mooncake answers a value of another size with an error code (TRANSFER_FAIL into larger
        buffers, INVALID_PARAMS into smaller ones), as it answers a transfer that failed: the
        object's stored size tells the two apart."""
        if code == size:
            return GetOutcome.ARRIVED
        if code >= 0:
            return GetOutcome.MISMATCHED
        stored = self._store.get_size(key)
        return GetOutcome.MISMATCHED if stored >= 0 and stored != size else GetOutcome.FAILED

    def close(self) -> None:
        self._store.close()
