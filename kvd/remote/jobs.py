"""The remote tier's work on the link's thread: the jobs, and one tier's door to the thread.

Store calls block, so every one runs on the link's worker thread (kvd/remote/link.py), in
submission order, never on the event loop. ``TierJobs`` is one tier's door to it: it hands
a job over with what to do with its outcome back on the loop, naming every extent's memory
and the header staging area, which the link registers with the store before the job runs
(puts and gets name page addresses directly: no copy of kvd's own).

The jobs are plain functions of the store and what they were handed; they read pages and
write headers, never the pool, and all they decide comes back as an outcome:

- ``put`` writes each page's header and stores header and page (write-behind and offering
  again, kvd/remote/storing.py);
- ``find`` hashes a prompt's missing pages' chain keys and asks the store which it holds,
  ``get`` reads their values into local pages and checks each one's checksum (a fetch,
  kvd/remote/fetching.py).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvd.core.arena import Arena
from kvd.core.index import ChainSpec, ExtraKey, page_key
from kvd.core.namespaces import Namespace
from kvd.core.records import page_checksum
from kvd.core.types import PageId
from kvd.remote.format import PageHeader, header_bytes, read_header, store_key, write_header
from kvd.remote.link import RemoteLink
from kvd.remote.mooncake_store import GetOutcome, PutOutcome
from kvd.wire.codec import TOKEN_BYTES

MAX_BATCH_PAGES = 256  # pages per store call: bounds the header staging area


class Unsent(enum.Enum):
    """Why ``put`` did not send a page it was handed."""

    CHANGED = "changed"  # the page's bytes no longer match its seal: never stored
    PRESENT = "present"  # offered again, and the store holds it still


@dataclass(frozen=True)
class Put:
    """One page for ``put``: where its bytes are, what its header says, what must hold."""

    key: str
    page: PageId | None  # the page held for the put; None: ``view`` is a copy of an evicted page
    view: np.ndarray  # the page's bytes: in shared memory, or a copy
    header: PageHeader
    ns: Namespace
    extra_keys: tuple[ExtraKey, ...]  # the publishing sequence's, for the page's REMOTE event
    sealed: tuple[bytes, int] | None = None  # record fields and checksum the bytes must match to be stored
    reoffer: bool = False  # offered again after the store came back


class TierJobs:
    """One tier's jobs on the link's thread: its scope (the tenant) and staging area."""

    def __init__(self, link: RemoteLink, scope: str, arena: Arena) -> None:
        self.link = link
        self.scope = scope  # the tenant: tenants never share pages through the store
        self.arena = arena
        self._staging = np.zeros((MAX_BATCH_PAGES, 0), dtype=np.uint8)  # headers: [pages, header bytes]

    @property
    def up(self) -> bool:
        return self.link.up

    def staging_for(self, page_size: int) -> np.ndarray:
        """The header staging area, large enough for pages of ``page_size`` tokens."""
        if self._staging.shape[1] < header_bytes(page_size):
            self._staging = np.zeros((MAX_BATCH_PAGES, header_bytes(page_size)), dtype=np.uint8)
        return self._staging

    def run(self, job: Callable, done: Callable) -> None:
        """Runs ``job(store)`` on the link's thread; ``done(outcome, error)`` follows on the loop."""
        regions = [(e.pages.ctypes.data, e.plan.size) for e in self.arena.extents()]
        if self._staging.nbytes:
            regions.append((self._staging.ctypes.data, self._staging.nbytes))
        self.link.run(self.scope, frozenset(regions), job, done)


def put(store, batch: list[Put], staging: np.ndarray, missing_only: bool = False) -> list[PutOutcome | Unsent]:
    """Writes each page's header and stores header and page; with ``missing_only`` only the
    pages the store does not hold (PRESENT for the others). A page whose bytes no longer
    match its seal (they changed in host memory) is not stored: CHANGED."""
    present = store.exists([item.key for item in batch]) if missing_only else [False] * len(batch)
    keys, parts, outcomes = [], [], []
    for n, (item, there) in enumerate(zip(batch, present)):
        if there:
            outcomes.append(Unsent.PRESENT)
            continue
        if item.sealed is not None and page_checksum(item.sealed[0], item.view) != item.sealed[1]:
            outcomes.append(Unsent.CHANGED)
            continue
        size = header_bytes(len(item.header.tokens) // TOKEN_BYTES)
        write_header(staging[n, :size], item.header, item.view)
        keys.append(item.key)
        parts.append(([staging[n].ctypes.data, item.view.ctypes.data], [size, item.view.nbytes]))
        outcomes.append(n)
    stored = iter(store.put(keys, parts) if keys else [])
    return [next(stored) if isinstance(n, int) else n for n in outcomes]


def find(
    store,
    scope: str,
    ns: Namespace,
    chain: ChainSpec,
    tokens: bytes,
    parent_key: bytes,
    pages: range,
    rejected: OrderedDict[str, None],
) -> list[tuple[str, PageHeader]]:
    """The store keys and expected headers of the leading run of ``pages`` (chain indexes; the
    first one's parent key is ``parent_key``) the store holds, up to the first key whose value
    was rejected before."""
    step = ns.page_size * TOKEN_BYTES
    wanted = []
    for i in pages:
        page_tokens = tokens[i * step : (i + 1) * step]
        key = page_key(parent_key, i, page_tokens, chain.local_bytes(i))
        name = store_key(scope, ns.root, key)
        if name in rejected:
            break
        wanted.append((name, PageHeader(i, key, parent_key, chain.local_digest(i), page_tokens)))
        parent_key = key
    if not wanted:
        return []
    found = store.exists([k for k, _ in wanted])
    run = next((n for n, there in enumerate(found) if not there), len(found))
    return wanted[:run]


def get(
    store, found: list[tuple[str, PageHeader]], views: list[np.ndarray], staging: np.ndarray
) -> list[PageHeader | GetOutcome]:
    """For each fetched page: its header, once its checksum holds for the bytes that arrived;
    FAILED when nothing arrived; MISMATCHED when what arrived is not a page of this size or
    fails its checksum."""
    size = header_bytes(len(found[0][1].tokens) // TOKEN_BYTES)
    got: list[PageHeader | GetOutcome] = []
    for start in range(0, len(found), MAX_BATCH_PAGES):
        chunk = found[start : start + MAX_BATCH_PAGES]
        parts = [
            ([staging[n].ctypes.data, views[start + n].ctypes.data], [size, views[start + n].nbytes])
            for n in range(len(chunk))
        ]
        for n, outcome in enumerate(store.get([k for k, _ in chunk], parts)):
            if outcome is GetOutcome.ARRIVED:
                outcome = read_header(staging[n, :size], views[start + n]) or GetOutcome.MISMATCHED
            got.append(outcome)
    return got
