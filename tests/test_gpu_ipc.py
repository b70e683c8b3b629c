"""Pool export/import: another process sees the pages the owner loaded (CPU via posix_ipc)."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import pickle

import pytest
import torch

from engine_client import PageLayout
from gpu_worker.ipc import PoolExport, PoolHandle, PoolImport, SharedSegment
from gpu_worker.loader import PageLoader
from gpu_worker.planner import DecodeBatchPlanner, DecodePlan, HostRow, SeqId
from gpu_worker.pool import HostPageId
from shm_host_pages import ShmHostPages

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")
HOST_PAGES = 64


@pytest.fixture
def host() -> ShmHostPages:
    pages = ShmHostPages.create(LAYOUT, HOST_PAGES, seed=5)
    yield pages
    pages.segment.unlink()


@pytest.fixture
def export() -> PoolExport:
    pool = PoolExport(LAYOUT, 32)
    yield pool
    pool.close()


def digest(page: torch.Tensor) -> str:
    return hashlib.sha256(page.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def load_shared_batch(export: PoolExport, host: ShmHostPages) -> DecodePlan:
    """Two sequences sharing host pages 0..9, each with one private page, loaded and published."""
    prefix = tuple(HostPageId(p) for p in range(10))
    plan = DecodeBatchPlanner(export.pool).plan(
        {SeqId("a"): HostRow(prefix, (HostPageId(20),)), SeqId("b"): HostRow(prefix, (HostPageId(21),))}
    )
    assert isinstance(plan, DecodePlan)
    PageLoader(export.pool, host).load(plan.loads).synchronize()
    export.publish()
    return plan


def importer_main(handle: PoolHandle, host_segment: str, replies: mp.Queue) -> None:
    """Child process: open the pool, check its pages against the host pages, mark one page."""
    pool = PoolImport(handle)
    host = ShmHostPages(SharedSegment.attach(host_segment), handle.layout, HOST_PAGES)
    mapping = pool.lookup()
    mismatched = [h for h, g in mapping.items() if digest(pool.kv[g]) != digest(host.page(h))]
    free_page = min(set(range(handle.num_pages)) - set(mapping.values()))
    pool.kv[free_page].fill_(3.0)  # visible to the owner only if the memory is really shared
    if pool.kv.is_cuda:
        torch.cuda.synchronize()
    replies.put((mapping, mismatched, free_page))


def test_handle_is_small_and_picklable(export: PoolExport) -> None:
    blob = pickle.dumps(export.handle)
    assert len(blob) < 1024
    assert pickle.loads(blob) == export.handle


def test_import_in_process_sees_the_same_memory_and_map(export: PoolExport, host: ShmHostPages) -> None:
    imported = PoolImport(export.handle)
    assert imported.lookup() == {}
    load_shared_batch(export, host)
    assert imported.lookup() == export.pool.resident()
    assert imported.kv.data_ptr() != export.pool.kv.data_ptr()  # a second mapping, same pages
    export.pool.kv[5].fill_(7.0)
    assert torch.equal(imported.kv[5], export.pool.kv[5])


def test_publish_reflects_eviction(export: PoolExport, host: ShmHostPages) -> None:
    imported = PoolImport(export.handle)
    planner = DecodeBatchPlanner(export.pool)
    plan = planner.plan({SeqId("a"): HostRow(tuple(HostPageId(p) for p in range(5)))})
    assert isinstance(plan, DecodePlan)
    planner.complete(SeqId("a"))
    export.pool.forget([HostPageId(0)])
    export.publish()
    assert set(imported.lookup()) == {1, 2, 3, 4}


def test_another_process_sees_the_pages_the_owner_loaded(export: PoolExport, host: ShmHostPages) -> None:
    plan = load_shared_batch(export, host)
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=importer_main, args=(export.handle, host.segment.name, replies))
    child.start()
    mapping, mismatched, free_page = replies.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert mapping == export.pool.resident()
    assert len(mapping) == len(plan.loads) == 12
    assert mismatched == []
    assert bool((export.pool.kv[free_page] == 3.0).all())


def test_import_rejects_a_map_of_another_size(export: PoolExport) -> None:
    bad = PoolHandle(LAYOUT, 16, "cpu", export.handle.map_segment, export.handle.pool_segment, None)
    with pytest.raises(ValueError, match="is for 32 pages, not 16"):
        PoolImport(bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pool_is_shared_with_another_process(host: ShmHostPages) -> None:
    export = PoolExport(LAYOUT, 32, device="cuda")
    try:
        assert export.handle.pool_segment is None and export.handle.cuda_ipc is not None
        load_shared_batch(export, host)
        ctx = mp.get_context("spawn")
        replies = ctx.Queue()
        child = ctx.Process(target=importer_main, args=(export.handle, host.segment.name, replies))
        child.start()
        mapping, mismatched, free_page = replies.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0 and mismatched == []
        assert mapping == export.pool.resident()
        torch.cuda.synchronize()
        assert bool((export.pool.kv[free_page] == 3.0).all())
    finally:
        export.close()
