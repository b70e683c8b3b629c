"""What the reference runner needs to know about a model, parsed from a Hugging Face config.

``ModelSpec`` is the one frozen description of a supported architecture: sizes, RoPE,
per-layer attention kind (full or sliding window), attention sinks, biases and MoE.
Parsing is strict: a model type or attention feature the runner cannot compute exactly
(multi-head latent attention, sparse-attention indexers, compressed or shared-KV
attention, quantised checkpoints, unknown RoPE scalings) raises ``UnsupportedModelError``
instead of being run as plain GQA, which would produce plausible-looking but wrong KV
pages. The error names every such feature the config shows (``unsupported_features``), so
a DeepSeek-V3.2 config reads as MLA *and* a DSA indexer, a DeepSeek-V4 one as compressed
sparse attention with shared K = V, not as MLA.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine_client import PageLayout

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt_oss")

_CSA = "compressed sparse attention with one shared K = V head (CSA/HCA)"
# Features that make a model "not plain GQA", each with the config keys that show it (a
# key shows it when present and neither null nor false). One feature may show by several
# keys; it is named once, with the keys found.
_UNSUPPORTED_FEATURES: dict[str, tuple[str, ...]] = {
    "multi-head latent attention (MLA)": ("kv_lora_rank", "use_mla"),
    "a sparse attention indexer (DSA)": ("index_topk", "index_n_heads", "index_head_dim"),
    _CSA: (
        "compress_ratios",
        "compress_rate_csa",
        "compress_rate_hca",
        "compress_rope_theta",
    ),
    "a low-rank query projection": ("q_lora_rank",),
    "a grouped low-rank output projection": ("o_lora_rank", "o_groups"),
    "sparse attention": ("sparse_attention_config",),
    "chunked local attention": ("attention_chunk_size",),
    "a quantised checkpoint (dequantise it first)": ("quantization_config",),
}
# layer_types entries that name attention kinds the runner does not compute.
_UNSUPPORTED_LAYER_KINDS = {"compressed_sparse_attention": _CSA, "heavily_compressed_attention": _CSA}

# Keys HF's config classes default when a config.json leaves them out.
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 10000.0, "mistral": 10000.0, "gpt_oss": 150000.0}
_GPT_OSS_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

RopeKind = Literal["default", "linear", "llama3", "yarn"]
AttentionKind = Literal["full", "sliding"]


class UnsupportedModelError(ValueError):
    """The config describes a model or feature the reference runner does not compute."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, in HF's ``rope_parameters`` vocabulary.

    ``factor`` is 1.0 for ``default``; the llama3 and yarn fields hold HF's defaults when
    the config leaves them out, so the frequencies match ``modeling_rope_utils`` exactly.
    """

    kind: RopeKind
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float | None = None  # yarn: cos/sin scale; None = derived from factor
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn


@dataclass(frozen=True)
class LayerAttention:
    """Attention pattern of one layer: full causal, or a causal window of ``window`` keys.

    A query at position p sees keys at positions in (p - window, p] (HF's sliding mask).
    """

    kind: AttentionKind
    window: int | None = None

    def __post_init__(self) -> None:
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(f"{self.kind} attention with window {self.window!r}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"sliding window must be positive, got {self.window}")


@dataclass(frozen=True)
class MoeSpec:
    """GPT-OSS mixture of experts: top-k router, experts with a clamped SwiGLU."""

    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one supported decoder-only model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width, or the width of one expert
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    layers: tuple[LayerAttention, ...]
    attention_sinks: bool  # GPT-OSS: a learned per-head logit joins each softmax
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool  # dense MLP only
    moe: MoeSpec | None
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def page_layout(self, page_size: int, dtype: object) -> PageLayout:
        """The KV page layout of this model; ``dtype`` is a torch dtype or its name."""
        name = str(dtype).removeprefix("torch.")
        return PageLayout(self.num_layers, self.num_kv_heads, self.head_dim, page_size, name)


def parse_config(config: object) -> ModelSpec:
    """Build a ``ModelSpec`` from a ``PretrainedConfig``, a config dict, or a config.json path."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    elif isinstance(config, Mapping):
        cfg = dict(config)
    elif hasattr(config, "to_dict"):
        cfg = config.to_dict()
    else:
        raise TypeError(f"cannot read a model config from {type(config).__name__}")
    return _parse(cfg)


def unsupported_features(cfg: Mapping[str, Any]) -> list[str]:
    """Every feature the config shows that the runner does not compute, each with the
    config keys (or layer kinds) that show it, in ``_UNSUPPORTED_FEATURES``' order."""
    found: dict[str, list[str]] = {}
    for feature, keys in _UNSUPPORTED_FEATURES.items():
        for key in keys:
            if cfg.get(key) not in (None, False):
                found.setdefault(feature, []).append(key)
    for kind in dict.fromkeys(cfg.get("layer_types") or ()):
        if kind in _UNSUPPORTED_LAYER_KINDS:
            found.setdefault(_UNSUPPORTED_LAYER_KINDS[kind], []).append(f"layer_types {kind!r}")
    order = list(_UNSUPPORTED_FEATURES)
    return [f"{f} ({', '.join(keys)})" for f, keys in sorted(found.items(), key=lambda item: order.index(item[0]))]


def _parse(cfg: dict[str, Any]) -> ModelSpec:
    model_type = cfg.get("model_type")
    features = unsupported_features(cfg)
    if features:
        raise UnsupportedModelError(
            f"model_type {model_type!r} uses {'; '.join(features)}; the reference runner implements none of "
            "these, and the model must not be run as plain GQA"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act {cfg['hidden_act']!r} is not silu")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{model_type}: partial rotary embeddings are not supported")

    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    is_gpt_oss = model_type == "gpt_oss"
    moe = None
    if is_gpt_oss:
        moe = MoeSpec(
            num_experts=int(cfg.get("num_local_experts") or cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
    attention_bias = bool(cfg.get("attention_bias", is_gpt_oss))
    return ModelSpec(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if is_gpt_oss else 1e-6)),
        rope=_parse_rope(cfg, model_type),
        layers=_parse_layers(cfg, model_type, num_layers),
        attention_sinks=is_gpt_oss,
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        moe=moe,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _parse_layers(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[LayerAttention, ...]:
    """Per-layer attention pattern, following each HF model's own rules."""
    window = cfg.get("sliding_window")
    if model_type == "llama":
        kinds = ["full_attention"] * num_layers
    elif model_type == "mistral":
        # HF's Mistral applies its sliding window to every layer and ignores layer_types.
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif model_type == "qwen2":
        if not cfg.get("use_sliding_window", False):
            window = None
        first_sliding = cfg.get("max_window_layers", 28)
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    else:  # gpt_oss: even layers slide, odd layers are full, unless layer_types says otherwise
        window = cfg.get("sliding_window", 128)
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    if len(kinds) != num_layers:
        raise UnsupportedModelError(f"{model_type}: {len(kinds)} layer_types for {num_layers} layers")
    layers = []
    for i, kind in enumerate(kinds):
        if kind == "full_attention" or (kind == "sliding_attention" and window is None):
            layers.append(LayerAttention("full"))  # HF: a sliding layer without a window is full
        elif kind == "sliding_attention":
            layers.append(LayerAttention("sliding", int(window)))
        else:
            raise UnsupportedModelError(f"{model_type}: layer {i} has unsupported attention kind {kind!r}")
    return tuple(layers)


def _parse_rope(cfg: dict[str, Any], model_type: str) -> RopeSpec:
    """Read ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if model_type == "gpt_oss" and "rope_type" not in params and "type" not in params:
        params = {**_GPT_OSS_DEFAULT_ROPE, **params}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(f"{model_type}: per-layer-type RoPE parameters are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA[model_type])))
    if kind == "default":
        return RopeSpec("default", theta)
    if kind == "linear":
        return RopeSpec("linear", theta, factor=float(params["factor"]))
    original = int(params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    if kind == "llama3":
        return RopeSpec(
            "llama3",
            theta,
            factor=float(params["factor"]),
            original_max_position_embeddings=original,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    if kind == "yarn":
        factor = params.get("factor") or cfg["max_position_embeddings"] / original
        optional = {k: params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")}
        return RopeSpec(
            "yarn",
            theta,
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            **{k: None if v is None else float(v) for k, v in optional.items()},
        )
    raise UnsupportedModelError(f"{model_type}: rope type {kind!r} is not supported")
