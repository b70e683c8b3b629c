"""Reference paged attention in plain torch: slot-mapped KV writes and varlen causal attention.

The device page pool is one tensor

    kv_pool: [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]

(one page = the fixed layout of ``kvd/wire/layout.py``). A sequence's page table lists
pool pages in token order: absolute position p lives in page ``table[p // page_size]``,
slot ``p % page_size``.

One call serves every phase. Each sequence brings ``query_len`` query tokens at absolute
positions ``[start, start + query_len)`` and its context is ``start + query_len`` tokens:
prefill of an uncached prompt (start 0), suffix-only prefill over cached prefix pages
(start = shared prefix tokens), a full hit (one query, the last prompt token, whose K/V
are already cached and are not written again), and decode (one query). A query at p sees
keys at positions <= p, and on a sliding layer only keys in (p - window, p]; such a layer
gathers only the pages that intersect the windows of the sequence's queries, so pages
that slid out are never read. Scores and softmax run in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Most float32 score elements one query chunk may hold (32 MiB): long prompts are
# attended in query chunks so a no-hit 8K prefill does not build an 8K x 8K matrix.
_SCORE_BUDGET = 1 << 23


@dataclass(frozen=True)
class AttentionBatch:
    """Page tables, query positions and slot mapping of one batch; the tokens of all
    sequences are concatenated along one token axis, sequence after sequence."""

    page_size: int
    page_tables: tuple[torch.Tensor, ...]  # each [pages_i] int64 pool page ids, token order
    query_starts: tuple[int, ...]  # absolute position of each sequence's first query token
    query_lens: tuple[int, ...]  # query tokens of each sequence, >= 1
    positions: torch.Tensor  # [tokens] int64 absolute position of every query token
    write_rows: torch.Tensor  # [written] int64 token rows whose new K/V go into the pool
    slot_pages: torch.Tensor  # [written] int64 pool page of each written row
    slot_offsets: torch.Tensor  # [written] int64 slot of each written row inside its page

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        page_tables: Sequence[Sequence[int] | torch.Tensor],
        query_starts: Sequence[int],
        query_lens: Sequence[int],
        writes_kv: Sequence[bool],
        page_size: int,
        device: torch.device | str,
    ) -> AttentionBatch:
        """Batch whose sequence i queries positions ``[query_starts[i], + query_lens[i])``.

        A page table already on ``device`` as int64 (``BatchTables.tables``) is used as it
        is, with no copy. ``writes_kv[i]`` says whether those tokens' K/V are new (prefill,
        decode) and go to their slots, or are already cached (full hit) and must not be written.
        """
        n = len(page_tables)
        if not n == len(query_starts) == len(query_lens) == len(writes_kv):
            raise ValueError("page_tables, query_starts, query_lens and writes_kv differ in length")
        tables = tuple(torch.as_tensor(t, dtype=torch.int64, device=device) for t in page_tables)
        positions: list[torch.Tensor] = []  # each [query_lens[i]] int64
        write_rows: list[torch.Tensor] = []
        slot_pages: list[torch.Tensor] = []
        row = 0
        for i, (table, start, length, writes) in enumerate(zip(tables, query_starts, query_lens, writes_kv)):
            if start < 0 or length < 1:
                raise ValueError(f"sequence {i}: query start {start} and length {length} are not a valid range")
            if len(table) * page_size < start + length:
                raise ValueError(
                    f"sequence {i}: {len(table)} pages of {page_size} tokens cannot hold {start + length} tokens"
                )
            span = torch.arange(start, start + length, dtype=torch.int64, device=device)
            if writes:
                write_rows.append(torch.arange(row, row + length, dtype=torch.int64, device=device))
                slot_pages.append(table[span // page_size])
            positions.append(span)
            row += length

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)

        all_positions, rows = cat(positions), cat(write_rows)
        return cls(
            page_size=page_size,
            page_tables=tables,
            query_starts=tuple(query_starts),
            query_lens=tuple(query_lens),
            positions=all_positions,
            write_rows=rows,
            slot_pages=cat(slot_pages),
            slot_offsets=all_positions[rows] % page_size,
        )


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new K/V of one layer at their slots: token j goes to (slot_pages[j], slot_offsets[j])."""
    # kv_pool: [pages, layers, 2, page_size, kv_heads, head_dim]; k, v: [written, kv_heads, head_dim]
    assert kv_pool.dim() == 6, f"kv_pool must be 6-d, got shape {tuple(kv_pool.shape)}"
    assert k.shape == v.shape == (slot_pages.shape[0], *kv_pool.shape[4:]), (
        f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
        f"{slot_pages.shape[0]} slots of {tuple(kv_pool.shape[4:])}"
    )
    assert slot_offsets.shape == slot_pages.shape
    kv_pool[slot_pages, layer, 0, slot_offsets] = k.to(kv_pool.dtype)
    kv_pool[slot_pages, layer, 1, slot_offsets] = v.to(kv_pool.dtype)


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    batch: AttentionBatch,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal GQA attention of every query token over its sequence's cached pages.

    ``window`` is the sliding window of this layer (None: full attention); ``sinks`` holds
    one learned logit per query head that joins the softmax denominator (GPT-OSS).
    Returns ``[tokens, heads, head_dim]`` in the dtype of ``q``.
    """
    # q: [tokens, heads, head_dim]
    tokens, heads, head_dim = q.shape
    assert kv_pool.dim() == 6 and kv_pool.shape[3] == batch.page_size, (
        f"kv_pool shape {tuple(kv_pool.shape)} is not [pages, layers, 2, {batch.page_size}, kv_heads, head_dim]"
    )
    assert kv_pool.shape[5] == head_dim and heads % kv_pool.shape[4] == 0, (
        f"q heads/head_dim {heads}/{head_dim} do not fit kv_pool {tuple(kv_pool.shape)}"
    )
    assert tokens == batch.num_tokens, f"q has {tokens} tokens, batch has {batch.num_tokens}"
    assert sinks is None or sinks.shape == (heads,)
    kv_heads = kv_pool.shape[4]
    out = torch.empty_like(q)
    row = 0
    for table, start, length in zip(batch.page_tables, batch.query_starts, batch.query_lens):
        # Gather once per sequence the pages any of its queries can see: on a sliding
        # layer those from the first query's window start, on a full layer all of them.
        key_lo = 0 if window is None else max(0, start - window + 1)
        key_hi = start + length
        page_lo, page_hi = key_lo // batch.page_size, -(-key_hi // batch.page_size)
        kv = kv_pool[table[page_lo:page_hi], layer]  # [pages, 2, page_size, kv_heads, head_dim]
        lo, hi = key_lo - page_lo * batch.page_size, key_hi - page_lo * batch.page_size
        k = kv[:, 0].reshape(-1, kv_heads, head_dim)[lo:hi].float()  # [keys, kv_heads, head_dim]
        v = kv[:, 1].reshape(-1, kv_heads, head_dim)[lo:hi].float()  # [keys, kv_heads, head_dim]
        chunk = max(1, _SCORE_BUDGET // (heads * (key_hi - key_lo)))
        for first in range(0, length, chunk):
            n = min(chunk, length - first)
            rows = slice(row + first, row + first + n)
            out[rows] = _attend(q[rows], start + first, k, v, key_lo, scale, window, sinks)
        row += length
    return out


def _attend(
    q: torch.Tensor,
    first_pos: int,
    k: torch.Tensor,
    v: torch.Tensor,
    key_base: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of queries at positions ``first_pos, first_pos + 1, ...`` over keys that
    start at position ``key_base`` (k, v float32)."""
    # q: [n, heads, head_dim]; k, v: [keys, kv_heads, head_dim]
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    key_lo = key_base if window is None else max(key_base, first_pos - window + 1)  # first key any query sees
    key_hi = first_pos + n  # one past the last query's own position
    k = k[key_lo - key_base : key_hi - key_base]
    v = v[key_lo - key_base : key_hi - key_base]

    q_pos = torch.arange(first_pos, key_hi, device=q.device)  # [n]
    k_pos = torch.arange(key_lo, key_hi, device=q.device)  # [keys]
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, keys]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window

    qg = q.float().view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kv_heads, group, n, head_dim]
    scores = (qg @ k.permute(1, 2, 0)[:, None]) * scale  # [kv_heads, group, n, keys]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(kv_heads, group, 1, 1).expand(kv_heads, group, n, 1)
        # The sink takes probability mass but contributes no value.
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs @ v.permute(1, 0, 2)[:, None]  # [kv_heads, group, n, head_dim]
    return out.permute(2, 0, 1, 3).reshape(n, heads, head_dim).to(q.dtype)
