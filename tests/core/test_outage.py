"""The edge's local decision during a NATS outage (llmgw.core.outage), property-tested."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.outage import LocalBudget, LocalEndpoint, LocalProvider, local_share

MANAGED = LocalProvider(
    "iris",
    unlimited=False,
    endpoints=(LocalEndpoint("e1", "http://e1", "m"), LocalEndpoint("e2", "http://e2", "m", 50)),
    global_slots=7,
    per_session=2,
)
THIRD_PARTY = LocalProvider("tx", unlimited=True, endpoints=(LocalEndpoint("t1", "http://t", "m"),))


def test_local_share_is_the_floor_of_g_over_the_edges_seen():
    assert local_share(8, 2) == 4
    assert local_share(7, 2) == 3
    assert local_share(3, 4) == 0  # all edges together never exceed G
    assert local_share(5, 0) == 5  # no edge heard of yet: this one


operations = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), st.sampled_from(["a", "b", "c", None]), st.booleans()),
        st.tuples(st.just("end"), st.integers(0, 50), st.just(False)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(1, 4))
def test_grants_stay_within_the_share_and_per_session_limit(ops, edges):
    budget = LocalBudget()
    running: list[tuple[str, str, str | None]] = []
    share = local_share(7, edges)
    for op, arg, with_overflow in ops:
        if op == "ask":
            providers = (MANAGED, THIRD_PARTY) if with_overflow else (MANAGED,)
            choice = budget.choose(providers, "m", arg, (), edges)
            managed_now = sum(1 for p, _, _ in running if p == "iris")
            same_session = sum(1 for p, _, s in running if p == "iris" and s == arg and s)
            managed_room = managed_now < share and (arg is None or same_session < 2)
            if choice is None:
                assert not managed_room and not with_overflow
                continue
            # Managed first whenever it has room; the third party only beyond it.
            assert (choice.provider.id == "iris") == managed_room
            budget.take(choice, "m", arg)
            running.append((choice.provider.id, choice.endpoint.id, arg))
        elif running:
            provider, endpoint, session = running.pop(arg % len(running))
            budget.give_back(provider, endpoint, "m", session)
        assert budget.pairs[("iris", "m")] <= share
        for session in ("a", "b", "c"):
            assert budget.sessions[("iris", "m", session)] <= 2
    for provider, endpoint, session in running:
        budget.give_back(provider, endpoint, "m", session)
    assert budget.in_flight() == 0 and not budget.pairs and not budget.sessions


def test_the_endpoint_with_the_fewest_requests_per_weight_is_chosen_and_tried_ones_skipped():
    budget = LocalBudget()
    first = budget.choose((MANAGED,), "m", None, (), 1)
    assert first is not None and first.endpoint.id == "e1"  # a tie: config order
    budget.take(first, "m", None)
    second = budget.choose((MANAGED,), "m", None, (), 1)
    assert second is not None and second.endpoint.id == "e2"  # 0/50 < 1/100
    skipped = budget.choose((MANAGED,), "m", None, ("e2",), 1)
    assert skipped is not None and skipped.endpoint.id == "e1"
    assert budget.choose((MANAGED,), "m", None, ("e1", "e2"), 1) is None
