"""Recomputes the invariants of docs/architecture.md from scratch and lists every violation.

Used by tests after every step and by the CheckInvariants admin call. It reads the
core's state and changes nothing.
"""

from __future__ import annotations

from collections import Counter

from kvd.types import PageState


def violations(manager) -> list[str]:
    found: list[str] = []
    pool, index = manager.pool, manager.index
    expected = Counter()
    pinned = Counter()
    owners: dict[int, list[str]] = {}
    logical = 0
    for seq in manager.sequences:
        ns = manager.namespaces.get(seq.namespace)
        logical += len(seq.pages)
        if len(seq.pages) != -(-seq.num_tokens // ns.page_size):
            found.append(f"sequence {seq.seq_id!r} holds {len(seq.pages)} pages for {seq.num_tokens} tokens")
        if seq.num_published * ns.page_size > seq.num_tokens:
            found.append(f"sequence {seq.seq_id!r} has a published page that is not full")
        for i, page in enumerate(seq.pages):
            expected[page] += 1
            owners.setdefault(page, []).append(seq.seq_id)
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
    for session in manager.sessions:
        for pin in session.pins.values():
            for page in pin.pages:
                expected[page] += 1
                pinned[page] += 1
    # The remote tier's holds: pages the store reads or writes right now (kvd/remote.py).
    held = manager.remote.holds() if manager.remote is not None else Counter()
    expected.update(held)
    counted = "sequences + pins + remote holds" if manager.remote is not None else "sequences + pins"
    physical = 0
    free_by_ns: dict[int, set] = {}
    cached_by_ns: dict[int, set] = {}
    for page, state, refcount, pins, ns_id in pool.pages():
        if refcount != expected[page]:
            found.append(f"page {page} has refcount {refcount} but {expected[page]} references ({counted})")
        if pins != pinned[page]:
            found.append(f"page {page} counts {pins} pins but {pinned[page]} pins hold it")
        if owners.get(page):
            physical += 1
        if state is PageState.FREE:
            free_by_ns.setdefault(ns_id, set()).add(page)
            if refcount:
                found.append(f"free page {page} has refcount {refcount}")
        elif state is PageState.PRIVATE:
            if refcount != 1 or pins or len(owners.get(page, [])) + held[page] != 1:
                found.append(f"private page {page} is referenced by {owners.get(page)} with {pins} pins")
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
    for key, page in index.items():
        if page not in pool or pool.state(page) not in (PageState.PUBLISHED, PageState.CACHED):
            found.append(f"index maps a key to page {page}, which is not published")
        elif pool.content(page).key != key or not pool.is_indexed(page):
            found.append(f"index key of page {page} does not match its content")
    found += index.run_problems()
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
    if physical > logical:
        found.append(f"physical pages {physical} exceed logical pages {logical}")
    if manager.arena.reserved_bytes > manager.arena.budget_bytes:
        found.append(
            f"arena holds {manager.arena.reserved_bytes} bytes, over its budget of {manager.arena.budget_bytes}"
        )
    return found
