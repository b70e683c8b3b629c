"""Prewarms: a router's (or an application's) promotion of prompts' pages from the tiers
below host memory (the disk, kvd/disk/tier.py; the remote store, kvd/remote/tier.py) before
their requests arrive, and the pins that cover pages still on their way
(``KVCacheManager.prewarm`` and ``pin``, kvd/cache/manager.py).

A prewarm matches each prompt locally (what is resident now) and promotes the full pages
past the hit, as many as the namespace spares (``Room.spare``: free pages, budget not made
into extents, its own cached pages but the prompt's hit) less what prewarms of the namespace
already have queued or in flight; the rest is over the budget, said at once, never fetched.
The prompts of a call come ``PROMPTS_PER_STEP`` at a time, and start in the call when nothing
is queued and the caps below allow (the disk answers from its index: a prompt it does not hold is not found
at once); the others are queued, and ``step``, which the daemon runs on its loop while
``busy`` (kvd/server/prewarming.py), starts them. Each goes through the tiers' one fetch
machinery (``Tiers.missed``, kvd/tiers/fetches.py: the same checks, publication and KV events
as any promotion, pages granted by ``Room.grant_spare``, which never evicts a page a sequence
or pin holds), and ``step`` watches the fetches end (``Tiers.fetching``). Prewarms stay below
engines' calls:
- the pages prewarms hold while their fetches run (the hit held, the pages landing) stay
  within ``MAX_PAGES_IN_FLIGHT`` and within half of what the namespace spares, so an
  engine's allocation meanwhile finds room (a prompt alone always starts);
- a step starts or settles at most ``PROMPTS_PER_STEP`` prompts, so a flood of prewarms
  costs each turn of the loop a bounded amount of work and each tier's reader a bounded
  backlog;
- an engine's own lookup of a prompt starts its fetch at once, never behind a prewarm.

When a prompt's fetch ends, the prompt is matched again: pages landed extend the hit, and
the tiers are asked again (the next tier holds what the disk did not), until no tier may
bring more (or ``MAX_ROUNDS``); then its counters settle: promoted (pages resident now that
were not when it started) and not found (the rest). A prewarm for a pin then extends the
pin with the pages that landed (``PinTable.extend``), if the pin is still held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvd.cache.pins import PinTable
from kvd.cache.requests import TOKEN_BYTES, PreparedRequest
from kvd.cache.room import Room
from kvd.core.index import Match
from kvd.core.namespaces import Namespace
from kvd.core.types import NamespaceId, PinId
from kvd.tiers.tier import Miss, Tiers

MAX_PAGES_IN_FLIGHT = 1024  # pages of prewarms started and not settled, all namespaces together
PROMPTS_PER_STEP = 16  # prompts a step starts or settles: a turn of the loop stays short
MAX_ROUNDS = 4  # times a prompt asks the tiers: the disk, the store, one more for a fetch cut short


@dataclass(frozen=True)
class PrewarmResult:
    """What a prewarm of one prompt found and started, in tokens of its full pages."""

    requested_tokens: int  # its full pages' (a partial tail page is never cached)
    resident_tokens: int  # already in host memory
    pending_tokens: int  # queued for a promotion, or being promoted
    over_budget_tokens: int  # past what the tenant's budget spares: not promoted
    not_found_tokens: int  # on no tier, known at once (the disk answers from its index)

    @property
    def partial(self) -> bool:
        return self.over_budget_tokens > 0


@dataclass
class PrewarmCounters:
    """The prewarms of one cache (``kvd stats`` ``prewarm``, ``kvd_prewarm_*``), in tokens."""

    prompts: int = 0
    requested_tokens: int = 0
    resident_tokens: int = 0
    promoted_tokens: int = 0
    not_found_tokens: int = 0
    over_budget_tokens: int = 0
    pending_tokens: int = 0  # gauge: queued or in flight now


@dataclass
class _Prewarm:
    """One prompt's pages on their way: ``take`` pages past the ``start`` hit."""

    ns: Namespace
    prepared: PreparedRequest  # its tokens cut to the pages it may take
    start: int  # pages resident when the prewarm came
    take: int
    pin: PinId | None
    miss: Miss | None = None  # the fetch asked for last; None while queued
    rounds: int = 0


class Prewarms:
    """The prewarms of one cache: queued, in flight, and their counters."""

    def __init__(
        self, room: Room, tiers: Tiers, pins: PinTable, match: Callable[[Namespace, PreparedRequest], Match]
    ) -> None:
        """``match``: the cache's matching (``KVCacheManager.match_prefix``)."""
        self.room = room
        self.tiers = tiers
        self.pins = pins
        self.match = match
        self.counters = PrewarmCounters()
        self._queued: deque[_Prewarm] = deque()
        self._flying: list[_Prewarm] = []
        self._pages: dict[NamespaceId, int] = {}  # pages queued or in flight, by namespace

    @property
    def busy(self) -> bool:
        """Whether ``step`` has anything to do."""
        return bool(self._queued or self._flying)

    def request(self, ns: Namespace, prompts: list[PreparedRequest], pin: PinId | None = None) -> list[PrewarmResult]:
        """The promotion of each prompt's full pages past its local hit, within the budget: the
        first ``PROMPTS_PER_STEP`` started at once when the caps allow (a tier that knows at
        once it holds none of them, the disk, makes them not found at once), the rest queued
        (``KVCacheManager.prewarm_parts`` asks for that many at a time)."""
        return [self._request(ns, p, pin, n < PROMPTS_PER_STEP) for n, p in enumerate(prompts)]

    def _request(self, ns: Namespace, p: PreparedRequest, pin: PinId | None, may_start: bool) -> PrewarmResult:
        size = ns.page_size
        full = p.num_tokens // size
        found = self.match(ns, p)
        hit = len(found.pages)
        take = max(0, min(full - hit, self.room.spare(ns, found.pages) - self._pages.get(ns.id, 0)))
        over = full - hit - take
        c = self.counters
        c.prompts += 1
        c.requested_tokens += full * size
        c.resident_tokens += hit * size
        c.over_budget_tokens += over * size
        not_found = 0
        if take:
            cut = p.tokens[: (hit + take) * size * TOKEN_BYTES]
            w = _Prewarm(ns, PreparedRequest(p.request, cut, len(cut) // TOKEN_BYTES, p.chain), hit, take, pin)
            self._pages[ns.id] = self._pages.get(ns.id, 0) + take
            c.pending_tokens += take * size
            if not may_start or self._queued or not self._may_start(w):
                self._queued.append(w)
            elif not self._start(w, found):
                not_found = take * size
        return PrewarmResult(full * size, hit * size, take * size - not_found, over * size, not_found)

    def step(self) -> None:
        """Settles or continues prewarms whose fetches ended, then starts queued ones within the caps."""
        budget = PROMPTS_PER_STEP
        for w in list(self._flying):
            if budget and not self.tiers.fetching(w.miss):
                budget -= 1
                self._flying.remove(w)
                self._start(w, self.match(w.ns, w.prepared))
        while budget and self._queued and self._may_start(self._queued[0]):
            budget -= 1
            w = self._queued.popleft()
            self._start(w, self.match(w.ns, w.prepared))

    def _may_start(self, w: _Prewarm) -> bool:
        """Whether a prompt may start now: the pages prewarms hold while their fetches run (the
        hit held, the pages landing) stay within ``MAX_PAGES_IN_FLIGHT`` and within half of
        what the namespace would spare without them, the other half left to engines' calls.
        A prompt alone always starts (its pages were within the budget when it came)."""
        if not self._flying:
            return True
        need = w.start + w.take
        held_here = sum(x.start + x.take for x in self._flying if x.ns.id == w.ns.id)
        return (
            sum(x.start + x.take for x in self._flying) + need <= MAX_PAGES_IN_FLIGHT
            and held_here + need <= (self.room.spare(w.ns) + held_here) // 2
        )

    def _start(self, w: _Prewarm, found: Match) -> bool:
        """Asks the tiers for the prompt's pages past ``found``, its hit now; settles it when
        none may come. Returns whether a fetch is in flight."""
        if w.rounds < MAX_ROUNDS and len(found.pages) < w.start + w.take:
            w.rounds += 1
            r = w.prepared.request
            w.miss = Miss(w.ns, w.prepared.chain, r.extra_keys, w.prepared.tokens, found.pages, found.keys)
            if self.tiers.missed(w.miss):
                self._flying.append(w)
                return True
        self._settle(w, found)
        return False

    def _settle(self, w: _Prewarm, found: Match) -> None:
        size = w.ns.page_size
        promoted = min(w.take, max(0, len(found.pages) - w.start))
        c = self.counters
        c.promoted_tokens += promoted * size
        c.not_found_tokens += (w.take - promoted) * size
        c.pending_tokens -= w.take * size
        self._pages[w.ns.id] -= w.take
        if w.pin is not None:
            self.pins.extend(w.pin, found.pages)
