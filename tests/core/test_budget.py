"""Budget accounts: money held across holders by compare-and-swap (llmgw.core.budget)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.budget import Account, AccountError, Purse, account_key, period_id, regrant

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
