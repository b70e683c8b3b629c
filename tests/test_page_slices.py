"""Which KV heads of a page each tensor-parallel rank holds and writes (kvd/wire/layout.py):
vLLM's split, one writer for a replicated head, and the splits vLLM cannot make refused."""

from __future__ import annotations

import pytest

from kvd.wire.layout import LayoutError, rank_heads, writes_heads


@pytest.mark.parametrize("heads,tp", [(8, 1), (8, 2), (8, 4), (8, 8), (4, 8), (8, 16), (2, 8), (1, 4)])
def test_every_head_has_exactly_one_writer_and_every_rank_holds_its_share(heads, tp):
    held = [rank_heads(heads, tp, rank) for rank in range(tp)]
    writers = [rank for rank in range(tp) if writes_heads(heads, tp, rank)]
    assert sorted(h for r in writers for h in held[r]) == list(range(heads))
    assert all(len(r) == max(1, heads // tp) for r in held)
    assert len(writers) == min(heads, tp)
    # a replicated head sits on consecutive ranks, and the first of them writes it
    for rank in range(1, tp):
        assert held[rank].start >= held[rank - 1].start
        assert writes_heads(heads, tp, rank) == (held[rank].start != held[rank - 1].start)


@pytest.mark.parametrize("heads,tp,rank", [(8, 3, 0), (6, 4, 1), (8, 2, 2), (8, 2, -1), (8, 0, 0)])
def test_a_split_vllm_cannot_make_is_refused(heads, tp, rank):
    with pytest.raises(LayoutError):
        rank_heads(heads, tp, rank)
    with pytest.raises(LayoutError):
        writes_heads(heads, tp, rank)
