"""Host→device traffic of one decode batch: planned (deduped) loads against naive loads.

N sequences share a 50K-token prefix (page_size 16, 3125 pages) and have a few private
pages each. "Naive" loads each sequence's host row into its own GPU pages; "planned" runs
GpuPageTables.map, which loads each unique page once. Printed: pages and bytes moved
and their ratio (target: the shared part moves 1/N of naive), and that a second decode
step moves nothing. The layout is tiny (512 B pages) so the run fits on a small CPU box.

On CUDA also: host→device GB/s of whole-page loads from (cudaHostRegister'ed) shared
memory against ordinary pinned memory of the same size, printed as a ratio.

    python bench/bench_decode_loads.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import time

import posix_ipc
import torch

from engine_client import PageLayout
from gpu_worker.loader import PageLoader
from gpu_worker.page_tables import BatchTables, GpuPageTables, HostRow, SeqId
from gpu_worker.pool import GpuPageId, GpuPagePool, HostPageId, PageLoad, torch_dtype

PREFIX_TOKENS = 50_000
PRIVATE_PAGES = 4
SMALL = PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="float16")
# A realistic page for bandwidth: 8 layers x 8 KV heads x 128 dims x 16 tokens, fp16 = 512 KiB.
LARGE = PageLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16")


class TensorHostPages:
    """HostPages over one CPU tensor `pages: [num_pages, *page_shape]` (shared or pinned)."""

    def __init__(self, pages: torch.Tensor) -> None:
        self.pages = pages

    def page(self, page_id: HostPageId) -> torch.Tensor:
        return self.pages[page_id]

    def extents(self) -> list[memoryview]:
        return [memoryview(self.pages.view(torch.uint8).reshape(-1).numpy())]


def shm_host_pages(layout: PageLayout, num_pages: int) -> tuple[TensorHostPages, str]:
    """Host pages in a new POSIX shared-memory segment; the caller unlinks the returned name."""
    name = f"/kvd-bench-host-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=num_pages * layout.page_bytes)
    buffer = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    pages = torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype(layout))  # the tensor keeps the mmap
    return TensorHostPages(pages.reshape(num_pages, *layout.page_shape)), name


def elapsed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def compare_loads(num_seqs: int, device: torch.device) -> None:
    prefix_pages = PREFIX_TOKENS // SMALL.page_size
    host, segment = shm_host_pages(SMALL, prefix_pages + num_seqs * PRIVATE_PAGES)
    try:
        shared = tuple(HostPageId(p) for p in range(prefix_pages))
        rows = {
            SeqId(f"s{i}"): HostRow(
                shared, tuple(HostPageId(prefix_pages + i * PRIVATE_PAGES + j) for j in range(PRIVATE_PAGES))
            )
            for i in range(num_seqs)
        }
        row_pages = prefix_pages + PRIVATE_PAGES

        naive_pool = GpuPagePool.allocate(SMALL, num_seqs * row_pages, device)
        naive = [
            PageLoad(page, GpuPageId(i * row_pages + j))
            for i, row in enumerate(rows.values())
            for j, page in enumerate(row.pages)
        ]
        naive_loader = PageLoader(naive_pool, host)
        naive_s = elapsed(device, lambda loader=naive_loader: loader.load(naive))
        del naive_pool, naive_loader

        planner = GpuPageTables(GpuPagePool.allocate(SMALL, prefix_pages + num_seqs * (PRIVATE_PAGES + 1), device))
        loader = PageLoader(planner.pool, host)
        start = time.perf_counter()
        plan = planner.map(rows, runway_pages=1)
        plan_s = time.perf_counter() - start
        assert isinstance(plan, BatchTables)
        planned_s = elapsed(device, lambda: loader.load(plan.loads))
        start = time.perf_counter()
        second = planner.map(rows, runway_pages=1)
        second_s = time.perf_counter() - start
        assert isinstance(second, BatchTables)

        n_naive, n_planned = len(naive), len(plan.loads)
        shared_naive = sum(1 for load in naive if load.host_page < prefix_pages)
        shared_planned = sum(1 for load in plan.loads if load.host_page < prefix_pages)
        page_bytes = SMALL.page_bytes
        print(f"{num_seqs:>2} seqs x {PREFIX_TOKENS} shared tokens + {PRIVATE_PAGES} private pages each:")
        print(f"   naive    {n_naive:>7} pages {n_naive * page_bytes / 2**20:8.2f} MiB  {naive_s * 1e3:8.1f} ms")
        print(f"   planned  {n_planned:>7} pages {n_planned * page_bytes / 2**20:8.2f} MiB  {planned_s * 1e3:8.1f} ms")
        print(
            f"   bytes planned/naive {n_planned / n_naive:.4f}"
            f"  shared part {shared_planned / shared_naive:.4f} (target 1/{num_seqs} = {1 / num_seqs:.4f})"
            f"  time ratio {planned_s / naive_s:.3f}"
        )
        stats = planner.pool.stats()
        print(
            f"   logical/physical GPU pages {stats.logical_pages}/{stats.physical_pages}"
            f" = {stats.sharing_ratio:.2f}; planning took {plan_s * 1e3:.1f} ms;"
            f" the next decode step's plan {second_s * 1e3:.2f} ms, loading {len(second.loads)} pages"
        )
    finally:
        posix_ipc.unlink_shared_memory(segment)


def compare_bandwidth(device: torch.device, num_pages: int = 1024, repeats: int = 5) -> None:
    """CUDA only: H2D GB/s of page loads from registered shared memory vs pinned memory."""
    shape = (num_pages, *LARGE.page_shape)
    shm, segment = shm_host_pages(LARGE, num_pages)
    try:
        pinned = TensorHostPages(torch.empty(shape, dtype=torch_dtype(LARGE), pin_memory=True))
        pool = GpuPagePool.allocate(LARGE, num_pages, device)
        loads = [PageLoad(HostPageId(p), GpuPageId(p)) for p in range(num_pages)]
        rates = {}
        for label, host in (("shared memory", shm), ("pinned", pinned)):
            loader = PageLoader(pool, host)
            best = min(elapsed(device, lambda loader=loader: loader.load(loads)) for _ in range(repeats))
            rates[label] = num_pages * LARGE.page_bytes / best / 1e9
            print(f"   H2D from {label:<13} {rates[label]:6.1f} GB/s ({LARGE.page_bytes >> 10} KiB pages)")
        print(f"   shared-memory/pinned bandwidth ratio {rates['shared memory'] / rates['pinned']:.3f}")
    finally:
        posix_ipc.unlink_shared_memory(segment)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    for num_seqs in (4, 16):
        compare_loads(num_seqs, device)
    if device.type == "cuda":
        compare_bandwidth(device)


if __name__ == "__main__":
    main()
