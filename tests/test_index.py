"""Chained page keys and the prefix index: what enters a key, and what a hit must match."""

from __future__ import annotations

import dataclasses
import hashlib

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import budget_for, identity
from hypothesis import HealthCheck, given, settings

import kvd.cache.publishing
import kvd.core.index
import kvd.wire.keys
from kvd.cache import invariants
from kvd.cache.manager import SequenceRequest
from kvd.core import key_table
from kvd.core.errors import InvalidArgument, ResourceExhausted
from kvd.core.index import ChainSpec, ExtraKey, ExtraKind, PageContent, PrefixIndex, chain_spec, page_key
from kvd.core.key_table import KeyTable
from kvd.core.page_columns import PageColumns
from kvd.core.types import PageId, PageKey, PageState

PAGE_SIZE = 4
ROOT = bytes(range(16))


def toks(ids) -> bytes:
    """Token ids packed as the wire carries them: little-endian int32."""
    return np.asarray(list(ids), dtype="<i4").tobytes()


def chain_keys(spec: ChainSpec, ids: list[int], page_size: int = PAGE_SIZE) -> list[PageKey]:
    """Keys of every full page of a prompt, computed independently of the manager."""
    keys, parent = [], spec.root
    for i in range(len(ids) // page_size):
        parent = page_key(parent, i, toks(ids[i * page_size : (i + 1) * page_size]), spec.local_bytes(i))
        keys.append(parent)
    return keys


def lora(name: bytes) -> ExtraKey:
    return ExtraKey(ExtraKind.LORA, name)


def salt(value: bytes) -> ExtraKey:
    return ExtraKey(ExtraKind.CACHE_SALT, value)


def image(digest: bytes, offset: int, length: int) -> ExtraKey:
    return ExtraKey(ExtraKind.MULTIMODAL, digest, offset, length)


@pytest.fixture
def core(make_manager):
    """A manager, one session, one namespace of page_size 4."""
    m = make_manager()
    session = m.open_session("test", 1)
    ns = m.catalog.register_namespace(identity(page_size=PAGE_SIZE))
    return m, session.id, ns.id


def allocate_and_publish(m, sid, ns, seq_id, ids, extra=()):
    plan = m.allocate(sid, ns, [SequenceRequest(seq_id, toks(ids), tuple(extra))]).result[0]
    m.publish(sid, ns, [(seq_id, 0)])
    return plan


def hits(m, sid, ns, ids, extra=()) -> list[PageId]:
    return m.lookup(sid, ns, [SequenceRequest("probe", toks(ids), tuple(extra))])[0].hit_pages


# ---- chained keys -------------------------------------------------------------------


def test_key_depends_on_page_index_parent_tokens_and_local_bytes():
    tokens = toks([1, 2, 3, 4])
    base = page_key(ROOT, 0, tokens, b"")
    assert page_key(ROOT, 0, tokens, b"") == base  # deterministic
    assert page_key(ROOT, 1, tokens, b"") != base
    assert page_key(bytes(16), 0, tokens, b"") != base
    assert page_key(ROOT, 0, toks([1, 2, 3, 5]), b"") != base
    assert page_key(ROOT, 0, tokens, b"x") != base
    assert len(base) == 16


def test_same_page_tokens_under_another_parent_is_a_different_page(core):
    m, sid, ns = core
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    allocate_and_publish(m, sid, ns, "ab", a + b)  # pages 0, 1
    assert hits(m, sid, ns, a + b) == [0, 1]
    # b's tokens behind another first page: no hit, the chain stops at page 0.
    assert hits(m, sid, ns, c + b) == []
    # b's tokens at page index 0 (no parent): no hit either.
    assert hits(m, sid, ns, b) == []
    # the same tokens repeated at two page indexes are two pages with two keys.
    plan = allocate_and_publish(m, sid, ns, "aa", a + a)
    assert plan.shared_pages == [0] and plan.private_pages == [2]
    assert hits(m, sid, ns, a + a) == [0, 2]
    assert len(m.index) == 3
    keys = chain_keys(chain_spec(m.namespaces.get(ns).root, PAGE_SIZE, []), a + a)
    assert keys[0] != keys[1]
    assert {m.index.get(k) for k in keys} == {0, 2}
    assert invariants.violations(m) == []


def test_publishing_a_page_under_another_parent_does_not_dedup(core):
    m, sid, ns = core
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    allocate_and_publish(m, sid, ns, "ab", a + b)
    m.allocate(sid, ns, [SequenceRequest("cb", toks(c + b))])
    [result] = m.publish(sid, ns, [("cb", 0)])
    assert result.published_pages == 2 and result.rebinds == []
    assert m.sequences.find(ns, "cb").pages == [2, 3]
    assert len(m.index) == 4


# ---- extra keys ---------------------------------------------------------------------


def test_extra_keys_are_tagged_so_a_lora_name_never_equals_a_salt():
    plain = chain_spec(ROOT, PAGE_SIZE, [])
    as_lora = chain_spec(ROOT, PAGE_SIZE, [lora(b"tenant-1")])
    as_salt = chain_spec(ROOT, PAGE_SIZE, [salt(b"tenant-1")])
    assert len({plain.root, as_lora.root, as_salt.root}) == 3
    # request-wide keys do not depend on their order in the request
    both = chain_spec(ROOT, PAGE_SIZE, [lora(b"l"), salt(b"s")])
    assert chain_spec(ROOT, PAGE_SIZE, [salt(b"s"), lora(b"l")]).root == both.root


def test_extra_keys_are_length_prefixed():
    # Tag bytes alone would encode LORA b"x" + SALT b"y" as 02 'x' 03 'y', the same bytes as
    # one LORA key b"x\x03y"; the length prefix keeps them apart.
    two = chain_spec(ROOT, PAGE_SIZE, [lora(b"x"), salt(b"y")])
    one = chain_spec(ROOT, PAGE_SIZE, [lora(b"x" + bytes([ExtraKind.CACHE_SALT]) + b"y")])
    assert two.root != one.root
    # the same split inside one kind
    assert chain_spec(ROOT, PAGE_SIZE, [lora(b"ab")]).root != chain_spec(ROOT, PAGE_SIZE, [lora(b"a"), lora(b"b")]).root


def test_lora_and_salt_with_equal_bytes_never_share_pages(core):
    m, sid, ns = core
    ids = list(range(1, 9))
    allocate_and_publish(m, sid, ns, "lora", ids, [lora(b"t1")])
    assert hits(m, sid, ns, ids, [lora(b"t1")]) == [0, 1]
    assert hits(m, sid, ns, ids, [salt(b"t1")]) == []
    assert hits(m, sid, ns, ids) == []
    assert hits(m, sid, ns, ids, [lora(b"t2")]) == []
    plan = m.allocate(sid, ns, [SequenceRequest("salt", toks(ids), (salt(b"t1"),))]).result[0]
    assert plan.shared_pages == [] and plan.private_pages == [2, 3]
    [result] = m.publish(sid, ns, [("salt", 0)])
    assert result.rebinds == [] and result.published_pages == 2


@pytest.mark.parametrize(
    "offset, length, pages",
    [(5, 6, {1, 2}), (4, 4, {1}), (3, 2, {0, 1}), (0, 1, {0}), (15, 1, {3}), (0, 16, {0, 1, 2, 3})],
)
def test_multimodal_item_enters_every_page_it_overlaps_and_only_those(offset, length, pages):
    ids = list(range(100, 116))  # 4 full pages
    plain = chain_spec(ROOT, PAGE_SIZE, [])
    spec = chain_spec(ROOT, PAGE_SIZE, [image(b"img-1", offset, length)])
    assert spec.root == plain.root
    assert set(spec.page_local) == pages
    for i in range(4):
        if i in pages:
            # the offset is relative to the page, so the same image elsewhere is different content;
            # each page holds a fixed-size digest of the item's value
            digest = hashlib.blake2b(b"img-1", digest_size=16).digest()
            expected = kvd.wire.keys.tagged(ExtraKind.MULTIMODAL, digest, offset - i * PAGE_SIZE, length)
            assert spec.page_local[i] == expected
    plain_keys, keys = chain_keys(plain, ids), chain_keys(spec, ids)
    first = min(pages)
    # pages before the item keep their keys; from the item's first page on, the chain differs
    assert keys[:first] == plain_keys[:first]
    assert all(k != p for k, p in zip(keys[first:], plain_keys[first:]))


def test_a_chain_continued_from_a_page_and_its_parent_key_is_the_tail_of_the_whole_chain():
    """kvd.wire.keys.chain_keys from ``first_page`` with the key of the page before gives the
    keys the whole prefix gives those pages, extra keys included (a LoRA, a cache salt, an
    image over pages 1 to 3): a growing sequence hashes only its new pages."""
    ids = list(range(100, 126))  # 6 full pages, then 2 tokens of a 7th
    extra = [lora(b"adapter"), salt(b"tenant"), image(b"img-1", 6, 7)]
    whole = kvd.wire.keys.chain_keys(ROOT, PAGE_SIZE, toks(ids), extra)
    assert whole == chain_keys(chain_spec(ROOT, PAGE_SIZE, extra), ids)
    assert whole != kvd.wire.keys.chain_keys(ROOT, PAGE_SIZE, toks(ids)), "the extra keys enter the keys"
    for first_page in range(1, 7):
        tail = kvd.wire.keys.chain_keys(
            ROOT,
            PAGE_SIZE,
            toks(ids[first_page * PAGE_SIZE :]),
            extra,
            first_page=first_page,
            parent=whole[first_page - 1],
        )
        assert tail == whole[first_page:], f"continued from page {first_page}"

    grown: list[bytes] = []
    for start, end in [(0, 1), (1, 2), (2, 4), (4, 6)]:  # pages published a few at a time, as a decode does
        grown += kvd.wire.keys.chain_keys(
            ROOT,
            PAGE_SIZE,
            toks(ids[start * PAGE_SIZE : end * PAGE_SIZE]),
            extra,
            first_page=start,
            parent=grown[-1] if grown else None,
        )
    assert grown == whole

    with pytest.raises(ValueError, match="parent"):
        kvd.wire.keys.chain_keys(ROOT, PAGE_SIZE, toks(ids[8:]), extra, first_page=2)
    with pytest.raises(ValueError, match="parent"):
        kvd.wire.keys.chain_keys(ROOT, PAGE_SIZE, toks(ids), extra, parent=whole[0])


def test_multimodal_hits_stop_at_the_first_page_with_another_image(core):
    m, sid, ns = core
    ids = list(range(100, 116))
    allocate_and_publish(m, sid, ns, "img1", ids, [image(b"h1", 5, 6)])  # pages 0..3
    assert hits(m, sid, ns, ids, [image(b"h1", 5, 6)]) == [0, 1, 2, 3]
    assert hits(m, sid, ns, ids, [image(b"h2", 5, 6)]) == [0]  # page 1 holds the image
    assert hits(m, sid, ns, ids, [image(b"h1", 6, 5)]) == [0]  # same image, other place
    assert hits(m, sid, ns, ids) == [0]


def test_multimodal_item_outside_the_prompt_is_rejected(core):
    m, sid, ns = core
    with pytest.raises(InvalidArgument, match="outside the prompt"):
        m.allocate(sid, ns, [SequenceRequest("x", toks(range(8)), (image(b"h", 6, 4),))])
    assert len(m.sequences) == 0


# ---- collisions ---------------------------------------------------------------------


def test_a_forced_hash_collision_costs_a_miss_never_a_wrong_hit(core, monkeypatch):
    m, sid, ns = core
    constant = lambda *args: PageKey(b"\0" * 16)  # noqa: E731
    monkeypatch.setattr(kvd.core.index, "page_key", constant)  # matching
    monkeypatch.setattr(kvd.cache.publishing, "page_key", constant)  # publishing
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    plan = allocate_and_publish(m, sid, ns, "ab", a + b)
    assert plan.pages == [0, 1]
    # page 1 collides with page 0: published (immutable) but left out of the index
    assert m.pool.state(1) is PageState.PUBLISHED and not m.pool.is_indexed(1)
    assert len(m.index) == 1 and m.index.get(PageKey(b"\0" * 16)) == 0
    assert hits(m, sid, ns, b + a) == []  # same key as page 0, other tokens: miss
    assert hits(m, sid, ns, a + b) == [0]  # page 1's key leads to page 0: parent differs, miss
    # dedup on publish is confirmed too: a colliding page is never rebound to other content
    m.allocate(sid, ns, [SequenceRequest("ba", toks(b + a))])
    [result] = m.publish(sid, ns, [("ba", 0)])
    assert result.rebinds == [] and result.published_pages == 2
    assert m.sequences.find(ns, "ba").pages == [2, 3]
    assert invariants.violations(m) == []
    # an unindexed published page is freed, not cached, when its last reference goes
    m.release(sid, ns, ["ab", "ba"])
    assert m.pool.lru_order(ns) == [0]
    assert invariants.violations(m) == []


def test_an_index_entry_pointing_at_other_tokens_is_not_a_hit(core):
    m, sid, ns = core
    allocate_and_publish(m, sid, ns, "a", [1, 2, 3, 4])  # page 0
    wanted = [9, 9, 9, 9]
    key = chain_keys(chain_spec(m.namespaces.get(ns).root, PAGE_SIZE, []), wanted)[0]
    planted = dataclasses.replace(m.pool.content(PageId(0)), page=PageId(99), key=key)
    m.index.insert(planted, 0)  # a collision planted in the index
    try:
        assert hits(m, sid, ns, wanted) == []
        plan = m.allocate(sid, ns, [SequenceRequest("b", toks(wanted))]).result[0]
        assert plan.shared_pages == [] and plan.shared_prefix_tokens == 0
    finally:
        m.index.remove(planted.page, planted.key)
    assert invariants.violations(m) == []


def test_page_content_confirms_tokens_parent_and_local_bytes():
    content = PageContent(PageId(8), PageKey(b"k" * 16), toks([1, 2, 3, 4]), PageId(7), b"L")
    assert content.matches(toks([1, 2, 3, 4]), PageId(7), b"L")
    assert not content.matches(toks([1, 2, 3, 5]), PageId(7), b"L")
    assert not content.matches(toks([1, 2, 3, 4]), PageId(8), b"L")
    assert not content.matches(toks([1, 2, 3, 4]), None, b"L")
    assert not content.matches(toks([1, 2, 3, 4]), PageId(7), b"")


def test_prefix_index_rejects_a_second_page_under_one_key():
    columns = PageColumns()
    columns.add(PageId(0), 4, 0)  # pages 0-3
    index = PrefixIndex(columns)
    first = PageContent(PageId(1), PageKey(b"k" * 16), toks([1, 2, 3, 4]), None, b"")
    second = dataclasses.replace(first, page=PageId(2))
    index.insert(first, 0)
    with pytest.raises(AssertionError, match="already indexed to page 1"):
        index.insert(second, 0)
    with pytest.raises(AssertionError, match="index held page 1 under the key of page 2"):
        index.remove(second.page, second.key)


def test_the_key_table_finds_every_key_after_removals_inside_a_probe_run_and_growth():
    columns = PageColumns()
    columns.add(PageId(0), 5000, 0)
    table = KeyTable(columns)
    # keys 0-7 share their first 8 bytes (one home bucket: a run of 8 probes); the rest spread
    keys = [b"\7" * 8 + k.to_bytes(8, "little") for k in range(8)]
    keys += [hashlib.blake2b(k.to_bytes(4, "little"), digest_size=16).digest() for k in range(8, 5000)]
    columns.key[:] = np.frombuffer(b"".join(keys), columns.key.dtype)
    table.add([0, 1, 2])  # one at a time
    table.add(np.arange(3, 5000))  # in one numpy pass, through a few growths
    assert len(table) == 5000 and [table.find(k) for k in keys] == list(range(5000))
    for slot in (1, 4, 0):  # each move of a later key of the run back keeps it findable
        assert table.remove(keys[slot]) == slot
    assert [table.find(k) for k in keys[:8]] == [-1, -1, 2, 3, -1, 5, 6, 7]
    assert table.find(b"\7" * 16) == -1 and len(table) == 4997
    table.add([4, 1, 0])
    assert [table.find(k) for k in keys] == list(range(5000))
    with pytest.raises(AssertionError, match="already indexed to page 7"):
        table.add([7])


def test_keys_a_client_lines_up_on_their_low_bits_spread_over_the_key_table():
    """Without the process's secret, a bucket would be a key's low bits: a client computing
    the keys of the token ids it sends (kvd/wire/keys.py) could find keys that agree there
    and build one probe run every look-up walks. Keys equal in their low 32 bits spread."""
    columns = PageColumns()
    columns.add(PageId(0), 4096, 0)
    table = KeyTable(columns)
    keys = [(0xC0FFEE | i << 32).to_bytes(8, "little") + bytes(8) for i in range(4096)]
    columns.key[:] = np.frombuffer(b"".join(keys), columns.key.dtype)
    table.add(list(range(2048)))
    table.add(np.arange(2048, 4096))
    assert [table.find(k) for k in keys] == list(range(4096))
    held = table.slots()
    buckets = np.flatnonzero(table._table >= 0)
    homes = key_table._homes(columns.key[held], table._shift)
    longest = int(((buckets - homes) & table._mask).max())
    assert longest < 64, f"a probe run of {longest} buckets"


# ---- tokens only --------------------------------------------------------------------


def test_keys_and_stored_content_are_token_ids_only(core):
    m, sid, ns = core
    # a request carries token ids; there is no field for text
    assert {f.name for f in dataclasses.fields(SequenceRequest)} == {"seq_id", "tokens", "extra_keys"}
    ids = [17, 4242, 0, 31999, 5, 6, 7, 8, 9]
    allocate_and_publish(m, sid, ns, "t", ids)
    spec = chain_spec(m.namespaces.get(ns).root, PAGE_SIZE, [])
    keys = chain_keys(spec, ids)
    assert [m.index.get(k) for k in keys] == [0, 1]
    assert sorted(k for k, _ in m.index.items()) == sorted(keys)
    assert m.pool.content(0).tokens == toks(ids[:4])
    assert m.pool.content(1).tokens == toks(ids[4:8])
    assert m.pool.content(1).parent == 0 and m.pool.content(0).parent is None


# ---- runs: following published chains in bulk ---------------------------------------


def walked(m, ns, ids, extra=()) -> list[PageId]:
    """The hits of a prompt found one page at a time (hash, look up, confirm), as the
    index's docstring defines a hit; runs must find exactly these."""
    spec = chain_spec(m.namespaces.get(ns).root, PAGE_SIZE, list(extra))
    pages, parent_key, parent = [], spec.root, None
    for i in range(len(ids) // PAGE_SIZE):
        page_tokens, local = toks(ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]), spec.local_bytes(i)
        key = page_key(parent_key, i, page_tokens, local)
        content = m.index.lookup(key)
        if content is None or not content.matches(page_tokens, parent, spec.local_digest(i) if local else b""):
            break
        pages.append(content.page)
        parent_key, parent = key, content.page
    return pages


def test_a_branch_starts_a_new_run_and_a_prompt_crossing_both_hits_every_page(core):
    m, sid, ns = core
    trunk = list(range(100, 140))  # 10 pages
    branch = trunk[:24] + list(range(500, 516))  # leaves the trunk at page 6
    a = allocate_and_publish(m, sid, ns, "trunk", trunk).pages
    b = allocate_and_publish(m, sid, ns, "branch", branch).pages
    assert b[:6] == a[:6] and set(b[6:]).isdisjoint(a)
    assert hits(m, sid, ns, trunk) == a
    assert hits(m, sid, ns, branch + [7] * 4) == b  # and its own next page misses
    assert hits(m, sid, ns, trunk[:22]) == a[:5]  # a partial page never hits
    assert hits(m, sid, ns, trunk[:20] + [0] * 20) == a[:5]
    assert invariants.violations(m) == []


@pytest.mark.parametrize("pages", [6, 3000])  # short spans compare slices, long ones numpy
@pytest.mark.parametrize("diverge", ["first token", "last token"])
def test_a_prompt_leaving_a_run_inside_a_page_hits_the_pages_before_it(make_manager, pages, diverge):
    m = make_manager(budget_bytes=16 << 20, extent_bytes=1 << 20)
    sid = m.open_session("test", 1).id
    ns = m.catalog.register_namespace(identity(page_size=PAGE_SIZE)).id
    ids = list(range(1, pages * PAGE_SIZE + 1))
    published = allocate_and_publish(m, sid, ns, "a", ids).pages
    at = (pages * 2 // 3) * PAGE_SIZE + (0 if diverge == "first token" else PAGE_SIZE - 1)
    other = ids[:at] + [0] + ids[at + 1 :]
    assert hits(m, sid, ns, other) == walked(m, ns, other) == published[: at // PAGE_SIZE]
    assert hits(m, sid, ns, ids) == published


def test_a_sequence_that_continues_a_run_extends_it(core):
    """Publishing page by page (decode) grows one run; another sequence continuing its tail joins it."""
    m, sid, ns = core
    ids = list(range(200, 232))
    m.allocate(sid, ns, [SequenceRequest("a", toks(ids[:8]))])
    m.publish(sid, ns, [("a", 0)])
    for step in range(8, 24, 4):
        m.extend(sid, ns, [("a", 4, toks(ids[step : step + 4]))])
        m.publish(sid, ns, [("a", 0)])
    pages = allocate_and_publish(m, sid, ns, "b", ids).pages  # hits 6 pages, publishes 2 more
    assert hits(m, sid, ns, ids) == walked(m, ns, ids) == pages
    assert invariants.violations(m) == []


def test_evicting_a_run_tail_cuts_the_run_and_republishing_grows_it_again(make_manager):
    m = make_manager(budget_bytes=budget_for(8, 512, PAGE_SIZE), extent_bytes=8 * 512)  # 8 pages of 512 bytes
    sid = m.open_session("test", 1).id
    ns = m.catalog.register_namespace(identity(page_size=PAGE_SIZE)).id
    ids = list(range(300, 324))  # 6 pages
    allocate_and_publish(m, sid, ns, "a", ids)
    m.release(sid, ns, ["a"])  # all 6 cached; the tail goes first
    m.allocate(sid, ns, [SequenceRequest("other", toks(range(900, 912)))])  # needs 3 pages: evicts 1
    assert len(hits(m, sid, ns, ids)) == 5 and invariants.violations(m) == []
    m.release(sid, ns, ["other"])
    again = allocate_and_publish(m, sid, ns, "a2", ids).pages
    assert hits(m, sid, ns, ids) == walked(m, ns, ids) == again
    assert invariants.violations(m) == []


def test_a_page_dropped_from_the_middle_of_a_run_ends_every_hit_there(core):
    m, sid, ns = core
    ids = list(range(400, 432))  # 8 pages
    pages = allocate_and_publish(m, sid, ns, "a", ids).pages
    m.integrity.drop_corrupted(pages[3])
    assert hits(m, sid, ns, ids) == walked(m, ns, ids) == pages[:3]
    assert invariants.violations(m) == []


@pytest.mark.parametrize("first_holder", ["released", "still running"])
def test_a_chain_published_again_after_a_drop_hits_to_its_end(core, first_holder):
    """The pages after a dropped page can no longer be reached; publishing the prompt again
    replaces them (cached ones are freed, ones in use stay with their holder), so the next
    request hits all of it, not only up to the dropped page."""
    m, sid, ns = core
    ids = list(range(400, 432))  # 8 pages
    pages = allocate_and_publish(m, sid, ns, "a", ids).pages
    if first_holder == "released":
        m.release(sid, ns, ["a"])
    m.integrity.drop_corrupted(pages[3])
    allocate_and_publish(m, sid, ns, "b", ids)
    again = hits(m, sid, ns, ids)
    assert len(again) == 8 and again == walked(m, ns, ids) and again[:3] == pages[:3]
    if first_holder == "still running":  # a's pages after the drop: its own, out of the index
        assert set(again[3:]).isdisjoint(pages) and not any(m.pool.is_indexed(page) for page in pages[3:])
        assert [m.pool.state(page) for page in pages[3:]] == [PageState.PUBLISHED] * 5
    assert invariants.violations(m) == []


def test_a_run_stops_at_a_page_with_other_local_bytes(core):
    m, sid, ns = core
    ids = list(range(600, 640))  # 10 pages, an image in page 5
    with_image = allocate_and_publish(m, sid, ns, "img", ids, [image(b"h1", 21, 2)]).pages
    assert hits(m, sid, ns, ids, [image(b"h1", 21, 2)]) == with_image
    assert hits(m, sid, ns, ids) == with_image[:5]  # no image: page 5 differs
    plain = allocate_and_publish(m, sid, ns, "plain", ids).pages
    assert plain[:5] == with_image[:5] and set(plain[5:]).isdisjoint(with_image)
    assert hits(m, sid, ns, ids) == plain
    assert hits(m, sid, ns, ids, [image(b"h2", 21, 2)]) == plain[:5]
    assert invariants.violations(m) == []


_family = st.tuples(st.integers(0, 2), st.integers(0, 40), st.lists(st.integers(0, 2), max_size=12))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["publish", "release", "drop", "probe"]), _family, st.booleans()),
        min_size=1,
        max_size=25,
    )
)
def test_runs_find_exactly_the_pages_a_per_page_walk_finds(make_manager, steps):
    """Random trees of prompts (3 families, branching anywhere, some with an image), releases
    that let LRU eviction cut runs, pages dropped as corrupted: after every step the index's
    matching equals the per-page walk and every invariant holds."""
    m = make_manager(budget_bytes=48 * 512, extent_bytes=8 * 512)
    sid = m.open_session("test", 1).id
    ns = m.catalog.register_namespace(identity(page_size=PAGE_SIZE)).id
    live: list[str] = []
    for n, (op, (family, cut, tail), with_image) in enumerate(steps):
        ids = list(range(family * 1000, family * 1000 + cut)) + tail
        extra = [image(b"img", 9, 6)] if with_image and len(ids) >= 15 else []
        if op == "publish":
            try:
                allocate_and_publish(m, sid, ns, f"s{n}", ids, extra)
                live.append(f"s{n}")
            except ResourceExhausted:
                pass
        elif op == "release" and live:
            m.release(sid, ns, [live.pop(cut % len(live))])
        elif op == "drop":
            published = [
                page
                for page, state, *_ in m.pool.pages()
                if state in (PageState.PUBLISHED, PageState.CACHED) and m.pool.is_indexed(page)
            ]
            if published:
                m.integrity.drop_corrupted(published[cut % len(published)])
        assert hits(m, sid, ns, ids, extra) == walked(m, ns, ids, extra)
        assert invariants.violations(m) == []
