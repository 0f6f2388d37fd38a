"""Budget accounts: money held across holders by compare-and-swap (llmgw.core.budget)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.budget import (
    Account,
    AccountError,
    Purse,
    account_key,
    loan_order,
    period_id,
    regrant,
)

TTL = 30.0


def test_a_grant_is_what_was_asked_as_far_as_the_others_leave_room():
    account, grant = regrant(None, holder="a", limit=100, spent=0, want=60, now=0.0, ttl=TTL)
    assert grant == 60 and account.room == 40
    account, grant = regrant(account, holder="b", limit=100, spent=0, want=60, now=1.0, ttl=TTL)
    assert grant == 40 and account.room == 0
    # a gives back what it does not use; b may then have it
    account, grant = regrant(account, holder="a", limit=100, spent=10, want=10, now=2.0, ttl=TTL)
    assert grant == 10 and account.room == 50
    account, grant = regrant(account, holder="b", limit=100, spent=0, want=90, now=3.0, ttl=TTL)
    assert grant == 90 and account.room == 0


def test_spent_money_is_never_taken_back_even_past_the_limit():
    account, _ = regrant(None, holder="a", limit=100, spent=0, want=100, now=0.0, ttl=TTL)
    account, grant = regrant(account, holder="a", limit=100, spent=130, want=0, now=1.0, ttl=TTL)
    assert grant == 130 and account.spent == 130 and account.room == 0
    # totals never go back: an older report does not undo a newer one
    account, _ = regrant(account, holder="a", limit=100, spent=20, want=0, now=2.0, ttl=TTL)
    assert account.holders["a"].spent == 130


def test_a_silent_holder_is_closed_its_spend_kept_and_its_grant_freed():
    account, _ = regrant(None, holder="dead", limit=100, spent=30, want=80, now=0.0, ttl=TTL)
    account, grant = regrant(
        account, holder="b", limit=100, spent=0, want=100, now=TTL + 1, ttl=TTL
    )
    assert "dead" not in account.holders and account.closed == 30
    assert grant == 70 and account.spent == 30


def test_accounts_round_trip_and_bad_values_say_so():
    account, _ = regrant(None, holder="e.1", limit=5, spent=1, want=3, now=2.5, ttl=TTL)
    assert Account.from_json(account.to_json()) == account
    with pytest.raises(AccountError):
        Account.from_json(b'{"v": 9}')
    with pytest.raises(AccountError):
        Account.from_json(b'{"v": 1, "holders": {}}')


def test_periods_and_keys():
    now = 1_796_256_000.0  # 2026-12-03T00:00:00Z
    assert period_id("daily", now) == "2026-12-03"
    assert period_id("monthly", now) == "2026-12"
    assert period_id("total", now) == "total"
    assert (
        account_key("overflow", "tenant-team.a", "2026-12")
        == "budget.overflow.tenant-team_a.2026-12"
    )


def test_a_purse_reserves_within_its_grant_and_settles_the_real_cost():
    purse = Purse(grant=100)
    assert purse.reserve(60) and not purse.reserve(50) and purse.reserve(40)
    purse.settle(60, 70)  # cost more than estimated
    assert (purse.spent, purse.reserved) == (70, 40)
    assert not purse.reserve(1)
    purse.release(40)
    assert purse.want(10, 5) == 85


# One step of a run: a holder reserves an estimate, settles one of its reservations (its real
# cost within `error` of the estimate), or syncs with the account (CAS: one at a time).
steps = st.lists(
    st.tuples(
        st.sampled_from("abc"),
        st.sampled_from(["reserve", "settle", "sync"]),
        st.integers(1, 40),
        st.integers(0, 5),
    ),
    max_size=120,
)


@settings(max_examples=300)
@given(steps, st.integers(0, 300))
def test_spend_never_passes_the_limit_by_more_than_the_estimate_errors(run, limit):
    """Holders follow the protocol (reserve within their grant, ask the account when it does
    not fit, settle the real cost); whatever the interleaving, the account's settled spend stays
    within the limit plus the sum of the amounts by which real costs exceeded estimates."""
    account: Account | None = None
    purses = {h: Purse() for h in "abc"}
    open_: dict[str, list[tuple[int, int]]] = {h: [] for h in "abc"}
    overshoot = 0
    now = 0.0
    for holder, action, estimate, error in run:
        now += 0.01
        purse = purses[holder]
        if action == "reserve":
            if not purse.reserve(estimate):
                account, purse.grant = regrant(
                    account,
                    holder=holder,
                    limit=limit,
                    spent=purse.spent,
                    want=purse.want(estimate, 0),
                    now=now,
                    ttl=TTL,
                )
                if not purse.reserve(estimate):
                    continue
            open_[holder].append((estimate, error))
        elif action == "settle" and open_[holder]:
            estimate, error = open_[holder].pop(0)
            purse.settle(estimate, estimate + error)
            overshoot += error
        elif action == "sync":
            account, purse.grant = regrant(
                account,
                holder=holder,
                limit=limit,
                spent=purse.spent,
                want=purse.spent + purse.reserved,
                now=now,
                ttl=TTL,
            )
        committed = sum(p.spent + p.reserved for p in purses.values())
        assert committed <= limit + overshoot
    for holder, purse in purses.items():
        for estimate, error in open_[holder]:
            purse.settle(estimate, estimate + error)
            overshoot += error
        account, _ = regrant(
            account, holder=holder, limit=limit, spent=purse.spent, want=0, now=now, ttl=TTL
        )
    spent = account.spent if account is not None else 0
    assert spent == sum(p.spent for p in purses.values())
    assert spent <= limit + overshoot


def test_without_the_others_commitments_two_holders_pass_the_limit():
    """What the property guards against: an account that granted each holder what it asked for
    (ignoring the other's grant) lets two holders commit twice the limit."""
    account, grant_a = regrant(None, holder="a", limit=100, spent=0, want=100, now=0.0, ttl=TTL)
    _, grant_b = regrant(account, holder="b", limit=100, spent=0, want=100, now=0.0, ttl=TTL)
    assert grant_a + grant_b == 100  # held
    _, naive_b = regrant(None, holder="b", limit=100, spent=0, want=100, now=0.0, ttl=TTL)
    assert grant_a + naive_b == 200  # what a lost update (no CAS) would give


def test_an_account_names_who_holds_more_than_it_spent_and_loans_ask_them_most_first():
    account, _ = regrant(None, holder="a", limit=100, spent=10, want=40, now=0.0, ttl=TTL)
    account, _ = regrant(account, holder="b", limit=100, spent=5, want=5, now=1.0, ttl=TTL)
    account, _ = regrant(account, holder="c", limit=100, spent=0, want=20, now=2.0, ttl=TTL)
    assert account.lenders("b") == {"a": 30, "c": 20}  # b holds nothing beyond its spend
    assert account.lenders("a") == {"c": 20}
    assert loan_order({"x": 5, "a": 30, "c": 30}) == ["a", "c", "x"]


def test_a_purse_lends_only_what_is_idle_and_gives_back_before_the_account_hears():
    purse = Purse(grant=100, spent=30, room=7, elsewhere=3)
    assert purse.reserve(20)
    assert purse.may_fit(60) and not purse.may_fit(61)  # idle 50 + room 7 + elsewhere 3
    assert purse.lend(80) == 50  # never what is spent or reserved
    assert (purse.grant, purse.idle, purse.room) == (50, 0, 57)
    assert purse.may_fit(60) and not purse.may_fit(61)  # what was given back is room now
    purse.release(20)
    purse.lower(35)  # a smaller grant asked for applies here at once, never below spent
    assert (purse.grant, purse.room) == (35, 72)
    purse.lower(10)
    assert purse.grant == 30
    purse.lower(90)  # a larger one only once the account gave it
    assert purse.grant == 30
    assert Purse().may_fit(10**9)  # never heard: worth an ask


def _reach(account: Account, holder: str) -> int:
    """What `holder` could still get of the account: its grant beyond its spend, the room and
    what every other holder holds beyond its spend."""
    mine = account.holders.get(holder)
    own = max(0, mine.grant - mine.spent) if mine is not None else 0
    return own + account.room + sum(account.lenders(holder).values())


writes = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(0, 30), st.integers(0, 120)),
    max_size=60,
)


@settings(max_examples=300)
@given(writes, st.integers(0, 300))
def test_what_a_holder_heard_bounds_what_it_may_still_get(run, limit):
    """Whatever the holders write (spending within their grants, asking for any grant), what a
    holder could still get of the account (its own idle grant, the room, the others' grants
    beyond their spend) never grows: an old answer bounds every later one, so a holder that
    heard its estimate cannot fit need not ask again (`Purse.may_fit`)."""
    account: Account | None = None
    spent = dict.fromkeys("abc", 0)
    for step, (holder, spend, want) in enumerate(run):
        if account is not None:
            held = account.holders.get(holder)
            spent[holder] += min(spend, held.grant - held.spent if held is not None else 0)
        before = {h: _reach(account, h) for h in "abc"} if account is not None else None
        account, _ = regrant(
            account,
            holder=holder,
            limit=limit,
            spent=spent[holder],
            want=want,
            now=step * 0.01,
            ttl=TTL,
        )
        if before is not None:
            for h in "abc":
                assert _reach(account, h) <= before[h], h


# One step of a run in which writes travel: a holder reserves (and asks for more, with as much
# again to spare, when its grant cannot fit), settles one of its reservations (its real cost
# `error` off the estimate: less, or up to 5 more), asks to shrink to what it spent and
# reserved, or lends what it holds idle to another holder; an ask is written by CAS later
# (`write`), and its answer reaches the holder later still.
flights = st.lists(
    st.tuples(
        st.sampled_from("ab"),
        st.sampled_from(["reserve", "settle", "shrink", "lend", "write", "reply"]),
        st.integers(1, 40),
        st.integers(-40, 5),
    ),
    min_size=10,
    max_size=150,
)


@settings(max_examples=500)
@given(flights, st.integers(0, 300))
def test_grants_moved_while_writes_travel_never_let_the_holders_pass_the_limit(run, limit):
    """A holder has one ask in flight at most; a smaller grant applies in memory before its
    ask is sent (`Purse.lower`, `Purse.lend`), a larger one when its answer arrives. Whatever
    the interleaving, what the holders have spent and reserved stays within the limit plus
    the estimate errors, and no holder commits more than the account holds for it."""
    account: Account | None = None
    purses = {h: Purse() for h in "ab"}
    open_: dict[str, list[tuple[int, int]]] = {h: [] for h in "ab"}
    sent: dict[str, tuple[int, int]] = {}  # holder -> (spent, want) of its ask in flight
    answered: dict[str, int] = {}  # holder -> the grant written for it, not yet heard
    overshoot = 0
    for step, (holder, action, amount, error) in enumerate(run):
        purse = purses[holder]
        busy = holder in sent or holder in answered

        def ask(want: int, purse: Purse = purse, holder: str = holder) -> None:
            purse.lower(want)
            sent[holder] = (purse.spent, want)

        if action == "reserve":
            if purse.reserve(amount):
                open_[holder].append((amount, error))
            elif not busy:
                ask(purse.want(amount, amount))
        elif action == "settle" and open_[holder]:
            estimate, error = open_[holder].pop(0)
            purse.settle(estimate, max(0, estimate + error))
            overshoot += max(0, error)
        elif action == "shrink" and not busy:
            ask(purse.spent + purse.reserved)
        elif action == "lend" and not busy and purse.lend(amount):
            ask(purse.grant)
        elif action == "write" and holder in sent:
            spent, want = sent.pop(holder)
            account, answered[holder] = regrant(
                account,
                holder=holder,
                limit=limit,
                spent=spent,
                want=want,
                now=step * 0.01,
                ttl=TTL,
            )
        elif action == "reply" and holder in answered:
            purse.grant = answered.pop(holder)
        committed = sum(p.spent + p.reserved for p in purses.values())
        assert committed <= limit + overshoot
        if overshoot == 0:
            for name, other in purses.items():
                held = account.holders.get(name) if account is not None else None
                assert other.grant <= (held.grant if held is not None else 0), name
