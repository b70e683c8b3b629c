"""`Lookahead`: the scheduler half's kvd calls, made on a thread of their own, so that
vLLM's scheduler loop never waits for kvd.

vLLM announces each request as it arrives (`on_new_request`); its prompt goes to this
thread at once (`ask`). The thread takes every prompt asked since its last turn and, in
one call per namespace (per tensor-parallel rank), looks them all up, then holds each
one's hit in a kvd sequence of the link's session (`allocate_with_prefix` of the hit's
tokens, again one call per namespace): a held page cannot be evicted, so what is offered
is what gets loaded. With the holds it asks which extents hold their pages (one
`DescribeExtents` per namespace): the load plan names them, so a worker that has not
mapped one yet maps it without a kvd call (gpu_worker/vllm/worker.py). vLLM asks for
the hit (`get_num_new_matched_tokens`) right after the request arrives and at each step
until it is scheduled: `answer` returns the `Hold`, or None while the thread is still
at it (vLLM then asks again next step). The scheduler loop reads memory; it makes no
call. While vLLM has nothing else to run, `answer` may wait a few milliseconds for the
thread (`wait`): vLLM's engine loop would otherwise spin empty steps, two processes busy
that starve the daemon and this thread of the CPU they need to answer.

A hold is not offered any more (`answer` forgets it and asks again) once
- its session ended: the daemon restarted or stopped answering, and the pages went
  with the session (page ids of another daemon instance mean nothing);
- kvd removed one of its pages (the audit dropped a corrupted page), heard on kvd's
  event stream (gpu_worker/vllm/removal_feed.py `RemovalFeed`). Evictions cannot take a
  held page.
A hold vLLM allocated blocks for (`claim`) is the request's load; `usable_blocks` says
how many of its blocks are still there (before the first page kvd removed since), so the
load plan leaves the rest out.

Holds are let go (`let_go`) a batch per turn: one `release` per namespace for every
request that vLLM scheduled without a load, that finished or that was aborted since.
Holds asked at arrival and not yet claimed are at most `max_unclaimed`: past that a
request is asked when vLLM first asks about it (it is about to be scheduled), so a long
queue does not pin a long list of cached pages.

The prompts that finished requests asked to keep resident (`keep`, their `keep_seconds`)
are pinned with the thread's next turn, after its lookups (`Keeps`, gpu_worker/vllm/keeps.py).

When kvd cannot answer (not running, hung, refusing) a prompt gets an empty hold: a
miss. An answer that takes longer than `patience` seconds (by default the link's call
timeout: one call's worth; the connector's `lookup_patience_seconds`) is given up (an
empty hold; the hold, should it come, is let go), so a slow daemon never delays a request
longer than that, and the requests running meanwhile not at all. Each request kvd gave
no answer for (its lookup or hold call failed, or the patience ran out) is logged (a
warning) and counted (`take_unanswered`, vLLM's `vllm:kvd_lookups_unanswered`).
While kvd fetches more of a prompt from its remote store, the thread asks again every
`remote_poll` seconds and `answer` stays None, as long as the fetch lasts.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_client import SequenceRequest
from gpu_worker.vllm.keeps import KeepAsk, Keeps
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.plans import ExtentRef
from gpu_worker.vllm.removal_feed import RemovalFeed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hold:
    """A prompt's hit, held in kvd sequence `seq_id` of `session` in each rank's namespace.

    `pages_by_rank[r]` are rank r's pages of the prompt's first blocks, as many blocks as
    every rank holds; `keys_by_rank[r]` are their kvd keys in rank r's namespace and
    `extents_by_rank[r]` the extents that hold them (for workers that have not mapped
    them yet). A hold of no pages (no session) is a miss."""

    seq_id: str = ""
    session: str = ""
    instance: str = ""
    pages_by_rank: tuple[list[int], ...] = ()
    keys_by_rank: tuple[list[bytes], ...] = ()
    extents_by_rank: tuple[list[ExtentRef], ...] = ()

    @property
    def blocks(self) -> int:
        return len(self.pages_by_rank[0]) if self.pages_by_rank else 0


MISS = Hold()


def _holding(extents: list[ExtentRef], pages: list[int]) -> list[ExtentRef]:
    """The extents that hold any of the pages."""
    return [e for e in extents if any(e.first_page <= p < e.first_page + e.num_pages for p in pages)]


class Lookahead:
    def __init__(
        self,
        link: KVDLink,
        block_size: int,
        removal_listeners: list[Callable[[list[bytes]], None]] = (),
        max_unclaimed: int = 256,
        patience: float | None = None,
        remote_poll: float = 0.01,
        keep_share: float = 0.5,
    ) -> None:
        self.link = link
        self.keeps = Keeps(link, keep_share)  # the thread's
        self.block_size = block_size
        self.max_unclaimed = max_unclaimed
        self.patience = link.call_timeout if patience is None else patience
        self.remote_poll = remote_poll
        self._feed = RemovalFeed(link, [self._removed, *removal_listeners])
        lock = threading.RLock()
        self._lock = threading.Condition(lock)  # notified when there is work for the thread
        self._landed = threading.Condition(lock)  # notified when the thread's answers land
        # all below under _lock
        self._asked: dict[str, tuple[SequenceRequest, float]] = {}  # not taken by the thread yet: (wanted, since)
        self._busy: dict[str, float] = {}  # the thread is at these (since)
        self._remote: dict[str, tuple[SequenceRequest, float]] = {}  # kvd fetches more of them: asked again
        self._holds: dict[str, Hold] = {}
        self._claimed: set[str] = set()
        self._stale: dict[str, int] = {}  # holds with a page kvd removed -> the first such block
        self._holders: dict[bytes, set[tuple[str, int]]] = {}  # kvd key -> (request, block) of holds of its page
        self._abandoned: set[str] = set()  # let go while the thread was at them
        self._let_go: list[Hold] = []  # to release with the thread's next turn
        self._keep: list[KeepAsk] = []  # prompts to keep, with the thread's next turn
        self._unanswered = 0  # requests kvd gave no answer for, since `take_unanswered` last ran
        self._closing = False
        self._serial = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvd-lookahead", daemon=True)
        self._thread.start()

    # ---- the scheduler's side (vLLM's scheduler thread) ----------------------------------

    def ask(self, req_id: str, wanted: SequenceRequest, speculative: bool = False) -> None:
        """Look the prompt up and hold its hit (unless asked already). A `speculative` ask (a
        request just arrived) is dropped while `max_unclaimed` holds wait for vLLM."""
        with self._lock:
            if req_id in self._holds or req_id in self._asked or req_id in self._busy or req_id in self._remote:
                return
            if speculative and self._unclaimed() >= self.max_unclaimed:
                return
            self._asked[req_id] = (wanted, time.monotonic())
            self._lock.notify()

    def answer(self, req_id: str, wanted: SequenceRequest, wait: float = 0.0) -> Hold | None:
        """The prompt's hold, MISS when kvd cannot serve it, None while the thread is at it
        (asked now if it was not) after waiting up to `wait` seconds for it."""
        deadline = time.monotonic() + wait
        with self._lock:
            while (hold := self._answer(req_id, wanted)) is None and (left := deadline - time.monotonic()) > 0:
                self._landed.wait(left)
        if hold is None:
            # vLLM's engine loop spins while a request waits for its answer (it has work),
            # and a spinning thread keeps the GIL for the whole switch interval (5 ms) each
            # time this thread wants it back from a kvd call: ~10 such waits made a 16K-token
            # hit's lookup and hold 45 ms instead of 5. Let the thread run now.
            time.sleep(0)
        return hold

    def _answer(self, req_id: str, wanted: SequenceRequest) -> Hold | None:
        """`answer` without waiting; under the lock."""
        hold = self._holds.get(req_id)
        if hold is not None and hold.session and (req_id in self._stale or hold.session != self.link.session):
            self._forget(req_id)
            hold = None
        if hold is not None:
            return hold
        if req_id in self._remote:
            return None
        since = self._asked[req_id][1] if req_id in self._asked else self._busy.get(req_id)
        if since is None:
            self._asked[req_id] = (wanted, time.monotonic())
            self._lock.notify()
            return None
        if time.monotonic() - since > self.patience:  # give up: computed without kvd
            if self._asked.pop(req_id, None) is None:
                self._abandoned.add(req_id)
            self._holds[req_id] = MISS
            self._unanswered += 1
            log.warning("kvd gave no answer for request %s in %.1f s: computed without kvd", req_id, self.patience)
            return MISS
        return None

    def claim(self, req_id: str) -> Hold:
        """vLLM allocated blocks to load the request's hold into: it stays until `let_go`."""
        with self._lock:
            self._claimed.add(req_id)
            return self._holds.get(req_id, MISS)

    def usable_blocks(self, req_id: str) -> int:
        """The blocks of the request's hold still there: those before the first page kvd
        removed since it was taken; none once its session ended."""
        with self._lock:
            hold = self._holds.get(req_id, MISS)
            if hold.session != self.link.session:
                return 0
            return min(hold.blocks, self._stale.get(req_id, hold.blocks))

    def let_go(self, req_id: str) -> None:
        """The request needs no hold (any more): released with the thread's next turn."""
        with self._lock:
            self._asked.pop(req_id, None)
            self._remote.pop(req_id, None)
            if req_id in self._busy:
                self._abandoned.add(req_id)
            self._forget(req_id)

    def keep(self, ask: KeepAsk) -> None:
        """Keep the prompt resident as the request asked (`Keeps`), with the thread's next turn."""
        with self._lock:
            self._keep.append(ask)
            self._lock.notify()

    def take_unanswered(self) -> int:
        """How many requests kvd gave no answer for (computed without kvd) since the last call."""
        with self._lock:
            unanswered, self._unanswered = self._unanswered, 0
            return unanswered

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout=self.link.connect_timeout + 2 * self.link.call_timeout)
        self._feed.close()

    def _unclaimed(self) -> int:
        return len(self._holds) + len(self._asked) + len(self._busy) + len(self._remote) - len(self._claimed)

    def _forget(self, req_id: str) -> None:
        hold = self._holds.pop(req_id, None)
        self._claimed.discard(req_id)
        self._stale.pop(req_id, None)
        if hold is not None and hold.session:
            for keys in hold.keys_by_rank:
                for block, key in enumerate(keys):
                    holders = self._holders.get(key)
                    if holders is not None:
                        holders.discard((req_id, block))
                        if not holders:
                            del self._holders[key]
            self._let_go.append(hold)
            self._lock.notify()

    def _removed(self, keys: list[bytes]) -> None:
        """kvd removed these pages (the feed's thread): holds of them are stale."""
        with self._lock:
            for key in keys:
                for req_id, block in self._holders.pop(key, ()):
                    self._stale[req_id] = min(block, self._stale.get(req_id, block))

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        self._feed.follow()  # connects: the first requests find a session
        while True:
            with self._lock:
                if not (self._asked or self._let_go or self._keep or self._closing):
                    self._lock.wait(self.remote_poll if self._remote else 0.5)
                if self._closing:
                    return
                asked = {r: wanted for r, (wanted, _) in self._asked.items()}
                self._busy.update((r, since) for r, (_, since) in self._asked.items())
                for req_id, (wanted, _) in self._remote.items():  # patience counts each call
                    asked[req_id] = wanted
                    self._busy[req_id] = time.monotonic()
                self._asked, self._remote = {}, {}
                let_go, self._let_go = self._let_go, []
                keep, self._keep = self._keep, []
            self._feed.follow()
            self._release(let_go)
            if asked:
                start = time.monotonic()
                self._look_up(asked)
                log.debug("kvd lookahead: %d prompts in %.1f ms", len(asked), (time.monotonic() - start) * 1000)
            if keep:
                self.keeps.keep(keep)

    def _release(self, holds: list[Hold]) -> None:
        """One `release` per namespace for the holds of the current session (those of an
        ended session ended with it)."""
        seq_ids = [h.seq_id for h in holds if h.session == self.link.session]
        if seq_ids:
            self.link.attempt_all("release", lambda kvd, namespaces: [kvd.release(ns, seq_ids) for ns in namespaces])

    def _look_up(self, asked: dict[str, SequenceRequest]) -> None:
        """Looks the prompts up in every rank's namespace, then holds the hits every rank has."""
        wanted = list(asked.values())
        by_rank = self.link.attempt_all("lookup", lambda kvd, namespaces: [kvd.lookup(ns, wanted) for ns in namespaces])
        answers: dict[str, Hold] = {}
        remote: dict[str, SequenceRequest] = {}
        hits: dict[str, SequenceRequest] = {}
        unanswered = set() if by_rank else set(asked)  # the lookup call failed
        for i, (req_id, w) in enumerate(asked.items()):
            found = [rank[i] for rank in by_rank] if by_rank else []
            hit = min((r.hit_tokens for r in found), default=0) // self.block_size * self.block_size
            if any(r.remote_pending_tokens for r in found):
                remote[req_id] = w
            elif hit:
                seq_id = self.link.seq_id(f"{req_id}#{next(self._serial)}")
                hits[req_id] = SequenceRequest(seq_id, w.token_ids[:hit], w.extra_keys)
            else:
                answers[req_id] = MISS
        held = self._hold(hits)
        if held is None:  # the hold call failed
            unanswered.update(hits)
            held = dict.fromkeys(hits, MISS)
        answers.update(held)
        with self._lock:
            self._unanswered += len(unanswered - self._abandoned)  # abandoned: given up on (counted) or let go
            for req_id, w in remote.items():
                since = self._busy.pop(req_id)
                if req_id not in self._abandoned:
                    self._remote[req_id] = (w, since)
            for req_id, hold in answers.items():
                self._busy.pop(req_id, None)
                if req_id in self._abandoned or req_id in self._holds:  # let go, or given up on, meanwhile
                    if hold.session:
                        self._let_go.append(hold)
                    continue
                self._holds[req_id] = hold
                for keys in hold.keys_by_rank:
                    for block, key in enumerate(keys):
                        self._holders.setdefault(key, set()).add((req_id, block))
            self._abandoned -= set(asked)
            self._landed.notify_all()

    def _hold(self, hits: dict[str, SequenceRequest]) -> dict[str, Hold] | None:
        """Holds each hit in every rank's namespace, one call a rank (all ranks or none: a
        rank that refuses lets the others' holds go), as far as every rank still has it;
        None when kvd did not hold them."""
        if not hits:
            return {}
        requests = list(hits.values())
        held: list[int] = []

        def hold_every_rank(kvd, namespaces):
            by_rank = []
            for ns in namespaces:
                by_rank.append(kvd.allocate_with_prefix(ns, requests))
                held.append(ns)
            extents = [[ExtentRef(*e) for e in kvd.describe_extents(ns)] for ns in namespaces]
            holds = []
            for i, request in enumerate(requests):
                pages = tuple(rank[i].shared_pages[: min(len(r[i].shared_pages) for r in by_rank)] for rank in by_rank)
                tokens = request.token_ids[: len(pages[0]) * self.block_size]
                keys = tuple(kvd.page_keys(ns, tokens, request.extra_keys) for ns in namespaces)
                holding = tuple(_holding(of_rank, p) for of_rank, p in zip(extents, pages))
                holds.append(Hold(request.seq_id, kvd.session, kvd.daemon_instance, pages, keys, holding))
            return holds

        holds = self.link.attempt_all("hold", hold_every_rank)
        if holds is None:
            if held:
                seq_ids = [r.seq_id for r in requests]
                self.link.attempt_all("release", lambda kvd, _: [kvd.release(ns, seq_ids) for ns in held])
            return None
        return dict(zip(hits, holds))
