"""GpuPagePool refcounts, LRU cache and eviction; PageLoader copies; CPU only unless marked."""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from shm_host_pages import ShmHostPages

from engine_client import PageLayout
from gpu_worker.host_registration import register_chunks, register_host_extents
from gpu_worker.loader import PageLoader, PageStore
from gpu_worker.pool import (
    Acquired,
    GpuPageId,
    GpuPagePool,
    HostPageId,
    PageLoad,
    PoolExhausted,
    PoolInvariantError,
)

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")


@pytest.fixture
def host() -> ShmHostPages:
    pages = ShmHostPages.create(LAYOUT, 64, seed=7)
    yield pages
    pages.segment.unlink()


def h(*ids: int) -> list[HostPageId]:
    return [HostPageId(i) for i in ids]


def digest(page: torch.Tensor) -> str:
    return hashlib.sha256(page.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def acquired(result: Acquired | PoolExhausted) -> Acquired:
    assert isinstance(result, Acquired), result
    return result


def test_acquire_dedups_host_pages_and_counts_rows() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 8)
    got = acquired(pool.acquire(h(10, 11, 10, 11, 12), private=2))
    assert got.gpu_pages == (0, 1, 0, 1, 2)
    assert got.loads == (PageLoad(10, 0), PageLoad(11, 1), PageLoad(12, 2))
    assert got.private_pages == (3, 4)
    assert [pool.refcount(GpuPageId(g)) for g in range(5)] == [2, 2, 1, 1, 1]
    stats = pool.stats()
    assert (stats.logical_pages, stats.physical_pages) == (7, 5)
    assert (stats.shared_pages, stats.shared_refs) == (2, 4)
    assert (stats.unique_host_pages_loaded, stats.duplicate_loads_skipped) == (3, 2)
    pool.check()


def test_released_copies_stay_cached_and_private_pages_go_free() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 4)
    got = acquired(pool.acquire(h(1, 2), private=1))
    pool.release(got.gpu_pages + got.private_pages)
    state = pool.snapshot()
    assert state.refcounts == {}
    assert state.cached == (0, 1)
    assert state.free == (3, 2)
    again = acquired(pool.acquire(h(2, 1)))
    assert again.loads == () and again.gpu_pages == (1, 0)
    pool.check()


def test_eviction_takes_free_pages_first_then_oldest_cached() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 3)
    for host_page in (1, 2):
        pool.release(acquired(pool.acquire(h(host_page))).gpu_pages)
    got = acquired(pool.acquire(h(3, 4)))
    assert got.loads == (PageLoad(3, 2), PageLoad(4, 0))
    assert got.evicted == (1,)
    assert pool.resident() == {2: 1, 3: 2, 4: 0}
    pool.check()


def test_exhaustion_changes_nothing() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 4)
    held = acquired(pool.acquire(h(1, 2)))
    pool.release(acquired(pool.acquire(h(3))).gpu_pages)
    before = pool.snapshot()
    # 3 is cached and requested, so it cannot also be evicted to make room.
    result = pool.acquire(h(3, 4, 5), private=1)
    assert result == PoolExhausted(needed=3, available=1)
    assert pool.snapshot() == before
    assert pool.stats().unique_host_pages_loaded == 3
    pool.release(held.gpu_pages)
    pool.check()


def test_double_release_names_the_page() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 20)
    got = acquired(pool.acquire(h(*range(18))))
    pool.release([got.gpu_pages[17]], owner="sequence 'a'")
    with pytest.raises(PoolInvariantError, match="gpu page 17 released by sequence 'a'.*twice"):
        pool.release([got.gpu_pages[17]], owner="sequence 'a'")


def test_bind_makes_a_private_page_a_cached_copy() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 2)
    (page,) = acquired(pool.acquire([], private=1)).private_pages
    pool.bind(page, HostPageId(40))
    with pytest.raises(PoolInvariantError, match="host page 40 bound to gpu page 1 but already resident"):
        pool.bind(acquired(pool.acquire([], private=1)).private_pages[0], HostPageId(40))
    pool.release([page])
    assert pool.snapshot().cached == (page,)
    assert acquired(pool.acquire(h(40))).loads == ()
    pool.check()


def test_forget_drops_cached_copies_and_refuses_used_ones() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 2)
    used = acquired(pool.acquire(h(5)))
    pool.release(acquired(pool.acquire(h(6))).gpu_pages)
    pool.forget(h(6, 99))
    assert pool.resident() == {5: used.gpu_pages[0]}
    with pytest.raises(PoolInvariantError, match="host page 5 forgotten while gpu page 0 holds 1"):
        pool.forget(h(5))
    pool.check()


def test_check_names_the_page_whose_state_is_broken() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 4)
    acquired(pool.acquire(h(1)))
    pool._free.append(GpuPageId(0))  # corrupt on purpose: page 0 is in use
    with pytest.raises(PoolInvariantError, match="gpu page 0 is both free and in use"):
        pool.check()


def test_pool_rejects_a_tensor_of_the_wrong_layout() -> None:
    with pytest.raises(ValueError, match="not \\[num_pages"):
        GpuPagePool(LAYOUT, torch.empty(4, 2, 2, 4, 2, 9, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        GpuPagePool(LAYOUT, torch.empty(4, *LAYOUT.page_shape, dtype=torch.float32))


# ---- loader -------------------------------------------------------------------------------


def test_loaded_pages_are_byte_identical_to_host_pages(host: ShmHostPages) -> None:
    pool = GpuPagePool.allocate(LAYOUT, 16)
    loader = PageLoader(pool, host)
    got = acquired(pool.acquire(h(3, 9, 3, 40)))
    batch = loader.load(got.loads)
    batch.synchronize()
    assert (batch.pages, batch.nbytes) == (3, 3 * LAYOUT.page_bytes)
    for host_page, gpu_page in got.loads:
        assert digest(pool.kv[gpu_page]) == digest(host.page(host_page))


def test_store_offloads_a_layer_slice_into_a_host_page(host: ShmHostPages) -> None:
    pool = GpuPagePool.allocate(LAYOUT, 4)
    loader = PageLoader(pool, host)
    (page,) = acquired(pool.acquire([], private=1)).private_pages
    pool.kv[page].fill_(1.5)
    untouched = digest(host.page(HostPageId(20))[0])
    batch = loader.store([PageStore(page, HostPageId(20), slice(1, 2))])
    batch.synchronize()
    assert batch.nbytes == LAYOUT.page_bytes // LAYOUT.num_layers
    assert digest(host.page(HostPageId(20))[1]) == digest(pool.kv[page, 1])
    assert digest(host.page(HostPageId(20))[0]) == untouched


def test_loader_rejects_host_pages_of_another_layout(host: ShmHostPages) -> None:
    other = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    pool = GpuPagePool.allocate(other, 4)
    with pytest.raises(ValueError, match="host page 1 is torch.float16"):
        PageLoader(pool, host).load([PageLoad(HostPageId(1), GpuPageId(0))])


def test_register_chunks_are_bounded_and_page_aligned() -> None:
    chunks = register_chunks(0x1000, 10_000, align=3_000, max_chunk=7_000)
    assert chunks == [(0x1000, 6_000), (0x1000 + 6_000, 4_000)]
    assert register_chunks(0, 100 << 30, align=4096) == [(0, 64 << 30), (64 << 30, 36 << 30)]
    with pytest.raises(ValueError):
        register_chunks(0, 10, align=20, max_chunk=10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_loads_from_registered_shared_memory(host: ShmHostPages) -> None:
    pool = GpuPagePool.allocate(LAYOUT, 16, device="cuda")
    loader = PageLoader(pool, host)
    got = acquired(pool.acquire(h(1, 2, 1)))
    loader.load(got.loads)
    assert host.page(HostPageId(0)).is_pinned()
    assert register_host_extents(host.extents(), LAYOUT.page_bytes) == 0  # registered once
    pinned = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    assert register_host_extents([memoryview(pinned.numpy())], LAYOUT.page_bytes) == 0
    torch.cuda.current_stream().synchronize()
    for host_page, gpu_page in got.loads:
        assert digest(pool.kv[gpu_page].cpu()) == digest(host.page(host_page))
    (page,) = acquired(pool.acquire([], private=1)).private_pages
    pool.kv[page].fill_(2.0)
    loader.store([PageStore(page, HostPageId(30))]).synchronize()
    assert digest(host.page(HostPageId(30))) == digest(pool.kv[page].cpu())


# ---- refcount invariants, stateful --------------------------------------------------------

CAPACITY = 6


class PoolMachine(RuleBasedStateMachine):
    """Rows acquire and release pages at random; the pool's counts must match the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = GpuPagePool.allocate(PageLayout(1, 1, 1, 1, "uint8"), CAPACITY)
        # each row: (host pages, their GPU pages, private GPU pages)
        self.rows: list[tuple[list[HostPageId], list[GpuPageId], list[GpuPageId]]] = []
        self.next_bound_host = 1000

    @rule(hosts=st.lists(st.integers(0, 9), max_size=4, unique=True), private=st.integers(0, 2))
    def acquire(self, hosts: list[int], private: int) -> None:
        before = self.pool.snapshot()
        result = self.pool.acquire(h(*hosts), private=private)
        if isinstance(result, PoolExhausted):
            assert self.pool.snapshot() == before
            return
        for host_page, gpu_page in zip(hosts, result.gpu_pages):
            assert self.pool.host_page(gpu_page) == host_page
        assert {load.host_page for load in result.loads} == set(hosts) - set(before.host_of_gpu.values())
        self.rows.append((h(*hosts), list(result.gpu_pages), list(result.private_pages)))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _, gpu_pages, private = self.rows.pop(data.draw(st.integers(0, len(self.rows) - 1)))
        self.pool.release(gpu_pages + private)

    @precondition(lambda self: any(row[2] for row in self.rows))
    @rule(data=st.data())
    def bind_private(self, data: st.DataObject) -> None:
        hosts, gpu_pages, private = data.draw(st.sampled_from([r for r in self.rows if r[2]]))
        page = private.pop()
        self.pool.bind(page, HostPageId(self.next_bound_host))
        hosts.append(HostPageId(self.next_bound_host))
        gpu_pages.append(page)
        self.next_bound_host += 1

    @rule(host_page=st.integers(0, 9))
    def forget_idle(self, host_page: int) -> None:
        if any(host_page in row[0] for row in self.rows):
            return
        self.pool.forget(h(host_page))
        assert host_page not in self.pool.resident()

    @invariant()
    def counts_match_rows(self) -> None:
        self.pool.check()
        state = self.pool.snapshot()
        expected: dict[GpuPageId, int] = {}
        for _, gpu_pages, private in self.rows:
            for page in gpu_pages + private:
                expected[page] = expected.get(page, 0) + 1
        assert state.refcounts == expected
        assert all(page not in state.refcounts for page in state.cached)
        assert len(state.host_of_gpu) <= CAPACITY
        stats = self.pool.stats()
        assert stats.physical_pages <= stats.logical_pages


TestPoolRefcounts = PoolMachine.TestCase
TestPoolRefcounts.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
