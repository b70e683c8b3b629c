"""A tiny random model (fixed seed, no download) and the reference recompute, for the demo,
tests and benches: every process that builds it from the same seed gets the same weights.
"""

from __future__ import annotations

import torch

from gpu_worker.model import ModelRunner, PrefillRequest
from gpu_worker.model_config import ModelSpec, parse_config
from gpu_worker.weights import DenseMlpWeights, LayerWeights, Linear, ModelWeights, MoeWeights

LOGIT_TOLERANCE = 1e-4  # float32 max |Δ| between the paged engine and a full recompute


def model_config(family: str, vocab_size: int) -> dict:
    """A Hugging Face style config of a tiny model: 2 layers, hidden 64, GQA 4/2 heads."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=131072,
    )
    if family == "llama":
        return dict(model_type="llama", intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6, **common)
    if family == "gpt_oss":  # sliding (window 128) and full layers, attention sinks, 4 experts
        return dict(
            model_type="gpt_oss",
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            swiglu_limit=7.0,
            **common,
        )
    raise ValueError(f"unknown demo model family {family!r} (llama or gpt_oss)")


def tiny_model(family: str = "llama", seed: int = 0, vocab_size: int = 512) -> tuple[ModelSpec, ModelWeights]:
    """Spec and random weights (float32, std 0.1; norms near 1) drawn from `seed` alone."""
    spec = parse_config(model_config(family, vocab_size))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int, bias: bool) -> Linear:
        return Linear(rand(out_features, in_features), rand(out_features) if bias else None)

    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    layers = []
    for _ in range(spec.num_layers):
        if spec.moe is None:
            mlp: DenseMlpWeights | MoeWeights = DenseMlpWeights(
                linear(inter, h, spec.mlp_bias), linear(inter, h, spec.mlp_bias), linear(h, inter, spec.mlp_bias)
            )
        else:
            e = spec.moe.num_experts
            mlp = MoeWeights(
                linear(e, h, True), rand(e, h, 2 * inter), rand(e, 2 * inter), rand(e, inter, h), rand(e, h)
            )
        layers.append(
            LayerWeights(
                input_norm=1 + rand(h),
                q_proj=linear(spec.num_heads * d, h, spec.qkv_bias),
                k_proj=linear(spec.num_kv_heads * d, h, spec.qkv_bias),
                v_proj=linear(spec.num_kv_heads * d, h, spec.qkv_bias),
                o_proj=linear(h, spec.num_heads * d, spec.o_bias),
                sinks=rand(spec.num_heads, std=1.0) if spec.attention_sinks else None,
                post_attention_norm=1 + rand(h),
                mlp=mlp,
            )
        )
    embed = rand(spec.vocab_size, h, std=1.0)
    return spec, ModelWeights(embed, tuple(layers), 1 + rand(h), rand(spec.vocab_size, h))


def recompute_logits(runner: ModelRunner, page_size: int, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [vocab] of `tokens` computed from scratch in a private pool, no cache."""
    pages = -(-len(tokens) // page_size)
    pool = torch.empty(
        (pages, *runner.spec.page_layout(page_size, runner.dtype).page_shape), dtype=runner.dtype, device=runner.device
    )
    return runner.prefill([PrefillRequest(list(range(pages)), 0, tokens)], pool).last_logits[0]
