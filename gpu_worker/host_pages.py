"""`HostPages` over one namespace of a `KVDClient`: the daemon's shared-memory pages.

Pages are zero-copy torch views (`client.page(ns, id)`), so a loader copy goes straight
between shared memory and the GPU pool. The client maps extents lazily, when a page in a
new extent is first asked for; `map_pages` does that up front, so that on CUDA the loader
can register (`cudaHostRegister`) every extent a copy batch touches before it copies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine_client import KVDClient
from gpu_worker.pool import HostPageId


class ClientHostPages:
    """The host pages of namespace `ns`, seen through `client`'s mapped extents."""

    def __init__(self, client: KVDClient, ns: int) -> None:
        self.client = client
        self.ns = ns
        # Extents handed out for registration stay mapped for the life of this object, even
        # if the client stops tracking one: cudaHostRegister'd memory must not be unmapped.
        self._handed_out: dict[str, object] = {}

    def page(self, page_id: HostPageId) -> torch.Tensor:
        """[num_layers, 2, page_size, num_kv_heads, head_dim] view of one host page."""
        return self.client.page(self.ns, page_id)

    def map_pages(self, page_ids: Iterable[HostPageId]) -> None:
        """Map the extents holding these pages now (one DescribeExtents call at most)."""
        for page_id in page_ids:
            self.client.page(self.ns, page_id)

    def extents(self) -> list[memoryview]:
        """Every extent of the namespace this process has mapped, through both of its maps:
        writable (private pages) and read-only (published pages; `client.page` views)."""
        extents = self.client.mapped_extents(self.ns)
        for extent in extents:
            self._handed_out.setdefault(extent.name, extent)
        return [memoryview(m) for extent in extents for m in (extent.memory, extent.readonly_memory)]
