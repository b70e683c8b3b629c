"""Publishing: a sequence's full private pages become immutable, indexed and shareable.

A 50K-token prompt of 16-token pages is 3,125 pages, ~7 µs each (key, index entry, page
state, metadata record): ~22 ms. Done in one piece it holds the event loop that long and
every engine's calls wait behind it. A ``PublishJob`` is validated whole first (by the
manager: a refused publish changes nothing), then publishes in ``step``s of a bounded
time, and the servicer lets the loop serve other calls between them.

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
                rebind = self._publish_page(seq, seq.num_published)
                self.published[self._next] += 1
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

    def _publish_page(self, seq: Sequence, i: int) -> Rebind | None:
        """Page ``i``, the sequence's first unpublished one: indexed, or replaced by an equal
        page published earlier (dedup: the rebind)."""
        step = self.ns.page_size * TOKEN_BYTES
        page = seq.pages[i]
        page_tokens = bytes(seq.tokens[i * step : (i + 1) * step])
        local = seq.chain.local_bytes(i)
        parent_key, parent = (seq.keys[i - 1], seq.pages[i - 1]) if i else (seq.chain.root, None)
        key = page_key(parent_key, i, page_tokens, local)
        seq.keys.append(key)
        local = seq.chain.local_digest(i)
        existing = self.index.lookup(key)
        if existing is not None and existing.matches(page_tokens, parent, local):
            self.pool.acquire(existing.page)
            seq.pages[i] = existing.page
            self.pool.release(page)
            return Rebind(i, page, existing.page)
        # On a (verified) hash collision the page is published but left out of the index.
        content = PageContent(page, key, page_tokens, parent, local)
        self.pool.publish(page, content, ChainPlace(self.ns, i, parent_key, seq.extra_keys), indexed=existing is None)
        return None
