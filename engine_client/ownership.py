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
        self._writable: Counter[tuple[int, int]] = Counter()  # (ns, page)

    def add(self, ns: int, seq_id: str, pages: list[int]) -> None:
        self._by_seq.setdefault((ns, seq_id), []).extend(pages)
        self._writable.update((ns, p) for p in pages)

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

    def writable(self, ns: int, page: int) -> bool:
        return (ns, page) in self._writable

    def _forget(self, ns: int, pages: list[int]) -> None:
        self._writable.subtract((ns, p) for p in pages)
        for p in pages:
            if self._writable[(ns, p)] <= 0:
                del self._writable[(ns, p)]
