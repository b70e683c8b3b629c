"""The audit (``kvd verify``) in process, step by step: its hashing runs off the event loop,
a batch at a time, and what happens between two steps (a page freed and its memory reused,
a page published) never makes it drop a page whose bytes were right."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from cores import PAGE_SIZE, Core, check, prompt

from kvd.durability import integrity as integrity_module


def sealed(c: Core) -> None:
    c.m.integrity.submit()
    c.m.integrity.apply(wait=True)


def test_the_audit_hashes_off_the_loop_a_batch_a_step_and_judges_only_pages_unchanged_meanwhile(
    make_manager, monkeypatch
):
    monkeypatch.setattr(integrity_module, "VERIFY_BATCH_BYTES", 4 * 512)  # four 512-byte pages a batch
    gate = threading.Event()
    hash_all = integrity_module._hash_all
    monkeypatch.setattr(integrity_module, "_hash_all", lambda jobs: gate.wait() and hash_all(jobs))
    c = Core(make_manager, pages=64)
    c.alloc1("a", prompt(0, 12 * PAGE_SIZE))
    c.publish("a")
    c.release("a")  # 12 cached pages
    gate.set()
    sealed(c)
    gate.clear()
    pages = c.lookup(prompt(0, 12 * PAGE_SIZE))
    assert len(pages) == 12 and len(c.m.pool.sealed()) == 12

    audit = c.m.integrity.verification()
    steps = audit.steps()
    first = next(steps)  # the first batch's hash, waiting on the sealer thread
    assert isinstance(first, Future) and not first.done()
    # Between two steps the loop serves other calls: every page leaves the cache and the
    # first batch's memory is written by its next owner before that batch is hashed.
    c.m.catalog.reset_prefix_cache(c.ns)
    assert c.m.pool.sealed() == []
    for page in pages[:4]:
        c.m.arena.page_bytes_view(page)[:] = 9
    gate.set()
    assert list(steps) == [], "every page left the cache: no other batch is hashed"
    assert audit.result.checked_pages == 0 and audit.result.corrupted_pages == 0
    assert c.m.counters.of(c.ns).corrupted_pages == 0
    check(c.m)


def test_the_audit_drops_only_the_pages_whose_bytes_changed(make_manager, monkeypatch):
    monkeypatch.setattr(integrity_module, "VERIFY_BATCH_BYTES", 4 * 512)
    c = Core(make_manager, pages=64)
    c.alloc1("a", prompt(0, 8 * PAGE_SIZE))
    c.alloc1("b", prompt(500, 8 * PAGE_SIZE))
    c.publish("a", "b")
    c.release("a")
    sealed(c)
    a_pages, b_pages = c.lookup(prompt(0, 8 * PAGE_SIZE)), c.seq("b").pages
    c.m.arena.page_bytes_view(b_pages[5])[:] = 1  # a page b still holds is scribbled on
    audit = c.m.integrity.verification()
    futures = list(audit.steps())
    assert len(futures) == 4 and all(isinstance(f, Future) for f in futures), "16 pages, four a batch"
    assert (audit.result.checked_pages, audit.result.corrupted_pages) == (16, 1)
    assert c.lookup(prompt(500, 8 * PAGE_SIZE)) == b_pages[:5]  # the chain ends before the changed page
    assert c.lookup(prompt(0, 8 * PAGE_SIZE)) == a_pages
    check(c.m)
