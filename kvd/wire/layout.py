"""The one place that fixes the byte layout of a KV page.

A page holds the K and V of ``page_size`` consecutive tokens for every layer of one
namespace, as one C-contiguous array of shape

    [num_layers, 2, page_size, num_kv_heads, head_dim]      # axis 1: 0 = K, 1 = V

in ``dtype``. Pages of one namespace all have ``page_bytes`` bytes and start at
multiples of ``page_bytes`` inside their shared-memory extent. Host pages, GPU pool
pages and the model runner all use this shape, so copies between them are plain
contiguous copies.
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

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"page layout {field} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LayoutError(f"page layout dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """[num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]"""
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
        """Bytes of K and V of one token across all layers."""
        return self.page_bytes // self.page_size
