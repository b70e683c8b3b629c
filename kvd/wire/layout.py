"""The one place that fixes the byte layout of a KV page.

A page holds the cache of ``page_size`` consecutive tokens for every layer of one
namespace, as one C-contiguous array in ``dtype``, of one of two kinds:

- ``"kv"`` (attention with K and V per head: MHA, GQA, MQA, sliding windows):

      [num_layers, 2, page_size, num_kv_heads, head_dim]      # axis 1: 0 = K, 1 = V

- ``"latent"`` (one vector per token and layer, no K/V split and no heads: MLA's
  compressed KV, e.g. DeepSeek-V2/V3's 512 latent values then 64 rotary-key values):

      [num_layers, page_size, head_dim]                        # num_kv_heads is 1

  vLLM describes such a cache the same way (`MLAAttentionSpec`: one KV head of
  `head_size` 576, no V), so ``head_dim`` is the vector's width.

Pages of one namespace all have ``page_bytes`` bytes and start at multiples of
``page_bytes`` inside their shared-memory extent. Host pages, GPU pool pages and the
model runner all use these shapes, so copies between them are plain contiguous copies.
The kind is part of a namespace's identity (kvd/core/namespaces.py: a latent page's
namespace is of attention kind "mla"), so a latent page never matches a K/V one.
"""

from __future__ import annotations

from dataclasses import dataclass

# Element size in bytes of every dtype a page may hold. Names follow torch's spelling.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

KV_PAGES = "kv"  # K and V of each KV head
LATENT_PAGES = "latent"  # one vector per token and layer (MLA)
PAGE_KINDS = (KV_PAGES, LATENT_PAGES)


class LayoutError(ValueError):
    """A page layout that cannot describe a real KV page."""


@dataclass(frozen=True)
class PageLayout:
    """Shape and dtype of one KV page; see the module docstring for the byte order."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float16"
    kind: str = KV_PAGES

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"page layout {field} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LayoutError(f"page layout dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        if self.kind not in PAGE_KINDS:
            raise LayoutError(f"page layout kind {self.kind!r} is not one of {list(PAGE_KINDS)}")
        if self.kind == LATENT_PAGES and self.num_kv_heads != 1:
            raise LayoutError(f"a latent page holds one vector per token, not {self.num_kv_heads} KV heads")

    @classmethod
    def latent(cls, num_layers: int, width: int, page_size: int, dtype: str) -> PageLayout:
        """Pages of one `width`-element vector per token and layer (MLA's latent cache)."""
        return cls(num_layers, 1, width, page_size, dtype, kind=LATENT_PAGES)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """[num_layers, 2 (K, V), page_size, num_kv_heads, head_dim], or for latent pages
        [num_layers, page_size, head_dim]."""
        if self.kind == LATENT_PAGES:
            return (self.num_layers, self.page_size, self.head_dim)
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        n = self.itemsize
        for dim in self.page_shape:
            n *= dim
        return n

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's cache (K and V, or its latent vector) across all layers."""
        return self.page_bytes // self.page_size


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads (of a page's ``num_kv_heads``, the model's) that tensor-parallel rank
    ``tp_rank`` of ``tp_size`` holds, as vLLM splits them: ``num_kv_heads // tp_size``
    consecutive heads a rank, or, with more ranks than heads, the one head that vLLM
    replicates on ``tp_size // num_kv_heads`` consecutive ranks. LayoutError when neither
    count divides the other (vLLM refuses such a model too)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise LayoutError(f"{num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * num_kv_heads // tp_size
    return range(head, head + 1)


def writes_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether rank ``tp_rank`` writes its heads into shared pages: the first rank that
    holds them (every rank while ``tp_size <= num_kv_heads``; of the ranks a head is
    replicated on, the first)."""
    rank_heads(num_kv_heads, tp_size, tp_rank)  # checks the split
    return tp_size <= num_kv_heads or tp_rank % (tp_size // num_kv_heads) == 0
