"""`BlockEvents`: the vLLM KV events of the connector's scheduler half.

vLLM publishes what the connector's `take_events` returns beside its own KV events, for
KV-aware routers. When the workers report blocks they published (each step's
`KVDWorkerMetadata`), `stored` makes a `BlockStored` for them, keyed by vLLM's own block
hashes so that routers match them to vLLM's other events.

With removals tracked (vLLM's KV events on), `StoredBlocks` also keeps the kvd key → vLLM
hash of every block reported stored (kvd keys computed locally, `KVDLink.page_keys`), so
that when kvd later evicts or drops such a page (heard on kvd's event stream by
gpu_worker/vllm/removal_feed.py, whose thread calls `removed`), `take` adds
`BlockRemoved` for the same vLLM hash. Keys it never reported (pages of other processes,
pages it only loaded) are ignored. At most `max_tracked` keys are remembered, the oldest
forgotten first.

A request's kvd keys are a chain, each block's key made from its parent's: its
`KeyChain` (kept with the request by gpu_worker/vllm/scheduler.py) says how far they were
computed, so a long decode that publishes its generated blocks a few at a time hashes
each block once, not its whole prefix each time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from engine_client import ExtraKey
from gpu_worker.vllm.kvd_link import KVDLink

MEDIUM = "kvd"  # the medium of the connector's KV events


@dataclass
class KeyChain:
    """How far a request's kvd keys were computed: blocks [0, pages), the last of which
    has key `last`, where the chain goes on."""

    pages: int = 0
    last: bytes | None = None


class StoredBlocks:
    def __init__(self, max_tracked: int = 1 << 20) -> None:
        self.max_tracked = max_tracked
        self._hashes: OrderedDict[bytes, object] = OrderedDict()  # kvd key -> the vLLM block hash reported
        self._removed: deque[bytes] = deque()  # kvd keys the stream reported removed, not yet matched

    def remember(self, keys: list[bytes], hashes: list) -> None:
        """Blocks reported to vLLM as stored: kvd keys and the vLLM hashes they were reported under."""
        for key, block_hash in zip(keys, hashes):
            self._hashes[key] = block_hash
            self._hashes.move_to_end(key)
        while len(self._hashes) > self.max_tracked:
            self._hashes.popitem(last=False)

    def removed(self, keys: list[bytes]) -> None:
        """kvd removed these pages (the feed's thread calls this)."""
        self._removed.extend(keys)

    def take_removed(self) -> list:
        """vLLM hashes of remembered blocks that kvd removed since the last call, oldest first."""
        hashes = []
        while self._removed:
            block_hash = self._hashes.pop(self._removed.popleft(), None)
            if block_hash is not None:
                hashes.append(block_hash)
        return hashes


class BlockEvents:
    def __init__(self, link: KVDLink, block_size: int, track_removals: bool = True) -> None:
        self.link = link
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        # kvd key -> vLLM hash of the blocks reported stored, for BlockRemoved when kvd drops them
        self._stored = StoredBlocks() if track_removals else None

    @property
    def removal_listeners(self) -> list[Callable[[list[bytes]], None]]:
        """What the removal feed hands kvd's removals to for these events (none when untracked)."""
        return [self._stored.removed] if self._stored is not None else []

    def stored(self, request, extra_keys: tuple[ExtraKey, ...], chain: KeyChain, first: int, end: int) -> None:
        """The workers published blocks [first, end) of the request: a `BlockStored` for
        them, and, with removals tracked, their kvd keys (`extra_keys`: the prompt's; blocks
        past the prompt had no item cut) from where `chain` left off."""
        event = self._stored_event(request, first, end)
        self._events.append(event)
        if self._stored is not None:
            self._remember(request, extra_keys, chain, end, event.block_hashes)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call: stores in order, then one `BlockRemoved` for the
        reported blocks kvd removed meanwhile."""
        events, self._events = self._events, []
        removed = self._stored.take_removed() if self._stored is not None else []
        if removed:
            events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        return events

    def _remember(self, request, extra_keys: tuple[ExtraKey, ...], chain: KeyChain, end: int, hashes: list) -> None:
        """The kvd keys of the request's blocks [end - len(hashes), end), mapped to their vLLM hashes.

        The chain goes on from the last key computed for the request; blocks before that
        key (published again) are hashed from the request's first block on."""
        if not hashes:
            return
        if chain.pages > end - len(hashes):
            chain.pages, chain.last = 0, None
        first_page = chain.pages
        tokens = request.all_token_ids[first_page * self.block_size : end * self.block_size]
        new_keys = self.link.page_keys(tokens, extra_keys, first_page=first_page, parent=chain.last)
        if new_keys is not None and len(new_keys) == end - first_page:
            chain.pages, chain.last = end, new_keys[-1]
            self._stored.remember(new_keys[len(new_keys) - len(hashes) :], hashes)

    def _stored_event(self, request, first: int, end: int) -> BlockStored:
        """vLLM's KV event for blocks [first, end) of the request, keyed by vLLM's own block
        hashes so that KV-aware routers match them to vLLM's other events."""
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[first:end]]
        parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first and request.block_hashes else None
        lora = request.lora_request
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[first * self.block_size : end * self.block_size]),
            block_size=self.block_size,
            lora_id=lora.lora_int_id if lora else None,
            medium=MEDIUM,
            lora_name=lora.lora_name if lora else None,
        )
