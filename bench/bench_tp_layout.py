"""Issue 42: which byte layout of a page holding every KV head makes a tensor-parallel
rank's slice cheap to copy, measured against `numpy.copyto` of the same bytes, in one run.

    python bench/bench_tp_layout.py [--models small,8b,70b] [--tp 1,2,4,8,16]
                                    [--batch-mib 32] [--repeats 5]

For each model and TP degree, one rank (the last: its heads are the page's last) copies
its slice of full-heads pages to and from vLLM's CPU KV cache as that rank holds it: per
layer `[num_blocks, heads of the rank, block_size, 2 * head_dim]`, each head's block
bytes being its K rows then its V rows (`CPUAttentionBackendImpl.forward`'s view
`[blocks, heads, 2 * block_size, head_dim]`, chunked in two). The kernel arranges the
rows inside a head in an order of its own (K transposed on AMX), the same at any TP
degree, so a page treats each head's block as `[2, block_size, head_dim]` opaque rows.

Candidate page layouts (every head of the model):

- A `[layers, 2, tokens, heads, dim]`: today's order, all heads; a slice is strided per token row
- B `[layers, 2, heads, tokens, dim]`: a slice is contiguous per layer and K/V
- H `[layers, heads, 2, tokens, dim]`: a slice is one run per layer (a vLLM block's own head-major order)
- C `[heads, layers, 2, tokens, dim]`: a slice is one run for the whole page

Each copy is timed in turns with `numpy.copyto` of the slice's bytes between two
contiguous buffers (median of `--repeats`, after one untimed run of each), with numpy
(what gpu_worker/vllm/page_copies.py does on CPU) and with torch `copy_` on one thread:
"run", the pages of the batch into consecutive blocks (one copy per layer for them all);
"page", page by page into scattered blocks (one copy per page and layer); "indexed", into
the same scattered blocks with one indexed copy per layer (a gather or a scatter). More ranks than
KV heads (TP=16 on 8 heads): vLLM replicates heads, a rank holds one, and one rank per
head writes. A batch is `--batch-mib` of the rank's bytes (a 50K-token prompt's 3,125
pages where they fit). Target (issue 42): >= 0.5 x numpy.copyto per rank. Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

# A page's axes: L layers, K the K/V pair, N tokens, H KV heads, D head_dim.
LAYOUTS = {"A": "LKNHD", "B": "LKHND", "H": "LHKND", "C": "HLKND"}
BLOCK_AXES = "HKND"  # one layer of one vLLM CPU block, as a page reads it
PROMPT_PAGES = 3125  # a 50K-token prompt at 16 tokens a page


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: type = np.uint16  # bfloat16's bytes

    def page_shape(self, layout: str) -> tuple[int, ...]:
        size = {"L": self.layers, "K": 2, "N": self.page_size, "H": self.kv_heads, "D": self.head_dim}
        return tuple(size[axis] for axis in LAYOUTS[layout])

    @property
    def page_bytes(self) -> int:
        return self.layers * 2 * self.page_size * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


MODELS = {
    "small": Model("small (4 layers, 4 KV heads, dim 64)", 4, 4, 64),
    "8b": Model("Llama-3-8B (32 layers, 8 KV heads, dim 128)", 32, 8, 128),
    "70b": Model("Llama-3-70B (80 layers, 8 KV heads, dim 128)", 80, 8, 128),
}


def rank_heads(kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads [first, last) rank `tp_rank` holds: a slice of `kv_heads / tp_size`, or
    with more ranks than heads, the one head vLLM replicates onto it."""
    if tp_size <= kv_heads:
        per_rank = kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    head = tp_rank * kv_heads // tp_size
    return head, head + 1


def writes(kv_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether rank `tp_rank` writes its heads' slice: one writer per head (the first rank holding it)."""
    return tp_size <= kv_heads or tp_rank % (tp_size // kv_heads) == 0


def block_cache(model: Model, heads: int, num_blocks: int) -> np.ndarray:
    """One layer of a rank's vLLM CPU cache, `[blocks, heads, block_size, 2 * head_dim]`, as
    `[blocks, heads, 2, block_size, head_dim]`: each head's K rows, then its V rows."""
    cache = np.zeros((num_blocks, heads, model.page_size, 2 * model.head_dim), model.dtype)
    return cache.reshape(num_blocks, heads, 2, model.page_size, model.head_dim)


def slice_view(pages: np.ndarray, layout: str, layer: int, first_head: int, last_head: int) -> np.ndarray:
    """The rank's slice of one layer of `pages` (`[pages, *page shape]`), axes in the page's
    order without L."""
    index: list = [slice(None)] * pages.ndim
    axes = LAYOUTS[layout]
    index[1 + axes.index("L")] = layer
    index[1 + axes.index("H")] = slice(first_head, last_head)
    return pages[tuple(index)]


def blocks_as(blocks: np.ndarray, layout: str) -> np.ndarray:
    """`[blocks, *BLOCK_AXES]` blocks with their axes in the page's order without L (a view)."""
    order = LAYOUTS[layout].replace("L", "")
    return blocks.transpose(0, *(1 + BLOCK_AXES.index(axis) for axis in order))


def copy_slices(pages, layout, caches, heads, page_ids, block_ids, into_blocks: bool, copy) -> None:
    """Copies the rank's slice of each page to or from its block, layer by layer, with
    `copy(destination, source)`: as one copy per layer when both pages and blocks are a
    consecutive run, else page by page."""
    first_head, last_head = heads
    for layer, cache in enumerate(caches):
        if isinstance(page_ids, range) and isinstance(block_ids, range):  # consecutive runs
            spans = [(slice(page_ids.start, page_ids.stop), slice(block_ids.start, block_ids.stop))]
        else:
            spans = [(slice(p, p + 1), slice(b, b + 1)) for p, b in zip(page_ids, block_ids)]
        for page_span, block_span in spans:
            slice_ = slice_view(pages[page_span], layout, layer, first_head, last_head)
            block = blocks_as(cache[block_span], layout)
            if into_blocks:
                copy(block, slice_)
            else:
                copy(slice_, block)


def copy_indexed(pages, layout, caches, heads, block_ids: list[int], into_blocks: bool, library: str) -> None:
    """Copies the rank's slice of every page to or from its block, one indexed copy per layer
    (numpy's fancy indexing or torch's `index_put_` / `index_select` on the block axis)."""
    order = LAYOUTS[layout].replace("L", "")
    to_block_axes = (0, *(1 + order.index(axis) for axis in BLOCK_AXES))
    ids = np.asarray(block_ids) if library == "numpy" else torch.tensor(block_ids)
    for layer, cache in enumerate(caches):
        slice_ = slice_view(pages, layout, layer, *heads)
        if library == "numpy" and into_blocks:
            cache[ids] = slice_.transpose(to_block_axes)
        elif library == "numpy":
            np.copyto(slice_, blocks_as(cache[ids], layout))
        elif into_blocks:
            _signed(cache).index_put_((ids,), _signed(slice_.transpose(to_block_axes)))
        else:
            gathered = _signed(cache).index_select(0, ids).numpy()
            _signed(slice_).copy_(_signed(blocks_as(gathered, layout)))


def _signed(array: np.ndarray) -> torch.Tensor:
    """The uint16 array's bytes as a torch int16 tensor (torch indexes no uint16), no copy."""
    return torch.from_numpy(array.view(np.int16))


def numpy_copy(destination: np.ndarray, source: np.ndarray) -> None:
    np.copyto(destination, source)


def torch_copy(destination: np.ndarray, source: np.ndarray) -> None:
    torch.from_numpy(destination).copy_(torch.from_numpy(source))


def ratio_to_copyto(action, num_bytes: int, repeats: int) -> float:
    """`numpy.copyto` of `num_bytes` contiguous bytes against `action`: the ratio of their
    median times over `repeats` runs taken in turns (after one untimed run of each)."""
    src, dst = np.ones(num_bytes, np.uint8), np.empty(num_bytes, np.uint8)

    def floor() -> None:
        np.copyto(dst, src)

    times: dict = {action: [], floor: []}
    for _ in range(repeats + 1):
        for f, spent in times.items():
            start = time.perf_counter()
            f()
            spent.append(time.perf_counter() - start)
    return statistics.median(times[floor][1:]) / statistics.median(times[action][1:])


def measure(model: Model, tp_size: int, batch_bytes: int, repeats: int) -> tuple[int, dict[tuple, float]]:
    """The pages of a batch, and the ratios to numpy.copyto of the last rank's copies, by
    (layout, mode, direction, library)."""
    tp_rank = tp_size - 1
    heads = rank_heads(model.kv_heads, tp_size, tp_rank)
    rank_heads_count = heads[1] - heads[0]
    num_pages = min(PROMPT_PAGES, max(1, batch_bytes * model.kv_heads // (model.page_bytes * rank_heads_count)))
    caches = [block_cache(model, rank_heads_count, num_pages + 16) for _ in range(model.layers)]
    slice_bytes = num_pages * model.page_bytes * rank_heads_count // model.kv_heads
    consecutive = range(8, 8 + num_pages)
    scattered = [int(b) for b in np.random.default_rng(tp_size).permutation(num_pages + 16)[:num_pages]]
    ratios = {}
    for layout in LAYOUTS:
        pages = np.zeros((num_pages, *model.page_shape(layout)), model.dtype)
        for mode, blocks in (("run", consecutive), ("page", scattered), ("indexed", scattered)):
            for direction, into_blocks in (("save", False), ("load", True)):
                for library, copy in (("numpy", numpy_copy), ("torch", torch_copy)):
                    if mode == "indexed":
                        action = partial(copy_indexed, pages, layout, caches, heads, blocks, into_blocks, library)
                    else:
                        action = partial(
                            copy_slices, pages, layout, caches, heads, range(num_pages), blocks, into_blocks, copy
                        )
                    ratios[layout, mode, direction, library] = ratio_to_copyto(action, slice_bytes, repeats)
    return num_pages, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,8b,70b")
    parser.add_argument("--tp", default="1,2,4,8,16")
    parser.add_argument("--batch-mib", type=int, default=32, help="the rank's bytes a batch holds, in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # numpy.copyto's one thread, and the box is shared
    for key in args.models.split(","):
        model = MODELS[key]
        print(
            f"\n{model.name}, {model.page_size}-token pages, bf16: {model.page_bytes / 1024:.0f} KiB a full page; "
            f"median of {args.repeats} in turns, x numpy.copyto of the rank's bytes"
        )
        print(
            f"{'TP':>3} {'heads':>6} {'pages':>5} {'mode':>7} {'dir':>4} {'lib':>5}  "
            + "  ".join(f"{n:>5}" for n in LAYOUTS)
        )
        for tp_size in (int(t) for t in args.tp.split(",")):
            first, last = rank_heads(model.kv_heads, tp_size, tp_size - 1)
            heads = f"{first}-{last - 1}" if last - first > 1 else f"{first}"
            heads += "" if writes(model.kv_heads, tp_size, tp_size - 1) else " r"  # r: a reader only (replica)
            num_pages, ratios = measure(model, tp_size, args.batch_mib << 20, args.repeats)
            for mode in ("run", "page", "indexed"):
                for direction in ("save", "load"):
                    for library in ("numpy", "torch"):
                        row = "  ".join(f"{ratios[n, mode, direction, library]:5.2f}" for n in LAYOUTS)
                        print(
                            f"{tp_size:>3} {heads:>6} {num_pages:>5} {mode:>7} {direction:>4} {library:>5}  {row}",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
