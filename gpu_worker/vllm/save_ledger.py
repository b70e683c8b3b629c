"""`SaveLedger`: the kvd sequences a vLLM worker saves requests' blocks into, and how far each is published.

The worker half's saver (gpu_worker/vllm/saver.py) copies bytes, on its own thread, the
only one that uses this ledger; the ledger says where they go and when they count. Per
request it keeps the tokens the scheduler half's save plans (gpu_worker/vllm/plans.py
`SavePlan`) sent so far, and the request's kvd sequence in the worker's own session: its
pages (one per full block it knows), which of them were written, and how many are
published (hits count from the start, so a sequence publishes its written blocks in
order, from its first unpublished one).

A save goes in three steps, each the ledger's: `targets` names the pages that the plans
of the steps handed since the saver's last turn write (allocating the sequences of
requests new to this worker, then growing the others, one kvd call each); once their
bytes are complete, `written` records them; `publish` publishes every sequence's blocks
written in order, in one call, and `take_published` hands what it published to the
scheduler half (its KV events). A `SaveTarget` names the session of the sequence it
writes, so `written` may come after a kvd call that changed the session (a copy that
finished after the daemon restarted): a target whose sequence was released, or belongs
to a session that ended, is not recorded.

`finished` releases the sequences of requests that are done, in one call; their
published pages stay cached in kvd. After a daemon restart a request's sequence is
allocated again in the new session, for every token known by then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_client import ExtendItem, SequenceRequest
from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.plans import PromptKey, SavePlan


@dataclass
class _Sequence:
    """One request's kvd sequence in this worker's session."""

    session: str  # this worker's session that owns the sequence
    page_ids: list[int]  # one per full block it knows (the kvd sequence holds full blocks only)
    published: int  # blocks [0, published) are published (hits count from the start)
    written: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class SaveTarget:
    """What one request's save writes: its blocks `positions` (vLLM blocks `block_ids`,
    per KV-cache group) into pages `page_ids` of its kvd sequence in `session`."""

    req_id: str
    session: str
    positions: list[int]
    page_ids: list[int]
    block_ids: list[list[int]]  # per KV-cache group, one per position


class SaveLedger:
    def __init__(self, link: KVDLink) -> None:
        self.link = link
        self.page_size = link.namespace.layout.page_size
        self._known: dict[str, PromptKey] = {}  # per request: the tokens the plans sent so far
        self._sequences: dict[str, _Sequence] = {}
        self._published: dict[str, tuple[int, int]] = {}  # per request: blocks published since the last report

    def learn(self, plans: list[SavePlan]) -> None:
        """The tokens the plans send: a request's prompt with its first plan, then the
        tokens of the blocks generated since."""
        for plan in plans:
            if plan.prompt is not None:  # a list of the ledger's own, grown in place below
                self._known[plan.req_id] = PromptKey(list(plan.prompt.token_ids), plan.prompt.extra_keys)
            if plan.more_tokens and plan.req_id in self._known:
                self._known[plan.req_id].token_ids.extend(plan.more_tokens)

    def targets(self, plans: list[SavePlan]) -> list[SaveTarget]:
        """The plans' blocks that the requests' sequences hold and have not published yet,
        with their pages. Allocates sequences for requests that have none in the current
        session and grows those that hold fewer blocks than planned, in one call each; a
        request kvd cannot hold gets no target."""
        plans = [plan for plan in plans if plan.req_id in self._known]
        self._allocate([plan.req_id for plan in plans if not self._has_sequence(plan.req_id)])
        plans = [plan for plan in plans if self._has_sequence(plan.req_id)]
        self._extend([p.req_id for p in plans if max(p.positions) >= len(self._sequences[p.req_id].page_ids)])
        targets = []
        for plan in plans:
            seq = self._sequences[plan.req_id]
            todo = [i for i, p in enumerate(plan.positions) if seq.published <= p < len(seq.page_ids)]
            if todo:
                positions = [plan.positions[i] for i in todo]
                targets.append(
                    SaveTarget(
                        plan.req_id,
                        seq.session,
                        positions,
                        [seq.page_ids[p] for p in positions],
                        [[blocks[i] for i in todo] for blocks in plan.block_ids],
                    )
                )
        return targets

    def written(self, target: SaveTarget) -> None:
        """The target's bytes are complete; recorded unless its sequence went meanwhile."""
        seq = self._sequences.get(target.req_id)
        if seq is not None and seq.session == target.session:
            seq.written.update(target.positions)

    def publish(self, req_ids: list[str]) -> None:
        """Publishes each sequence's blocks written so far in order from its first
        unpublished one, all in one call."""
        ends = {}
        for req_id in req_ids:
            seq = self._sequences[req_id]
            end = seq.published
            while end in seq.written:
                end += 1
            if end > seq.published and seq.session == self.link.session:
                ends[req_id] = end
        if not ends:
            return
        num_tokens = {self.link.seq_id(r): end * self.page_size for r, end in ends.items()}
        if self.link.attempt("publish", lambda kvd, ns: kvd.publish(ns, list(num_tokens), num_tokens)) is None:
            return
        for req_id, end in ends.items():
            seq = self._sequences[req_id]
            start = self._published.get(req_id, (seq.published, 0))[0]
            self._published[req_id] = (start, end)
            seq.published = end

    def take_published(self) -> dict[str, tuple[int, int]]:
        """Per request, the blocks [start, end) published since the last call."""
        published, self._published = self._published, {}
        return published

    def finished(self, req_ids: set[str]) -> None:
        """The requests are done: release their sequences (published pages stay cached)."""
        for req_id in req_ids:
            self._known.pop(req_id, None)
        live = [
            self.link.seq_id(r)
            for r in req_ids
            if (seq := self._sequences.pop(r, None)) is not None and seq.session == self.link.session
        ]
        if live:
            self.link.attempt("release", lambda kvd, ns: kvd.release(ns, live))

    def _has_sequence(self, req_id: str) -> bool:
        """Whether the request has a kvd sequence in this worker's current session."""
        seq = self._sequences.get(req_id)
        return seq is not None and seq.session == self.link.session

    def _allocate(self, req_ids: list[str]) -> None:
        """Allocates the requests' kvd sequences (again, for every token known by then,
        after a daemon restart), in one call; none when kvd cannot hold them all."""
        if not req_ids:
            return
        for req_id in req_ids:
            self._sequences.pop(req_id, None)
        requests = [
            SequenceRequest(self.link.seq_id(r), self._known[r].token_ids, self._known[r].extra_keys) for r in req_ids
        ]
        found = self.link.attempt("allocate", lambda kvd, ns: kvd.allocate_with_prefix(ns, requests))
        for req_id, allocation in zip(req_ids, found or ()):
            self._sequences[req_id] = _Sequence(
                self.link.session, allocation.pages, published=len(allocation.shared_pages)
            )

    def _extend(self, req_ids: list[str]) -> None:
        """Grows the requests' kvd sequences by the full blocks the plans sent since they were
        allocated (generated tokens), in one call; none when kvd cannot grow them all."""
        if not req_ids:
            return
        items = []
        for req_id in req_ids:
            tokens = self._known[req_id].token_ids[len(self._sequences[req_id].page_ids) * self.page_size :]
            items.append(ExtendItem(self.link.seq_id(req_id), len(tokens), token_ids=tokens))
        grown = self.link.attempt("extend", lambda kvd, ns: kvd.extend_batch(ns, items))
        for req_id, result in zip(req_ids, grown or ()):
            self._sequences[req_id].page_ids += result.new_pages
