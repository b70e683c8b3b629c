"""Page copies between kvd's shared-memory extents and vLLM's KV blocks, in as few
operations as the layouts allow (the worker half's data movement, gpu_worker/vllm/worker.py).

A step's copies are grouped by extent first (`ExtentCopies`: every page of one extent
that the step copies, whichever request it belongs to, with its vLLM block), then each
layer is copied extent by extent:

- On CPU, one `numpy.copyto` per run of pages that are consecutive in the extent and
  whose blocks are consecutive in vLLM's cache (a single page is a run of one). A layer
  of a page and a block of a layer are each contiguous, so a run is one strided memcpy,
  with no gathered temporary (torch's indexed copies gather first and run several times
  slower here, bench/bench_vllm_copy.py).
- On CUDA, page by page with `non_blocking` copies, as before this module: each page's
  layer is contiguous in the registered extent, so each is one DMA (checked on a GPU by
  scripts/gpu_check.sh). An MLA layer's block (`[block_size, 576]`, worker.block_view) is
  one contiguous run in vLLM's cache as well, so a latent page's layer is one DMA too
  (written for, not yet run on, a GPU: tests/test_vllm_halves.py's CUDA test covers it).

The copies know nothing of the page kind: a layer of a K/V page and of a latent page
(kvd/wire/layout.py) are each contiguous, and so are the blocks `block_view` makes of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.vllm.plans import NULL_BLOCK

Copies = list[tuple[torch.Tensor, list[int], list[int]]]  # (extent, page indices, block ids)


@dataclass
class ExtentCopies:
    """Pages of one extent and the vLLM blocks they are copied to or from."""

    extent: torch.Tensor  # [pages, *page_shape]: [pages, layers, 2, page_size, heads, head_dim] or latent pages
    pages: list[int] = field(default_factory=list)  # indices in the extent
    blocks: list[int] = field(default_factory=list)  # vLLM block ids, one per page


def to_blocks(groups, block_ids: list[int]) -> Copies:
    """`KVDClient.pages_by_extent` groups with the vLLM block of each page instead of its
    position, without the pages whose block is vLLM's null block (nothing kept there)."""
    copies = []
    for extent, indices, positions in groups:
        kept = [(i, block_ids[p]) for i, p in zip(indices, positions) if block_ids[p] != NULL_BLOCK]
        if kept:
            copies.append((extent, [i for i, _ in kept], [b for _, b in kept]))
    return copies


def merged(copies: list[list[Copies]], num_groups: int) -> list[list[ExtentCopies]]:
    """Each request's copies per KV-cache group, merged per group and extent."""
    return [by_extent(g for per_group in copies for g in per_group[group]) for group in range(num_groups)]


def by_extent(groups: Iterable[tuple[torch.Tensor, list[int], list[int]]]) -> list[ExtentCopies]:
    """(extent view, page indices, block ids) groups, of one request or many, merged per extent."""
    merged: dict[int, ExtentCopies] = {}
    for extent, pages, blocks in groups:
        copies = merged.setdefault(extent.data_ptr(), ExtentCopies(extent))
        copies.pages += pages
        copies.blocks += blocks
    return list(merged.values())


def runs(pages: list[int], blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first page, first block, length) of each stretch where pages and blocks both go up
    by one, in order."""
    found: list[tuple[int, int, int]] = []
    for page, block in sorted(zip(pages, blocks)):
        if found:
            first_page, first_block, n = found[-1]
            if page == first_page + n and block == first_block + n:
                found[-1] = (first_page, first_block, n + 1)
                continue
        found.append((page, block, 1))
    return found


def copy_layer(blocks_view: torch.Tensor, layer: int, copies: list[ExtentCopies], into_blocks: bool) -> None:
    """Copies one layer of the pages into their vLLM blocks (`into_blocks`, a load) or of
    the blocks into their pages (a save).

    `blocks_view` is the layer's vLLM cache as `[blocks, *layer of a page]`: `[blocks, 2,
    page_size, heads, head_dim]` or `[blocks, page_size, latent]` (worker.block_view); on a
    GPU the copies are queued on the current stream."""
    if blocks_view.device.type == "cpu":
        cache = _bytes(blocks_view)  # [blocks, *layer of a page], the last dimension in bytes
        for c in copies:
            pages = _bytes(c.extent)[:, layer]  # [pages, *layer of a page], the last dimension in bytes
            for page, block, n in runs(c.pages, c.blocks):
                if into_blocks:
                    np.copyto(cache[block : block + n], pages[page : page + n])
                else:
                    np.copyto(pages[page : page + n], cache[block : block + n])
        return
    for c in copies:  # page by page: each is one DMA to or from the registered extent
        for page, block in zip(c.pages, c.blocks):
            if into_blocks:
                blocks_view[block].copy_(c.extent[page, layer], non_blocking=True)
            else:
                c.extent[page, layer].copy_(blocks_view[block], non_blocking=True)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array of bytes (numpy has no bfloat16), no copy."""
    return t.view(torch.uint8).numpy()
