"""Quotas: the fair split every instance computes alike, and books that never exceed the limits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.quota import (
    Quota,
    QuotaBook,
    QuotaCounts,
    QuotaError,
    fair_targets,
    headroom,
    idle,
    lendable,
    max_min_share,
    reclaimable,
    scaled_quota,
)


@dataclass(frozen=True)
class Limits:
    max_pinned_sessions: int
    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int = 2


wants = st.dictionaries(st.sampled_from(list("abcdefg")), st.integers(0, 200), max_size=7)


@given(capacity=st.integers(0, 500), wants=wants)
def test_max_min_share_splits_everything_and_is_fair(capacity, wants):
    share = max_min_share(capacity, wants)
    if not wants:
        assert share == {}
        return
    assert sum(share.values()) == capacity
    assert set(share) == set(wants)
    if sum(wants.values()) <= capacity:
        assert all(share[i] >= wants[i] for i in wants)  # everyone gets what it wants
    else:
        for i in wants:
            if share[i] < wants[i]:
                # a short instance gets at least as much as anyone else, less one unit
                assert all(share[i] >= min(share[j], wants[j]) - 1 for j in wants)
    assert max_min_share(capacity, dict(reversed(list(wants.items())))) == share


def test_a_lone_instance_holds_the_whole_limit():
    assert max_min_share(64, {"only": 3}) == {"only": 64}


def test_two_busy_instances_split_evenly_and_a_quiet_one_keeps_its_want():
    assert max_min_share(64, {"a": 100, "b": 100}) == {"a": 32, "b": 32}
    assert max_min_share(64, {"busy": 100, "quiet": 4}) == {"busy": 60, "quiet": 4}


def _book(holders):
    return QuotaBook("iris", "m", {i: Quota(g, u, p) for i, (g, u, p) in holders.items()})


def test_a_book_over_any_limit_is_refused_with_the_limit_named():
    limits = Limits(10, 8, 2)
    _book({"a": (4, 3, 5), "b": (4, 3, 5)}).check(limits)  # exactly at every limit
    with pytest.raises(QuotaError, match="Σg=9 exceed G=8"):
        _book({"a": (5, 3, 5), "b": (4, 3, 5)}).check(limits)
    with pytest.raises(QuotaError, match="Σu=7 exceed G-R=6"):
        _book({"a": (4, 4, 5), "b": (4, 3, 5)}).check(limits)
    with pytest.raises(QuotaError, match="Σp=11 exceed P=10"):
        _book({"a": (4, 3, 6), "b": (4, 3, 5)}).check(limits)


def test_a_holder_cannot_have_more_unreserved_than_leases():
    with pytest.raises(QuotaError, match="exceeds the lease quota"):
        Quota(g=2, u=3)


@given(
    source=st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    move=st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)),
)
def test_a_transfer_never_changes_the_totals_nor_moves_more_than_was_held(source, move):
    g, u, p = source
    u = min(u, g)
    book = QuotaBook("iris", "m", {"dead": Quota(g, u, p), "alive": Quota(1, 1, 1)})
    after = book.transfer("dead", "alive", *move, at=5.0)
    assert after.totals() == book.totals()
    moved = after.quota("alive")
    assert moved.g - 1 <= g and moved.u - 1 <= u and moved.p - 1 <= p
    for q in after.holders.values():
        assert q.u <= q.g


def test_books_round_trip_through_json():
    book = QuotaBook("iris", "llama-3.3-70b", {"a": Quota(3, 2, 10, 4, 2, 11, 1.5)})
    assert QuotaBook.from_json(book.to_json()) == book
    with pytest.raises(QuotaError, match="version"):
        QuotaBook.from_json(b'{"v": 1, "holders": {}}')


@given(
    wants=st.dictionaries(
        st.sampled_from(list("abcd")),
        st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)),
        min_size=1,
    ),
    limits=st.builds(Limits, st.integers(0, 100), st.integers(1, 100), st.integers(0, 100)),
)
def test_fair_targets_fit_the_limits(wants, limits):
    book = QuotaBook(
        "iris", "m", {i: Quota(0, 0, 0, wg, wu, wp) for i, (wg, wu, wp) in wants.items()}
    )
    targets = fair_targets(book, limits, sorted(wants))
    g = limits.max_global_in_flight_request_slots
    r = min(limits.global_in_flight_request_slots_reserved_for_pinned_sessions, g)
    assert sum(t.g for t in targets.values()) <= g
    assert sum(t.u for t in targets.values()) <= g - r
    assert sum(t.p for t in targets.values()) <= limits.max_pinned_sessions
    assert all(t.u <= t.g for t in targets.values())


def test_headroom_is_a_tenth_of_a_fair_share_and_at_least_one():
    assert headroom(64, 1) == 7 and headroom(64, 4) == 2 and headroom(3, 8) == 1
    assert headroom(0, 1) == 0


def test_only_dead_holders_with_old_entries_are_reclaimable():
    book = QuotaBook(
        "iris",
        "m",
        {
            "live": Quota(1, 1, 1, at=0.0),
            "dead-old": Quota(2, 1, 1, at=0.0),
            "dead-new": Quota(2, 1, 1, at=95.0),
        },
    )
    assert reclaimable(book, {"live": object()}, now=100.0, grace=10.0) == ["dead-old"]


@given(
    giver=st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    mark=st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    giver_first=st.booleans(),
)
def test_an_earmark_is_taken_by_the_receiver_or_given_back_never_both(giver, mark, giver_first):
    """Whichever CAS lands first wins; the other changes nothing: the giver's spendable quota
    (its entry less its earmarks) plus the receiver's never exceeds what both held before."""
    g, u, p = giver
    u = min(u, g)
    mg, mp = min(mark[0], g), min(mark[2], p)
    mu = min(mark[1], u, mg)
    book = QuotaBook("iris", "m", {"giver": Quota(g, u, p), "receiver": Quota(1, 1, 1)})
    marked = book.earmark("giver", 7, mg, mu, mp)
    assert marked.totals() == book.totals()
    assert marked.earmarked("giver") == (mg, mu, mp)
    assert QuotaBook.from_json(marked.to_json()) == marked

    def take(b: QuotaBook) -> QuotaBook:
        return b.take("giver", 7, "receiver", at=1.0)[0]

    def give_back(b: QuotaBook) -> QuotaBook:
        return b.unmark("giver", 7)

    first, second = (give_back, take) if giver_first else (take, give_back)
    after = second(first(marked))
    assert after.totals() == book.totals() and not after.handing
    spendable = [
        after.quota("giver").g - after.earmarked("giver")[0] + after.quota("receiver").g,
        after.quota("giver").p - after.earmarked("giver")[2] + after.quota("receiver").p,
    ]
    assert spendable == [g + 1, p + 1]  # nothing counted twice, nothing lost
    if giver_first:  # given back: the receiver got nothing
        assert after.quota("receiver") == Quota(1, 1, 1)
    else:  # taken: exactly the earmark moved
        assert (after.quota("receiver").g, after.quota("receiver").p) == (1 + mg, 1 + mp)
        assert after.quota("giver").g == g - mg


def test_dropping_a_holder_drops_its_earmarks():
    book = _book({"dead": (3, 2, 2), "alive": (1, 1, 1)}).earmark("dead", 3, 1, 1, 1)
    assert book.drop("dead").handing == {}
    assert book.earmark("alive", 4, 1, 0, 0).drop("dead").earmarked("alive") == (1, 0, 0)


def test_without_spreading_what_nobody_wants_stays_free():
    assert max_min_share(64, {"a": 3, "b": 5}, spread=False) == {"a": 3, "b": 5}
    assert max_min_share(10, {"a": 100, "b": 4}, spread=False) == {"a": 6, "b": 4}


@given(capacity=st.integers(0, 500), wants=wants)
def test_unspread_shares_are_the_spread_ones_up_to_each_want(capacity, wants):
    spread = max_min_share(capacity, wants)
    kept = max_min_share(capacity, wants, spread=False)
    assert all(kept[i] == min(spread[i], wants[i]) for i in wants)
    assert sum(kept.values()) <= capacity


def test_several_instances_leave_the_unwanted_rest_free_and_a_lone_one_holds_it_all():
    limits = Limits(200, 24, 6)
    book = QuotaBook("iris", "m", {i: Quota(0, 0, 0, 3, 2, 4) for i in ("a", "b")})
    targets = fair_targets(book, limits, ["a", "b"])
    assert targets["a"] == Quota(3, 2, 4) and targets["b"] == Quota(3, 2, 4)
    assert fair_targets(book, limits, ["a"])["a"] == Quota(24, 18, 200)


quotas = st.builds(
    lambda g, u, p: Quota(g, min(u, g), p),
    st.integers(0, 30),
    st.integers(0, 30),
    st.integers(0, 30),
)
counts = st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))


@given(entry=quotas, aside=counts, used=counts, ask=counts, borrower=quotas)
def test_a_loan_never_takes_what_the_lender_uses_or_breaks_its_entry(
    entry, aside, used, ask, borrower
):
    # What the lender may spend: its entry less what is set aside (as `_sync` shows it).
    g = max(0, entry.g - aside[0])
    spendable = Quota(g, min(g, max(0, entry.u - aside[1])), max(0, entry.p - aside[2]))
    # It never uses more than it may spend (the ledger's grant rule).
    used = (
        min(used[0], spendable.g),
        min(used[1], used[0], spendable.g, spendable.u),
        min(used[2], spendable.p),
    )
    borrower = Quota(borrower.g, borrower.u, borrower.p, 5, 4, 3)
    lent = lendable(entry, spendable, QuotaCounts(*used), QuotaCounts(*ask), borrower)
    lg, lu, lp = lent
    assert 0 <= lg <= entry.g and 0 <= lu <= entry.u and 0 <= lp <= entry.p
    assert lu <= lg + (borrower.g - borrower.u)  # u beyond g only into the borrower's room
    assert spendable.g - lg >= used[0]
    assert spendable.u - lu >= used[1]
    assert spendable.p - lp >= used[2]
    assert lg <= max(ask[0], ask[1]) and lp <= ask[2]
    book = QuotaBook("iris", "m", {"lender": entry, "borrower": borrower})
    after = book.lend("lender", "borrower", *lent, at=7.0)
    assert after.totals() == book.totals()  # a valid book stays valid
    left, got = after.quota("lender"), after.quota("borrower")
    assert left.u <= left.g and got.u <= got.g
    assert (left.wg, left.wu, left.wp) == (entry.wg, entry.wu, entry.wp)  # wants kept
    assert (got.g, got.u, got.p) == (borrower.g + lg, borrower.u + lu, borrower.p + lp)


def test_unreserved_quota_moves_alone_when_the_lenders_leases_are_all_in_use():
    # The lender's 6 leases are all taken (4 of them by pinned sessions), 2 of its unreserved
    # are idle; the borrower has an idle lease and lacks only unreserved quota: a lone instance
    # would admit the new session, so the idle unreserved moves without lease quota.
    lender = Quota(6, 4, 0)
    borrower = Quota(5, 3, 0)
    assert lendable(lender, lender, QuotaCounts(6, 2, 0), QuotaCounts(0, 1, 0), borrower) == (
        0,
        1,
        0,
    )
    # Without room above its unreserved the borrower needs the lease too, which is not idle.
    assert lendable(lender, lender, QuotaCounts(6, 2, 0), QuotaCounts(0, 1, 0), Quota(3, 3, 0)) == (
        0,
        0,
        0,
    )
    # What was asked and the borrower's room bound it.
    assert lendable(lender, lender, QuotaCounts(6, 2, 0), QuotaCounts(0, 5, 0), borrower) == (
        0,
        2,
        0,
    )
    assert lendable(lender, lender, QuotaCounts(6, 0, 0), QuotaCounts(0, 5, 0), Quota(5, 4, 0)) == (
        0,
        1,
        0,
    )


def test_a_loan_of_more_than_is_held_is_refused():
    book = QuotaBook("iris", "m", {"lender": Quota(2, 1, 0)})
    with pytest.raises(QuotaError, match="cannot lend"):
        book.lend("lender", "borrower", 3, 0, 0, at=1.0)
    with pytest.raises(QuotaError, match="exceeds the lease quota"):
        book.lend("lender", "borrower", 2, 0, 0, at=1.0)  # it would keep u=1 with g=0


def test_a_peers_idle_quota_is_what_it_holds_beyond_its_wants_less_headroom():
    # Holds 10, wants 6 = use 4 + headroom 2: 6 idle (its headroom included).
    assert idle(Quota(10, 8, 5, 6, 4, 5), QuotaCounts(2, 2, 1)) == (6, 6, 1)
    assert idle(Quota(3, 3, 0, 9, 9, 0), QuotaCounts(2, 2, 1)) == (
        0,
        0,
        0,
    )  # wants more than it holds


# ---- limits lowered under load: each share scaled on its own ------------------------------------


@st.composite
def shrinking(draw: st.DrawFn) -> tuple[Limits, Limits, list[Quota]]:
    g = draw(st.integers(1, 80))
    old = Limits(draw(st.integers(0, 80)), g, draw(st.integers(0, g)))
    g2 = draw(st.integers(1, 80))
    new = Limits(draw(st.integers(0, 80)), g2, draw(st.integers(0, g2)))
    left_g = g
    left_u = g - old.global_in_flight_request_slots_reserved_for_pinned_sessions
    left_p = old.max_pinned_sessions
    holders = []
    for _ in range(draw(st.integers(1, 5))):
        qg = draw(st.integers(0, left_g))
        qu = draw(st.integers(0, min(qg, left_u)))
        qp = draw(st.integers(0, left_p))
        left_g, left_u, left_p = left_g - qg, left_u - qu, left_p - qp
        holders.append(Quota(qg, qu, qp))
    return old, new, holders


@given(shrinking())
def test_shares_scaled_to_new_limits_each_on_its_own_fit_the_new_limits_together(case):
    old, new, holders = case
    QuotaBook("p", "m", holders={f"i{n}": q for n, q in enumerate(holders)}).check(old)
    scaled = [scaled_quota(q, old, new) for q in holders]
    QuotaBook("p", "m", holders={f"i{n}": q for n, q in enumerate(scaled)}).check(
        new
    )  # or QuotaError
    for before, after in zip(holders, scaled, strict=True):
        assert after.g <= before.g and after.u <= before.u and after.p <= before.p
        assert after.u <= after.g
