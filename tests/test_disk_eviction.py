"""The disk tier's eviction policies (kvd/tiers/eviction.py), in process: LRU's order, ARC's
lists and ghosts on worked examples (Megiddo and Modha's cases), and, on random operations,
what every policy promises its callers (a page admitted is held, what it gives up was held
and is gone, never more than its capacity) with ARC's own bounds on its lists."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.tiers.eviction import POLICIES, ArcPolicy, LruPolicy


def held(policy, keys) -> list:
    return [k for k in keys if k in policy]


def lists(arc: ArcPolicy) -> tuple[list, list, list, list]:
    """T1, T2, B1, B2, each oldest first."""
    return list(arc._t1), list(arc._t2), list(arc._b1), list(arc._b2)


def test_lru_gives_up_the_least_recently_used():
    lru = LruPolicy(3)
    assert [lru.admit(k) for k in "abc"] == [[], [], []]
    lru.hit("a")
    assert lru.admit("d") == ["b"]
    lru.forget("c")
    assert lru.admit("e") == [] and len(lru) == 3
    assert lru.victims(5) == ["a", "d", "e"] and len(lru) == 0


def test_a_policy_of_no_pages_holds_none():
    for policy in (LruPolicy(0), ArcPolicy(0)):
        assert policy.admit("a") == ["a"] and "a" not in policy and len(policy) == 0


def test_arc_keeps_pages_used_twice_through_a_scan_that_flushes_lru():
    scan = [f"s{i}" for i in range(20)]
    arc, lru = ArcPolicy(4), LruPolicy(4)
    for policy in (arc, lru):
        for k in "ab":
            policy.admit(k)
            policy.hit(k)
        for k in scan:
            policy.admit(k)
    assert held(arc, "ab") == ["a", "b"] and held(lru, "ab") == []
    t1, t2, b1, b2 = lists(arc)
    assert (t1, t2) == (scan[-2:], ["a", "b"])
    assert b1 == scan[-4:-2] and b2 == []  # T1 and B1 hold 4 keys at most: the older scan is forgotten


def test_arc_ghosts_steer_the_target_of_t1():
    arc = ArcPolicy(4)
    for k in "ab":
        arc.admit(k)
        arc.hit(k)
    assert [arc.admit(k) for k in "cdef"] == [[], [], ["c"], ["d"]]
    assert lists(arc) == (["e", "f"], ["a", "b"], ["c", "d"], [])
    # d comes back: recency gave it up too soon, so T1's target grows by one, and d is used twice now
    assert arc.admit("d") == ["e"] and arc._target == 1
    assert lists(arc) == (["f"], ["a", "b", "d"], ["c", "e"], [])
    assert arc.admit("g") == ["a"]  # T1 at its target: T2 gives up its oldest, which B2 remembers
    assert lists(arc) == (["f", "g"], ["b", "d"], ["c", "e"], ["a"])
    # a comes back: frequency gave it up too soon, so the target shrinks (by |B1| / |B2| = 2, to 0)
    assert arc.admit("a") == ["f"] and arc._target == 0
    assert lists(arc) == (["g"], ["b", "d", "a"], ["c", "e", "f"], [])


def test_arc_forced_victims_come_from_t1_below_its_target_when_t2_is_empty():
    """A write the disk refused for room (pages of several sizes) takes victims ARC would not
    have named yet: from T1 even below its target when T2 has none."""
    arc = ArcPolicy(4)
    arc._target = 4.0  # T1 may take the whole cache
    for k in "ab":
        arc.admit(k)
    assert arc.victims(1) == ["a"] and lists(arc) == (["b"], [], ["a"], [])


def test_victims_are_only_the_usable_pages_in_the_policy_order():
    """A full disk frees slots the refused pages can use (kvd/disk/reclaim.py): victims among
    the pages ``usable`` accepts, each policy's oldest of them first; ARC gives each up to
    its ghost list as REPLACE would (T1 above its target, else T2), so a ghost that comes
    back still steers T1's target."""
    usable = set("bdf").__contains__
    lru = LruPolicy(6)
    for k in "abcdef":
        lru.admit(k)
    lru.hit("b")
    assert lru.victims(2, usable) == ["d", "f"] and held(lru, "abcdef") == ["a", "b", "c", "e"]
    arc = ArcPolicy(6)
    for k in "abcdef":
        arc.admit(k)
    for k in "ab":
        arc.hit(k)  # T1 c d e f, T2 a b; target 0: T1 is above it
    assert arc.victims(1, usable) == ["d"] and lists(arc) == (["c", "e", "f"], ["a", "b"], ["d"], [])
    arc._target = 3.0  # T1 at its target: T2 gives up its oldest usable page
    assert arc.victims(1, usable) == ["b"] and lists(arc) == (["c", "e", "f"], ["a"], ["d"], ["b"])
    assert arc.victims(5, usable) == ["f"]  # T2 has none: T1's, below its target; then none is left
    assert lists(arc) == (["c", "e"], ["a"], ["d", "f"], ["b"])
    assert arc.admit("d") == [] and arc._target == 4.0 and lists(arc)[1] == ["a", "d"]


OPS = st.lists(st.tuples(st.sampled_from(["admit", "hit", "forget", "victims"]), st.integers(0, 11)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.integers(0, 6), OPS)
def test_a_policy_keeps_its_promises(name, capacity, ops):
    """Against a plain set of what it holds: an admitted page is held (with room for any),
    what it gives up was held and is gone, victims are held pages, at most ``capacity``."""
    policy = POLICIES[name](capacity)
    model: set[int] = set()
    for op, key in ops:
        if op == "admit" and key not in model:
            freed = policy.admit(key)
            assert len(freed) <= 1 and set(freed) <= model | {key}
            model = (model | {key}) - set(freed)
        elif op == "hit":
            policy.hit(key)
        elif op == "forget":
            policy.forget(key)
            model.discard(key)
        elif op == "victims":  # of the even or of the odd keys, or of any
            count, parity = key % 3, key // 3 % 3
            usable = (lambda k, p=parity: k % 2 == p) if parity < 2 else (lambda k: True)
            freed = policy.victims(count, usable)
            assert len(freed) == min(count, len([k for k in model if usable(k)]))
            assert set(freed) <= model and all(usable(k) for k in freed)
            model -= set(freed)
        assert {k for k in range(12) if k in policy} == model and len(policy) == len(model) <= capacity
        if isinstance(policy, ArcPolicy):
            t1, t2, b1, b2 = map(set, lists(policy))
            assert not (t1 & t2) and not ((t1 | t2) & (b1 | b2)) and not (b1 & b2)
            assert len(t1) + len(b1) <= capacity and len(t1) + len(t2) + len(b1) + len(b2) <= 2 * capacity
            assert 0 <= policy._target <= capacity


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 30), max_size=100))
def test_arc_holds_what_lru_holds_when_no_page_is_used_twice(capacity, keys):
    """Pages admitted once each and never hit: T1 is the whole cache, in recency order."""
    arc, lru = ArcPolicy(capacity), LruPolicy(capacity)
    for key in dict.fromkeys(keys):
        assert arc.admit(key) == lru.admit(key)
    assert held(arc, range(31)) == held(lru, range(31))
