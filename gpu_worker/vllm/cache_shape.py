"""`CacheShape`: what the kvd pages of one vLLM instance hold, read from vLLM's configuration.

`namespace_spec` turns vLLM's config and its KV-cache groups into the kvd namespace of
this instance's KV bytes (model, revision, page layout, tensor-parallel degree, and for
vLLM's CPU backend the block arrangement its kernel uses) and into the order in which a
page holds the attention layers, whichever group vLLM put each in. It refuses, naming
it, what kvd's page layout cannot hold yet (sparse MLA and its indexer cache, Mamba,
chunked local attention, packed or padded pages, pipeline or decode-context
parallelism, several sliding windows). The facade (gpu_worker/vllm/connector.py) builds
it once per process and hands it to its half.

MLA models (DeepSeek-V2/V3/R1, Kimi K2: one `MLAAttentionSpec` group) cache one latent
vector per token and layer (`[num_blocks, 1, block_size, 576]` a layer: 512 compressed-KV
then 64 rotary-key values), the same whole vector on every tensor-parallel rank. Their
pages are latent pages (kvd/wire/layout.py) in a namespace without a rank or TP degree
(`CacheShape.replicated`): every rank loads the same pages, rank 0 alone saves them, and
engines of any TP degree share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
)

from engine_client import PageLayout
from gpu_worker.vllm.kvd_link import NamespaceSpec

SUPPORTED = (
    "dense full and sliding-window attention (Llama, Qwen, Mistral, Gemma 2/3, GPT-OSS and other GQA/MHA "
    "models) and dense MLA (DeepSeek V2/V3/R1, Kimi K2), with vLLM's hybrid KV cache manager on or off, "
    "at any tensor_parallel_size"
)


@dataclass(frozen=True)
class CacheShape:
    """What kvd pages of this vLLM instance hold: the namespace (tensor-parallel rank 0's;
    each rank's pages hold its own KV heads, in a namespace of its own, unless the cache is
    `replicated`), the attention layers in page order, the KV-cache group of each, and
    which groups are sliding-window groups of vLLM's hybrid manager (their blocks outside
    the window are vLLM's null block)."""

    namespace: NamespaceSpec
    layer_names: list[str]
    layer_groups: list[int]
    sliding_groups: tuple[bool, ...]
    # every rank holds the same whole cache (MLA's latent): one namespace for all ranks,
    # whatever the TP degree, and one rank's saves are every rank's
    replicated: bool = False

    def rank_namespace(self, tp_rank: int) -> NamespaceSpec:
        """The namespace of the pages tensor-parallel rank `tp_rank` loads and saves."""
        return self.namespace if self.replicated else self.namespace.of_rank(tp_rank)

    def saves(self, tp_rank: int) -> bool:
        """Whether rank `tp_rank` saves its blocks (of a replicated cache, rank 0 alone: the
        others' bytes are the same)."""
        return tp_rank == 0 or not self.replicated


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
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    windows = _checked(parallel, specs)
    spec = specs[0]
    latent = isinstance(spec, MLAAttentionSpec)
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    layer_names = sorted(group_of, key=_layer_order)
    dtype = str(spec.dtype).removeprefix("torch.")
    if latent:  # [block_size, 576] a layer and block, on every backend; the same on every rank
        layout = PageLayout.latent(len(layer_names), spec.head_size, spec.block_size, dtype)
    else:  # this rank's heads
        layout = PageLayout(len(layer_names), spec.num_kv_heads, spec.head_size, spec.block_size, dtype)
    model = vllm_config.model_config
    namespace = NamespaceSpec(
        model.model,
        layout,
        revision=model.revision or "",
        tp_size=1 if latent else parallel.tensor_parallel_size,
        attention="mla" if latent else "gqa",
        extra=_identity_extras(vllm_config, spec, windows),
    )
    return CacheShape(
        namespace,
        layer_names,
        [group_of[name] for name in layer_names],
        tuple(isinstance(s, SlidingWindowSpec) for s in specs),
        replicated=latent,
    )


def _checked(parallel, specs: list) -> set[int]:
    """Refuses the parallelism and KV-cache specs kvd's page layout cannot hold yet (ValueError,
    naming what); returns the model's sliding windows (one at most)."""
    for setting in ("pipeline_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, setting, 1) != 1:
            raise ValueError(
                f"KVDConnector supports {setting}=1 only (got {getattr(parallel, setting)}); supported: {SUPPORTED}"
            )
    for spec in specs:
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec) or _sparse(spec):
            raise ValueError(f"KVDConnector does not support {refused_feature(spec)} yet; supported: {SUPPORTED}")
        latent = isinstance(spec, MLAAttentionSpec)
        if (
            spec.head_size_v != (0 if latent else spec.head_size)
            or spec.num_head_slots is not None
            or spec.page_size_padded is not None
            or spec.state_content_bytes is not None
        ):
            raise ValueError(
                "KVDConnector needs dense K/V of equal head sizes or dense MLA latents (no packed or padded pages); "
                f"supported: {SUPPORTED}"
            )
    shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.head_size_v, s.dtype) for s in specs}
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
    return windows


def _identity_extras(vllm_config, spec, windows: set[int]) -> tuple[tuple[str, str], ...]:
    """What else makes this engine's KV bytes differ, for the namespace's identity: the CPU
    backend's KV layout, an fp8 cache's format, the sliding window."""
    extra: tuple[tuple[str, str], ...] = ()
    if current_platform.is_cpu() and not isinstance(spec, MLAAttentionSpec):
        model_dtype, cache_dtype = vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype
        extra += (("kv_layout", cpu_kv_layout(model_dtype, cache_dtype, spec.block_size, spec.head_size)),)
    if vllm_config.cache_config.cache_dtype != "auto":  # fp8 caches: which format (the page dtype says uint8)
        extra += (("kv_cache_dtype", str(vllm_config.cache_config.cache_dtype)),)
    if windows:  # kept in every page's identity: a window changes the KV of every later layer
        extra += (("sliding_window", str(next(iter(windows)))),)
    return extra


def _sparse(spec) -> bool:
    """Whether the spec is of attention kvd cannot hold as plain pages: chunked local
    attention (Llama 4 with the hybrid manager off), or sparse MLA's caches (DeepSeek-V3.2's
    indexer keys, the index group's leader, DeepSeek-V4's compressed states)."""
    if getattr(spec, "attention_chunk_size", None):
        return True
    if not isinstance(spec, MLAAttentionSpec):
        return False
    return (
        spec.cache_role != SparseCacheRole.SPARSE
        or spec.is_index_group_leader
        or spec.model_version is not None
        or spec.tokens_per_state != 1
    )


def refused_feature(spec) -> str:
    """What a KV cache spec kvd cannot hold is, in the words of the models that use it."""
    if type(spec) in (MLAAttentionSpec, SlidingWindowMLASpec):
        return (
            f"sparse or windowed MLA caches ({type(spec).__name__}: DeepSeek-V3.2's indexer, DeepSeek-V4, "
            "MLA with a sliding window)"
        )
    if isinstance(spec, MambaSpec):
        return f"Mamba or linear-attention state ({type(spec).__name__}: Qwen3-Next, Jamba and other hybrid models)"
    if isinstance(spec, ChunkedLocalAttentionSpec) or getattr(spec, "attention_chunk_size", None):
        return f"chunked local attention ({type(spec).__name__}: Llama 4)"
    return f"KV caches of kind {type(spec).__name__}"


def cpu_kv_layout(dtype, cache_dtype: str, block_size: int, head_size: int) -> str:
    """vLLM's CPU attention backend arranges K and V inside a block in an order of its own
    that depends on the kernel it picked for this CPU and dtype (its "ISA"), not in kvd's
    page order; a page holds each layer's block bytes as vLLM's cache holds them
    ("block-bytes", worker.block_view). Its pages are shared only with engines that use
    the same arrangement. `dtype`: the model's (torch), `cache_dtype`: vLLM's setting."""
    from vllm.v1.attention.backends import cpu_attn

    isa = cpu_attn._get_attn_isa(dtype, block_size, head_size, cache_dtype)
    return f"vllm-cpu-{isa}-block-bytes"
