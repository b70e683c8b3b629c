"""`Keeps`: the prompts kvd keeps resident because their requests asked (`keep_seconds`),
pinned from the scheduler half's lookahead thread.

A request that asks to keep its prompt (`"kvd": {"keep_seconds": N}`,
gpu_worker/vllm/request_params.py) is handed here once it is done and what its workers
saved is published (`KVDSchedulerSide.finished`, or the workers' `finished_sending`): its
pages are all in kvd then, and while it ran its own kvd sequences held them anyway. The
lookahead thread (gpu_worker/vllm/lookahead.py, never vLLM's scheduler loop) takes the keeps
asked since its last turn and pins each prompt's full pages in every rank's namespace: a
kvd pin with a time to live of N seconds, keyed as the request's pages are (its LoRA
adapter and cache salt are extra keys of the pin). The pins belong to the scheduler half's
session and end with it: an engine that stops keeps nothing.

Budget. One engine's keeps hold at most `share` of the tenant's host budget (the session's
`host_bytes`; `keep_share` in kv_connector_extra_config, default 0.5), counted in distinct
pages over its live keeps, so that keeps never take the room new requests need. A keep
that would go beyond keeps the prompt's first pages that fit (none: it is refused), with a
warning that names the request; the request was served all the same. Counted: keeps
made, pages they pinned, keeps cut or refused for the budget (`take_counts`, the
connector's stats).

Refreshing. A prompt kept already (same pages, same extra keys: the same last page key)
at least as long as asked, give or take `REFRESH_SECONDS`, is not pinned again; a keep
that outlasts it pins the prompt anew and unpins the old pin: a prompt that every request
asks to keep holds one pin at a time.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from gpu_worker.vllm.kvd_link import KVDLink
from gpu_worker.vllm.plans import PromptKey

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0  # a keep this much shorter than the prompt's current one changes nothing
COUNTS = ("keeps", "kept_pages", "keeps_over_budget")


@dataclass(frozen=True)
class KeepAsk:
    """Keep `prompt`'s full pages (tokens and extra keys) resident for `seconds` from now."""

    req_id: str
    prompt: PromptKey
    seconds: float


@dataclass
class _Kept:
    """A prompt's live keep: its pins (one per namespace) and the page keys they hold."""

    pin_ids: list[int]
    keys: list[bytes]  # the link's namespace's keys of the pages pinned
    until: float  # time.monotonic()


class Keeps:
    def __init__(self, link: KVDLink, share: float = 0.5) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"keep_share must be a fraction of kvd's budget in [0, 1], got {share}")
        self.link = link
        self.share = share
        # the lookahead thread's alone:
        self._session = ""  # the session of the keeps below (they end with it)
        self._kept: dict[bytes, _Kept] = {}  # a prompt's last page key -> its keep
        self._held: Counter[bytes] = Counter()  # page key -> live keeps holding it
        self._ends: list[tuple[float, bytes]] = []  # (until, prompt) heap: the pins' expiry
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # under _lock: since `take_counts`

    def take_counts(self) -> dict[str, int]:
        """What keeps did since the last call (any thread)."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        return {name: counts[name] for name in COUNTS}

    def keep(self, asks: list[KeepAsk]) -> None:
        """Pins each asked prompt (the lookahead thread), within the budget."""
        self._forget_ended(time.monotonic())
        for ask in asks:
            keys = self.link.page_keys(ask.prompt.token_ids, ask.prompt.extra_keys)
            if keys:  # no session: nothing to keep (nor anything in kvd to keep)
                self._keep(ask, keys)

    def _keep(self, ask: KeepAsk, keys: list[bytes]) -> None:
        until = time.monotonic() + ask.seconds
        old = self._kept.get(keys[-1])
        if old is not None and old.until >= until - REFRESH_SECONDS:
            return
        page_size = self.link.namespace.layout.page_size

        def pin_every_rank(kvd, namespaces):
            page_bytes = self.link.namespace.layout.page_bytes * len(namespaces)
            fit = self._fitting(keys, old, int(self.share * kvd.host_bytes // page_bytes))
            if fit < len(keys):
                log.warning(
                    "kvd: request %s asks to keep %d pages of its prompt for %g s; this engine's keeps may hold "
                    "%d pages (keep_share %g of kvd's %d MiB budget): %s",
                    ask.req_id,
                    len(keys),
                    ask.seconds,
                    int(self.share * kvd.host_bytes // page_bytes),
                    self.share,
                    kvd.host_bytes >> 20,
                    f"its first {fit} pages are kept" if fit else "not kept",
                )
            if not fit:
                return fit, []
            tokens, extra_keys = ask.prompt.token_ids[: fit * page_size], ask.prompt.extra_keys
            return fit, [kvd.pin(ns, tokens, ttl=ask.seconds, extra_keys=extra_keys) for ns in namespaces]

        done = self.link.attempt_all(f"keep for request {ask.req_id}", pin_every_rank)
        if done is None:
            return
        fit, pins = done
        pinned = min((p.pinned_pages for p in pins), default=0)
        with self._lock:
            self._counts["keeps_over_budget"] += int(fit < len(keys))
            self._counts["keeps"] += int(pinned > 0)
            self._counts["kept_pages"] += sum(p.pinned_pages for p in pins)
        if old is not None:
            self._drop(keys[-1])
        if pinned:
            self._kept[keys[-1]] = _Kept([p.pin_id for p in pins], keys[:pinned], until)
            self._held.update(keys[:pinned])
            heapq.heappush(self._ends, (until, keys[-1]))
        elif pins:  # kvd holds none of the prompt's pages
            self._unpin([p.pin_id for p in pins])

    def _fitting(self, keys: list[bytes], old: _Kept | None, limit: int) -> int:
        """How many of the prompt's first pages the budget (`limit` pages held by keeps at
        once) leaves room for, beside the live keeps other than `old` (the prompt's own)."""
        replaced = set(old.keys) if old is not None else set()
        held = len(self._held) - sum(1 for k in replaced if self._held[k] == 1)
        fit = 0
        for key in keys:
            if self._held[key] == (1 if key in replaced else 0):  # no other keep holds the page
                held += 1
            if held > limit:
                break
            fit += 1
        return fit

    def _drop(self, prompt: bytes) -> None:
        """Unpins a prompt's keep that a longer one replaced."""
        old = self._kept.pop(prompt)
        self._unhold(old.keys)
        self._unpin(old.pin_ids)

    def _unpin(self, pin_ids: list[int]) -> None:
        self.link.attempt("unpin", lambda kvd, _: [kvd.unpin(p) for p in pin_ids])

    def _forget_ended(self, now: float) -> None:
        """Forgets keeps whose pins expired (kvd drops them by itself) or whose session ended."""
        if self.link.session != self._session:
            self._session = self.link.session
            self._kept, self._held, self._ends = {}, Counter(), []
        while self._ends and self._ends[0][0] <= now:
            until, prompt = heapq.heappop(self._ends)
            kept = self._kept.get(prompt)
            if kept is not None and kept.until == until:
                del self._kept[prompt]
                self._unhold(kept.keys)

    def _unhold(self, keys: list[bytes]) -> None:
        for key in keys:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
