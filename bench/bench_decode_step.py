"""Decode step of a shared-prefix batch against the same batch with no sharing (small model, CPU).

N sequences share a P-token prefix and each has a few own tokens. With sharing, their
page tables point at one copy of the prefix pages in the device pool; without, each has
its own copy (what per-engine KV caches do). Both run the same ModelRunner.decode, so the
printed ratios isolate what sharing changes: pool bytes (memory) and step time.

    python bench/bench_decode_step.py [--sequences 8] [--prefix-tokens 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_worker.model import DecodeRequest, ModelRunner, PrefillRequest
from gpu_worker.tiny_model import tiny_model

PAGE = 16


def build_pool(runner: ModelRunner, spec, sequences: int, prefix: list[int], own: list[list[int]], shared: bool):
    """Prefills every sequence into a fresh pool; returns the pool and each sequence's page table."""
    prefix_pages = len(prefix) // PAGE
    own_pages = -(-(len(prefix) + max(map(len, own)) + 64) // PAGE) - prefix_pages  # room to decode
    copies = 1 if shared else sequences
    num_pages = copies * prefix_pages + sequences * own_pages
    pool = torch.zeros(num_pages, *spec.page_layout(PAGE, torch.float32).page_shape)
    tables = []
    for s in range(sequences):
        base = 0 if shared else s * prefix_pages
        prefix_table = list(range(base, base + prefix_pages))
        first_own = copies * prefix_pages + s * own_pages
        tables.append(prefix_table + list(range(first_own, first_own + own_pages)))
    # The prefix is computed once per copy; then each sequence's own tokens over it.
    for c in range(copies):
        runner.prefill([PrefillRequest(tables[c][:prefix_pages], 0, prefix)], pool)
    runner.prefill([PrefillRequest(tables[s], len(prefix), own[s]) for s in range(sequences)], pool)
    return pool, tables


def decode_time(runner: ModelRunner, pool, tables, lengths: list[int], steps: int) -> float:
    best = float("inf")
    lengths = list(lengths)
    for _ in range(steps):
        batch = [DecodeRequest(t, n, 7) for t, n in zip(tables, lengths)]
        start = time.perf_counter()
        runner.decode(batch, pool)
        best = min(best, time.perf_counter() - start)
        lengths = [n + 1 for n in lengths]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--own-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    spec, weights = tiny_model("llama")
    runner = ModelRunner(spec, weights)
    prefix = torch.randint(0, spec.vocab_size, (args.prefix_tokens // PAGE * PAGE,)).tolist()
    own = [torch.randint(0, spec.vocab_size, (args.own_tokens,)).tolist() for _ in range(args.sequences)]
    lengths = [len(prefix) + len(o) for o in own]
    results = {}
    for shared in (True, False):
        pool, tables = build_pool(runner, spec, args.sequences, prefix, own, shared)
        results[shared] = (pool.numel() * pool.element_size(), decode_time(runner, pool, tables, lengths, args.steps))
    (shared_bytes, shared_s), (private_bytes, private_s) = results[True], results[False]
    print(
        f"{args.sequences} sequences x {len(prefix)} shared + {args.own_tokens} own tokens, page_size {PAGE}, "
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, CPU"
    )
    print(
        f"  pool bytes: shared {shared_bytes / 2**20:.1f} MiB, no sharing {private_bytes / 2**20:.1f} MiB"
        f" = {shared_bytes / private_bytes:.3f} (the prefix once instead of {args.sequences} times)"
    )
    print(
        f"  decode step: shared {shared_s * 1e3:.1f} ms, no sharing {private_s * 1e3:.1f} ms"
        f" = {shared_s / private_s:.2f}x the unshared step time"
    )


if __name__ == "__main__":
    main()
