"""A KVCacheManager over real shared memory in the test's process, with one session and one
namespace, and short calls: what the tests of the cache's parts (test_manager.py,
test_pool.py, test_room.py, test_publishing.py) drive it through.

Page size is 4 tokens and a page is 512 bytes (identity() defaults), so prompts of a few
tokens exercise full pages, partial tails and chains. Budgets given in pages make
eviction and exhaustion exact; a single extent holds the whole budget, so pages are
handed out in id order 0, 1, 2, ... and ids can be asserted.
"""

from __future__ import annotations

import numpy as np
from conftest import budget_for, identity

from kvd.cache import invariants, stats
from kvd.cache.manager import SequenceRequest
from kvd.core.types import SequenceState

PAGE_SIZE = 4
PAGE_BYTES = 512


def toks(ids) -> bytes:
    return np.asarray(list(ids), dtype="<i4").tobytes()


def prompt(start: int, num_tokens: int) -> list[int]:
    """num_tokens distinct token ids starting at ``start``."""
    return list(range(start, start + num_tokens))


def req(seq_id: str, ids, extra=()) -> SequenceRequest:
    return SequenceRequest(seq_id, toks(ids), tuple(extra))


def settle(m) -> None:
    """Waits for background extent builds and adopts them, so a snapshot is stable."""
    m.supply.settle()


def snapshot(m) -> dict:
    """Everything a failed call must leave as it was."""
    settle(m)
    namespaces = m.namespaces.all()
    return {
        "stats": stats.collect(m).as_dict(),
        "pages": sorted((p, s, r, pins) for p, s, r, pins, _ in m.pool.pages()),
        "free": {ns.id: m.pool.free_list(ns.id) for ns in namespaces},
        "lru": {ns.id: m.pool.lru_order(ns.id) for ns in namespaces},
        "index": sorted(m.index.items()),
        "sequences": sorted(
            (
                s.namespace,
                s.seq_id,
                s.session,
                s.state,
                list(s.pages),
                s.num_tokens,
                bytes(s.tokens),
                list(s.keys),
                s.aux,
            )
            for s in m.sequences
        ),
        "sessions": sorted(
            (s.id, sorted((q.namespace, q.seq_id) for q in m.sequences.of_session(s.id))) for s in m.sessions
        ),
        "pins": sorted((pin.id, pin.session, pin.pages) for pin in m.pins),
        "counters": {ns.id: (m.counters.of(ns.id).lookup_tokens, m.counters.of(ns.id).hit_tokens) for ns in namespaces},
        "extents": [e.name for e in m.arena.extents()],
        "reserved": m.arena.reserved_bytes,
    }


def check(m) -> None:
    assert invariants.violations(m) == []


class Core:
    """One manager, one session, one namespace, and short calls for the tests."""

    def __init__(self, make_manager, pages: int | None = None, prefix_reuse: bool = True, **ident) -> None:
        if pages is None:
            self.m = make_manager(prefix_reuse=prefix_reuse)
        else:
            # one extent holds the whole budget
            budget = budget_for(pages, PAGE_BYTES, PAGE_SIZE)
            self.m = make_manager(budget_bytes=budget, extent_bytes=pages * PAGE_BYTES, prefix_reuse=prefix_reuse)
        self.sid = self.m.open_session("test", 1).id
        self.ns = self.m.catalog.register_namespace(identity(**ident)).id
        self.evicted: list[tuple[int, list[str]]] = []  # what the session stream heard
        self.replied: list[list[str]] = []  # what replies named as evicted by the call (non-empty only)
        self.m.sessions.get(self.sid).listener = lambda ns, ids: self.evicted.append((ns, list(ids)))

    def alloc(self, *requests: SequenceRequest, sid=None):
        return self.replies(self.m.allocate(sid or self.sid, self.ns, list(requests)))

    def extend(self, *items):
        return self.replies(self.m.extend(self.sid, self.ns, list(items)))

    def fork(self, src: str, dst: str):
        return self.replies(self.m.fork(self.sid, self.ns, src, dst))

    def replies(self, done):
        if done.evicted:
            self.replied.append(list(done.evicted))
        return done.result

    def alloc1(self, seq_id: str, ids, extra=()):
        return self.alloc(req(seq_id, ids, extra))[0]

    def publish(self, *seq_ids: str, num_tokens: int = 0):
        return self.m.publish(self.sid, self.ns, [(s, num_tokens) for s in seq_ids])

    def release(self, *seq_ids: str) -> int:
        return self.m.release(self.sid, self.ns, list(seq_ids))

    def seq(self, seq_id: str):
        return self.m.sequences.find(self.ns, seq_id)

    def refcounts(self, pages) -> list[int]:
        return [self.m.pool.refcount(p) for p in pages]

    def lru(self) -> list[int]:
        return self.m.pool.lru_order(self.ns)

    def lookup(self, ids, extra=()) -> list[int]:
        return self.m.lookup(self.sid, self.ns, [req("probe", ids, extra)])[0].hit_pages


def evict(c: Core, seq_id: str) -> None:
    """Makes the daemon evict the on-hold ``seq_id``: a batch that needs every page of the
    budget takes its pages, then goes."""
    assert c.seq(seq_id).state is SequenceState.ON_HOLD
    ns = c.m.namespaces.get(c.ns)
    free = c.m.pool.free_count(c.ns) + c.m.arena.creatable_pages(ns.page_bytes, ns.page_size)
    c.alloc1("pressure", prompt(5000, (free + len(c.seq(seq_id).private_pages)) * PAGE_SIZE))
    c.release("pressure")
    assert c.seq(seq_id).state is SequenceState.EVICTED and c.replied[-1] == [seq_id]
