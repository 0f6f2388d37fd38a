"""Prices and spend as exact integers (llmgw.core.spend)."""

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.placement import EndpointState, ProviderState, Room
from llmgw.core.spend import (
    PICOS,
    PriceBook,
    PromptCalibration,
    SpendTotals,
    TokenPrices,
    TokenUse,
    billed_use,
    cheaper_first,
    estimate_input_tokens,
    fleet_cost,
    format_money,
    micros_of,
    money_of,
    period_of,
    spread_fleet_cost,
)
from llmgw.core.usage import Usage

amounts = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False)
tokens = st.integers(min_value=0, max_value=2_000_000)


@pytest.mark.parametrize(
    ("given", "micros"),
    [(0, 0), (2.4, 2_400_000), ("0.6", 600_000), (Decimal("1.000001"), 1_000_001), (3, 3_000_000)],
    ids=["zero", "float", "string", "decimal", "int"],
)
def test_amounts_become_micro_units(given, micros):
    assert micros_of(given) == micros


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (-1, ">= 0"),
        ("abc", "a number"),
        (True, "a number"),
        (None, "a number"),
        ("nan", "finite"),
        (float("inf"), "finite"),
        (0.0000001, "decimals"),
    ],
    ids=["negative", "text", "bool", "none", "nan", "inf", "too-fine"],
)
def test_bad_amounts_say_why(bad, says):
    with pytest.raises(ValueError, match=says):
        micros_of(bad)


@given(amounts, amounts, amounts, tokens, tokens, tokens)
def test_a_cost_is_the_exact_product_of_tokens_and_prices(pin, pcached, pout, n_in, n_cached, out):
    prices = TokenPrices(micros_of(pin), micros_of(pout), micros_of(pcached))
    cached = min(n_cached, n_in)
    use = TokenUse(input=n_in, cached=cached, output=out)
    exact = (pin * (n_in - cached) + pcached * cached + pout * out) / Decimal(1_000_000)
    assert money_of(prices.cost(use)) == exact


@given(st.lists(st.tuples(amounts, tokens, tokens), min_size=1, max_size=40))
def test_totals_in_any_order_and_grouping_are_equal_to_the_pico(attempts):
    book = PriceBook(
        {("p", "*"): TokenPrices(micros_of(Decimal("0.6")), micros_of(Decimal("2.4")))}
    )
    one, two = SpendTotals(), SpendTotals()
    halves = (SpendTotals(), SpendTotals())
    for index, (_, n_in, out) in enumerate(attempts):
        use = TokenUse(input=n_in, output=out)
        picos = book.cost("p", "m", use)
        one.add(("k", "t", "p", "m"), use, picos)
        halves[index % 2].add(("k", "t", "p", "m"), use, picos)
    for _, n_in, out in reversed(attempts):
        use = TokenUse(input=n_in, output=out)
        two.add(("k", "t", "p", "m"), use, book.cost("p", "m", use))
    merged = SpendTotals()
    for half in halves:
        merged.merge(SpendTotals.from_wire(half.to_wire()))
    assert one.picos == two.picos == merged.picos
    assert one.rows == merged.rows


def test_a_pair_price_wins_over_the_providers_star_and_others_are_free():
    book = PriceBook(
        {("x", "*"): TokenPrices(1_000_000, 2_000_000), ("x", "m"): TokenPrices(3_000_000, 0)}
    )
    use = TokenUse(input=1_000_000, output=1_000_000)
    assert book.cost("x", "m", use) == 3 * PICOS
    assert book.cost("x", "other", use) == 3 * PICOS
    assert book.cost("ours", "m", use) == 0


def test_cached_input_costs_the_input_price_unless_given():
    use = TokenUse(input=1_000_000, cached=400_000, output=0)
    assert TokenPrices(input=1_000_000).cost(use) == PICOS
    assert TokenPrices(input=1_000_000, cached_input=500_000).cost(use) == (
        600_000 * 1_000_000 + 400_000 * 500_000
    )


@pytest.mark.parametrize(
    ("picos", "cents"),
    [(0, "0.00"), (4_999_999_999, "0.00"), (5_000_000_000, "0.01"), (1_234_567_000_000, "1.23")],
)
def test_money_rounds_half_up_once(picos, cents):
    assert format_money(picos) == cents


def test_periods_are_utc_days_and_months():
    assert period_of(1_796_256_000.0) == "2026-12-03"
    assert period_of(1_796_256_000.0 - 1) == "2026-12-02"
    assert period_of(1_796_256_000.0, "month") == "2026-12"


def test_an_attempt_is_billed_its_usage_else_what_it_relayed():
    body = {"messages": [{"role": "user", "content": "xxxx " * 10}]}
    assert billed_use(Usage(10, 5, 3), 99, body, True) == TokenUse(10, 3, 5)
    assert billed_use(None, 6, body, True) == TokenUse(input=4 + 10, output=5)
    assert billed_use(None, 6, {"prompt": "abcd, efghi"}, False) == TokenUse(input=4, output=6)
    assert billed_use(None, 1, body, True) == TokenUse()  # the role event only
    assert billed_use(None, 0, body, False) == TokenUse()


def test_prompt_estimates_read_text_parts_and_token_ids():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh!"}]}]}
    assert estimate_input_tokens(body) == 4 + 3
    assert estimate_input_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_input_tokens({"input": ["abcd", "efgh"]}) == 2


def test_the_calibration_scales_estimates_to_what_the_provider_counted():
    calibration = PromptCalibration()
    assert calibration.scale(10) == 10  # nothing seen yet
    for _ in range(5):
        calibration.observe(10, 15)
    assert calibration.scale(20) == 30 and not calibration.warm
    usage = Usage(30, 2)
    body = {"prompt": "a b c d e f g h i j k l m n o p q r s t"}  # 20 pieces
    assert billed_use(usage, 3, body, False, calibration).input == 30  # observed, its own
    assert billed_use(None, 3, body, False, calibration) == TokenUse(input=30, output=3)


@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=12),
    st.integers(0, 10**15),
)
def test_a_fleets_cost_is_spread_over_the_tokens_served_exactly(rows, cost):
    totals = SpendTotals()
    for index, (n_in, out) in enumerate(rows):
        totals.add((f"k{index}", "t", "ours", "m"), TokenUse(input=n_in, output=out), 0)
    totals.add(("k", "t", "theirs", "m"), TokenUse(input=5, output=5), 7)
    parts = spread_fleet_cost(totals, {"ours": cost})
    served = sum(n_in + out for n_in, out in rows)
    assert all(where[2] == "ours" for where in parts)  # only the provider's own rows
    if served == 0:
        assert parts == {}
        return
    assert sum(parts.values()) == cost
    for where, share in parts.items():
        row = totals.rows[where]
        assert abs(share * served - cost * (row.input + row.output)) < served  # within 1 pico


def test_a_fleet_costs_its_endpoint_hours():
    assert fleet_cost(4_000_000, 2, 1800) == 4 * PICOS  # $4 an endpoint-hour, 2 for half an hour


def _provider(pid: str, managed: bool = False, weight: float | None = None) -> ProviderState:
    endpoint = EndpointState(f"{pid}-e", rate_weight=weight)
    return ProviderState(pid, managed, True, False, (endpoint,), Room(True, True, True))


def test_cheaper_third_parties_of_equal_priority_go_first_unless_too_slow():
    ours, dear, cheap, other = (
        _provider("ours", managed=True),
        _provider("dear", weight=0.9),
        _provider("cheap", weight=0.8),
        _provider("other", weight=0.1),
    )
    priority = {"ours": 100, "dear": 50, "cheap": 50, "other": 10}
    cost = {"dear": 3_000_000, "cheap": 1_000_000, "other": 0}
    order = cheaper_first((ours, dear, cheap, other), cost, priority, 0.8)
    assert [p.id for p in order] == ["ours", "cheap", "dear", "other"]  # other: lower priority
    slow = _provider("cheap", weight=0.5)  # 0.5 < 0.8 x 0.9: too slow to be preferred
    assert [p.id for p in cheaper_first((ours, dear, slow), cost, priority, 0.8)][1] == "dear"
    assert [p.id for p in cheaper_first((ours, dear, slow), cost, priority, 0.0)][1] == "cheap"
    assert cheaper_first((ours, dear, cheap), cost, priority, 1.5) == (ours, dear, cheap)


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 2),
            st.integers(0, 5),
            st.none() | st.floats(0, 1),
        ),
        max_size=8,
    ),
    st.floats(0, 1),
)
def test_cost_only_reorders_unlimited_providers_within_a_priority(specs, min_speed):
    providers = []
    priority, cost = {}, {}
    for index, (managed, prio, price, weight) in enumerate(specs):
        pid = f"p{index}"
        providers.append(_provider(pid, managed=managed, weight=weight))
        priority[pid], cost[pid] = prio, price
    order = cheaper_first(tuple(providers), cost, priority, min_speed)
    assert sorted(p.id for p in order) == sorted(p.id for p in providers)
    for before, after in zip(providers, order, strict=True):
        if before.managed or after.managed:
            assert before.id == after.id  # managed providers never move
        else:
            assert priority[before.id] == priority[after.id]  # only within a priority's run
