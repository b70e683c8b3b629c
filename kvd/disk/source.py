"""The disk as the ``FetchSource`` of its tier's promotions (kvd/tiers/fetches.py): the one
place a promotion goes down to the store and comes back up from.

``find`` walks the missing pages' chain keys through the tier's index ((namespace root,
chain key) → ``DiskPage``, kvd/disk/index.py) and through the write-back's copies (the pages
still on their way to disk, kvd/disk/write_back.py), counts each page found as used in the
policy, and answers the leading run on the next loop turn, as the remote store's answer would
come. ``get`` reads the pages on disk into the host pages ``Fetches`` was granted
(``DiskStore.read``, kvd/diskstore/store.py, which checks each page's checksum on the store's
threads) and copies a page still on its way from its write's copy once that matches its
seal; back on the loop (``StoreAnswers``, kvd/disk/answers.py) each page's header is answered
from the identity on disk (``Arrival.MISMATCHED`` for another tenant or namespace root, or a
page that failed its checksum, which the store dropped). ``reject``: a page that failed the
request's checks is freed from the disk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np

from kvd.core.index import ChainSpec, page_key
from kvd.core.namespaces import Namespace
from kvd.disk.answers import StoreAnswers
from kvd.disk.index import DiskIndex
from kvd.disk.ledger import DiskTierCounters
from kvd.disk.write_back import WriteBack, from_copy
from kvd.diskstore.layout import DiskPage
from kvd.diskstore.results import PageRead, PageWrite, ReadFailure, ReadOk
from kvd.diskstore.store import DiskStore
from kvd.tiers.fetches import Arrival, Done, Found, PageHeader
from kvd.wire.codec import TOKEN_BYTES


class DiskSource:
    """One tenant's disk, where its promotions read pages from."""

    name = "the disk"
    recheck_after_landing = False  # the index answers at once: a prompt asked again is promoted again

    def __init__(
        self,
        store: DiskStore,
        scope: str,
        index: DiskIndex,
        write_back: WriteBack,
        answers: StoreAnswers,
        counters: DiskTierCounters,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.store = store
        self.scope = scope  # the tenant: a page on disk of another never matches
        self.index = index
        self.write_back = write_back
        self.answers = answers
        self.counters = counters
        self.loop = loop

    @property
    def up(self) -> bool:
        return True

    def find(self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range, done: Done) -> None:
        found: Found = list(self.leading_run(ns, chain, tokens, parent_key, pages))
        for _, header in found:
            self.index.hit((ns.root, header.key))
        self.loop.call_soon(done, found, None)  # as the store's answer would: after the caller's call

    def leading_run(
        self, ns: Namespace, chain: ChainSpec, tokens: bytes, parent_key: bytes, pages: range
    ) -> Iterator[tuple[DiskPage | PageWrite, PageHeader]]:
        """The leading run of ``pages`` on disk or on their way there, each with the header
        the request expects."""
        step = ns.page_size * TOKEN_BYTES
        for i in pages:
            page_tokens = tokens[i * step : (i + 1) * step]
            key = page_key(parent_key, i, page_tokens, chain.local_bytes(i))
            on_disk = self.index.get((ns.root, key)) or self.write_back.copy_of((ns.root, key))
            if on_disk is None:
                return
            yield on_disk, PageHeader(i, key, parent_key, chain.local_digest(i), page_tokens)
            parent_key = key

    def get(self, ns: Namespace, found: Found, views: list[np.ndarray], done: Done) -> None:
        """Reads the pages on disk; a page still on its way there is copied from its write's
        copy at once (on the loop, as the eviction copied it) once that matches its seal."""
        on_disk: list[tuple[int, PageRead]] = []
        copied: dict[int, PageHeader | Arrival] = {}
        for n, ((entry, _), view) in enumerate(zip(found, views)):
            if isinstance(entry, DiskPage):
                on_disk.append((n, PageRead(entry.slot, view)))
            else:
                copied[n] = from_copy(entry, view)
        started = time.monotonic()

        def arrived(results) -> None:
            reads = [found[n] for n, _ in on_disk]
            headers = self._arrivals(ns, reads, results, started) if reads else []
            read = dict(zip((n for n, _ in on_disk), headers))
            done([read[n] if n in read else copied[n] for n in range(len(found))], None)

        self.answers.when_done(self.store.read([r for _, r in on_disk]), arrived, lambda error: done(None, error))

    def reject(self, entry: DiskPage | PageWrite) -> None:
        """The page read back is not the one the request expects: freed from the disk (a
        write's copy: not read again)."""
        if isinstance(entry, PageWrite):
            self.write_back.drop_copy(entry)
        elif self.index.forget(entry):
            self.store.free([entry.slot])

    def _arrivals(self, ns: Namespace, found: Found, results, started: float) -> list[PageHeader | Arrival]:
        """Each page's header as the disk has it, once its checksum held; a page the store
        dropped is forgotten."""
        self.counters.promotions.observe(time.monotonic() - started)
        got: list[PageHeader | Arrival] = []
        for (on_disk, _), result in zip(found, results):
            if isinstance(result, ReadOk):
                self.counters.read_bytes += result.page.page_bytes
                i = result.page.identity
                ours = i.scope == self.scope and i.namespace_root == ns.root
                got.append(
                    PageHeader(i.page_index, i.key, i.parent_key, i.local, i.tokens) if ours else Arrival.MISMATCHED
                )
                continue
            if result.dropped:
                self.index.forget(on_disk)
            if result.reason is ReadFailure.CORRUPT:
                got.append(Arrival.MISMATCHED)
            else:
                got.append(Arrival.FAILED)
        return got
