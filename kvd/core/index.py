"""Chained page keys and the prefix index of published full pages.

A page key hashes (parent key, page index, the page's token ids, the page's extra keys);
the chain starts at a per-request root that hashes the namespace root, the page size and
the request-wide extra keys (LoRA identity, cache salt). Every extra key is tagged with
its kind and length-prefixed, so a LoRA name can never collide with a cache salt or an
image hash. Raw prompt text is never hashed or stored; token ids are. The key functions
live in kvd/wire/keys.py, so that clients compute the keys kvd's events name.

The hash only narrows the search: a hit counts only when the stored page's token ids,
parent page and a digest of the local extra bytes equal the request's (``PageContent``), so a collision
costs a miss, never wrong KV.
"""

from __future__ import annotations

import array
import bisect
from dataclasses import dataclass, field

import numpy as np

from kvd.core.key_table import KeyTable
from kvd.core.page_columns import KEY_BYTES, PageColumns
from kvd.core.types import PageId, PageKey
from kvd.wire.codec import TOKEN_BYTES, token_array
from kvd.wire.enums import ExtraKind
from kvd.wire.keys import ChainSpec, chain_spec, page_key  # noqa: F401 - the core's key functions

_SMALL_SPAN_BYTES = 16 << 10  # token bytes of a run span compared as slices rather than with numpy


@dataclass(frozen=True, slots=True)  # slots: a large call makes thousands (kvd/cache/requests.py SequenceRequest)
class ExtraKey:
    """Something other than token ids that changes a page's KV.

    MULTIMODAL items cover tokens [offset, offset + length) and enter the key of every
    page they overlap, with their offset relative to that page. LORA and CACHE_SALT apply
    to the whole request and enter the chain root.
    """

    kind: ExtraKind
    value: bytes
    offset: int = 0
    length: int = 1


@dataclass(frozen=True, slots=True)  # slots: a publish makes one a page
class PageContent:
    """What a published page holds. An indexed page's is kept in its run (``_Run``) and built
    again when asked for (``PrefixIndex.content``); one out of the index, the pool keeps."""

    page: PageId
    key: PageKey
    tokens: bytes  # page_size little-endian int32 token ids
    parent: PageId | None  # the previous page of the chain; None for page 0
    local: bytes  # ChainSpec.local_digest of this page

    def matches(self, tokens: bytes, parent: PageId | None, local: bytes) -> bool:
        return self.parent == parent and self.tokens == tokens and self.local == local


@dataclass(frozen=True)
class Match:
    """What matching a request found: its longest run of leading full-page hits.

    ``pages[i]`` holds the request's page ``i`` (equal tokens, parent and local bytes),
    ``keys[i]`` is that page's key; both empty on a miss."""

    pages: list[PageId]
    keys: list[PageKey]

    def tokens(self, page_size: int) -> int:
        """The tokens the hit covers."""
        return len(self.pages) * page_size


@dataclass
class _Run:
    """Published pages that follow one another in one chain, with their token ids back to back.

    A page joins the run of its parent when the parent is that run's last page, so
    ``pages[q + 1]``'s parent is ``pages[q]`` and its chain page index is ``start + q + 1``.
    One hit on a run's page confirms the pages after it with one comparison of token
    bytes instead of one hash and one lookup per page.
    """

    start: int  # chain page index of pages[0]
    number: int  # the run's number in ``PrefixIndex._numbered``
    parent: PageId | None  # pages[0]'s parent
    page_bytes: int  # of one page's token ids
    # the page ids (uint32 on the wire): 4 B a page, where a list of ints took 8 B and the ints ~32 B
    pages: array.array = field(default_factory=lambda: array.array("I"))
    tokens: bytearray = field(default_factory=bytearray)  # the pages' token ids, in order
    local_positions: list[int] = field(default_factory=list)  # positions of pages with local bytes
    locals: list[bytes] = field(default_factory=list)  # their local digests (PageContent.local)

    def append(self, content: PageContent) -> None:
        if content.local:
            self.local_positions.append(len(self.pages))
            self.locals.append(content.local)
        self.pages.append(content.page)
        self.tokens += content.tokens

    def content(self, position: int, key: PageKey) -> PageContent:
        """What the page at ``position`` holds, ``key`` its key."""
        local_at = bisect.bisect_left(self.local_positions, position)
        has_local = local_at < len(self.local_positions) and self.local_positions[local_at] == position
        return PageContent(
            self.pages[position],
            key,
            bytes(self.tokens[position * self.page_bytes : (position + 1) * self.page_bytes]),
            self.pages[position - 1] if position else self.parent,
            self.locals[local_at] if has_local else b"",
        )

    def truncate(self, length: int) -> None:
        """Keeps the first ``length`` pages."""
        del self.pages[length:], self.tokens[length * self.page_bytes :]
        local_at = bisect.bisect_left(self.local_positions, length)
        del self.local_positions[local_at:], self.locals[local_at:]


class PrefixIndex:
    """Maps page keys to the published page holding that content; its content is in its run.

    Pages are also threaded into runs (``_Run``): matching a long prompt hashes and looks
    up one page per run it crosses and compares the rest of each run's tokens at once.
    Every page of a run is indexed, and no indexed page lacks its parent: ``remove`` names
    the pages that followed the one removed, and the pool removes them too.
    """

    def __init__(self, columns: PageColumns) -> None:
        """``columns``: the pool's page columns, where the index keeps each page's place in
        its run (``PageColumns.run``: its run's number << 32 | its position in the run, -1
        for none; 8 B a page, where a dict entry and a tuple took ~130 B)."""
        self._entries = KeyTable(columns)  # PageKey -> the slot of its page (columns.key holds the keys)
        self._columns = columns
        self._numbered: dict[int, _Run] = {}  # the runs that hold pages, by number
        self._next_run = 0
        # PageId -> the pages that start a run of their own under it (a chain that branches
        # off where its parent is not the last page of a run): with the runs, what follows
        # a removed page (``remove``)
        self._branches: dict[PageId, list[PageId]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PageKey) -> PageId | None:
        slot = self._entries.find(key)
        return None if slot < 0 else PageId(self._columns.page_at[slot])

    def lookup(self, key: PageKey) -> PageContent | None:
        page = self.get(key)
        return None if page is None else self.content(page)

    def content(self, page: PageId) -> PageContent | None:
        """What an indexed page holds, built from its run; None for a page of no run (one the
        pool is taking out of the index: kvd/core/pool.py keeps what it held)."""
        place = self._place(page)
        return None if place is None else place[0].content(place[1], self.key_of(page))

    def key_of(self, page: PageId) -> PageKey | None:
        """An indexed page's key; None as ``content``."""
        if self._packed(page) < 0:
            return None
        slot = self._columns.slot(page)
        return PageKey(bytes(self._columns.key_at[slot * KEY_BYTES : (slot + 1) * KEY_BYTES]))

    def insert(self, content: PageContent, page_index: int) -> None:
        """Indexes a published page, ``page_index`` pages from the start of its chain."""
        slot = self._columns.slot(content.page)
        assert self._columns.run_at[slot] < 0, f"page {content.page} indexed twice"
        self._columns.key_at[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] = content.key
        self._entries.add([slot])
        parent = self._place(content.parent) if content.parent is not None else None
        if parent is not None and parent[1] == len(parent[0].pages) - 1:
            run = parent[0]
        else:
            run = _Run(page_index, self._next_run, content.parent, len(content.tokens))
            self._numbered[self._next_run] = run
            self._next_run += 1
            if content.parent is not None:
                self._branches.setdefault(content.parent, []).append(content.page)
        assert run.start + len(run.pages) == page_index, (
            f"page {content.page} at chain index {page_index} joins a run ending at index "
            f"{run.start + len(run.pages) - 1}"
        )
        self._columns.run_at[slot] = run.number << 32 | len(run.pages)
        run.append(content)

    def insert_chain(self, contents: list[PageContent], page_index: int) -> None:
        """``insert`` for consecutive pages of one chain, parents first, the first
        ``page_index`` pages from the start of its chain: the rest extend its run."""
        self.insert(contents[0], page_index)
        run = self._place(contents[0].page)[0]
        first = len(run.pages)
        for content in contents[1:]:
            assert content.parent == run.pages[-1], f"page {content.page} does not follow page {run.pages[-1]}"
            run.append(content)
        slots = self._columns.slots(run.pages[first:])
        self._columns.run[slots] = (run.number << 32) + np.arange(first, len(run.pages))
        self._columns.key[slots] = np.frombuffer(
            b"".join(content.key for content in contents[1:]), self._columns.key.dtype
        )
        self._entries.add(slots)

    def remove(self, page: PageId, key: PageKey) -> list[PageContent]:
        """Takes the page's entry (under ``key``) out; returns what the indexed pages that
        followed it held (the rest of its run, the runs branching off it): no match reaches
        them any more, and their runs no longer hold them. Only the pool calls this
        (kvd/core/pool.py), and it takes those out too, so no indexed page lacks its parent; a
        chain's tail, removed first as eviction goes, returns none."""
        held = self._columns.page_at[self._entries.remove(key)]
        assert held == page, f"index held page {held} under the key of page {page}"
        orphans = []
        place = self._place(page)
        if place is not None:
            run, position = place
            cut = [run.content(q, self.key_of(p)) for q, p in enumerate(run.pages[position:], position)]
            parent = run.pages[position - 1] if position else run.parent
            if position == 0 and parent is not None:
                siblings = self._branches.get(parent, [])
                if page in siblings:  # absent when its parent left the index first
                    siblings.remove(page)
                    if not siblings:
                        del self._branches[parent]
            run.truncate(position)
            self._columns.run[self._columns.slots([content.page for content in cut])] = -1
            if not run.pages:
                del self._numbered[run.number]
            orphans += cut[1:]
        for branch in self._branches.pop(page, ()):
            orphans.append(self.content(branch))
        return orphans

    def match(self, chain: ChainSpec, tokens: bytes, page_bytes: int, full_pages: int) -> Match:
        """The longest run of leading full pages whose stored content equals the request's.

        ``page_bytes`` is the size of one page's token ids. Each step hashes and looks up
        one page (a hit needs equal tokens, parent and local bytes), then takes as many
        of the following pages of that page's run as carry the request's next tokens.
        """
        pages: list[PageId] = []
        keys: list[PageKey] = []
        parent_key, parent = chain.root, None
        local_pages = sorted(chain.page_local)
        i = 0
        while i < full_pages:
            page_tokens = tokens[i * page_bytes : (i + 1) * page_bytes]
            local = chain.local_bytes(i)
            page = self.get(page_key(parent_key, i, page_tokens, local))
            content = None if page is None else self.content(page)
            if content is None or not content.matches(page_tokens, parent, chain.local_digest(i) if local else b""):
                break  # a miss; on a hash collision too, never wrong KV
            pages.append(page)
            keys.append(content.key)
            i += 1
            # The run's next pages are hits as far as their tokens equal the request's, up to
            # the first page with local bytes on either side (those need the per-page check).
            local_at = bisect.bisect_left(local_pages, i)
            stop = min(full_pages, local_pages[local_at] if local_at < len(local_pages) else full_pages)
            followed, followed_keys = self._follow_run(page, tokens, i, stop, page_bytes)
            pages += followed
            keys += followed_keys
            i += len(followed)
            parent_key, parent = keys[-1], pages[-1]
        return Match(pages, keys)

    def _follow_run(
        self, page: PageId, tokens: bytes, i: int, stop: int, page_bytes: int
    ) -> tuple[list[PageId], list[PageKey]]:
        """Pages after ``page`` in its run that hold the request's pages [i, stop)."""
        place = self._place(page)
        if place is None or stop <= i:
            return [], []
        run, position = place
        first = position + 1
        last = min(len(run.pages), first + stop - i)
        run_local = bisect.bisect_left(run.local_positions, first)
        if run_local < len(run.local_positions):
            last = min(last, run.local_positions[run_local])
        if last <= first:
            return [], []
        span = last - first
        if (
            span * page_bytes <= _SMALL_SPAN_BYTES
            and tokens[i * page_bytes : (i + span) * page_bytes] == run.tokens[first * page_bytes : last * page_bytes]
        ):
            equal_pages = span  # a short span: comparing slices beats numpy's call overhead
        else:
            theirs = token_array(run.tokens)[first * page_bytes // TOKEN_BYTES : last * page_bytes // TOKEN_BYTES]
            ours = token_array(tokens)[i * page_bytes // TOKEN_BYTES : (i + span) * page_bytes // TOKEN_BYTES]
            differ = np.flatnonzero(theirs != ours)
            equal_pages = span if not differ.size else int(differ[0]) * 4 // page_bytes
        followed = run.pages[first : first + equal_pages]
        return followed.tolist(), self._columns.key[self._columns.slots(followed)].tolist()

    def run_problems(self) -> list[str]:
        """Broken run invariants, for kvd/cache/invariants.py: every run page is indexed under
        its key at its position, its run holding its token ids and local digest."""
        found = []
        c = self._columns
        placed = np.flatnonzero(c.run[: c.capacity] >= 0)
        for page, packed in zip(c.page[placed].tolist(), c.run[placed].tolist()):
            run, position = self._numbered.get(packed >> 32), packed & 0xFFFFFFFF
            if run is None:
                found.append(f"page {page} is mapped to run {packed >> 32}, which holds no pages")
                continue
            if position >= len(run.pages) or run.pages[position] != page:
                found.append(f"page {page} is mapped to position {position} of a run that holds other pages there")
                continue
            if self.get(self.key_of(page)) != page:
                found.append(f"run page {page} is not indexed under its key")
            elif len(run.tokens) != len(run.pages) * run.page_bytes:
                found.append(f"run page {page}'s run holds {len(run.tokens)} token bytes for {len(run.pages)} pages")
            elif len(run.locals) != len(run.local_positions):
                found.append(
                    f"run page {page}'s run holds {len(run.locals)} local digests, "
                    f"{len(run.local_positions)} positions with local bytes"
                )
        for parent, branches in self._branches.items():
            for page in branches:
                run, position = self._place(page) or (None, -1)
                if position != 0 or run.parent != parent:
                    found.append(
                        f"page {page} is recorded as a branch under page {parent} but does not start a run there"
                    )
        for run in self._numbered.values():
            missing = [p for q, p in enumerate(run.pages) if self._packed(p) != run.number << 32 | q]
            if missing:
                found.append(f"run starting at chain index {run.start} holds pages {missing} not mapped to it")
        return found

    def _place(self, page: PageId) -> tuple[_Run, int] | None:
        """The run ``page`` is threaded into and its position there; None for a page of none."""
        packed = self._packed(page)
        return None if packed < 0 else (self._numbered[packed >> 32], packed & 0xFFFFFFFF)

    def _packed(self, page: PageId) -> int:
        """The page's place in its run as ``PageColumns.run`` holds it; -1 for none (a page of
        no live extent too)."""
        try:
            return self._columns.run_at[self._columns.slot(page)]
        except KeyError:
            return -1

    def items(self):
        """(key, page) of every entry."""
        slots = self._entries.slots()
        return list(zip(self._columns.key[slots].tolist(), self._columns.page[slots].tolist()))
