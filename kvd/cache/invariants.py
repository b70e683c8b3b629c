"""Recomputes the invariants of docs/architecture.md from scratch and lists every violation.

Used by tests after every step and by the CheckInvariants admin call. It reads the
core's state and changes nothing. The checks go in three passes: what sequences and pins
hold (the references every page should count), each page against those references, and
the index and per-namespace queues against the pages' states.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvd.core.types import PageState


@dataclass
class _References:
    """What sequences, pins and the remote tier hold, recomputed: the refcount every page should have."""

    expected: Counter = field(default_factory=Counter)  # page → sequence entries + pins + holds
    pinned: Counter = field(default_factory=Counter)  # page → pins
    owners: dict[int, list[str]] = field(default_factory=dict)  # page → seq ids
    logical: int = 0  # page-table entries of all sequences
    held: Counter = field(default_factory=Counter)  # page → the tiers' holds (kvd/tiers/tier.py)
    counted: str = "sequences + pins"  # what ``expected`` counts, for messages


def violations(manager) -> list[str]:
    found: list[str] = []
    refs = _references(manager, found)
    free_by_ns, cached_by_ns, physical = _check_pages(manager.pool, manager.index, refs, found)
    _check_index(manager.pool, manager.index, found)
    _check_queues(manager, free_by_ns, cached_by_ns, found)
    if physical > refs.logical:
        found.append(f"physical pages {physical} exceed logical pages {refs.logical}")
    if manager.arena.reserved_bytes > manager.arena.budget_bytes:
        found.append(
            f"arena holds {manager.arena.reserved_bytes} bytes, over its budget of {manager.arena.budget_bytes}"
        )
    aux = sum(len(seq.aux) for seq in manager.sequences)
    if aux != manager.aux.used or aux > manager.aux.budget:
        found.append(
            f"sequences hold {aux} bytes of aux state, counted as {manager.aux.used}, budget {manager.aux.budget}"
        )
    return found


def _references(manager, found: list[str]) -> _References:
    """Each sequence's page table against its token count and its pages' states; every pin."""
    pool = manager.pool
    refs = _References()
    for seq in manager.sequences:
        ns = manager.namespaces.get(seq.namespace)
        refs.logical += len(seq.pages)
        if len(seq.pages) != -(-seq.num_tokens // ns.page_size):
            found.append(f"sequence {seq.seq_id!r} holds {len(seq.pages)} pages for {seq.num_tokens} tokens")
        if seq.num_published * ns.page_size > seq.num_tokens:
            found.append(f"sequence {seq.seq_id!r} has a published page that is not full")
        for i, page in enumerate(seq.pages):
            refs.expected[page] += 1
            refs.owners.setdefault(page, []).append(seq.seq_id)
            if page not in pool:
                found.append(f"sequence {seq.seq_id!r} points at unknown page {page}")
                continue
            if pool.namespace_of(page) != seq.namespace:
                found.append(f"sequence {seq.seq_id!r} points at page {page} of another namespace")
            state = pool.state(page)
            if i < seq.num_published and state is not PageState.PUBLISHED:
                found.append(f"shared page {page} of sequence {seq.seq_id!r} is {state.value}")
            if i >= seq.num_published and state is not PageState.PRIVATE:
                found.append(f"private page {page} of sequence {seq.seq_id!r} is {state.value}")
    for pin in manager.pins:
        for page in pin.pages:
            refs.expected[page] += 1
            refs.pinned[page] += 1
    for job in manager.allocations:  # hits an allocation in progress holds (kvd/cache/allocation.py)
        refs.expected.update(job.held())
    refs.held = manager.tiers.holds()  # pages the tiers' stores read or write right now
    if manager.catalog.reindexing is not None:  # a warm restart's pages not verified yet
        refs.held.update(manager.catalog.reindexing.held())
    if refs.held:
        refs.expected.update(refs.held)
        refs.counted = "sequences + pins + tier and recovery holds"
    return refs


def _check_pages(pool, index, refs: _References, found: list[str]) -> tuple[dict[int, set], dict[int, set], int]:
    """Every page's refcount, pins and state against the references; returns the free and
    cached pages per namespace and the number of distinct pages sequences point at."""
    free_by_ns: dict[int, set] = {}
    cached_by_ns: dict[int, set] = {}
    physical = 0
    for page, state, refcount, pins, ns_id in pool.pages():
        owners = refs.owners.get(page, [])
        if refcount != refs.expected[page]:
            found.append(f"page {page} has refcount {refcount} but {refs.expected[page]} references ({refs.counted})")
        if pins != refs.pinned[page]:
            found.append(f"page {page} counts {pins} pins but {refs.pinned[page]} pins hold it")
        if owners:
            physical += 1
        if state is PageState.FREE:
            free_by_ns.setdefault(ns_id, set()).add(page)
            if refcount:
                found.append(f"free page {page} has refcount {refcount}")
        elif state is PageState.PRIVATE:
            if refcount != 1 or pins or len(owners) + refs.held[page] != 1:
                found.append(f"private page {page} is referenced by {owners or None} with {pins} pins")
        elif state is PageState.PUBLISHED:
            if refcount < 1:
                found.append(f"published page {page} has refcount {refcount}")
        elif state is PageState.CACHED:
            cached_by_ns.setdefault(ns_id, set()).add(page)
            if refcount or not pool.is_indexed(page):
                found.append(f"cached page {page} has refcount {refcount}, indexed={pool.is_indexed(page)}")
        if state in (PageState.PUBLISHED, PageState.CACHED) and pool.content(page) is None:
            found.append(f"{state.value} page {page} has no content record")
        elif pool.is_indexed(page) and index.get(pool.content(page).key) != page:
            found.append(f"page {page} is marked indexed but the index does not map its key to it")
    return free_by_ns, cached_by_ns, physical


def _check_index(pool, index, found: list[str]) -> None:
    """Every index entry names a published or cached page whose content has that key, and
    whose parent is indexed too (a match walks from the chain's first page)."""
    for key, page in index.items():
        if page not in pool or pool.state(page) not in (PageState.PUBLISHED, PageState.CACHED):
            found.append(f"index maps a key to page {page}, which is not published")
        elif pool.content(page).key != key or not pool.is_indexed(page):
            found.append(f"index key of page {page} does not match its content")
        elif (parent := pool.content(page).parent) is not None and (parent not in pool or not pool.is_indexed(parent)):
            found.append(f"indexed page {page} follows page {parent}, which is not indexed: no match reaches it")
    found += index.run_problems()


def _check_queues(manager, free_by_ns: dict[int, set], cached_by_ns: dict[int, set], found: list[str]) -> None:
    """Each namespace's free list and LRU hold exactly its free and cached pages, once each."""
    pool = manager.pool
    for ns in manager.namespaces.all():
        for what, listed, pages in (
            ("free list", pool.free_list(ns.id), free_by_ns.get(ns.id, set())),
            ("LRU", pool.lru_order(ns.id), cached_by_ns.get(ns.id, set())),
        ):
            if len(listed) != len(pages) or set(listed) != pages:
                found.append(
                    f"namespace {ns.id}: {what} holds pages {sorted(set(listed) - pages)} it should not, misses "
                    f"{sorted(pages - set(listed))} and lists {len(listed) - len(set(listed))} pages twice"
                )
        lru = len(pool.lru_order(ns.id))
        if pool.cached_count(ns.id) != lru:  # the queue counts them apart from its entries, some left behind
            found.append(f"namespace {ns.id}: counts {pool.cached_count(ns.id)} cached pages, its LRU lists {lru}")
