"""Pairs an applied config adds, removes, limits or frees, and the rule that keeps a pair given
limits exact: first entries of what runs, no grant before the book has joined."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from test_quota import Limits

from llmgw.core.pairs import NOT_JOINED, Fits, first_entry, fits, joined, pair_changes
from llmgw.core.quota import Quota, QuotaBook

pairs = st.tuples(st.sampled_from("pq"), st.sampled_from("abc"))
tables = st.dictionaries(pairs, st.sampled_from([None, Limits(8, 8, 2), Limits(8, 4, 1)]))


@given(old=tables, new=tables)
def test_pair_changes_name_each_pair_once_and_lead_from_the_old_limits_to_the_new(old, new):
    changes = pair_changes(old, new)
    kept, released, changed = set(changes.kept), set(changes.released), set(changes.changed)
    assert not (kept & released) and not (kept & changed) and not (released & changed)
    assert changes.added == set(new) - set(old) and changes.removed == set(old) - set(new)
    limited = {p: lim for p, lim in old.items() if lim is not None and p not in released}
    limited.update(changes.changed)
    limited.update(changes.kept)
    assert limited == {p: lim for p, lim in new.items() if lim is not None}
    for pair in kept:  # kept: limits now, none before (or not there)
        assert old.get(pair) is None
    for pair in changed:  # changed: limits before and after, other ones
        assert old[pair] is not None and old[pair] != new[pair]


def test_a_first_entry_is_what_runs_and_asks_for_no_more():
    assert first_entry(5, 2, 3, at=1.0) == Quota(5, 2, 3, 5, 2, 3, 1.0)


def test_a_book_joins_once_every_live_instance_holds_an_entry_and_each_count_apart():
    limits = Limits(4, 6, 2)
    book = QuotaBook("p", "m", {"a": first_entry(3, 3, 5, 0.0)})
    assert joined(book, limits, ["a", "b"]) == NOT_JOINED  # b has not written its own
    book = book.with_quota("b", first_entry(1, 1, 0, 0.0))
    assert joined(book, limits, ["a", "b"]) == Fits(True, False)  # 5 pins > P = 4
    assert fits(book.with_quota("b", first_entry(2, 2, 0, 0.0)), limits) == Fits(False, False)
    assert joined(book.with_quota("a", first_entry(3, 3, 4, 0.0)), limits, ["a", "b"]).both
    assert joined(book, limits, ["a"]) == Fits(True, False)  # b is not live: not waited for


@dataclass
class _Instance:
    use: int  # leases running here (granted while the pair had no limits, then from quota)
    applied: bool = False
    joined: bool = False


actions = st.lists(
    st.tuples(st.sampled_from("abc"), st.sampled_from(["apply", "end", "work"])), max_size=80
)


@given(
    running=st.fixed_dictionaries({i: st.integers(0, 6) for i in "abc"}),
    limit=st.integers(1, 8),
    steps=actions,
)
def test_a_pair_given_limits_never_runs_above_them_once_any_instance_grants_from_them(
    running, limit, steps
):
    """Three instances run leases on a pair without limits; each applies the new limits when
    it will (its first entry), and works: it checks whether the book has joined, moves its
    entry as the quota keeper does (only given back until joined), and grants if its entry has
    room. A grant under the limits never finds the pair's leases everywhere above them, though
    the instances may have run more than the limit before the change."""
    limits = Limits(100, limit, 0)
    book = QuotaBook("p", "m")
    instances = {i: _Instance(use) for i, use in running.items()}
    for name, action in steps:
        me = instances[name]
        if action == "apply" and not me.applied:
            me.applied = True
            book = book.with_quota(name, first_entry(me.use, me.use, 0, 0.0))
        elif action == "end" and me.use > 0:
            me.use -= 1
        elif action == "work" and not me.applied:
            me.use += 1  # no limits here yet: the window before this instance applied
        elif action == "work":
            me.joined = me.joined or joined(book, limits, instances).leases
            mine = book.quota(name).g
            # never below what runs here; raised only by what is free, toward one lease of
            # headroom, once joined; only given back before
            wanted = me.use + 1
            g = mine + max(0, min(wanted - mine, book.free(limits).leases))
            g = g if wanted >= mine else wanted
            if not me.joined:
                g = min(mine, me.use)
            book = book.with_quota(name, Quota(g, g, 0))
            if me.joined and me.use < g:
                me.use += 1
                total = sum(i.use for i in instances.values())
                assert total <= limit, f"{total} leases run on a pair with G={limit}"
