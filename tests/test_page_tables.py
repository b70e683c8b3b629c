"""GpuPageTables over a CPU pool and real shared-memory host pages."""

from __future__ import annotations

import hashlib

import pytest
import torch
from shm_host_pages import ShmHostPages

from engine_client import PageLayout
from gpu_worker.loader import PageLoader, PageStore
from gpu_worker.page_tables import BatchTables, GpuPageTables, HostRow, SeqId
from gpu_worker.pool import GpuPagePool, HostPageId, PageLoad, PoolExhausted

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
PREFIX = 40
PRIVATE = 3
BATCH = 8


@pytest.fixture
def host() -> ShmHostPages:
    pages = ShmHostPages.create(LAYOUT, 256, seed=3)
    yield pages
    pages.segment.unlink()


def seq(i: int) -> SeqId:
    return SeqId(f"s{i}")


def rows(count: int = BATCH, prefix_start: int = 0, private_start: int = 100) -> dict[SeqId, HostRow]:
    """`count` sequences sharing pages [prefix_start, prefix_start + PREFIX) plus PRIVATE own pages."""
    shared = tuple(HostPageId(p) for p in range(prefix_start, prefix_start + PREFIX))
    return {
        seq(i): HostRow(shared, tuple(HostPageId(private_start + PRIVATE * i + j) for j in range(PRIVATE)))
        for i in range(count)
    }


def planned(result: BatchTables | PoolExhausted) -> BatchTables:
    assert isinstance(result, BatchTables), result
    return result


def digest(page: torch.Tensor) -> str:
    return hashlib.sha256(page.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_shared_prefix_is_loaded_once_and_shared_by_every_row() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 128)
    plan = planned(GpuPageTables(pool).map(rows(), runway_pages=1))
    assert len(plan.loads) == PREFIX + BATCH * PRIVATE
    assert len({load.host_page for load in plan.loads}) == len(plan.loads)
    tables = torch.stack(plan.tables)
    assert tables.shape == (BATCH, PREFIX + PRIVATE + 1) and tables.dtype == torch.int64
    assert torch.equal(tables[:, :PREFIX], tables[:1, :PREFIX].expand(BATCH, PREFIX))
    assert [len(t) for t in plan.tables] == [PREFIX + PRIVATE + 1] * BATCH
    for table, row in zip(plan.rows, rows().values()):  # host-backed entries first, then the runway
        assert table[: PREFIX + PRIVATE] == tuple(pool.copy_of(h) for h in row.pages)
        assert pool.copy_of(table[-1]) is None
    assert plan.logical_pages == BATCH * (PREFIX + PRIVATE + 1)
    assert plan.physical_pages == PREFIX + BATCH * (PRIVATE + 1)
    stats = pool.stats()
    assert (stats.logical_pages, stats.physical_pages) == (plan.logical_pages, plan.physical_pages)
    assert (stats.shared_pages, stats.shared_refs) == (PREFIX, PREFIX * BATCH)
    assert stats.duplicate_loads_skipped == (BATCH - 1) * PREFIX


def test_second_decode_step_loads_nothing() -> None:
    planner = GpuPageTables(GpuPagePool.allocate(LAYOUT, 128))
    first = planned(planner.map(rows()))
    before = planner.pool.snapshot()
    second = planned(planner.map(rows()))
    assert second.loads == ()
    assert all(a is b for a, b in zip(first.tables, second.tables))  # rows built once, reused
    assert planner.pool.snapshot() == before


def test_rows_of_different_lengths_keep_their_own_length() -> None:
    planner = GpuPageTables(GpuPagePool.allocate(LAYOUT, 16))
    batch = {seq(0): HostRow(tuple(map(HostPageId, (1, 2, 3)))), seq(1): HostRow((HostPageId(1),))}
    plan = planned(planner.map(batch, runway_pages=2))
    assert [len(t) for t in plan.tables] == [5, 3]
    assert [t.tolist() for t in plan.tables] == [[0, 1, 2, 3, 4], [0, 5, 6]]
    assert plan.rows == ((0, 1, 2, 3, 4), (0, 5, 6))


def test_hold_and_resume_reload_only_what_was_evicted() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 100)
    planner = GpuPageTables(pool)
    batch = rows(count=2)
    planned(planner.map(batch))
    for s in batch:
        planner.suspend(s)  # IN_DECODE → ON_HOLD
    assert pool.stats().logical_pages == 0
    assert pool.stats().cached_pages == PREFIX + 2 * PRIVATE
    # Another batch with its own 40-page prefix needs 60 pages: 54 free, 6 evicted (oldest).
    other = rows(count=4, prefix_start=200, private_start=300)
    squeeze = planned(planner.map(other, runway_pages=2))
    assert len(squeeze.evicted) == PREFIX + 4 * PRIVATE + 4 * 2 - (100 - PREFIX - 2 * PRIVATE)
    for s in other:
        planner.suspend(s)
        pool.forget(other[s].private)
    resumed = planned(planner.map(batch))  # ON_HOLD → IN_DECODE
    assert {load.host_page for load in resumed.loads} == set(squeeze.evicted)


def test_completion_releases_every_gpu_reference_and_private_copies() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 128)
    planner = GpuPageTables(pool)
    batch = rows()
    planned(planner.map(batch, runway_pages=2))
    for s in batch:
        planner.suspend(s)
        pool.forget(batch[s].private)
    assert planner.holding() == ()
    state = pool.snapshot()
    assert state.refcounts == {}
    assert set(state.host_of_gpu.values()) == set(range(PREFIX))  # private copies forgotten
    pool.check()


def test_failed_extension_changes_nothing() -> None:
    pool = GpuPagePool.allocate(LAYOUT, 80)
    planner = GpuPageTables(pool)
    batch = rows()
    first = planned(planner.map(batch))
    before = pool.snapshot()
    grown = {
        s: HostRow(r.shared, r.private + tuple(HostPageId(500 + 10 * i + j) for j in range(2)))
        for i, (s, r) in enumerate(batch.items())
    }
    result = planner.map(grown, runway_pages=1)
    assert result == PoolExhausted(needed=16, available=80 - first.physical_pages)
    assert pool.snapshot() == before
    again = planned(planner.map(batch))
    assert again.loads == () and again.rows == first.rows
    assert all(torch.equal(a, b) for a, b in zip(again.tables, first.tables))


def test_the_next_step_sees_every_change_made_between_steps() -> None:
    """A step whose rows did not change reuses their page-table rows; trimming, adopting
    and rebinding between steps must still show in the next step's tables."""
    pool = GpuPagePool.allocate(LAYOUT, 128)
    planner = GpuPageTables(pool)
    batch = rows(count=2)

    def consistent(plan: BatchTables) -> BatchTables:
        for i, s in enumerate(plan.seq_ids):
            assert plan.rows[i] == planner.table(s) == tuple(plan.tables[i].tolist())
        assert plan.physical_pages == len(set(sum(plan.rows, ()))) == pool.stats().physical_pages
        return plan

    first = consistent(planned(planner.map(batch, runway_pages=2)))
    planner.trim_runway(seq(0), 1)
    second = consistent(planned(planner.map(batch, runway_pages=1)))
    assert second.rows == (first.rows[0][:-1], first.rows[1])

    adopted = HostPageId(250)  # seq 0's runway page, offloaded into a new private host page
    planner.adopt_runway(seq(0), [adopted])
    batch[seq(0)] = HostRow(batch[seq(0)].shared, batch[seq(0)].private + (adopted,))
    third = consistent(planned(planner.map(batch, runway_pages=1)))
    assert third.loads == () and third.rows[0][:-1] == second.rows[0] and third.rows[0][-1] not in second.rows[0]

    # publish dedup: seq 1's first private page equals seq 0's, which is resident
    theirs, mine = batch[seq(0)].private[0], batch[seq(1)].private[0]
    assert planner.rebind(seq(1), PREFIX, theirs) is None
    batch[seq(1)] = HostRow(batch[seq(1)].shared, (theirs,) + batch[seq(1)].private[1:])
    fourth = consistent(planned(planner.map(batch, runway_pages=1)))
    assert fourth.loads == () and fourth.rows[1][PREFIX] == fourth.rows[0][PREFIX] != third.rows[1][PREFIX]
    assert pool.copy_of(mine) is None


def test_bad_row_is_rejected_before_any_change() -> None:
    planner = GpuPageTables(GpuPagePool.allocate(LAYOUT, 8))
    with pytest.raises(ValueError, match="sequence 's0': host row lists a page twice"):
        planner.map({seq(0): HostRow((HostPageId(1), HostPageId(1)))})
    with pytest.raises(KeyError, match="sequence 's9' holds no GPU pages"):
        planner.suspend(seq(9))
    assert planner.pool.snapshot().refcounts == {}


def test_adopted_runway_needs_no_reload_after_hold(host: ShmHostPages) -> None:
    pool = GpuPagePool.allocate(LAYOUT, 16)
    planner = GpuPageTables(pool)
    loader = PageLoader(pool, host)
    row = HostRow(tuple(map(HostPageId, (1, 2))), (HostPageId(3),))
    plan = planned(planner.map({seq(0): row}, runway_pages=1))
    loader.load(plan.loads)
    runway = plan.tables[0][3].item()
    pool.kv[runway].fill_(0.25)  # decode filled the runway page
    loader.store([PageStore(runway, HostPageId(4))]).synchronize()
    planner.adopt_runway(seq(0), [HostPageId(4)])
    planner.suspend(seq(0))
    grown = HostRow(row.shared, row.private + (HostPageId(4),))
    resumed = planned(planner.map({seq(0): grown}, runway_pages=1))
    assert resumed.loads == ()
    assert resumed.tables[0][3].item() == runway
    assert digest(pool.kv[runway]) == digest(host.page(HostPageId(4)))


def test_shared_pages_stay_byte_identical_over_many_decode_steps(host: ShmHostPages) -> None:
    """Decode writes only private GPU pages; the shared copies keep matching the host."""
    pool = GpuPagePool.allocate(LAYOUT, 128)
    planner = GpuPageTables(pool)
    loader = PageLoader(pool, host)
    batch = rows()
    plan = planned(planner.map(batch, runway_pages=2))
    loader.load(plan.loads).synchronize()
    for host_page, gpu_page in plan.loads:
        assert digest(pool.kv[gpu_page]) == digest(host.page(host_page))
    shared_gpu = plan.tables[0][:PREFIX].tolist()
    for step in range(30):
        plan = planned(planner.map(batch, runway_pages=2))
        assert plan.loads == ()
        for i, s in enumerate(plan.seq_ids):
            runway = plan.tables[i][len(batch[s].pages) :]
            pool.kv[runway.long(), :, :, step % LAYOUT.page_size] = float(step + i)
    for p in range(PREFIX):
        assert digest(pool.kv[shared_gpu[p]]) == digest(host.page(HostPageId(p)))


def test_rebind_shares_a_resident_copy_or_renames_its_own() -> None:
    pool = GpuPagePool.allocate(PageLayout(1, 1, 4, 4, "float32"), 8)
    planner = GpuPageTables(pool)
    a, b = SeqId("a"), SeqId("b")
    h = [HostPageId(i) for i in range(10)]
    planner.map({a: HostRow((h[1], h[2])), b: HostRow((), (h[5], h[6]))}, runway_pages={a: 0, b: 2})
    own = planner.table(b)
    assert len(own) == 4 and len(planner.table(a)) == 2
    planner.trim_runway(b, 0)  # undo the runway
    assert planner.table(b) == own[:2] and pool.stats().physical_pages == 4

    assert planner.rebind(b, 0, h[1]) is None  # resident: share a's copy, drop b's own
    assert planner.table(b)[0] == planner.table(a)[0] and pool.copy_of(h[5]) is None
    assert planner.rebind(b, 1, h[9]) == PageLoad(h[9], own[1])  # not resident: rename, reload
    assert pool.copy_of(h[9]) == own[1] and pool.copy_of(h[6]) is None
    assert pool.refcount(planner.table(a)[0]) == 2
    pool.check()
