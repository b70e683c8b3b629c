"""Which pages this client may write: the private pages of its own live sequences.

A published page is shared by every engine on the host, so one stray write would corrupt
all of their KV; ``KVDClient.page`` hands out read-only views of every page not listed
here (engine_client/pages.py maps each extent once read-only, once read-write).

Private pages come from ``allocate_with_prefix``, ``extend`` and ``fork``, in position
order after the sequence's published pages. ``publish`` makes the first N of them
immutable (published, or replaced by an equal published page), in that order;
``release``, ``COMPLETED`` and eviction drop the rest.
"""

from __future__ import annotations

from collections import Counter


class PrivatePages:
    def __init__(self) -> None:
        self._by_seq: dict[tuple[int, str], list[int]] = {}  # (ns, seq_id) -> private pages in position order
        # Per namespace, the pages some live sequence of ours holds privately: a set, so a
        # 50K-token allocation (3,125 pages) is added and dropped in C. A page can be held
        # twice for a moment (an eviction notice arrives on a thread after its page was
        # handed out again): ``_again`` counts those extra holds.
        self._writable: dict[int, set[int]] = {}
        self._again: Counter[tuple[int, int]] = Counter()  # (ns, page)

    def add(self, ns: int, seq_id: str, pages: list[int]) -> None:
        self._by_seq.setdefault((ns, seq_id), []).extend(pages)
        held = self._writable.setdefault(ns, set())
        self._again.update((ns, page) for page in held.intersection(pages))
        held.update(pages)

    def published(self, ns: int, seq_id: str, count: int) -> None:
        """The sequence's first ``count`` private pages became immutable."""
        pages = self._by_seq.get((ns, seq_id), [])
        self._forget(ns, pages[:count])
        del pages[:count]

    def drop(self, ns: int, seq_id: str) -> None:
        """The sequence is gone (released, completed, evicted): none of its pages is ours."""
        self._forget(ns, self._by_seq.pop((ns, seq_id), []))

    def clear(self) -> None:
        self._by_seq.clear()
        self._writable.clear()
        self._again.clear()

    def writable(self, ns: int, page: int) -> bool:
        return page in self._writable.get(ns, ())

    def _forget(self, ns: int, pages: list[int]) -> None:
        if self._again:  # keep the pages another sequence still holds
            pages = [page for page in pages if not self._held_again(ns, page)]
        self._writable.get(ns, set()).difference_update(pages)

    def _held_again(self, ns: int, page: int) -> bool:
        """Drops one extra hold of the page; False when it had none."""
        key = (ns, page)
        extra = self._again.get(key, 0)
        if extra > 1:
            self._again[key] = extra - 1
        elif extra:
            del self._again[key]
        return extra > 0
