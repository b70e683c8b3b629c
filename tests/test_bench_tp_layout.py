"""bench/bench_tp_layout.py's slice copies: for every candidate layout, the ranks of any TP
degree (more ranks than KV heads included) save the same full-heads pages, byte for byte,
and any TP degree loads back each rank's own blocks (issue 42)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import bench_tp_layout as bench  # noqa: E402

MODEL = bench.Model("tiny", layers=3, kv_heads=4, head_dim=8, page_size=4)
NUM_PAGES, NUM_BLOCKS = 5, 9
BLOCK_IDS = [7, 2, 3, 4, 0]  # page i in block BLOCK_IDS[i]


def rank_caches(full: list[np.ndarray], tp_size: int, tp_rank: int) -> list[np.ndarray]:
    """Rank `tp_rank`'s vLLM cache, per layer: its heads of the full model's."""
    first, last = bench.rank_heads(MODEL.kv_heads, tp_size, tp_rank)
    return [layer[:, first:last].copy() for layer in full]


def saved_pages(layout: str, full: list[np.ndarray], tp_size: int, block_ids) -> np.ndarray:
    pages = np.zeros((NUM_PAGES, *MODEL.page_shape(layout)), MODEL.dtype)
    for rank in range(tp_size):
        if bench.writes(MODEL.kv_heads, tp_size, rank):
            heads = bench.rank_heads(MODEL.kv_heads, tp_size, rank)
            caches = rank_caches(full, tp_size, rank)
            bench.copy_slices(pages, layout, caches, heads, range(NUM_PAGES), block_ids, False, bench.numpy_copy)
    return pages


@pytest.mark.parametrize("layout", list(bench.LAYOUTS))
@pytest.mark.parametrize("copy", [bench.numpy_copy, bench.torch_copy])
def test_every_tp_degree_saves_and_loads_the_same_pages(layout, copy):
    rng = np.random.default_rng(0)
    shape = (NUM_BLOCKS, MODEL.kv_heads, 2, MODEL.page_size, MODEL.head_dim)
    full = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(MODEL.layers)]
    by_tp1 = saved_pages(layout, full, 1, BLOCK_IDS)
    for tp_size in (2, 4, 8):
        assert np.array_equal(saved_pages(layout, full, tp_size, BLOCK_IDS), by_tp1), tp_size
    in_a_order = by_tp1.transpose(0, *(1 + bench.LAYOUTS[layout].index(axis) for axis in bench.LAYOUTS["A"]))
    assert np.array_equal(in_a_order, saved_pages("A", full, 1, BLOCK_IDS))  # the same bytes, in another order
    consecutive = saved_pages(layout, full, 2, range(2, 2 + NUM_PAGES))
    assert np.array_equal(consecutive, saved_pages(layout, full, 1, range(2, 2 + NUM_PAGES)))
    for tp_size in (1, 2, 4, 8):
        for rank in range(tp_size):
            heads = bench.rank_heads(MODEL.kv_heads, tp_size, rank)
            loaded = [np.zeros((NUM_BLOCKS, heads[1] - heads[0], *shape[2:]), MODEL.dtype) for _ in full]
            bench.copy_slices(by_tp1, layout, loaded, heads, range(NUM_PAGES), BLOCK_IDS, True, copy)
            expected = rank_caches(full, tp_size, rank)
            for layer in range(MODEL.layers):
                assert np.array_equal(loaded[layer][BLOCK_IDS], expected[layer][BLOCK_IDS])


@pytest.mark.parametrize("layout", list(bench.LAYOUTS))
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_indexed_copies_equal_page_by_page_ones(layout, library):
    rng = np.random.default_rng(1)
    shape = (NUM_BLOCKS, 2, 2, MODEL.page_size, MODEL.head_dim)  # rank 1 of 2: heads 2-3
    caches = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(MODEL.layers)]
    pages = np.zeros((NUM_PAGES, *MODEL.page_shape(layout)), MODEL.dtype)
    bench.copy_indexed(pages, layout, caches, (2, 4), BLOCK_IDS, False, library)
    expected = np.zeros_like(pages)
    bench.copy_slices(expected, layout, caches, (2, 4), range(NUM_PAGES), BLOCK_IDS, False, bench.numpy_copy)
    assert np.array_equal(pages, expected)
    loaded = [np.zeros_like(layer) for layer in caches]
    bench.copy_indexed(pages, layout, loaded, (2, 4), BLOCK_IDS, True, library)
    for layer in range(MODEL.layers):
        assert np.array_equal(loaded[layer][BLOCK_IDS], caches[layer][BLOCK_IDS])


def test_more_ranks_than_heads_have_one_writer_per_head():
    holders = [bench.rank_heads(4, 8, rank) for rank in range(8)]
    assert holders == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]
    writers = [holders[rank] for rank in range(8) if bench.writes(4, 8, rank)]
    assert writers == [(0, 1), (1, 2), (2, 3), (3, 4)]
