"""Publishing: a sequence's full private pages become immutable, indexed and shareable.

A 50K-token prompt of 16-token pages is 3,125 pages, ~5 µs each (key, index entry, page
state, metadata record): ~16 ms. Done in one piece it holds the event loop that long and
every engine's calls wait behind it. A ``PublishJob`` is validated whole first (by the
manager: a refused publish changes nothing), then publishes in ``step``s of a bounded
time, and the servicer lets the loop serve other calls between them. Within a step the
pages of a chain go in batches (``RUN_PAGES``): the pool changes a batch's columns in a few
array operations, the index takes it as one run, the sealer's records are written in one
pass (bench/RESULTS.md, 2026-12-03).

Every step leaves a state the invariants accept: a sequence's pages are published in
position order, so between steps it is a sequence whose first k pages are published,
exactly what ``publish(num_tokens=k * page_size)`` leaves. Other calls may run between
steps, and each is safe against them:
- a sequence released, completed, evicted or dropped with its session meanwhile is no
  longer in the table as the same object (or is EVICTED): its remaining pages are skipped;
- a second publish of the same sequence shares the work: each step publishes the next
  unpublished page (``num_published``), never a page twice;
- extend appends pages after the ones being published; fork copies what is private at
  that moment.
The reply goes only after the last step, so a returned publish is as durable as before
(records written, kvd/durability/integrity.py seals them; ``publish-recorded`` crash point).
What follows each page published (its record, its KV event, the tiers) is
``PageEvents``'s (kvd/cache/page_events.py), which the pool tells. A call
cancelled between steps (its deadline passed) leaves the pages published so far, a state
as consistent as any step's; they are handed to the sealer with the next publish.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvd import crashpoints
from kvd.cache.events import EventLog
from kvd.cache.page_events import PageEvents
from kvd.cache.requests import STEP_SECONDS, PublishResult, Rebind
from kvd.cache.sequences import Sequence, SequenceTable
from kvd.core.index import PageContent, PrefixIndex, page_key
from kvd.core.listener import ChainPlace
from kvd.core.namespaces import Namespace
from kvd.core.pool import PagePool
from kvd.core.types import SequenceState
from kvd.wire.codec import TOKEN_BYTES

RUN_PAGES = 64  # pages published in one batch at most, between two looks at the step's deadline
PAGE_SECONDS = 4e-6  # about what publishing one page of a batch takes (bench/bench_scale.py)


def _batch_pages(seconds: float) -> int:
    """The pages of the next batch with ``seconds`` left of a step: one at least."""
    return RUN_PAGES if seconds >= RUN_PAGES * PAGE_SECONDS else max(1, int(seconds / PAGE_SECONDS))


@dataclass
class PublishJob:
    """Publishes ``targets`` (sequence, pages to have published) a step at a time."""

    ns: Namespace
    pool: PagePool
    index: PrefixIndex
    sequences: SequenceTable
    events: EventLog  # the call's events close as one batch (kvd/cache/events.py)
    pages: PageEvents  # what follows each page published (kvd/cache/page_events.py)
    targets: list[tuple[Sequence, int]]
    published: list[int] = field(init=False)
    rebinds: list[list[Rebind]] = field(init=False)
    _next: int = 0  # the target being published

    def __post_init__(self) -> None:
        self.published = [0] * len(self.targets)
        self.rebinds = [[] for _ in self.targets]

    @property
    def done(self) -> bool:
        return self._next == len(self.targets)

    def step(self, seconds: float = STEP_SECONDS) -> bool:
        """Publishes pages for about ``seconds`` (at least one); True when the job is done."""
        deadline = time.perf_counter() + seconds
        while not self.done:
            seq, upto = self.targets[self._next]
            if self.sequences.find(seq.namespace, seq.seq_id) is not seq or seq.state is SequenceState.EVICTED:
                upto = 0  # it went away between steps: nothing of it is left to publish
            while seq.num_published < upto:
                batch = _batch_pages(deadline - time.perf_counter())
                count, rebind = self._publish_pages(seq, seq.num_published, min(upto, seq.num_published + batch))
                self.published[self._next] += count
                if rebind is not None:
                    self.rebinds[self._next].append(rebind)
                if time.perf_counter() > deadline:
                    break
            else:
                self._next += 1
                continue
            break
        if self.done:
            crashpoints.reached("publish-recorded")
            self.pages.submit()
        return self.done

    def steps(self) -> Iterator[None]:
        """``step`` until done, yielding between steps (the servicer lets other calls run
        there); what it indexes is one event batch, as for a call in one piece."""
        self.events.hold()
        try:
            while not self.step():
                yield None
        finally:
            self.events.end_hold()

    def run(self) -> list[PublishResult]:
        """Every step at once (in-process callers: tests, benchmarks)."""
        while not self.step(float("inf")):
            pass
        return self.results()

    def results(self) -> list[PublishResult]:
        return [
            PublishResult(seq.seq_id, published, rebinds)
            for (seq, _), published, rebinds in zip(self.targets, self.published, self.rebinds)
        ]

    def _publish_pages(self, seq: Sequence, start: int, stop: int) -> tuple[int, Rebind | None]:
        """Pages [start, stop) of the sequence, its first unpublished ones, in chain order:
        indexed in one batch up to the first whose key is indexed already, which is replaced
        by the equal page published earlier (dedup: the rebind) or, on a verified hash
        collision, published but left out of the index (a key taken inside the batch is
        looked up again at the next one). Returns the pages published and that rebind."""
        step = self.ns.page_size * TOKEN_BYTES
        chain, tokens, pages = seq.chain, seq.tokens, seq.pages
        parent_key, parent = (seq.keys[start - 1], pages[start - 1]) if start else (chain.root, None)
        contents: list[PageContent] = []
        places: list[ChainPlace] = []
        existing = None
        batch: set[bytes] = set()  # the batch's keys: a (forced) collision inside it waits for the next batch
        for i in range(start, stop):
            page_tokens = bytes(tokens[i * step : (i + 1) * step])
            local = chain.local_bytes(i)
            key = page_key(parent_key, i, page_tokens, local)
            local = chain.local_digest(i) if local else b""
            place = ChainPlace(self.ns, i, parent_key, seq.extra_keys)
            existing = self.index.lookup(key)
            if existing is not None or key in batch:
                break
            batch.add(key)
            contents.append(PageContent(pages[i], key, page_tokens, parent, local))
            places.append(place)
            parent_key, parent = key, pages[i]
        seq.keys += [content.key for content in contents]
        self.pool.publish_chain(contents, places)
        if existing is None:
            return len(contents), None
        seq.keys.append(key)
        page = pages[i]
        if existing.matches(page_tokens, parent, local):
            self.pool.acquire(existing.page)
            pages[i] = existing.page
            self.pool.release(page)
            return len(contents) + 1, Rebind(i, page, existing.page)
        self.pool.publish(page, PageContent(page, key, page_tokens, parent, local), place, indexed=False)
        return len(contents) + 1, None
