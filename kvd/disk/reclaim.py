"""Which disk pages to free when a write finds the disk full: the policy's victims, among the
pages whose slots the refused pages can use.

The store (kvd/diskstore/store.py) cuts its file into chunks formatted for one page size each and
formats a chunk for another size only once all its slots are free (kvd/diskstore/slots.py). So a
victim of another size frees no slot a refused page can take, unless it empties its chunk.
``victims`` asks the policy (kvd/tiers/eviction.py) for its victims among the pages of the
refused size first; when those are too few, it empties whole chunks of other sizes, each
chosen by the policy's next victim among them, until the emptied chunks hold what is missing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

from kvd.diskstore.layout import DiskPage, SlotClass, chunk_of
from kvd.tiers.eviction import EvictionPolicy


def victims(
    policy: EvictionPolicy, on_disk: dict[Hashable, DiskPage], page_class: SlotClass, count: int, chunk_bytes: int
) -> list[Hashable]:
    """The keys of the pages to free so that ``count`` pages of ``page_class`` find slots;
    taken out of the policy, not out of ``on_disk``. Fewer when the disk cannot make room."""
    chosen = policy.victims(count, lambda key: on_disk[key].page_class == page_class)
    missing = count - len(chosen)
    if missing <= 0:
        return chosen
    per_chunk = page_class.slots_in(chunk_bytes)
    by_chunk: dict[int, list[Hashable]] = defaultdict(list)  # pages of other sizes, by chunk
    for key, page in on_disk.items():
        if page.page_class != page_class:
            by_chunk[chunk_of(page.slot)[0]].append(key)
    while missing > 0 and per_chunk > 0:
        oldest = policy.victims(1, lambda key: on_disk[key].page_class != page_class)
        if not oldest:
            break
        emptied = by_chunk.pop(chunk_of(on_disk[oldest[0]].slot)[0])
        for key in emptied:
            policy.forget(key)
        chosen += emptied
        missing -= per_chunk
    return chosen
