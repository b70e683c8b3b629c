"""Latent pages (MLA: one vector per token and layer, kvd/wire/layout.py): their shape and
size, and an identity that names them, so a latent page never meets a K/V page of the
same model, not even one of the same size."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import identity

from engine_client import KVDClient, SequenceRequest
from kvd.cache.manager import SequenceRequest as CoreRequest
from kvd.core.errors import InvalidArgument
from kvd.core.namespaces import NamespaceIdentity, identity_doc, identity_from_doc, make_layout
from kvd.wire.layout import LATENT_PAGES, LayoutError, PageLayout

# DeepSeek-V2/V3's latent: 512 compressed-KV values then 64 rotary-key values per token
LATENT = PageLayout.latent(num_layers=2, width=576, page_size=16, dtype="bfloat16")
# a K/V layout of the same model whose pages are exactly as large
SAME_SIZE_KV = PageLayout(num_layers=2, num_kv_heads=1, head_dim=288, page_size=16, dtype="bfloat16")


def latent_identity(model: str = "tiny-mla", **kw) -> NamespaceIdentity:
    return NamespaceIdentity(model, LATENT, attention="mla", **kw)


def test_a_latent_page_is_one_vector_per_token_and_layer():
    assert LATENT.page_shape == (2, 16, 576) and LATENT.kind == LATENT_PAGES
    assert LATENT.page_bytes == 2 * 16 * 576 * 2 == SAME_SIZE_KV.page_bytes
    assert LATENT.token_bytes == 2 * 576 * 2
    with pytest.raises(LayoutError, match="one vector per token"):
        PageLayout(2, 2, 576, 16, "bfloat16", kind=LATENT_PAGES)
    with pytest.raises(LayoutError, match="kind"):
        PageLayout(2, 1, 576, 16, "bfloat16", kind="kv-packed")


def test_latent_pages_go_with_mla_attention_and_only_with_it():
    latent_identity()
    for attention in ("gqa", "sliding"):
        with pytest.raises(InvalidArgument, match="'mla' attention takes 'latent' pages"):
            NamespaceIdentity("tiny-mla", LATENT, attention=attention)
    with pytest.raises(InvalidArgument, match="'mla' attention takes 'latent' pages"):
        NamespaceIdentity("tiny-mla", SAME_SIZE_KV, attention="mla")


def test_a_latent_page_never_hits_in_a_kv_namespace_of_the_same_model_and_page_size(make_manager):
    m = make_manager()
    session = m.open_session("test", 1)
    latent = m.catalog.register_namespace(latent_identity())
    kv = m.catalog.register_namespace(NamespaceIdentity("tiny-mla", SAME_SIZE_KV))
    assert latent.id != kv.id and latent.root != kv.root and latent.page_bytes == kv.page_bytes
    prompt = np.arange(3, 3 + 4 * 16, dtype="<i4").tobytes()
    m.allocate(session.id, latent.id, [CoreRequest("s", prompt)])
    m.publish(session.id, latent.id, [("s", 0)])
    [in_latent] = m.lookup(session.id, latent.id, [CoreRequest("probe", prompt)])
    [in_kv] = m.lookup(session.id, kv.id, [CoreRequest("probe", prompt)])
    assert len(in_latent.hit_pages) == 4 and in_kv.hit_pages == []


def test_a_latent_identity_survives_the_manifest_and_an_older_entry_reads_as_kv_pages():
    doc = identity_doc(latent_identity(tp_size=1))
    assert identity_from_doc(doc) == latent_identity(tp_size=1)
    older = identity_doc(identity())
    older["layout"] = older["layout"][:5]  # written before latent pages: no kind
    assert identity_from_doc(older) == identity()
    assert make_layout(*doc["layout"]) == LATENT


def test_a_client_registers_latent_pages_and_maps_them_in_their_shape(daemon):
    with KVDClient.connect(daemon.socket) as kvd:
        ns = kvd.register_namespace("tiny-mla", LATENT, attention="mla")
        kv_ns = kvd.register_namespace("tiny-mla", SAME_SIZE_KV)
        assert ns != kv_ns
        [seq] = kvd.allocate_with_prefix(ns, [SequenceRequest("s", list(range(3, 3 + 32)))])
        page = kvd.page_array(ns, seq.pages[0])
        assert page.shape == (2, 16, 576) and page.nbytes == LATENT.page_bytes
        [namespace, _] = kvd.stats()["namespaces"]
        assert namespace["page_bytes"] == LATENT.page_bytes
