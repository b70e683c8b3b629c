"""Model weights for the reference runner, from a transformers model or a local checkpoint.

Weights are read under Hugging Face's parameter names (``model.layers.{i}.self_attn.q_proj
.weight`` ...) into typed per-layer dataclasses, so the runner never looks a name up.
Loading is strict: a missing tensor, a tensor the spec does not expect (say an MLP bias
the config did not announce) or a quantised tensor (``*_blocks``/``*_scales``) is an
error rather than a silently different model. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from gpu_worker.model_config import ModelSpec, UnsupportedModelError, parse_config

# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """A checkpoint that does not hold the tensors its config describes."""


@dataclass(frozen=True)
class Linear:
    """y = x @ weight.T + bias."""

    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None  # [out_features]


@dataclass(frozen=True)
class DenseMlpWeights:
    """Llama-family SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True)
class MoeWeights:
    """GPT-OSS experts, in HF's transposed, gate/up-interleaved layout."""

    router: Linear  # weight: [experts, hidden]
    gate_up: torch.Tensor  # [experts, hidden, 2 * intermediate]; even columns gate, odd up
    gate_up_bias: torch.Tensor  # [experts, 2 * intermediate]
    down: torch.Tensor  # [experts, intermediate, hidden]
    down_bias: torch.Tensor  # [experts, hidden]


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    sinks: torch.Tensor | None  # [heads]; GPT-OSS only
    post_attention_norm: torch.Tensor  # [hidden]
    mlp: DenseMlpWeights | MoeWeights


@dataclass(frozen=True)
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ModelWeights:
        """Copy to ``device`` in ``dtype``; sinks stay float32 because softmax runs in float32."""
        moved = _map_tensors(self, lambda name, t: t.to(device, torch.float32 if name == "sinks" else dtype))
        if self.lm_head is self.embed_tokens:  # keep tied weights one tensor
            moved = replace(moved, lm_head=moved.embed_tokens)
        return moved


def load_state_dict(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor]) -> ModelWeights:
    """Weights from a ``CausalLM`` state dict (``model.state_dict()`` of a transformers model)."""
    quantised = sorted(k for k in state_dict if k.endswith(("_blocks", "_scales")))
    if quantised:
        raise UnsupportedModelError(f"quantised tensors are not supported (e.g. {quantised[0]!r})")
    reader = _Reader(state_dict)
    layers = tuple(_read_layer(spec, reader, f"model.layers.{i}.") for i in range(spec.num_layers))
    embed = reader.take("model.embed_tokens.weight")
    if spec.tie_word_embeddings:
        reader.discard("lm_head.weight")  # transformers lists the tied tensor under both names
        lm_head = embed
    else:
        lm_head = reader.take("lm_head.weight")
    weights = ModelWeights(embed, layers, reader.take("model.norm.weight"), lm_head)
    reader.assert_consumed()
    return weights


def load_model(model: torch.nn.Module) -> tuple[ModelSpec, ModelWeights]:
    """Spec and weights of an in-memory transformers ``*ForCausalLM`` model."""
    spec = parse_config(model.config)
    return spec, load_state_dict(spec, model.state_dict())


def load_directory(path: str | Path) -> tuple[ModelSpec, ModelWeights]:
    """Spec and weights of a local checkpoint: config.json plus one or more *.safetensors."""
    from safetensors.torch import load_file

    path = Path(path)
    spec = parse_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(file))
    return spec, load_state_dict(spec, state_dict)


class _Reader:
    """Takes tensors out of a state dict by name and reports what was missing or left over."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._left = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_SUFFIXES)}

    def take(self, name: str) -> torch.Tensor:
        if name not in self._left:
            raise WeightsError(f"checkpoint has no tensor {name!r}")
        return self._left.pop(name)

    def discard(self, name: str) -> None:
        self._left.pop(name, None)

    def linear(self, prefix: str, bias: bool) -> Linear:
        return Linear(self.take(prefix + "weight"), self.take(prefix + "bias") if bias else None)

    def assert_consumed(self) -> None:
        if self._left:
            names = sorted(self._left)
            raise WeightsError(f"checkpoint has {len(names)} tensors the config does not describe, e.g. {names[:3]}")


def _read_layer(spec: ModelSpec, reader: _Reader, prefix: str) -> LayerWeights:
    attn = prefix + "self_attn."
    if spec.moe is None:
        mlp: DenseMlpWeights | MoeWeights = DenseMlpWeights(
            gate=reader.linear(prefix + "mlp.gate_proj.", spec.mlp_bias),
            up=reader.linear(prefix + "mlp.up_proj.", spec.mlp_bias),
            down=reader.linear(prefix + "mlp.down_proj.", spec.mlp_bias),
        )
    else:
        experts = prefix + "mlp.experts."
        mlp = MoeWeights(
            router=reader.linear(prefix + "mlp.router.", bias=True),
            gate_up=reader.take(experts + "gate_up_proj"),
            gate_up_bias=reader.take(experts + "gate_up_proj_bias"),
            down=reader.take(experts + "down_proj"),
            down_bias=reader.take(experts + "down_proj_bias"),
        )
    layer = LayerWeights(
        input_norm=reader.take(prefix + "input_layernorm.weight"),
        q_proj=reader.linear(attn + "q_proj.", spec.qkv_bias),
        k_proj=reader.linear(attn + "k_proj.", spec.qkv_bias),
        v_proj=reader.linear(attn + "v_proj.", spec.qkv_bias),
        o_proj=reader.linear(attn + "o_proj.", spec.o_bias),
        sinks=reader.take(attn + "sinks") if spec.attention_sinks else None,
        post_attention_norm=reader.take(prefix + "post_attention_layernorm.weight"),
        mlp=mlp,
    )
    _check_shapes(spec, layer, prefix)
    return layer


def _check_shapes(spec: ModelSpec, layer: LayerWeights, prefix: str) -> None:
    h, d = spec.hidden_size, spec.head_dim
    expected = {
        "q_proj": (spec.num_heads * d, h),
        "k_proj": (spec.num_kv_heads * d, h),
        "v_proj": (spec.num_kv_heads * d, h),
        "o_proj": (h, spec.num_heads * d),
    }
    for name, shape in expected.items():
        got = tuple(getattr(layer, name).weight.shape)
        if got != shape:
            raise WeightsError(f"{prefix}self_attn.{name}.weight has shape {got}, config says {shape}")
    if isinstance(layer.mlp, MoeWeights) and spec.moe is not None:
        shape = (spec.moe.num_experts, h, 2 * spec.intermediate_size)
        got = tuple(layer.mlp.gate_up.shape)
        if got != shape:
            raise WeightsError(f"{prefix}mlp.experts.gate_up_proj has shape {got}, config says {shape}")


def _map_tensors(obj, fn):
    """Rebuild a weights dataclass tree with ``fn(field_name, tensor)`` applied to each tensor."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(f.name, value)
        elif isinstance(value, tuple):
            changes[f.name] = tuple(_map_tensors(v, fn) for v in value)
        elif value is not None:
            changes[f.name] = _map_tensors(value, fn)
    return replace(obj, **changes)
