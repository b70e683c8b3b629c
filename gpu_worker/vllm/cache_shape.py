"""`CacheShape`: what the kvd pages of one vLLM instance hold, read from vLLM's configuration.

`namespace_spec` turns vLLM's config and its KV-cache groups into the kvd namespace of
this instance's KV bytes (model, revision, page layout, tensor-parallel degree, and for
vLLM's CPU backend the block arrangement its kernel uses) and into the order in which a
page holds the attention layers, whichever group vLLM put each in. It refuses, naming
it, what kvd's page layout cannot hold yet (MLA, Mamba, chunked local attention, packed
or padded pages, pipeline parallelism, several sliding windows). The facade
(gpu_worker/vllm/connector.py) builds it once per process and hands it to its half.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from engine_client import PageLayout
from gpu_worker.vllm.kvd_link import NamespaceSpec

SUPPORTED = (
    "dense full and sliding-window attention (Llama, Qwen, Mistral, Gemma 2/3, GPT-OSS and other GQA/MHA "
    "models), with vLLM's hybrid KV cache manager on or off, at any tensor_parallel_size"
)


@dataclass(frozen=True)
class CacheShape:
    """What kvd pages of this vLLM instance hold: the namespace (tensor-parallel rank 0's;
    each rank's pages hold its own KV heads, in a namespace of its own), the attention
    layers in page order, the KV-cache group of each, and which groups are sliding-window
    groups of vLLM's hybrid manager (their blocks outside the window are vLLM's null block)."""

    namespace: NamespaceSpec
    layer_names: list[str]
    layer_groups: list[int]
    sliding_groups: tuple[bool, ...]


def _layer_order(name: str) -> tuple:
    """Layers in model order (`model.layers.10...` after `model.layers.9...`), whatever group holds them."""
    return tuple(int(part) for part in name.split(".") if part.isdigit()), name


def namespace_spec(vllm_config, kv_cache_config) -> CacheShape:
    """The kvd namespace of this vLLM instance's KV bytes and how its layers map to pages.

    A page holds every attention layer of one block, in model order, whichever KV-cache
    group vLLM put the layer in: with vLLM's hybrid manager on (a group per attention
    type) or off (one group, every token's KV kept), a model's pages are the same bytes,
    so both kinds of engine share them. Refuses (ValueError, at vLLM's start) what kvd's
    page layout cannot hold yet, naming it."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            f"KVDConnector supports pipeline_parallel_size=1 only (got {parallel.pipeline_parallel_size}); "
            f"supported: {SUPPORTED}"
        )
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    for spec in specs:
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec) or getattr(spec, "attention_chunk_size", None):
            raise ValueError(f"KVDConnector does not support {refused_feature(spec)} yet; supported: {SUPPORTED}")
        if spec.head_size_v != spec.head_size or spec.num_head_slots is not None or spec.page_size_padded is not None:
            raise ValueError(
                f"KVDConnector needs dense K/V of equal head sizes (no packed or padded pages); supported: {SUPPORTED}"
            )
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
    if len(shapes) != 1:
        raise ValueError(
            "KVDConnector needs one block size, KV head count, head size and dtype for every attention layer; "
            f"this model's KV cache groups have {sorted(map(str, shapes))}; supported: {SUPPORTED}"
        )
    windows = {s.sliding_window for s in specs if s.sliding_window}
    if len(windows) > 1:
        raise ValueError(
            f"KVDConnector supports one sliding window per model; this one has {sorted(windows)}; "
            f"supported: {SUPPORTED}"
        )
    spec = specs[0]
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    layer_names = sorted(group_of, key=_layer_order)
    layout = PageLayout(
        num_layers=len(layer_names),
        num_kv_heads=spec.num_kv_heads,  # this rank's heads
        head_dim=spec.head_size,
        page_size=spec.block_size,
        dtype=str(spec.dtype).removeprefix("torch."),
    )
    model = vllm_config.model_config
    extra = (("kv_layout", cpu_kv_layout(vllm_config, spec)),) if current_platform.is_cpu() else ()
    if windows:  # kept in every page's identity: a window changes the KV of every later layer
        extra += (("sliding_window", str(windows.pop())),)
    namespace = NamespaceSpec(
        model.model, layout, revision=model.revision or "", tp_size=parallel.tensor_parallel_size, extra=extra
    )
    return CacheShape(
        namespace,
        layer_names,
        [group_of[name] for name in layer_names],
        tuple(isinstance(s, SlidingWindowSpec) for s in specs),
    )


def refused_feature(spec) -> str:
    """What a KV cache spec kvd cannot hold is, in the words of the models that use it."""
    if isinstance(spec, MLAAttentionSpec):
        return f"MLA latent caches ({type(spec).__name__}: DeepSeek V2/V3, Kimi K2 and other MLA models)"
    if isinstance(spec, MambaSpec):
        return f"Mamba or linear-attention state ({type(spec).__name__}: Qwen3-Next, Jamba and other hybrid models)"
    if isinstance(spec, ChunkedLocalAttentionSpec) or getattr(spec, "attention_chunk_size", None):
        return f"chunked local attention ({type(spec).__name__}: Llama 4)"
    return f"KV caches of kind {type(spec).__name__}"


def cpu_kv_layout(vllm_config, spec) -> str:
    """vLLM's CPU attention backend arranges K and V inside a block in an order of its own
    that depends on the kernel it picked for this CPU and dtype (its "ISA"), not in kvd's
    page order; a page holds each layer's block bytes as vLLM's cache holds them
    ("block-bytes", worker.block_view). Its pages are shared only with engines that use
    the same arrangement."""
    from vllm.v1.attention.backends import cpu_attn

    isa = cpu_attn._get_attn_isa(
        vllm_config.model_config.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
    )
    return f"vllm-cpu-{isa}-block-bytes"
