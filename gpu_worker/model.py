"""Reference model runner: Llama-family and GPT-OSS forward passes over a paged KV pool.

The runner computes Q/K/V only for tokens that are not cached. A suffix-only prefill
embeds the suffix tokens, writes their K/V into private pages at positions
``[prefix_shared_tokens, context_length)`` and attends over the cached prefix pages plus
the suffix; the shared prefix pages are only read. A full hit (every prompt token cached)
runs the last prompt token's query alone over its cached context and writes nothing.
The math follows transformers' ``modeling_llama.py`` / ``modeling_gpt_oss.py`` (RoPE on
the two halves of each head, RMSNorm in float32, SwiGLU, GPT-OSS's clamped SwiGLU experts,
attention sinks, yarn) so logits match HF's eager implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionBatch, paged_attention, write_kv
from gpu_worker.model_config import ModelSpec, RopeSpec
from gpu_worker.weights import DenseMlpWeights, Linear, ModelWeights, MoeWeights

# Called with layer i right after layer i's new K/V are written into the pool (before that
# layer's attention), in the current stream's order: on CUDA a copy to host pages enqueued
# on another stream after an event recorded now overlaps the remaining layers.
LayerCallback = Callable[[int], None]


@dataclass(frozen=True)
class PrefillRequest:
    """One prompt whose first ``prefix_shared_tokens`` tokens have K/V in the pool already.

    ``page_table`` covers the whole prompt: cached prefix pages first, then private pages
    for the suffix (a list of pool pages, or ``BatchTables.tables[i]`` on the device).
    ``suffix_input_ids`` are the prompt tokens after the prefix. A full hit
    has an empty suffix and must name the prompt's last token in ``full_hit_last_token``:
    its query is recomputed (its K/V are not) so the prompt's next-token logits exist.
    """

    page_table: Sequence[int] | torch.Tensor  # [pages] pool page ids, token order
    prefix_shared_tokens: int
    suffix_input_ids: Sequence[int]
    full_hit_last_token: int | None = None

    def __post_init__(self) -> None:
        if self.prefix_shared_tokens < 0:
            raise ValueError(f"prefix_shared_tokens must be >= 0, got {self.prefix_shared_tokens}")
        if self.is_full_hit != (self.full_hit_last_token is not None):
            raise ValueError("an empty suffix (full hit) needs full_hit_last_token, and only a full hit may set it")
        if self.is_full_hit and self.prefix_shared_tokens == 0:
            raise ValueError("a full hit needs at least one cached token")

    @property
    def is_full_hit(self) -> bool:
        return len(self.suffix_input_ids) == 0

    @property
    def suffix_length(self) -> int:
        return len(self.suffix_input_ids)

    @property
    def context_length(self) -> int:
        return self.prefix_shared_tokens + self.suffix_length


@dataclass(frozen=True)
class DecodeRequest:
    """One new token at position ``context_length`` of a sequence with that many cached tokens.

    Its K/V go to slot ``context_length`` of ``page_table``, which must already hold that page.
    """

    page_table: Sequence[int] | torch.Tensor  # [pages] pool page ids, token order
    context_length: int
    input_id: int


@dataclass(frozen=True)
class PrefillOutput:
    """Logits of a prefill batch (float32), and what the forward pass computed."""

    last_logits: torch.Tensor  # [batch, vocab]: next-token logits of each prompt
    token_logits: tuple[torch.Tensor, ...] | None  # per request [suffix_len or 1, vocab]; if asked for
    # Per request, the prompt tokens the forward pass ran through every layer: the suffix,
    # or a full hit's last token (its query is recomputed for the logits, its K/V are not).
    computed_tokens: tuple[int, ...]


class ModelRunner:
    """Runs one model over a device page pool; the same code on cpu and cuda."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", to compare with pools
        self.dtype = dtype
        self.weights = weights.to(self.device, dtype)
        inv_freq, self._rope_scale = rope_frequencies(spec.rope, spec.head_dim)
        self._inv_freq = inv_freq.to(self.device)  # [head_dim / 2] float32

    def prefill(
        self,
        batch: Sequence[PrefillRequest],
        kv_pool: torch.Tensor,
        *,
        all_logits: bool = False,
        on_layer_written: LayerCallback | None = None,
    ) -> PrefillOutput:
        """Suffix-only prefill of a mixed batch (misses, prefix hits and full hits together).

        Writes each suffix token's K/V into its slot (never below ``prefix_shared_tokens``)
        and returns next-token logits; with ``all_logits`` also every suffix token's logits.
        """
        page_size = self._check_pool(kv_pool)
        input_ids = [int(t) for r in batch for t in ([r.full_hit_last_token] if r.is_full_hit else r.suffix_input_ids)]
        attn = AttentionBatch.build(
            page_tables=[r.page_table for r in batch],
            query_starts=[r.context_length - 1 if r.is_full_hit else r.prefix_shared_tokens for r in batch],
            query_lens=[max(r.suffix_length, 1) for r in batch],
            writes_kv=[not r.is_full_hit for r in batch],
            page_size=page_size,
            device=self.device,
        )
        hidden = self._forward(torch.tensor(input_ids, device=self.device), attn, kv_pool, on_layer_written)
        ends = torch.tensor(attn.query_lens, device=self.device).cumsum(0)
        last = self._logits(hidden[ends - 1])  # [batch, vocab]
        per_token = None
        if all_logits:
            per_token = tuple(self._logits(hidden).split(list(attn.query_lens)))
        return PrefillOutput(last, per_token, tuple(int(n) for n in attn.query_lens))

    def decode(
        self,
        batch: Sequence[DecodeRequest],
        kv_pool: torch.Tensor,
        *,
        on_layer_written: LayerCallback | None = None,
    ) -> torch.Tensor:
        """One decode step: returns next-token logits ``[batch, vocab]`` (float32)."""
        page_size = self._check_pool(kv_pool)
        attn = AttentionBatch.build(
            page_tables=[r.page_table for r in batch],
            query_starts=[r.context_length for r in batch],
            query_lens=[1] * len(batch),
            writes_kv=[True] * len(batch),
            page_size=page_size,
            device=self.device,
        )
        input_ids = torch.tensor([r.input_id for r in batch], device=self.device)
        return self._logits(self._forward(input_ids, attn, kv_pool, on_layer_written))

    def _check_pool(self, kv_pool: torch.Tensor) -> int:
        """Assert the pool matches this model's page layout; return its page size."""
        expected = self.spec.page_layout(kv_pool.shape[3], self.dtype).page_shape
        got = tuple(kv_pool.shape[1:])
        assert got == expected, f"kv_pool pages are {got}, the model needs {expected}"
        assert kv_pool.dtype == self.dtype and kv_pool.device == self.device, (
            f"kv_pool is {kv_pool.dtype} on {kv_pool.device}, runner is {self.dtype} on {self.device}"
        )
        return int(kv_pool.shape[3])

    def _forward(
        self,
        input_ids: torch.Tensor,
        attn: AttentionBatch,
        kv_pool: torch.Tensor,
        on_layer_written: LayerCallback | None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[tokens, hidden]`` of the batch's query tokens."""
        spec, w = self.spec, self.weights
        tokens, heads, kv_heads, head_dim = attn.num_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
        assert input_ids.shape == (tokens,)
        hidden = w.embed_tokens[input_ids]  # [tokens, hidden]
        cos, sin = self._rope(attn.positions)  # [tokens, head_dim / 2]
        cos_kv, sin_kv = cos[attn.write_rows], sin[attn.write_rows]  # [written, head_dim / 2]
        for i, (layer, kind) in enumerate(zip(w.layers, spec.layers)):
            x = rms_norm(hidden, layer.input_norm, spec.rms_norm_eps)  # [tokens, hidden]
            x_new = x[attn.write_rows]  # [written, hidden]: full-hit queries have cached K/V
            q = linear(x, layer.q_proj).view(tokens, heads, head_dim)
            k = linear(x_new, layer.k_proj).view(-1, kv_heads, head_dim)  # [written, kv_heads, head_dim]
            v = linear(x_new, layer.v_proj).view(-1, kv_heads, head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos_kv, sin_kv)
            write_kv(kv_pool, i, attn.slot_pages, attn.slot_offsets, k, v)
            if on_layer_written is not None:
                on_layer_written(i)
            out = paged_attention(
                q, kv_pool, i, attn, scale=head_dim**-0.5, window=kind.window, sinks=layer.sinks
            )  # [tokens, heads, head_dim]
            hidden = hidden + linear(out.reshape(tokens, heads * head_dim), layer.o_proj)
            x = rms_norm(hidden, layer.post_attention_norm, spec.rms_norm_eps)
            if isinstance(layer.mlp, MoeWeights):
                hidden = hidden + self._moe(x, layer.mlp)
            else:
                hidden = hidden + dense_mlp(x, layer.mlp)
        return rms_norm(hidden, w.final_norm, spec.rms_norm_eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> [n, vocab] float32
        return (hidden @ self.weights.lm_head.T).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[tokens, head_dim / 2]`` in the model dtype, as HF's rotary embedding."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return (freqs.cos() * self._rope_scale).to(self.dtype), (freqs.sin() * self._rope_scale).to(self.dtype)

    def _moe(self, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
        """GPT-OSS MoE: softmax over the top-k router logits, clamped SwiGLU experts."""
        # x: [tokens, hidden]
        moe = self.spec.moe
        assert moe is not None
        router_logits = linear(x, w.router)  # [tokens, experts]
        top_values, top_experts = torch.topk(router_logits, moe.top_k, dim=-1)  # [tokens, top_k]
        top_weights = torch.softmax(top_values, dim=1)
        out = torch.zeros_like(x)
        for expert in top_experts.unique().tolist():
            token_idx, slot = torch.where(top_experts == expert)  # [routed]
            gate_up = x[token_idx] @ w.gate_up[expert] + w.gate_up_bias[expert]  # [routed, 2 * intermediate]
            gate = gate_up[:, ::2].clamp(max=moe.swiglu_limit)
            up = gate_up[:, 1::2].clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))  # [routed, intermediate]
            y = act @ w.down[expert] + w.down_bias[expert]  # [routed, hidden]
            out.index_add_(0, token_idx, y * top_weights[token_idx, slot, None])
        return out


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    return F.linear(x, w.weight, w.bias)


def dense_mlp(x: torch.Tensor, w: DenseMlpWeights) -> torch.Tensor:
    """Llama SwiGLU: down(silu(gate(x)) * up(x))."""
    return linear(F.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in the dtype of ``x``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (HF's ``rotate_half`` convention)."""
    # x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim / 2]
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_frequencies(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` and the cos/sin scale, as ``modeling_rope_utils``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    return _yarn(rope, head_dim)


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by ``factor``, keep high ones, smooth between."""
    old_context = rope.original_max_position_embeddings
    assert old_context is not None
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin."""

    original = rope.original_max_position_embeddings
    assert original is not None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
