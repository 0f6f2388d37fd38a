"""Placement: the pinning rules step by step, plus affinity, free batch slots and return home.

Properties (hypothesis, over generated snapshots):
- a session's home replica (where its last request ran) is kept whenever it has a free batch
  slot, or is within the load bound (by capacity) unless the request is interactive and another
  usable endpoint has a free slot; a request without a cache of its own there starts where there
  is most room;
- no interactive request lands on an endpoint without a free batch slot while another usable
  endpoint of the same provider has one;
- an unlimited provider is chosen only when no managed provider can take the request now (or
  flow control said overflow, or the session is pinned there).
Then table-driven cases for each route.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.affinity import HashRing
from llmgw.core.ledger import LeaseKind, Room
from llmgw.core.outcomes import Refusal
from llmgw.core.placement import (
    CACHED_ENOUGH,
    FOLLOW_CACHE_MARGIN,
    AffinityBreak,
    EndpointState,
    PinAction,
    PinState,
    Placement,
    PlacementRequest,
    PlacementSettings,
    ProviderState,
    Route,
    Snapshot,
    can_take_now,
    place,
)

ROOMY = Room(True, True, True)
FULL = Room(False, False, False)
NOW = 1000.0
SESSION = "ab" * 16


def endpoint(id_, inflight=0, capacity=8, usable=True, saturation=0.0, priority=100):
    return EndpointState(id_, priority, usable, inflight, capacity, saturation)


def managed(id_, endpoints, room=ROOMY, degraded=False, evictable=False, saturation=0.0):
    ring = HashRing([e.id for e in endpoints]) if endpoints else None
    return ProviderState(
        id_, True, True, degraded, tuple(endpoints), room, "score", evictable, saturation, ring
    )


def unlimited(id_="tx", endpoints=("t1",)):
    return ProviderState(
        id_,
        False,
        True,
        False,
        tuple(EndpointState(e, rate_weight=1.0) for e in endpoints),
        ROOMY,
        "rate",
    )


DEFAULT_SETTINGS = PlacementSettings()


def snap(*providers, pin=None, settings=DEFAULT_SETTINGS):
    return Snapshot(tuple(providers), pin, NOW, settings)


# ---- generated snapshots ---------------------------------------------------------------------

endpoint_states = st.builds(
    EndpointState,
    id=st.just("x"),
    usable=st.booleans(),
    inflight=st.integers(0, 20),
    capacity=st.integers(1, 16),
    saturation=st.floats(0, 0.99),
    cached=st.floats(0, 1),
)
rooms = st.builds(Room, st.booleans(), st.booleans(), st.booleans())


@st.composite
def managed_providers(draw, name):
    states = draw(st.lists(endpoint_states, min_size=1, max_size=4))
    endpoints = [
        EndpointState(
            f"{name}-e{i}", 100, s.usable, s.inflight, s.capacity, s.saturation, cached=s.cached
        )
        for i, s in enumerate(states)
    ]
    return managed(
        name,
        endpoints,
        draw(rooms),
        degraded=draw(st.booleans()),
        evictable=draw(st.booleans()),
        saturation=draw(st.floats(0, 2)),
    )


@st.composite
def snapshots(draw):
    providers = [draw(managed_providers("iris")), draw(managed_providers("iris2"))]
    if draw(st.booleans()):
        providers.append(unlimited())
    pin = None
    if draw(st.booleans()):
        pin = PinState(
            draw(st.sampled_from([p.id for p in providers])),
            draw(st.booleans()),
            draw(st.floats(0, NOW)),
        )
    settings = PlacementSettings(return_home=draw(st.booleans()))
    return snap(*providers, pin=pin, settings=settings)


requests = st.builds(
    PlacementRequest,
    session=st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32)),
    interactive=st.booleans(),
    overflow=st.booleans(),
    draw=st.floats(0, 0.999),
)


def by_id(snapshot, provider_id):
    return next(p for p in snapshot.providers if p.id == provider_id)


@given(snapshot=snapshots(), request=requests)
def test_interactive_requests_never_queue_where_another_endpoint_has_a_free_slot(snapshot, request):
    """...unless the endpoint holds at least half of the prompt, and then behind at most
    `prefix_queue` requests past its slots (a cold prefill elsewhere would take longer)."""
    outcome = place(snapshot, request)
    if not isinstance(outcome, Placement) or not request.interactive:
        return
    provider = by_id(snapshot, outcome.provider)
    if not provider.managed:
        return
    chosen = next(e for e in provider.endpoints if e.id == outcome.endpoint)
    assert chosen.usable
    queue = snapshot.settings.prefix_queue
    if not chosen.free_slot and any(e.usable and e.free_slot for e in provider.endpoints):
        assert chosen.cached >= CACHED_ENOUGH, outcome
        assert chosen.inflight < chosen.capacity + queue, outcome


@given(snapshot=snapshots(), request=requests)
def test_placement_leaves_its_snapshot_and_request_as_it_found_them(snapshot, request):
    """The snapshot's values are `record`s: frozen for the type checker, plain slotted
    dataclasses at run time (llmgw.core.records). Placement only reads them."""
    rings = {id(p.ring): p.ring for p in snapshot.providers}  # compared by identity: kept
    snapshot_before, request_before = copy.deepcopy(snapshot, rings), copy.deepcopy(request)
    place(snapshot, request)
    assert snapshot == snapshot_before
    assert request == request_before


@given(snapshot=snapshots(), request=requests)
def test_an_unlimited_provider_is_chosen_only_when_no_managed_one_can_take_it(snapshot, request):
    outcome = place(snapshot, request)
    if not isinstance(outcome, Placement) or by_id(snapshot, outcome.provider).managed:
        return
    if request.overflow or outcome.route is Route.PINNED:
        return  # flow control's overflow, or the session's pin is there
    pin = snapshot.pin
    for provider in snapshot.providers:
        if not provider.managed:
            continue
        if outcome.route is Route.TEMPORARY and pin is not None and provider.id == pin.provider:
            continue  # the pin's own provider was full or failed: that is why it left
        needs_pin = outcome.route in (Route.NEW_PIN, Route.REPINNED)
        kind = LeaseKind.NEW_PIN if needs_pin else LeaseKind.TEMPORARY
        assert not can_take_now(provider, kind, new_pin=needs_pin), (provider.id, outcome)


def capacity_bound(endpoints, chosen, factor):
    """Bounded loads by capacity, written out: ceil(factor * (load + 1) * share of slots)."""
    load = sum(e.inflight for e in endpoints) + 1
    return math.ceil(factor * load * chosen.capacity / sum(e.capacity for e in endpoints))


@given(
    loads=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 16)), min_size=2, max_size=5),
    home_index=st.integers(0, 4),
    interactive=st.booleans(),
    session=st.text("0123456789abcdef", min_size=32, max_size=32),
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
)
def test_a_session_keeps_its_home_replica_while_it_has_room(
    loads, home_index, interactive, session, factor
):
    endpoints = [endpoint(f"e{i}", n, c) for i, (n, c) in enumerate(loads)]
    iris = managed("iris", endpoints)
    home = endpoints[home_index % len(endpoints)]
    settings = PlacementSettings(session_load_factor=factor)
    outcome = place(
        snap(iris, pin=PinState("iris", False, NOW, home.id), settings=settings),
        PlacementRequest(session, interactive),
    )
    assert isinstance(outcome, Placement) and outcome.route is Route.PINNED
    has_room = home.inflight + 1 <= capacity_bound(endpoints, home, factor)
    someone_free = any(e.free_slot for e in endpoints)
    if home.free_slot or (has_room and (not interactive or not someone_free)):
        assert outcome.endpoint == home.id and outcome.affinity_break is None
    else:
        assert outcome.endpoint != home.id and outcome.affinity_break is not None
        moved_to = next(e for e in endpoints if e.id == outcome.endpoint)
        if someone_free:
            assert moved_to.free_slot  # it leaves its cache only for a batch slot that is free


@given(
    loads=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 16)), min_size=2, max_size=5),
    interactive=st.booleans(),
    session=st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32)),
)
def test_work_without_a_cache_here_starts_where_there_is_most_room(loads, interactive, session):
    endpoints = [endpoint(f"e{i}", n, c) for i, (n, c) in enumerate(loads)]
    outcome = place(snap(managed("iris", endpoints)), PlacementRequest(session, interactive))
    assert isinstance(outcome, Placement) and outcome.affinity_break is None
    chosen = next(e for e in endpoints if e.id == outcome.endpoint)
    if any(e.free_slot for e in endpoints):
        assert chosen.free_slot  # nothing of its own to lose: it never starts in a queue
        assert chosen.score == min(e.score for e in endpoints if e.free_slot)
    else:
        assert chosen.score == min(e.score for e in endpoints)


@given(
    loads=st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 16), st.floats(0, 1)), min_size=2, max_size=5
    ),
    interactive=st.booleans(),
    session=st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32)),
    weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_new_work_starts_where_its_prompt_is_cached_traded_against_load(
    loads, interactive, session, weight
):
    endpoints = [
        EndpointState(f"e{i}", inflight=n, capacity=c, cached=held)
        for i, (n, c, held) in enumerate(loads)
    ]
    settings = PlacementSettings(prefix_weight=weight)
    outcome = place(
        snap(managed("iris", endpoints), settings=settings), PlacementRequest(session, interactive)
    )
    assert isinstance(outcome, Placement) and outcome.affinity_break is None
    chosen = next(e for e in endpoints if e.id == outcome.endpoint)
    queue = settings.prefix_queue if weight > 0 else 0
    room = [e for e in endpoints if e.has_room(queue)]
    # A cached prefix makes it wait behind at most `prefix_queue` requests where another
    # endpoint has a free slot (no herding): a popular prefix spreads once its engines are full.
    assert chosen.has_room(queue) or not room
    pool = room or endpoints
    assert chosen.cost(weight) == min(e.cost(weight) for e in pool)
    if weight == 0:  # cache-blind: the endpoint with most room, as before
        assert chosen.score == min(e.score for e in pool) and (chosen.free_slot or not room)


def test_a_new_session_starts_on_the_engine_that_holds_its_prompt_until_its_queue_is_full():
    busy_with_it = EndpointState("e0", inflight=3, capacity=4, cached=1.0)
    idle_without = EndpointState("e1", inflight=0, capacity=4, cached=0.0)
    chosen = place(snap(managed("iris", [busy_with_it, idle_without])), PlacementRequest("s"))
    assert isinstance(chosen, Placement) and chosen.endpoint == "e0"  # 0.75 - 2 x 1.0 < 0
    full = EndpointState("e0", inflight=4, capacity=4, cached=1.0)
    waits = place(snap(managed("iris", [full, idle_without])), PlacementRequest("s"))
    assert isinstance(waits, Placement) and waits.endpoint == "e0"  # one request past its slots
    queued = EndpointState("e0", inflight=5, capacity=4, cached=1.0)
    spread = place(snap(managed("iris", [queued, idle_without])), PlacementRequest("s"))
    assert isinstance(spread, Placement) and spread.endpoint == "e1"
    half = EndpointState("e0", inflight=4, capacity=4, cached=0.4)  # too little to wait for
    elsewhere = place(snap(managed("iris", [half, idle_without])), PlacementRequest("s"))
    assert isinstance(elsewhere, Placement) and elsewhere.endpoint == "e1"
    blind = PlacementSettings(prefix_weight=0.0)
    cold = place(
        snap(managed("iris", [busy_with_it, idle_without]), settings=blind), PlacementRequest("s")
    )
    assert isinstance(cold, Placement) and cold.endpoint == "e1"


@given(home_held=st.floats(0, 1), other_held=st.floats(0, 1), other_busy=st.integers(0, 4))
def test_a_pinned_session_follows_its_prompt_only_when_its_home_lost_it(
    home_held, other_held, other_busy
):
    home = EndpointState("e0", inflight=1, capacity=4, cached=home_held)
    other = EndpointState("e1", inflight=other_busy, capacity=4, cached=other_held)
    outcome = place(
        snap(managed("iris", [home, other]), pin=PinState("iris", False, NOW, "e0")),
        PlacementRequest("s", interactive=True),
    )
    assert isinstance(outcome, Placement) and outcome.route is Route.PINNED
    if other.has_room(1) and other_held - home_held >= FOLLOW_CACHE_MARGIN:
        assert outcome.endpoint == "e1" and outcome.affinity_break is AffinityBreak.HOME_COLD
    else:
        assert outcome.endpoint == "e0" and outcome.affinity_break is None


# ---- the pinning rules, route by route ---------------------------------------------------------


def test_no_session_runs_on_the_first_provider_with_room_without_a_pin():
    outcome = place(snap(managed("iris", [endpoint("e1")]), unlimited()), PlacementRequest(None))
    assert outcome == Placement("iris", "e1", Route.UNPINNED, LeaseKind.TEMPORARY)


def test_a_new_session_is_pinned_on_the_first_managed_provider_with_pin_and_request_room():
    iris = managed("iris", [endpoint("e1")], room=Room(True, True, False))  # pin table full
    iris2 = managed("iris2", [endpoint("f1")])
    outcome = place(snap(iris, iris2, unlimited()), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.pin_action) == (
        "iris2",
        Route.NEW_PIN,
        PinAction.CREATE,
    )


def test_a_full_pin_table_evicts_an_idle_pin_rather_than_sending_the_session_away():
    iris = managed("iris", [endpoint("e1")], room=Room(True, True, False), evictable=True)
    outcome = place(snap(iris, unlimited()), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.evict, outcome.route) == ("iris", True, Route.NEW_PIN)


def test_only_when_every_managed_provider_is_full_does_a_new_session_go_to_a_third_party():
    iris = managed("iris", [endpoint("e1")], room=Room(True, False, True))
    outcome = place(snap(iris, unlimited()), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement) and outcome.provider == "tx"
    assert outcome.route is Route.NEW_PIN


def test_a_pinned_session_at_its_limit_runs_elsewhere_and_keeps_its_pin():
    iris = managed("iris", [endpoint("e1")])
    iris2 = managed("iris2", [endpoint("f1")])
    outcome = place(snap(iris, iris2, pin=PinState("iris", True, NOW)), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.reason, outcome.pin_action) == (
        "iris2",
        Route.TEMPORARY,
        "session_limit",
        PinAction.NONE,
    )


def test_a_provider_at_its_global_limit_sends_the_request_elsewhere_once():
    iris = managed("iris", [endpoint("e1")], room=Room(False, False, True))
    outcome = place(
        snap(iris, unlimited(), pin=PinState("iris", False, NOW)), PlacementRequest(SESSION)
    )
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.reason) == (
        "tx",
        Route.TEMPORARY,
        "global_limit",
    )


def test_a_degraded_provider_loses_its_sessions_to_the_next_one():
    iris = managed("iris", [endpoint("e1")], degraded=True)
    iris2 = managed("iris2", [endpoint("f1")])
    outcome = place(snap(iris, iris2, pin=PinState("iris", False, NOW)), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.pin_action, outcome.reason) == (
        "iris2",
        Route.REPINNED,
        PinAction.MOVE,
        "degraded",
    )


def test_a_retry_whose_pinned_provider_has_no_endpoint_left_runs_on_the_next_provider():
    iris = managed("iris", [endpoint("e1", usable=False)])  # failed for this request
    outcome = place(
        snap(iris, unlimited(), pin=PinState("iris", False, NOW)), PlacementRequest(SESSION)
    )
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.reason) == (
        "tx",
        Route.TEMPORARY,
        "endpoint_failed",
    )


def test_a_session_on_a_third_party_returns_home_once_settled_and_our_pool_has_room():
    iris = managed("iris", [endpoint("e1")], saturation=0.2)
    pin = PinState("tx", False, NOW - 31)
    outcome = place(snap(iris, unlimited(), pin=pin), PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.pin_action) == (
        "iris",
        Route.RETURNED_HOME,
        PinAction.MOVE,
    )
    # Hysteresis: not before return_home_after, not while our pool is busy, not when disabled.
    for providers, pin_, settings in (
        ((iris, unlimited()), PinState("tx", False, NOW - 5), PlacementSettings()),
        (
            (managed("iris", [endpoint("e1")], saturation=0.9), unlimited()),
            pin,
            PlacementSettings(),
        ),
        ((iris, unlimited()), pin, PlacementSettings(return_home=False)),
    ):
        stays = place(snap(*providers, pin=pin_, settings=settings), PlacementRequest(SESSION))
        assert isinstance(stays, Placement) and stays.route is Route.PINNED
        assert stays.provider == "tx"


def test_overflow_goes_to_a_third_party_and_leaves_the_pin_alone():
    iris = managed("iris", [endpoint("e1")])
    outcome = place(
        snap(iris, unlimited(), pin=PinState("iris", False, NOW)),
        PlacementRequest(SESSION, overflow=True),
    )
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.pin_action) == (
        "tx",
        Route.OVERFLOW,
        PinAction.NONE,
    )


def test_nothing_serves_the_model_or_everything_is_full():
    unsupported = ProviderState("iris", True, False, False, (endpoint("e1"),), ROOMY)
    assert place(snap(unsupported), PlacementRequest(SESSION)) is Refusal.UNSUPPORTED
    full = managed("iris", [endpoint("e1")], room=FULL)
    assert place(snap(full), PlacementRequest(SESSION)) is Refusal.NO_CAPACITY


def test_an_interactive_request_leaves_a_full_home_for_a_free_slot_and_says_why():
    # Home e1 (where the session's last request ran) is full (8 of 8) but within the load bound
    # (ceil(1.25 * 16 / 2) = 10); e2 has one free slot.
    endpoints = [endpoint("e1", 8, 8), endpoint("e2", 7, 8)]
    iris = managed("iris", endpoints)
    session = next(s for s in (f"{i:032x}" for i in range(100)) if iris.ring.walk(s)[0] == "e1")
    pin = PinState("iris", False, NOW, "e1")
    batch = place(snap(iris, pin=pin), PlacementRequest(session, interactive=False))
    assert isinstance(batch, Placement) and batch.endpoint == "e1"  # keeps its prefix cache
    interactive = place(snap(iris, pin=pin), PlacementRequest(session, interactive=True))
    assert isinstance(interactive, Placement)
    assert interactive.endpoint == "e2" and interactive.affinity_break is AffinityBreak.HOME_BUSY


def test_rate_strategy_draws_by_the_balancers_weights():
    tx = ProviderState(
        "tx",
        False,
        True,
        False,
        (EndpointState("t1", rate_weight=1.0), EndpointState("t2", rate_weight=3.0)),
        ROOMY,
        "rate",
    )
    picks = [place(snap(tx), PlacementRequest(None, draw=d / 100)).endpoint for d in range(100)]
    assert picks.count("t1") == 25 and picks.count("t2") == 75


def test_a_lora_adapters_request_prefers_the_engine_that_has_it_loaded():
    loaded = EndpointState("e0", inflight=0, capacity=4, adapter_loaded=True)
    idle = EndpointState("e1", inflight=0, capacity=4)
    chosen = place(snap(managed("iris", [idle, loaded])), PlacementRequest("s"))
    assert isinstance(chosen, Placement) and chosen.endpoint == "e0"  # cost -0.25 against 0
    busier = EndpointState("e0", inflight=2, capacity=4, adapter_loaded=True)
    moved = place(snap(managed("iris", [busier, idle])), PlacementRequest("s"))
    assert isinstance(moved, Placement) and moved.endpoint == "e1"  # 0.5 - 0.25 > 0


# ---- a sub-agent's new session starts near its parent ------------------------------------------


@given(
    loads=st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 16), st.floats(0, 1)), min_size=2, max_size=5
    ),
    parent_index=st.integers(0, 4),
    interactive=st.booleans(),
    prefix_weight=st.sampled_from([0.0, 2.0]),
    parent_weight=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_a_new_sub_agent_session_starts_on_its_parents_endpoint_while_it_has_room(
    loads, parent_index, interactive, prefix_weight, parent_weight
):
    parent = parent_index % len(loads)
    endpoints = [
        EndpointState(f"e{i}", inflight=n, capacity=c, cached=held, near_parent=i == parent)
        for i, (n, c, held) in enumerate(loads)
    ]
    settings = PlacementSettings(prefix_weight=prefix_weight, parent_weight=parent_weight)
    outcome = place(
        snap(managed("iris", endpoints), settings=settings), PlacementRequest(SESSION, interactive)
    )
    assert isinstance(outcome, Placement) and outcome.route is Route.NEW_PIN
    chosen = next(e for e in endpoints if e.id == outcome.endpoint)
    near = endpoints[parent]
    queue = settings.prefix_queue if prefix_weight > 0 else 0
    room = [e for e in endpoints if e.has_room(queue)]
    # Room first, whatever the parent: it never starts past its parent's room elsewhere's.
    assert chosen.has_room(queue) or not room
    pool = room or endpoints
    costs = [e.cost(prefix_weight, settings.adapter_weight, parent_weight) for e in pool]
    assert chosen.cost(prefix_weight, settings.adapter_weight, parent_weight) == min(costs)
    cold = prefix_weight == 0 or all(e.cached == 0 for e in endpoints)
    if near.free_slot and parent_weight >= 1 and cold:
        assert chosen is near  # 1 outweighs any load difference within the room
    if room and not near.has_room(queue):
        assert chosen is not near
    if parent_weight == 0:  # parents ignored: the placement without one
        blind = [replace(e, near_parent=False) for e in endpoints]
        again = place(
            snap(managed("iris", blind), settings=settings),
            PlacementRequest(SESSION, interactive),
        )
        assert isinstance(again, Placement) and again.endpoint == outcome.endpoint


@given(snapshot=snapshots(), request=requests, data=st.data())
def test_a_parents_endpoint_never_changes_the_provider_route_or_lease(snapshot, request, data):
    """The seeds' rules (pins, limits and the reserve, provider order, flow control's overflow)
    decide before the parent does: marking any endpoint as the parent's changes at most which
    endpoint of the chosen provider a new session starts on."""
    marked = data.draw(st.sampled_from([e.id for p in snapshot.providers for e in p.endpoints]))
    near = replace(
        snapshot,
        providers=tuple(
            replace(p, endpoints=tuple(replace(e, near_parent=e.id == marked) for e in p.endpoints))
            for p in snapshot.providers
        ),
    )
    before, after = place(snapshot, request), place(near, request)
    if not isinstance(before, Placement):
        assert after == before
        return
    assert isinstance(after, Placement)
    assert (after.provider, after.route, after.lease_kind, after.pin_action, after.evict) == (
        before.provider,
        before.route,
        before.lease_kind,
        before.pin_action,
        before.evict,
    )
