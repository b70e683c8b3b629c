"""The vLLM connector's page copies against `numpy.copyto` of the same bytes, in one run.

    python bench/bench_vllm_copy.py [--tokens 16384] [--repeats 5]

One kvd daemon, one sequence of `tokens / 32` private pages in its shared memory (the
layout of bench/bench_vllm.py's model: 4 layers x 2 KV heads x head_dim 64, 32-token
pages, float32: 32 KiB per page and layer), and a vLLM CPU-backend KV cache of the same
shape per layer. Timed in turns with `numpy.copyto` of one buffer of the same size into
another (best of `--repeats` each, printed as a ratio): the connector's save (vLLM blocks
into kvd pages) and load (pages into blocks) through gpu_worker/vllm/page_copies.py, into
blocks that are consecutive and into blocks scattered at random; and the indexed torch
copies the worker made before (a gather, then a scatter into a permuted view).
Target: >= 0.5 x numpy.copyto. On a loaded box the ratios swing; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from engine_client import KVDClient, PageLayout, SequenceRequest
from engine_client.launch import DaemonProcess
from gpu_worker.vllm.page_copies import by_extent, copy_layer
from gpu_worker.vllm.worker import block_view

LAYOUT = PageLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=32, dtype="float32")


def side_by_side(action, reference, repeats: int) -> float:
    """How fast `action` runs against `reference`: the ratio of their fastest of `repeats`
    runs, taken in turns (after one untimed run of each), so that both see the same box."""
    times: dict = {action: [], reference: []}
    for _ in range(repeats + 1):
        for f, spent in times.items():
            start = time.perf_counter()
            f()
            spent.append(time.perf_counter() - start)
    return min(times[reference][1:]) / min(times[action][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    num_pages = args.tokens // LAYOUT.page_size
    num_bytes = num_pages * LAYOUT.page_bytes
    with tempfile.TemporaryDirectory() as workdir:
        socket = os.path.join(workdir, "kvd.sock")
        daemon = DaemonProcess.start(socket, "--host-bytes", "1GiB", log_path=os.path.join(workdir, "kvd.log"))
        try:
            with KVDClient.connect(socket, client_name="bench") as kvd:
                ns = kvd.register_namespace("bench-copy", LAYOUT)
                tokens = [int(t) for t in np.random.default_rng(0).integers(1, 30000, args.tokens)]
                [seq] = kvd.allocate_with_prefix(ns, [SequenceRequest("s", tokens)])
                groups = kvd.pages_by_extent(ns, seq.pages, writable=True)
                run(args, groups, num_pages, num_bytes)
        finally:
            daemon.stop()
            daemon.clean()


def run(args, groups, num_pages: int, num_bytes: int) -> None:
    heads, dim, block = LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.page_size
    # vLLM's CPU cache, per layer: [num_blocks, kv_heads, block_size, 2 * head_dim]
    cache = [torch.randn(num_pages + 64, heads, block, 2 * dim) for _ in range(LAYOUT.num_layers)]
    views = [block_view(kv, LAYOUT, k_then_v_rows=True) for kv in cache]
    consecutive = list(range(10, 10 + num_pages))
    scattered = [int(b) for b in np.random.default_rng(1).permutation(num_pages + 64)[:num_pages]]
    src, dst = np.random.rand(num_bytes // 4).astype(np.float32), np.empty(num_bytes // 4, np.float32)
    layer_kib = LAYOUT.page_bytes // LAYOUT.num_layers // 1024
    print(
        f"{num_pages} pages x {LAYOUT.num_layers} layers = {num_bytes / 2**20:.0f} MiB ({layer_kib} KiB a page and "
        f"layer) in {len(groups)} extent(s), best of {args.repeats} in turns"
    )

    def memcpy():
        np.copyto(dst, src)

    for name, blocks in (("consecutive", consecutive), ("scattered", scattered)):
        copies = by_extent((extent, indices, [blocks[p] for p in positions]) for extent, indices, positions in groups)
        for what, into_blocks in (("save", False), ("load", True)):

            def copy(copies=copies, into_blocks=into_blocks):
                for layer, view in enumerate(views):
                    copy_layer(view, layer, copies, into_blocks)

            print(f"  {what} into {name:11} blocks: {side_by_side(copy, memcpy, args.repeats):.2f} x numpy.copyto")
    # The copies the worker made before: an indexed gather, then a scatter into a permuted view.
    permuted = [kv.view(-1, heads, 2, block, dim).permute(0, 2, 3, 1, 4) for kv in cache]

    def indexed_load():
        for layer, view in enumerate(permuted):
            for extent, indices, positions in groups:
                view[torch.tensor([scattered[p] for p in positions])] = extent[indices, layer]

    ratio = side_by_side(indexed_load, memcpy, args.repeats)
    print(f"  before (indexed torch copies), load into scattered blocks: {ratio:.2f} x numpy.copyto")


if __name__ == "__main__":
    main()
