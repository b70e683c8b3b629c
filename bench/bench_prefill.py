"""Suffix-only prefill over a cached prefix against a full prefill, on a small random model.

A prompt of ``--prefix-tokens`` shared tokens plus ``--suffix-tokens`` new ones is
prefilled twice: once with nothing cached (every token computed), once with the prefix
pages already in the pool (only the suffix computed). Prints the tokens each computes,
both wall times, the FLOPs-ideal speed-up (projections and MLP per computed token plus
causal attention per visible key) and "achieved speedup / ideal speedup".

    python bench/bench_prefill.py --prefix-tokens 8192 --suffix-tokens 256 --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_worker.model import ModelRunner, PrefillRequest
from gpu_worker.model_config import ModelSpec
from gpu_worker.weights import load_model

PAGE_SIZE = 16


def small_model(device: str) -> ModelRunner:
    """A 4-layer GQA Llama (hidden 256, 4 heads over 2 kv heads) with random weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=65536,
    )
    spec, weights = load_model(LlamaForCausalLM(config))
    return ModelRunner(spec, weights, device=device, dtype=torch.float32)


def prefill_flops(spec: ModelSpec, first: int, end: int) -> float:
    """FLOPs of computing positions [first, end) of one prompt (dense model, causal)."""
    h, d = spec.hidden_size, spec.head_dim
    per_layer_params = h * d * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 3 * h * spec.intermediate_size
    total = 2.0 * per_layer_params * spec.num_layers * (end - first)
    for kind in spec.layers:
        # q @ k and p @ v: 4 * heads * head_dim FLOPs per (query, visible key) pair
        visible = sum(min(p + 1, kind.window or p + 1) for p in range(first, end))
        total += 4.0 * spec.num_heads * d * visible
    return total + 2.0 * h * spec.vocab_size  # next-token logits of the last position


def timed(r: ModelRunner, request: PrefillRequest, pool: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Best wall time of ``repeats`` prefills of ``request``, and its next-token logits."""
    best = float("inf")
    for _ in range(repeats):
        if pool.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = r.prefill([request], pool).last_logits
        if pool.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prefix, suffix = args.prefix_tokens, args.suffix_tokens
    if prefix % PAGE_SIZE or prefix <= 0 or suffix <= 0:
        parser.error(f"--prefix-tokens must be a positive multiple of the page size {PAGE_SIZE}; suffix > 0")

    r = small_model(args.device)
    total = prefix + suffix
    pages = -(-total // PAGE_SIZE)
    pool = torch.zeros(2 * pages, *r.spec.page_layout(PAGE_SIZE, r.dtype).page_shape, device=args.device)
    ids = torch.randint(0, r.spec.vocab_size, (total,), generator=torch.Generator().manual_seed(1)).tolist()
    miss_table = list(range(pages))
    # The hit reads the miss run's prefix pages and writes its suffix into pages of its own.
    hit_table = miss_table[: prefix // PAGE_SIZE] + list(range(pages, pages + pages - prefix // PAGE_SIZE))

    r.prefill([PrefillRequest(miss_table, 0, ids[:64])], pool)  # warm-up
    miss_s, miss_logits = timed(r, PrefillRequest(miss_table, 0, ids), pool, args.repeats)
    hit_s, hit_logits = timed(r, PrefillRequest(hit_table, prefix, ids[prefix:]), pool, args.repeats)

    ideal = prefill_flops(r.spec, 0, total) / prefill_flops(r.spec, prefix, total)
    achieved = miss_s / hit_s
    drift = ((hit_logits - miss_logits).abs().max() / miss_logits.abs().max()).item()
    print(
        f"model: {r.spec.num_layers} layers, hidden {r.spec.hidden_size}, "
        f"{r.spec.num_heads}/{r.spec.num_kv_heads} heads, device {args.device}"
    )
    print(f"tokens computed: without prefix hit {total}, with prefix hit {suffix} (prefix {prefix} cached)")
    print(f"prefill wall time: without hit {miss_s * 1e3:.1f} ms, with hit {hit_s * 1e3:.1f} ms")
    print(f"achieved speedup {achieved:.2f}x, FLOPs-ideal speedup {ideal:.2f}x")
    print(f"achieved speedup / ideal speedup: {achieved / ideal:.3f}")
    print(f"next-token logits, hit vs miss: max|d|/max|ref| = {drift:.1e}")


if __name__ == "__main__":
    main()
