"""What KVDConnector's scheduler half tells its worker halves each step, and what they answer.

vLLM sends the step's `KVDConnectorMetadata` from the scheduler process to every worker
before the forward pass, and returns each worker's `KVDWorkerMetadata` to the scheduler
after it. Page ids in a `LoadPlan` are those of the daemon instance it names: a worker
whose own session is with another instance (the daemon restarted in between) must not
use them. Saves carry no page ids: each worker writes and publishes pages of its own
kvd sequence, so no process ever writes a page another session owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from engine_client import ExtraKey

# vLLM's null block (BlockPool.null_block, the first block it hands out): a sliding-window
# group's block ids name it for blocks outside the window, which hold no KV to load or save.
NULL_BLOCK = 0


@dataclass(frozen=True)
class ExtentRef:
    """A kvd shared-memory extent of one namespace: its name and the pages it holds
    [first_page, first_page + num_pages)."""

    name: str
    first_page: int
    num_pages: int


@dataclass(frozen=True)
class LoadPlan:
    """Copy kvd pages (held by the scheduler half's sequences) into the request's vLLM blocks.

    `pages_by_rank[r]` are the pages of tensor-parallel rank r's namespace (its KV heads):
    each worker loads its own rank's. A page holds every layer of one block;
    `block_ids[g]` are KV-cache group g's blocks, one per page (NULL_BLOCK where that
    group keeps nothing: a sliding-window group's blocks outside the window), and the
    layers of group g go to them.

    `extents_by_rank[r]` are the extents that hold rank r's pages, for a worker that has
    not mapped them yet (it maps them without a kvd call).

    `missing_block_ids` are blocks vLLM was promised but kvd can no longer supply (it
    dropped a held page, or the hold's session ended, before the plan). A synchronous
    load (before the step's forward pass) reports them to vLLM as load errors, and vLLM
    recomputes them. An `asynchronous` one (vLLM waits for it between steps: models of
    several KV-cache groups, whose block ids vLLM cannot map back) fails as a whole:
    the worker reports the request as failed, and vLLM computes its prompt."""

    req_id: str
    daemon_instance: str
    pages_by_rank: tuple[list[int], ...]
    block_ids: tuple[list[int], ...]
    missing_block_ids: list[int] = field(default_factory=list)
    asynchronous: bool = False
    extents_by_rank: tuple[list[ExtentRef], ...] = ()


@dataclass(frozen=True)
class PromptKey:
    """What a worker allocates its kvd sequence for: the prompt's cacheable full blocks
    (later plans add the generated blocks' tokens, `SavePlan.more_tokens`)."""

    token_ids: list[int]
    extra_keys: tuple[ExtraKey, ...]


@dataclass(frozen=True)
class SavePlan:
    """Blocks of the request that this step completes: save them to kvd and publish them.

    `positions` are the blocks' indices in the request (block i holds tokens
    [i * block_size, (i + 1) * block_size)), each held by every KV-cache group (a page
    holds all layers); `prompt` comes with a request's first plan;
    `more_tokens` are the token ids after those the workers know, up to the end of the
    plan's last block (the prompt's last partial block and generated tokens)."""

    req_id: str
    positions: list[int]
    block_ids: tuple[list[int], ...]  # per KV-cache group, one per position
    prompt: PromptKey | None = None
    more_tokens: list[int] = field(default_factory=list)


@dataclass
class KVDConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # requests whose kvd sequences the workers release
    preempted: set[str] = field(default_factory=set)  # requests vLLM preempted: no save may read their blocks now


@dataclass
class KVDWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler after each step: per request, the blocks [start,
    end) it published in kvd this step, and the daemon instance its own kvd session is with
    now ("" while kvd cannot serve it). The scheduler offers loads only while that is the
    instance of its own session: a load the workers cannot perform would be recomputed.
    A worker that `saves` nothing (a rank other than 0 of a cache every rank holds whole,
    MLA's) has no say in what is published.

    `loaded`: per request whose synchronous load plan this worker ran this step, whether
    every block of it loaded. One rank's failure is every rank's (tensor parallelism
    all-reduces what attended to the stale blocks), MLA's ranks that save nothing included:
    the scheduler holds such requests' saves until it hears (gpu_worker/vllm/load_verdicts.py)."""

    published: dict[str, tuple[int, int]] = field(default_factory=dict)
    daemon_instance: str = ""
    saves: bool = True
    loaded: dict[str, bool] = field(default_factory=dict)

    def aggregate(self, other: KVDWorkerMetadata) -> KVDWorkerMetadata:
        """Blocks count as published only where every saving worker published them; the
        workers serve an instance only when every one of them does; a load succeeded only
        where every worker's did."""
        instance = self.daemon_instance if self.daemon_instance == other.daemon_instance else ""
        loaded = {r: self.loaded.get(r, True) and other.loaded.get(r, True) for r in self.loaded.keys() | other.loaded}
        if not (self.saves and other.saves):
            published = self.published if self.saves else other.published
            return KVDWorkerMetadata(published, instance, saves=self.saves or other.saves, loaded=loaded)
        both = {}
        for req_id, (start, end) in self.published.items():
            if req_id in other.published:
                o_start, o_end = other.published[req_id]
                if max(start, o_start) < min(end, o_end):
                    both[req_id] = (max(start, o_start), min(end, o_end))
        return KVDWorkerMetadata(both, instance, loaded=loaded)
